"""Codecs for the tiers below DRAM, found by name (config) and by id (a
stored block's frame).

The shipped codecs (`none`, `lossless`, `int8`, `int4`) are declared as
`ucm.codecs` entry points in pyproject.toml and are also in a built-in
table, so they work from a source checkout whose installed metadata is
older; a third-party package adds one by declaring an entry point to a
`ucm.codecs.base.Codec` subclass with a `codec_id` of 16-255. A name or id
found in neither is a ConfigError at load (a name) or a miss (an id read
from a stored block).
"""
from __future__ import annotations

import logging
from importlib import metadata
from typing import Optional

from ucm.codecs.base import Codec, Encoded, NoneCodec
from ucm.codecs.layout import KvLayout, KvSegmentSpec
from ucm.errors import ConfigError

log = logging.getLogger(__name__)

CODEC_NAMESPACE = "ucm.codecs"
_BUILTIN = {
    "none": "ucm.codecs.base:NoneCodec",
    "lossless": "ucm.codecs.lossless:LosslessCodec",
    "int8": "ucm.codecs.quant:Int8Codec",
    "int4": "ucm.codecs.quant:Int4Codec",
}

__all__ = ["Codec", "Encoded", "NoneCodec", "KvLayout", "KvSegmentSpec", "codec_names", "load_codec_class",
           "codec_class_by_id", "CODEC_NAMESPACE"]


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=CODEC_NAMESPACE)}


def codec_names() -> list[str]:
    """Every codec name a tier may be configured with."""
    return sorted(set(_BUILTIN) | set(_entry_points()))


def _import(target: str) -> type:
    mod, _, attr = target.partition(":")
    module = __import__(mod, fromlist=[attr])
    return getattr(module, attr)


def load_codec_class(name: str, key: str = "codec") -> type[Codec]:
    """The codec class named `name`; ConfigError naming `key` and the
    installed names when there is none (or its entry point fails to load)."""
    if name in _BUILTIN:
        cls = _import(_BUILTIN[name])
    else:
        ep = _entry_points().get(name)
        if ep is None:
            raise ConfigError(f"{key}: no {CODEC_NAMESPACE!r} codec found, looking for {name!r}; "
                              f"allowed: {codec_names()}")
        try:
            cls = ep.load()
        except Exception as exc:
            raise ConfigError(f"{key}: the {CODEC_NAMESPACE!r} entry point {name!r} failed to load: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise ConfigError(f"{key}: codec {name!r} is {cls!r}, not a ucm.codecs.base.Codec subclass")
    return cls


_BY_ID: dict[int, Optional[type[Codec]]] = {}


def codec_class_by_id(codec_id: int) -> Optional[type[Codec]]:
    """The codec class that wrote frames with `codec_id`, or None (a block
    written by a codec this process does not have: a miss)."""
    if codec_id in _BY_ID:
        return _BY_ID[codec_id]
    found: Optional[type[Codec]] = None
    for name in codec_names():
        try:
            cls = load_codec_class(name)
        except ConfigError:
            log.warning("ucm: codec %r could not be loaded while looking for codec id %d", name, codec_id)
            continue
        if cls.codec_id == codec_id:
            found = cls
            break
    _BY_ID[codec_id] = found
    return found
