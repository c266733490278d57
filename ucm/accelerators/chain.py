"""Accelerators: the accelerators active in one process, and the one place
their hooks are called from.

Built from the config's `accelerators` list (`Accelerators.build`), in that
order, those that run where the chain is built (`runs_in`: the cache's
chain, or an engine process's, ucm/accelerators/base.py); each hook is
passed to every accelerator in turn, and `get(kind)` hands out the one of a
class (how a connector reaches an accelerator it calls directly). A hook that raises
is counted as an `errors` counter of that accelerator and logged (the first
time with its traceback), and the next accelerator still runs: nothing an
accelerator does reaches the engine as an exception. An accelerator that
fails to load or to start is an error at start naming it (ConfigError),
never silently dropped.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypeVar

from ucm.accelerators.base import (RUNS_IN, Accelerator, BlocksLoaded, BlocksStored, CacheSettings,
                                   RequestFinished, RequestSeen, check_accelerator)
from ucm.errors import ArgumentError, ConfigError

if TYPE_CHECKING:
    from ucm.api import CacheAPI

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Accelerator)


class Accelerators:
    """The active accelerators of one cache, in config order."""

    def __init__(self, members: Sequence[Accelerator] = ()) -> None:
        self.members = list(members)
        self._errors = [0] * len(self.members)
        self._lock = threading.Lock()

    @classmethod
    def build(cls, config: CacheSettings, cache: "CacheAPI", runs_in: str = "cache") -> "Accelerators":
        """One instance of each accelerator `config` lists that runs in
        `runs_in` ("cache": the cache's chain; "engine": an engine
        process's, built by its connector), over `cache`; every entry is
        checked all the same. A ConfigError naming the entry (and closing
        those built) if one cannot be built."""
        if runs_in not in RUNS_IN:
            raise ArgumentError(f"runs_in {runs_in!r} not one of {list(RUNS_IN)}")
        built: list[Accelerator] = []
        try:
            for i, entry in enumerate(config.accelerators):
                acc_cls = check_accelerator(entry.name, entry.options, i)
                if acc_cls.runs_in != runs_in:
                    continue
                try:
                    built.append(acc_cls(cache, config, **entry.options))
                except ConfigError:
                    raise
                except Exception as exc:
                    raise ConfigError(f"accelerators.{i}: accelerator {entry.name!r} failed to start: "
                                      f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            for acc in built:
                _close_quietly(acc)
            raise
        return cls(built)

    def __bool__(self) -> bool:
        return bool(self.members)

    @property
    def names(self) -> list[str]:
        return [acc.name for acc in self.members]

    def get(self, kind: type[A]) -> Optional[A]:
        """The active accelerator of class `kind` (or a subclass of it), or
        None when the config does not enable one here; e.g.
        `get(SparseAccelerator)` in a connector."""
        for acc in self.members:
            if isinstance(acc, kind):
                return acc
        return None

    # ---- hooks -----------------------------------------------------------------
    def request_seen(self, event: RequestSeen) -> None:
        self._call("request_seen", event)

    def blocks_stored(self, event: BlocksStored) -> None:
        self._call("blocks_stored", event)

    def blocks_loaded(self, event: BlocksLoaded) -> None:
        self._call("blocks_loaded", event)

    def request_finished(self, event: RequestFinished) -> None:
        self._call("request_finished", event)

    def _call(self, hook: str, event: Any) -> None:
        for i, acc in enumerate(self.members):
            try:
                getattr(acc, hook)(event)
            except Exception:
                with self._lock:
                    self._errors[i] += 1
                    first = self._errors[i] == 1
                log.log(logging.WARNING if first else logging.DEBUG,
                        "accelerator %s: %s raised (counted as an error; the call it followed is unaffected)",
                        acc.name, hook, exc_info=True)

    # ---- figures and end ---------------------------------------------------------
    def stats(self) -> dict[str, dict[str, float]]:
        """Per accelerator (by name, config order): its counters and `errors`."""
        out: dict[str, dict[str, float]] = {}
        for i, acc in enumerate(self.members):
            try:
                counts = dict(acc.counters())
            except Exception:
                log.debug("accelerator %s: counters raised", acc.name, exc_info=True)
                counts = {}
            with self._lock:
                counts["errors"] = self._errors[i]
            out[acc.name] = counts
        return out

    def close(self) -> None:
        members, self.members = self.members, []
        for acc in reversed(members):
            _close_quietly(acc)


def _close_quietly(acc: Accelerator) -> None:
    try:
        acc.close()
    except Exception:
        log.warning("accelerator %s: close raised", acc.name, exc_info=True)
