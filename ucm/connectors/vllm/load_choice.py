"""How the scheduler side loads a hit: synchronously before the forward,
asynchronously (the request waits, reported through get_finished), or
streamed layer by layer under the forward (`wait_for_layer_load`). Runs in
the scheduler process; pure."""
from __future__ import annotations

from typing import Optional, Sequence

PENDING = "pending"  # hit tier of a block whose save is still in flight


def choose_load(tiers: Sequence[Optional[str]], landing: str, load_mode: str, streaming: str) -> tuple[bool, bool]:
    """(asynchronous, streamed) for a load of blocks found in `tiers`.

    `load_mode` "sync" / "async" force that (never streamed). "auto": a
    block still being saved makes the load asynchronous (it waits for the
    save); otherwise blocks below the landing tier are streamed when
    `streaming` is "auto" or "on" (asynchronous when "off"), and blocks all
    in the landing tier are copied whole before the forward, or streamed
    too when `streaming` is "on"."""
    if load_mode != "auto":
        return load_mode == "async", False
    if any(t == PENDING for t in tiers):
        return True, False
    below = any(t != landing for t in tiers)
    if streaming == "on" or (below and streaming == "auto"):
        return False, True
    return below, False
