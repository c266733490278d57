"""The `stream` op gives its progress words back when the cache refuses the
stream for any reason (not only ArgumentError): a refused stream must not
shrink the progress area for good."""
import pytest

from ucm.errors import ClosedError, UcmError
from ucm.service import protocol as proto
from ucm.service.server.handlers import ConnState, ServiceHandlers
from ucm.service.progress import ProgressArea

K = [bytes([i]) * 16 for i in range(1, 4)]


class FakeArena:
    segment_path = "/dev/shm/ucm-fake"
    capacity_bytes = 1 << 20


class RefusingCache:
    tier_names = ["dram"]
    adapters = []

    def __init__(self, exc):
        self.exc = exc

    def stream_slots(self, keys, sizes, layers, request_id=None, words=None, on_done=None):
        raise self.exc


@pytest.mark.parametrize("exc", [ClosedError("closed"), UcmError("no"), RuntimeError("bug")])
def test_a_refused_stream_gives_its_progress_words_back(tmp_path, exc):
    area = ProgressArea(str(tmp_path), 16)
    try:
        h = ServiceHandlers(RefusingCache(exc), FakeArena(), landing_tier="dram", epoch=1, arena_inode=1,
                            block_tokens=16, max_keys=64, prefetch_timeout_s=5, socket="/x.sock", progress=area)
        conn = ConnState(1)
        for _ in range(8):  # 4 words each: without the give-back the area is full after 4
            with pytest.raises((proto.ProtocolError, UcmError, RuntimeError)):
                h._stream(conn, {"keys": K, "sizes": [64] * 3, "layers": 2, "request_id": None})
        assert area.alloc(16) == 0  # every word free again
        assert conn.streams == {}
    finally:
        area.close()
