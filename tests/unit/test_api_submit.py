"""`ucm.api.submit`, the pool hand-off behind every asynchronous call of the
in-process cache: a call that races `close()` gets ClosedError, the typed
error of misuse after close, not the pool's own RuntimeError."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ucm.api import Outcome, submit
from ucm.errors import ClosedError


def test_submit_to_a_pool_shut_down_by_close_raises_closed_error():
    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown(wait=True)  # what close() does while another thread is between its open check and submit
    ran = threading.Event()
    with pytest.raises(ClosedError, match="close"):
        submit(pool, 2, lambda: ran.set() or [Outcome.DONE] * 2)
    assert not ran.is_set()


def test_submit_to_an_open_pool_completes_the_handle():
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert submit(pool, 2, lambda: [Outcome.DONE] * 2).wait(10) == [Outcome.DONE] * 2
