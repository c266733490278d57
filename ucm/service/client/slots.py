"""read_slots / write_slots through the service: the client half, pipelined.

A call is cut into parts of `PART_BYTES`, or of `PART_BLOCKS` blocks where
that is more (at most 1/8 of the arena of the link it goes over, so only
once that is connected; at least one block each). The request for part
n + 1 (`reserve` or `acquire`) is sent before part n is copied, so the
service places, evicts or stages it while this process copies
(ucm/service/client/link.py: replies are read in order). At most two
parts hold slots at once.

Stores keep the sequential meaning exactly: a part is committed only after
the commit of the part before it came back whole (its blocks' parents are
there), a refused block ends the call (the blocks after it would lack
their parent: MISSING), a `fill` that raises aborts its part (FAILED), and
a reservation sent ahead for a part that is then not copied is aborted.
Loads: every part on its own (a miss in one does not end the call); a
`release` is sent without waiting for its reply (the next request on the
connection reads it).

Everything runs on the caller's thread and goes over the client's
`Connection` (ucm/service/client/conn.py) through its public methods,
each of which takes the connection's lock per send and per reply, never
across a copy. Faults are outcomes. A
BaseException out of `fill` (KeyboardInterrupt, SystemExit) ends the call
and propagates, after the copy stopped counting on the link and the slots
of its part and of the part asked ahead were given back.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ucm.api import Outcome, RangeRead, SlotFn, cut_parts
from ucm.errors import CopyAborted, UcmError
from ucm.service.client.conn import Connection
from ucm.service.client.link import Link, Pending

log = logging.getLogger(__name__)

PART_BYTES = 16 << 20  # enough to hide a request's round trip under the copy of the part before
# ...and at least this many blocks: a copier's fixed cost per call (a CUDA copier launches kernels per
# layer, ~1 ms a call on an H200) is then shared by several blocks (`ucm bench pages`, docs/lab/benchmarks.md).
PART_BLOCKS = 4
RANGE_PART = 8  # blocks leased at once by read_ranges (it knows no sizes to cut parts by bytes)


def write_slots(conn: Connection, keys: list[bytes], sizes: Sequence[int], fill: SlotFn,
                parent: Optional[bytes], rid: Optional[str]) -> list[Outcome]:
    link = conn.try_live()
    if link is None or not keys:
        return [Outcome.FAILED] * len(keys)
    spans = _parts(link, sizes)

    def ask(n: int) -> Optional[Pending]:
        i, j = spans[n]
        return _send(conn, link, "reserve", {"keys": keys[i:j], "sizes": list(sizes[i:j]),
                                             "parent": keys[i - 1] if i else parent, "request_id": rid,
                                             "counted": n == 0})

    out: list[Outcome] = []
    asked, asked_n = ask(0), 0
    committing: Optional[_Commit] = None  # the part whose commit is on its way
    for n, (i, j) in enumerate(spans):
        entries = conn.claim(link, asked, j - i, 2)
        asked = None
        filled: list[bytes] = []
        slots: list = []
        if entries is None:
            part = [Outcome.FAILED] * (j - i)
        else:
            slots = [tuple(r) if isinstance(r, list) else None for r in entries]
            part = [Outcome.MISSING if r is None else Outcome.DONE for r in entries]
            filled = [k for k, s in zip(keys[i:j], slots) if s is not None]
            try:
                if part[-1] is Outcome.DONE and n + 1 < len(spans):
                    asked, asked_n = ask(n + 1), n + 1  # reserved by the service while this part is copied
                copied = not filled or _fill(fill, i, slots, link, "into reserved slots")
            except BaseException:  # KeyboardInterrupt, SystemExit: the copy ends, its slots go back
                conn.end_fill(link, "abort" if filled else None, {"keys": filled}, detached=True)
                if asked is not None:
                    _abort_unused(conn, link, asked, keys[slice(*spans[asked_n])])
                raise
            if not copied:
                conn.end_fill(link, "abort", {"keys": filled})
                part = [Outcome.FAILED if s is not None else o for s, o in zip(slots, part)]
                filled = []
            elif not filled:
                conn.end_fill(link, None, {})
        parent_ok = committing is None or _settled(conn, link, committing, out)
        committing = None
        if entries is None and not parent_ok:  # the part before did not commit whole: as sequentially
            part = [Outcome.MISSING] * (j - i)
        if filled:
            if parent_ok:
                at = [len(out) + x for x, s in enumerate(slots) if s is not None]
                committing = _Commit(filled, at, conn.end_fill(link, "commit", {"keys": filled}, reply=True))
            else:  # the part before did not commit whole: these blocks would lack their parent
                conn.end_fill(link, "abort", {"keys": filled})
                part = [Outcome.MISSING if s is not None else o for s, o in zip(slots, part)]
        out.extend(part)
        if not parent_ok or part[-1] is not Outcome.DONE:
            break
    if committing is not None:
        _settled(conn, link, committing, out)
    if asked is not None:  # sent ahead for a part that is not copied now
        _abort_unused(conn, link, asked, keys[slice(*spans[asked_n])])
    out.extend([Outcome.MISSING] * (len(keys) - len(out)))
    return out


def _abort_unused(conn: Connection, link: Link, asked: Pending, keys: list[bytes]) -> None:
    """Aborts what the reservation of `keys` sent ahead got, for a part that
    is then not copied."""
    entries = conn.claim(link, asked, len(keys), 2)
    if entries is not None:
        unused = [k for k, r in zip(keys, entries) if isinstance(r, list)]
        conn.end_fill(link, "abort" if unused else None, {"keys": unused})


class _Commit:
    """A part's commit on its way: its filled keys and their places in the
    call's outcomes."""

    __slots__ = ("keys", "at", "pending")

    def __init__(self, keys: list[bytes], at: list[int], pending: Optional[Pending]) -> None:
        self.keys, self.at, self.pending = keys, at, pending


