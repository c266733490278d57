"""PromptRow: what the transformers connector keeps of one prompt of a
batch, from `cache_for` to the request's finish: its left padding, the keys
of its full blocks, its request id, its hit and how far its blocks are
stored. A plain record; the connector (connector.py) and its restore path
(restore.py) read it, the connector moves it."""
from __future__ import annotations

from dataclasses import dataclass

from ucm.api import Key


@dataclass(slots=True, eq=False)
class PromptRow:
    pad: int  # positions of left padding before the prompt's real tokens
    keys: list[Key]  # keys of the prompt's full blocks
    request_id: str
    valid: bool  # left-padded as the mask says: restored and stored; else neither
    hit: int = 0  # blocks the cache holds (front or shared)
    stored: int = 0  # blocks below which nothing is left to store
