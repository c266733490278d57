"""nvme's padded reads (PaddedReads.get_padded): a block whose length is not
whole pages lands straight in a page-aligned destination padded to whole
pages (O_DIRECT in place: no scratch, no copy), is verified there, and a
read that lands nothing is CORRUPT, never the bytes the buffer held."""
import mmap

from ucm import _native
from ucm.adapters.base import PaddedReads, Status
from ucm.adapters.nvme import NvmeAdapter, NvmeConfig

from test_faults import LyingDevice, nvme, two_blocks


def padded(n, unit):
    m = mmap.mmap(-1, -(-n // unit) * unit)
    return m, memoryview(m)


def test_a_padded_aligned_read_lands_in_place_without_scratch(tmp_path):
    a = nvme(tmp_path, _native.IoEngine(1))
    try:
        assert isinstance(a, PaddedReads) and a.read_unit == 4096
        (k1, b1), (k2, b2) = two_blocks(a)  # 50,000 bytes: not whole pages
        m1, v1 = padded(len(b1), a.read_unit)
        m2, v2 = padded(len(b2), a.read_unit)
        assert a.get_padded([k1, k2], [v1, v2]) == [Status.OK] * 2
        assert bytes(v1[:len(b1)]) == b1 and bytes(v2[:len(b2)]) == b2
        assert a._scratch.made == 0  # read in place
        assert a.get([k1], [bytearray(len(b1))]) == [Status.OK]
        assert a._scratch.made == 1  # an exact-length get still goes through scratch
        for v, m in ((v1, m1), (v2, m2)):
            v.release()
            m.close()
    finally:
        a.close()


def test_a_padded_read_that_lands_nothing_is_corrupt_never_the_buffers_bytes(tmp_path):
    dev = LyingDevice(_native.IoEngine(1))
    a = nvme(tmp_path, dev)
    try:
        (k1, b1), (k2, b2) = two_blocks(a)
        m, v = padded(len(b1), a.read_unit)
        assert a.get_padded([k1], [v]) == [Status.OK] and bytes(v[:len(b1)]) == b1
        dev.lie = True  # reports every byte read, lands none: the buffer still holds k1
        assert a.get_padded([k2], [v]) == [Status.CORRUPT]
        v.release()
        m.close()
    finally:
        a.close()


def test_padded_reads_without_direct_io(tmp_path):
    a = NvmeAdapter(8 << 20, NvmeConfig(path=str(tmp_path), region_size="256KiB", io_chunk="256KiB",
                                        write_buffers=1, direct_io=False))
    try:
        (k1, b1), _ = two_blocks(a)
        m, v = padded(len(b1), a.read_unit)
        assert a.get_padded([k1], [v]) == [Status.OK] and bytes(v[:len(b1)]) == b1
        v.release()
        m.close()
    finally:
        a.close()