def read_slots(conn: Connection, keys: list[bytes], sizes: Sequence[int], fill: SlotFn,
               rid: Optional[str]) -> list[Outcome]:
    link = conn.try_live()
    if link is None or not keys:
        return [Outcome.MISSING] * len(keys)
    spans = _parts(link, sizes)

    def ask(n: int) -> Optional[Pending]:
        i, j = spans[n]
        return _send(conn, link, "acquire", {"keys": keys[i:j], "request_id": rid, "counted": n == 0})

    out: list[Outcome] = []
    asked = ask(0)
    for n, (i, j) in enumerate(spans):
        leases = conn.claim(link, asked, j - i, 3)
        asked = None
        try:
            asked = ask(n + 1) if n + 1 < len(spans) else None  # staged while this part is copied
            part = [Outcome.MISSING] * (j - i) if leases is None else _copy_out(fill, i, leases, sizes[i:j], link)
        except BaseException:  # KeyboardInterrupt, SystemExit: the copy ends, its leases go back
            if leases is not None:
                _release(conn, link, leases)
            if asked is not None:  # and those of the part acquired ahead
                k, m = spans[n + 1]
                ahead = conn.claim(link, asked, m - k, 3)
                if ahead is not None:
                    _release(conn, link, ahead)
            raise
        if leases is not None:
            _release(conn, link, leases)
        out.extend(part)
    return out


def read_ranges(conn: Connection, keys: list[bytes], offsets: Sequence[Sequence[int]],
                views: list[list[memoryview]], rid: Optional[str]) -> list[RangeRead]:
    """CacheAPI.read_ranges through the service: the service has no range
    read, so the blocks are leased as by read_slots (a block below the
    landing tier is staged into it, whole) and the ranges copied out of the
    leased slots, RANGE_PART blocks at a time. Each block's tier is where
    `locate` found it just before; a block staged from below it counts its
    whole size (what that tier served), one in the landing tier its ranges."""
    link = conn.try_live()
    if link is None or not keys:
        return [RangeRead(Outcome.FAILED)] * len(keys)
    tiers = conn.try_call("locate", {"keys": keys}, [None] * len(keys))  # a fault: None each
    landing = link.info.get("landing_tier")
    out: list[RangeRead] = []
    for i in range(0, len(keys), RANGE_PART):
        part = keys[i:i + RANGE_PART]
        asked = _send(conn, link, "acquire", {"keys": part, "request_id": rid, "counted": i == 0})
        leases = conn.claim(link, asked, len(part), 3)
        if leases is None:
            out.extend([RangeRead(Outcome.FAILED)] * len(part))
            continue
        try:
            with memoryview(link.arena.m) as arena:
                for j, lease in enumerate(leases):
                    out.append(_ranges_out(arena, lease, offsets[i + j], views[i + j], tiers[i + j], landing))
        finally:
            _release(conn, link, leases)
    return out


