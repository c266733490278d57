"""SummaryIndex: summaries by key within a byte capacity, least recently
used forgotten first, bytes counted; a block's summary from `add` equals
`summarize` of the same bytes."""
import numpy as np
import pytest

from ucm.accelerators.sparse.index import SummaryIndex
from ucm.accelerators.sparse.summaries import summarize, summary_nbytes
from ucm.codecs.layout import planar_layout
from ucm.errors import ArgumentError

LAYOUT = planar_layout("float16", 2, 2, 32, 8)
EACH = summary_nbytes(LAYOUT, 16)  # (2 x 2 + 4) x 2 layers x 2 heads x 2 pages x 8 = 512: float16 bounds, float32 mean


def block(seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.block_bytes // 2).astype(np.float16).tobytes()


def test_add_keeps_the_summary_of_the_bytes_and_counts_its_bytes():
    index = SummaryIndex(capacity_bytes=10 * EACH)
    got = index.add(b"a", block(1), LAYOUT)
    want = summarize(block(1), LAYOUT, 16)
    assert EACH == 512 and got.nbytes == EACH and index.used_bytes == EACH
    assert index.get(b"a") is got and b"a" in index and len(index) == 1
    np.testing.assert_array_equal(got.page_max, want.page_max)
    index.add(b"a", block(2), LAYOUT)  # replaced, counted once
    assert index.used_bytes == EACH and len(index) == 1
    np.testing.assert_array_equal(index.get(b"a").page_min, summarize(block(2), LAYOUT, 16).page_min)


def test_the_capacity_holds_and_the_least_recently_used_go_first():
    index = SummaryIndex(capacity_bytes=3 * EACH + EACH // 2)
    for i in range(3):
        index.add(bytes([i]), block(i), LAYOUT)
    assert index.get(bytes([0])) is not None  # 0 is now the most recently used
    index.add(b"\x03", block(3), LAYOUT)
    assert [k in index for k in (b"\x00", b"\x01", b"\x02", b"\x03")] == [True, False, True, True]
    assert index.used_bytes == 3 * EACH <= index.capacity_bytes
    assert index.get_many([b"\x01", b"\x02"])[0] is None
    c = index.counters()
    assert (c["summaries"], c["summaries_evicted"], c["summary_bytes"], c["lookup_misses"]) == (3, 1, 3 * EACH, 1)
    index.discard(b"\x02")
    assert index.used_bytes == 2 * EACH


def test_a_summary_larger_than_the_index_is_refused():
    index = SummaryIndex(capacity_bytes=EACH - 1)
    assert index.add(b"a", block(0), LAYOUT) is None
    assert len(index) == 0 and index.counters()["summaries_refused"] == 1


def test_bad_capacity_and_page_size_are_refused():
    with pytest.raises(ArgumentError, match="capacity_bytes"):
        SummaryIndex(capacity_bytes=0)
    index = SummaryIndex(capacity_bytes=1 << 20, page_tokens=32)
    with pytest.raises(ArgumentError, match="pages"):
        index.put(b"a", summarize(block(0), LAYOUT, 16))


def test_peek_neither_counts_a_lookup_nor_refreshes_recency():
    index = SummaryIndex(capacity_bytes=2 * EACH + EACH // 2)
    first = index.add(b"\x00", block(0), LAYOUT)
    index.add(b"\x01", block(1), LAYOUT)
    assert index.peek(b"\x00") is first and index.peek(b"\x09") is None
    c = index.counters()
    assert (c["lookups"], c["lookup_misses"]) == (0, 0)
    index.add(b"\x02", block(2), LAYOUT)  # 0 is still the least recently used: it goes
    assert b"\x00" not in index and b"\x01" in index
