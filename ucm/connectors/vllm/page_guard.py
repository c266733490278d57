"""A background job's hold on its request's vLLM pages (ucm/connectors/vllm/worker.py).

The worker copies a request's pages from threads of its own (asynchronous
loads, saves); vLLM may preempt the request meanwhile and give its pages
to others. `PageGuard` is that job's right to touch them, taken back by
`revoke` before the pages change hands.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from ucm.errors import CopyAborted


class PagesRevoked(CopyAborted):
    """Raised inside a copy callback when the job's pages were taken back:
    the cache then aborts the chunk (a save commits nothing, a load's
    blocks are not DONE)."""


class PageGuard:
    """A background job's right to touch its request's vLLM pages.

    Copies run inside `pages()`; `revoke()` (handle_preemptions: the pages
    are about to be given to other requests) waits only for a copy in
    progress, a memcpy of at most one client chunk, and makes every later
    `pages()` raise `PagesRevoked`. So a save either copied its pages
    whole before the preemption or commits nothing, and a load writes no
    page after it."""

    __slots__ = ("_lock", "_revoked")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revoked = False

    @property
    def revoked(self) -> bool:
        return self._revoked

    def revoke(self) -> None:
        with self._lock:
            self._revoked = True

    @contextmanager
    def pages(self) -> Iterator[None]:
        with self._lock:
            if self._revoked:
                raise PagesRevoked("the request was preempted; its pages belong to others now")
            yield
