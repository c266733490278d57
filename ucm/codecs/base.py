"""The codec interface: how a tier below DRAM turns a block's bytes into
fewer bytes and back.

A codec is stateless and thread-safe. `encode` gets the raw block and the
KV layout of its namespace (None where none was registered) and returns
its parts, or None when it cannot encode this block (no layout, a dtype it
does not read, values it cannot represent): the tier then stores the block
under the `none` codec. `decode` writes exactly the raw bytes back and
returns False for bytes that do not decode (never a partial answer taken
for a good one: the caller treats False as a miss). Framing, checksums and
the codec id of a stored block are `ucm.codecs.frame`'s; codecs are found
by name and by id in `ucm.codecs` (entry points `ucm.codecs`).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Optional

from ucm.codecs.layout import KvLayout


@dataclass(frozen=True, slots=True)
class Encoded:
    """A block's encoded parts: `meta` (what decoding needs besides the
    body: the layout, the codec's parameters) and `body`."""

    meta: bytes
    body: bytes | bytearray | memoryview


class Codec(abc.ABC):
    """Encodes blocks for a tier below DRAM and decodes them back."""

    name: ClassVar[str]
    codec_id: ClassVar[int]  # recorded in every stored block; 0-15 are ucm's, 16-255 third parties'
    lossy: ClassVar[bool]
    # Raw bytes a tier's byte of capacity is planned to hold (the placement
    # counts raw block sizes against capacity x this); the medium itself
    # counts the bytes stored.
    nominal_ratio: ClassVar[float] = 1.0

    @abc.abstractmethod
    def encode(self, raw: memoryview, layout: Optional[KvLayout]) -> Optional[Encoded]: ...

    @abc.abstractmethod
    def decode(self, meta: memoryview, body: memoryview, out: memoryview) -> bool: ...

    def decode_layers(self, meta: memoryview, body: memoryview, out: memoryview, first: int, last: int,
                      layers: int) -> Optional[bool]:
        """Decodes only what lands in bytes `[first * w, last * w)` of `out`
        (w = len(out) // layers: the block as `layers` equal layer ranges,
        as streamed loads see it), writing every byte of that range; None
        when this codec cannot decode part of this block (the caller
        decodes it whole), else as `decode`. Codecs without the ability
        keep this default."""
        return None


class NoneCodec(Codec):
    """The raw bytes (what a codec tier stores when its codec cannot encode
    a block)."""

    name = "none"
    codec_id = 0
    lossy = False

    def encode(self, raw: memoryview, layout: Optional[KvLayout]) -> Optional[Encoded]:
        return Encoded(b"", raw)

    def decode(self, meta: memoryview, body: memoryview, out: memoryview) -> bool:
        if len(meta) or len(body) != len(out):
            return False
        out[:] = body
        return True
