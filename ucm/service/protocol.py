"""The wire protocol between CacheClient and `ucm serve`.

A frame is a 4-byte little-endian length followed by that many bytes of
msgpack (no pickle, no extension types). A request is `[id, op, args]`
(int, str, map); a response is `[id, ok, result]` where `result` is the
error message when `ok` is false. Every frame is bounded
(`max_frame_bytes`), and every argument is validated before use: a
malformed request gets an error response, a malformed frame closes the
connection. Payload bytes never cross the socket: they move through the
shared-memory arena.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any, Optional

import msgpack

from ucm.api import check_request_id
from ucm.errors import ArgumentError, UcmError

# 2: hello announces the instance's epoch and arena inode; reserve and
# acquire answer {"epoch": int, "slots": [...]}.
# 3: the request events: op `begin` {request_id, keys, parent}, and
# `request_id` (a string or nil) on reserve, acquire and finish (a version 2
# service refuses both: unknown op, unknown argument).
VERSION = 3
_LEN = struct.Struct("<I")
KEY_BYTES = 16


class ProtocolError(UcmError):
    """A frame or request that breaks the protocol."""


def pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


NEED_MORE = object()  # FrameDecoder.next(): no whole frame buffered yet


class FrameDecoder:
    """Splits a byte stream into decoded frames (for non-blocking readers)."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def need(self) -> int:
        """Bytes still missing for the frame at the head of the buffer (>= 1
        when next() would answer NEED_MORE)."""
        if len(self._buf) < _LEN.size:
            return _LEN.size - len(self._buf)
        (n,) = _LEN.unpack_from(self._buf)
        return max(0, _LEN.size + n - len(self._buf))

    def next(self) -> Any:
        """The next decoded frame, or NEED_MORE. Raises ProtocolError for an
        oversized or undecodable frame."""
        if len(self._buf) < _LEN.size:
            return NEED_MORE
        (n,) = _LEN.unpack_from(self._buf)
        if n > self.max:
            raise ProtocolError(f"frame of {n} bytes exceeds max_frame_bytes={self.max}")
        if len(self._buf) < _LEN.size + n:
            return NEED_MORE
        body = bytes(self._buf[_LEN.size:_LEN.size + n])
        del self._buf[:_LEN.size + n]
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=self.max,
                                   max_str_len=1 << 16, max_array_len=1 << 20, max_map_len=64, max_ext_len=0)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None


class FrameReader:
    """Reads frames from a blocking stream socket with as few system calls
    as possible (one recv usually carries a whole small frame)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self.sock = sock
        self._dec = FrameDecoder(max_frame_bytes)

    def read(self, spin_s: float = 0.0) -> Optional[Any]:
        """The next decoded frame, or None when the peer closed the
        connection; polls `spin_s` seconds before sleeping in recv. Raises
        ProtocolError for an oversized or undecodable frame."""
        deadline = 0.0
        while True:
            frame = self._dec.next()
            if frame is not NEED_MORE:
                return frame
            n = max(65536, self._dec.need())
            chunk = None
            if spin_s > 0:
                # Not sock.recv: on a socket with a timeout it polls (sleeps)
                # before reading. os.read on its non-blocking fd does not.
                fd = self.sock.fileno()
                now = time.perf_counter()
                deadline = deadline or now + spin_s
                while now < deadline:
                    try:
                        chunk = os.read(fd, n)
                        break
                    except BlockingIOError:
                        os.sched_yield()  # the service may be waiting for this CPU
                        now = time.perf_counter()
            if chunk is None:
                chunk = self.sock.recv(n)
            if not chunk:
                return None
            self._dec.feed(chunk)


# ---- argument validation ------------------------------------------------------
def keys_arg(args: dict, name: str, max_keys: int) -> list[bytes]:
    v = args.get(name)
    if not isinstance(v, list):
        raise ProtocolError(f"{name}: expected a list of {KEY_BYTES}-byte keys")
    if len(v) > max_keys:
        raise ProtocolError(f"{name}: {len(v)} keys exceed max_keys={max_keys}")
    for k in v:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ProtocolError(f"{name}: every key must be {KEY_BYTES} bytes of bin, got {k!r:.40}")
    return v


def opt_key_arg(args: dict, name: str) -> Optional[bytes]:
    v = args.get(name)
    if v is None:
        return None
    if not isinstance(v, bytes) or len(v) != KEY_BYTES:
        raise ProtocolError(f"{name}: expected a {KEY_BYTES}-byte key or nil")
    return v


def request_id_arg(args: dict, name: str = "request_id") -> Optional[str]:
    """`args[name]`: nil (or absent), or a request id (`ucm.api.check_request_id`)."""
    try:
        return check_request_id(args.get(name))
    except ArgumentError as exc:
        raise ProtocolError(f"{name}: {exc}") from None


def bool_arg(args: dict, name: str, default: bool) -> bool:
    """`args[name]`: a bool, or `default` when absent."""
    v = args.get(name, default)
    if not isinstance(v, bool):
        raise ProtocolError(f"{name}: expected true or false, got {v!r:.40}")
    return v


def ints_arg(args: dict, name: str, n: int, lo: int, hi: int) -> list[int]:
    v = args.get(name)
    if not isinstance(v, list) or len(v) != n:
        raise ProtocolError(f"{name}: expected a list of {n} integers")
    for x in v:
        _check_int(name, "every value", x, lo, hi)
    return v


def int_arg(args: dict, name: str, lo: int, hi: int) -> int:
    return _check_int(name, "value", args.get(name), lo, hi)


def _check_int(name: str, what: str, x: Any, lo: int, hi: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise ProtocolError(f"{name}: {what} must be an integer in [{lo}, {hi}], got {x!r:.40}")
    return x


def check_args(args: Any, allowed: set[str]) -> dict:
    if not isinstance(args, dict):
        raise ProtocolError("args: expected a map")
    extra = set(args) - allowed
    if extra:
        raise ProtocolError(f"args: unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
    return args