def _ranges_out(arena: memoryview, lease: Optional[list], offsets: Sequence[int], views: list[memoryview],
                tier: Optional[str], landing: Optional[str]) -> RangeRead:
    """One leased block's ranges copied out of the arena."""
    if lease is None:
        return RangeRead(Outcome.MISSING)
    start, length = lease[1], lease[2]
    if any(o + len(v) > length for o, v in zip(offsets, views)):
        return RangeRead(Outcome.CORRUPT, tier)
    for o, v in zip(offsets, views):
        v[:] = arena[start + o:start + o + len(v)]
    n = sum(len(v) for v in views) if tier in (None, landing) else length
    return RangeRead(Outcome.DONE, tier or landing, n)


def _copy_out(fill: SlotFn, first: int, leases: list, sizes: Sequence[int], link: Link) -> list[Outcome]:
    """A part's copy out of its leased slots (`fill`); its outcomes."""
    slots: list[Optional[tuple[int, int]]] = []
    part: list[Outcome] = []
    for lease, size in zip(leases, sizes):
        if lease is None:
            slots.append(None)
            part.append(Outcome.MISSING)
        elif lease[2] != size:
            slots.append(None)
            part.append(Outcome.CORRUPT)
        else:
            slots.append((lease[1], lease[2]))
            part.append(Outcome.DONE)
    if any(s is not None for s in slots) and not _fill(fill, first, slots, link, "out of leased slots"):
        part = [Outcome.FAILED if o is Outcome.DONE else o for o in part]
    return part


def _release(conn: Connection, link: Link, leases: list) -> None:
    """Ends a copy out of `leases` counted by `claim` and gives them back
    (the reply is read by the next request on the link)."""
    held = [lease[0] for lease in leases if lease is not None]
    conn.end_fill(link, "release" if held else None, {"leases": held}, detached=True)


def arena_parts(sizes: Sequence[int], arena_bytes: int,
                part_bytes: Optional[int] = None) -> list[tuple[int, int]]:
    """Index ranges of at most 1/8 of an arena of `arena_bytes` (none known:
    one block a range) and `part_bytes` each, at least one block each, so
    that one request never needs more slots than the arena has."""
    budget = max(1, arena_bytes // 8)
    if part_bytes is not None:
        budget = min(budget, part_bytes)
    return cut_parts(sizes, budget)


def _parts(link: Link, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The call's parts: PART_BYTES, or PART_BLOCKS of the largest block if
    that is more, cut by the arena of the link that carries them (at most
    1/8 of it; its hello announced the size: a client that never connected
    knows none before `try_live`)."""
    part = max(PART_BYTES, PART_BLOCKS * max(sizes, default=0))
    return arena_parts(sizes, link.info["arena_bytes"], part)


def _send(conn: Connection, link: Link, op: str, args: dict) -> Optional[Pending]:
    try:
        return conn.send(link, op, args)
    except UcmError as exc:
        log.debug("%s", exc)
        return None


def _fill(fill: SlotFn, first: int, slots: list, link: Link, where: str) -> bool:
    """Whether `fill` returned; an Exception is a failed copy (logged). A
    BaseException (KeyboardInterrupt, SystemExit) propagates: the caller
    ends the copy and gives its slots back first."""
    try:
        fill(first, slots, link.arena.m)
        return True
    except Exception as exc:
        if isinstance(exc, CopyAborted):
            log.debug("ucm client: copying %s aborted: %s", where, exc)
        else:
            log.exception("ucm client: copying %s failed", where)
        return False


def _settled(conn: Connection, link: Link, commit: _Commit, out: list[Outcome]) -> bool:
    """Waits for a part's commit and marks its blocks that did not commit
    FAILED in `out`, which ends with that part; whether its last block
    committed (the parent of the next part)."""
    ok: Any = None
    if commit.pending is not None:
        try:
            ok = conn.wait(link, commit.pending)
        except UcmError as exc:
            log.debug("%s", exc)
    good = ok if isinstance(ok, list) and len(ok) == len(commit.keys) else [False] * len(commit.keys)
    for pos, g in zip(commit.at, good):
        if not g:
            out[pos] = Outcome.FAILED
    return out[-1] is Outcome.DONE
