"""ucm._native at its boundary: buffer exports held through the GIL-free part
of a call, and argument errors typed as ucm.errors.ArgumentError."""
import os
import threading

import pytest

from ucm import _native
from ucm.errors import ArgumentError

SIZE = 256 << 20  # long enough that a second thread runs many times during one copy
SPAN = 1 << 20
SAMPLES = [SIZE * i // 17 for i in range(1, 17)]  # away from the head and tail memcpy stores first


def _resize_during(call, watched: bytearray, blank: int, resized: bytearray, fill: int,
                   rounds: int = 20) -> tuple[list[str], int]:
    """Runs `call()`, which overwrites `watched` (reset to `blank` bytes before
    each round), while another thread tries to shrink `resized` (an argument of
    the call, refilled with `fill` bytes) by one byte.

    The other thread starts trying only once some sampled byte of `watched`
    has been overwritten, so the call is then inside its GIL-free part; an
    attempt counts as made during the call when a sampled byte is still blank
    after it, which no timing can fake. While an export pins `resized`, the
    shrink raises BufferError; a shrink that succeeds then is the defect.
    Shrinking by one byte never moves the memory, so the defect is reported,
    not a crash. Returns the violations and how many attempts were made during
    a call."""
    violations: list[str] = []
    during = 0
    chunk = bytes([blank]) * SPAN

    def written() -> list[bool]:
        return [watched[i] != blank for i in SAMPLES]

    for _ in range(rounds):
        resized.extend(bytes([fill]) * (SIZE - len(resized)))  # undo a shrink made after the last call returned
        for off in range(0, SIZE, SPAN):
            watched[off:off + SPAN] = chunk
        done = threading.Event()

        def resizer() -> None:
            nonlocal during
            while not done.is_set() and not any(written()):
                pass
            while not done.is_set():
                try:
                    del resized[-1:]
                except BufferError:
                    if not all(written()):
                        during += 1
                    continue
                if not all(written()):
                    violations.append(f"buffer resized while the call ran ({sum(written())}/{len(SAMPLES)} "
                                      "sampled bytes written)")
                return

        t = threading.Thread(target=resizer)
        t.start()
        try:
            call()
        finally:
            done.set()
            t.join()
        if violations or during:
            break
    resized.extend(bytes([fill]) * (SIZE - len(resized)))
    return violations, during


@pytest.fixture(scope="module")
def buffers():
    return bytearray(SIZE), bytearray(b"\xff") * SIZE


def test_copy_holds_its_exports_until_it_returns(buffers):
    dst, src = buffers
    violations, during = _resize_during(lambda: _native.copy(dst, src), dst, 0, src, 0xFF)
    assert violations == []
    assert during > 0, "no resize attempt landed inside a copy in 20 rounds"
    assert dst == src


def test_copy_spans_holds_its_exports_until_it_returns(buffers):
    dst, src = buffers
    offsets = list(range(0, SIZE, SPAN))
    violations, during = _resize_during(
        lambda: _native.copy_spans(dst, offsets, src, offsets, SPAN), dst, 0, src, 0xFF)
    assert violations == []
    assert during > 0, "no resize attempt landed inside a copy in 20 rounds"
    assert dst == src


def test_read_batch_holds_its_exports_until_it_returns(buffers):
    buf = buffers[0]
    io = _native.IoEngine(1)
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        result = []
        violations, during = _resize_during(lambda: result.append(io.read_batch(fd, [buf], [0])), buf, 0xFF,
                                            buf, 0)
    finally:
        os.close(fd)
    assert violations == []
    assert during > 0, "no resize attempt landed inside a read in 20 rounds"
    assert result[-1] == [SIZE] and buf.count(0) == SIZE


def test_argument_errors_are_typed_and_name_the_values():
    with pytest.raises(ArgumentError, match="2 != 3"):
        _native.copy(bytearray(2), bytearray(3))
    with pytest.raises(ArgumentError, match=r"src_offsets\[1\] = 8 \+ length 4 exceeds src \(10 bytes\)"):
        _native.copy_spans(bytearray(16), [0, 4], bytearray(10), [0, 8], 4)
    with pytest.raises(ArgumentError, match="bufs and offsets differ in length: 1 != 2"):
        _native.IoEngine(1).read_batch(-1, [bytearray(4)], [0, 4])
    strided = memoryview(bytearray(8))[::2]
    with pytest.raises(ArgumentError, match="src must be a C-contiguous buffer"):
        _native.copy(bytearray(4), strided)
    with pytest.raises(ArgumentError, match="seed must be 16 bytes, got 3"):
        _native.chain_keys(b"abc", memoryview(bytearray(4)).cast("I"), 1)
    with pytest.raises(ArgumentError, match="slots must be a power of two >= 8, got 6"):
        _native.index_init(bytearray(4096), 6)
    with pytest.raises(ArgumentError, match="not a ucm key index"):
        _native.index_count(bytearray(4096))
    # Still ValueErrors for callers that catch those (ucm.service.index does).
    assert issubclass(ArgumentError, ValueError)


def test_chunk_checksums_are_each_pieces_checksum_little_endian():
    data = os.urandom(3 * 4096 + 100)
    sums = _native.chunk_checksums(data, 4096)
    assert len(sums) == 4 * 8
    pieces = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    assert [int.from_bytes(sums[8 * i:8 * i + 8], "little") for i in range(4)] == [
        _native.checksum(p) for p in pieces]
    assert _native.chunk_checksums(b"", 4096) == b""
    assert _native.chunk_checksums(memoryview(data)[4096:8192], 4096) == sums[8:16]
    with pytest.raises(ArgumentError, match="chunk_bytes must be > 0"):
        _native.chunk_checksums(data, 0)


def test_the_key_index_never_finds_the_all_zero_key():
    """The all-zero key is the index's empty marker: it matched the first
    empty slot of its probe, so a lookup of it through the service was a
    hit on a key never stored."""
    from ucm import _native

    slots = 64
    mem = bytearray(_native.index_bytes(slots))
    _native.index_init(mem, slots)
    zero, one = bytes(16), (1).to_bytes(16, "little")
    assert _native.index_prefix(mem, zero) == 0
    assert _native.index_insert(mem, one)
    assert _native.index_prefix(mem, one + zero) == 1
