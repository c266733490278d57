"""Progress bars of the long commands (`ucm bench ...`, `ucm model prepare`).

One job: a `tqdm` bar on stderr when stderr is a terminal, and nothing
otherwise, so that stdout stays the command's result (`--json`: one JSON
object) and a log or a pipe never fills with bar updates.
`UCM_PROGRESS=0` turns the bars off on a terminal too, `UCM_PROGRESS=1` on
where stderr is not one. Without tqdm (it is a dependency of ucm, but a
stripped environment may lack it) the bars are silent no-ops.

Runs in the calling thread; a bar is not shared between threads.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

ENV = "UCM_PROGRESS"


def enabled() -> bool:
    """Whether bars are drawn: `UCM_PROGRESS` if set ("0" off, anything else
    on), else whether stderr is a terminal."""
    forced = os.environ.get(ENV)
    if forced is not None and forced.strip() != "":
        return forced.strip() != "0"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class _Silent:
    """The no-op bar: what `bar` returns when bars are off and tqdm is absent."""

    def __init__(self, iterable: Optional[Iterable[Any]] = None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable if self._iterable is not None else ())

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        pass

    def set_description_str(self, desc: str) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def bar(iterable: Optional[Iterable[T]] = None, *, total: Optional[float] = None, desc: str = "",
        unit: str = "it") -> Any:
    """A progress bar over `iterable` (or updated by hand with `update(n)`),
    drawn on stderr only when `enabled()`. Use it as an iterable or a
    context manager; `set_postfix_str` names the current step."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent(iterable)
    on = enabled()
    sized = _sized_terminal() if on else True
    # A terminal that reports no size (a pty nobody sized) would hide the bar: give it 80x24.
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not on,
                dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24, leave=False)


def _sized_terminal() -> bool:
    """Whether stderr's terminal reports a width and a height."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0
