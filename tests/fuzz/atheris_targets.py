"""Coverage-guided fuzz targets (atheris, libFuzzer): run as a script,
`python atheris_targets.py TARGET [libFuzzer flags]`, e.g. `-runs=20000`.

- `protocol`: bytes fed to the service's frame decoder in chunks, then the
  argument checks on every decoded request: only ProtocolError may come out.
- `nvme`: a region's footer and trailer built from the input with valid
  checksums (so the parser's checks of fields, bounds and overlaps are what
  is exercised, not only the checksum): a Refused value or entries that lie
  in the data area without overlapping, never an exception.
- `config`: the input as a YAML config file: a UcmConfig or a ConfigError.

Any other exception is a crash: libFuzzer stops and prints the input."""
from __future__ import annotations

import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from ucm import _native
    from ucm.adapters.nvme import format as fmt
    from ucm.config.schema import load_config
    from ucm.errors import ConfigError
    from ucm.service import protocol as proto


def protocol(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    dec = proto.FrameDecoder(max_frame_bytes=1 << 16)
    while fdp.remaining_bytes():
        dec.feed(fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 512)))
        while True:
            try:
                frame = dec.next()
            except proto.ProtocolError:
                return  # a malformed frame closes the connection
            if frame is proto.NEED_MORE:
                break
            if isinstance(frame, list) and len(frame) == 3 and isinstance(frame[2], dict):
                args = frame[2]
                for check in (lambda: proto.check_args(args, {"keys", "sizes", "parent", "leases"}),
                              lambda: proto.keys_arg(args, "keys", 4096),
                              lambda: proto.opt_key_arg(args, "parent"),
                              lambda: proto.ints_arg(args, "sizes", len(args.get("keys") or []), 1, 1 << 30),
                              lambda: proto.int_arg(args, "output_tokens", 0, 1 << 40)):
                    try:
                        check()
                    except proto.ProtocolError:
                        pass


REGION = 1 << 16


def nvme(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    n = fdp.ConsumeIntInRange(0, 40)
    raw, tables = bytearray(), bytearray()
    for _ in range(n):  # mostly plausible entries, so bounds, overlaps and chunk tables are what gets tested
        flags = fdp.ConsumeIntInRange(0, 2)
        parent = fdp.ConsumeBytes(16).ljust(16, b"\0") if flags or fdp.ConsumeBool() else bytes(16)
        off = fdp.ConsumeIntInRange(0, REGION // fmt.ALIGN) * fmt.ALIGN + (fdp.ConsumeIntInRange(0, 1) * 8)
        length = fdp.ConsumeIntInRange(0, REGION)
        chunk = fdp.ConsumeIntInRange(0, 4) * fmt.ALIGN + fdp.ConsumeIntInRange(0, 1)
        m = min(64, fmt.n_chunks(length, chunk) if chunk else 0) + fdp.ConsumeIntInRange(-1, 1)
        table = fdp.ConsumeBytes(max(0, m) * fmt.CHUNK_SUM)
        csum = _native.checksum(table) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 1 << 63)
        raw += fmt.ENTRY.pack(fdp.ConsumeBytes(16).ljust(16, b"\0"), parent, off, length, csum, flags, chunk)
        tables += table
    fbytes = fmt.align_up(len(raw) + len(tables) + fmt.TRAILER_BYTES)
    if fbytes > REGION:
        return
    region = fdp.ConsumeIntInRange(0, 3)
    seq = fdp.ConsumeIntInRange(0, 1 << 40)
    lie = fdp.ConsumeIntInRange(0, 3)  # sometimes a trailer that lies about its footer
    foot = bytearray(fbytes)  # entries and their tables first, the trailer in its last bytes
    foot[:len(raw)] = raw
    foot[len(raw):len(raw) + len(tables)] = tables
    ecsum = _native.checksum(bytes(raw))
    fields = [fmt.MAGIC, seq, n + (lie == 1), fbytes + 4096 * (lie == 2), ecsum, region, REGION]
    body = fmt.TRAILER.pack(*fields, 0)[:-8]
    fmt.TRAILER.pack_into(foot, fbytes - fmt.TRAILER_BYTES, *fields, _native.checksum(body))
    trailer = fmt.decode_trailer(memoryview(foot), region, REGION)
    if isinstance(trailer, fmt.Refused):
        return
    if len(foot) < trailer.footer_bytes:
        return
    entries = fmt.decode_entries(memoryview(foot), trailer)
    if isinstance(entries, fmt.Refused):
        return
    limit = REGION - trailer.footer_bytes
    spans = sorted((e.offset, e.offset + fmt.align_up(e.length)) for e in entries)
    for e in entries:
        assert e.length > 0 and e.offset % fmt.ALIGN == 0 and e.offset + e.length <= limit, e
        assert e.chunk_bytes >= fmt.ALIGN and e.chunk_bytes % fmt.ALIGN == 0, e
        assert len(e.chunks) == fmt.n_chunks(e.length, e.chunk_bytes) * fmt.CHUNK_SUM, e
        assert _native.checksum(e.chunks) == e.checksum, e
    for (_, end), (nxt, _) in zip(spans, spans[1:]):
        assert nxt >= end, spans


def config(data: bytes) -> None:
    fd, path = tempfile.mkstemp(prefix="ucm-atheris-", suffix=".yaml")  # libFuzzer exits without atexit hooks
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        load_config(path, environ={})
    except ConfigError:
        pass
    finally:
        os.unlink(path)


TARGETS = {"protocol": protocol, "nvme": nvme, "config": config}

if __name__ == "__main__":
    target = TARGETS[sys.argv[1]]
    atheris.instrument_func(target)
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()
