"""Streamed loads through `ucm serve`: the client polls the service's shared
progress words; a killed service turns the unfinished blocks into misses
at once, no wait runs into its timeout, and nothing reported landed is
ever other bytes than the stored ones."""
import signal

import pytest
import yaml

from support import chain, freeze, start_service
from ucm.api import Outcome
from ucm.layer_stream import LayerStreams
from ucm.service import CacheClient

LAYERS = 8
LAYER = 32 * 1024
SIZE = LAYERS * LAYER


def write_config(tmp_path):
    sock = str(tmp_path / "ucm.sock")
    cfg = {"tiers": [{"adapter": "dram", "capacity": "4MiB"},
                     {"adapter": "nvme", "capacity": "64MiB",
                      "options": {"path": str(tmp_path / "nvme"), "region_size": "1MiB", "io_chunk": "256KiB"}}],
           "policy": {"name": "lru"}, "service": {"socket": sock}}
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), sock


@pytest.fixture
def served(tmp_path):
    cfg_path, sock = write_config(tmp_path)
    proc = start_service(cfg_path, sock)
    client = CacheClient(sock)
    try:
        yield client, proc
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def on_nvme(client, n, seed):
    keys, data = chain(n, seed, SIZE)
    assert client.store(keys, data).wait(60) == [Outcome.DONE] * n
    more, mdata = chain(16, seed + 50, SIZE)  # pushes the first ones out of the 4 MiB DRAM tier
    assert client.store(more, mdata).wait(60) == [Outcome.DONE] * 16
    assert client.flush()
    assert client.locate(keys) == ["nvme"] * n
    return keys, data


def layer_bytes(s, i, layer):
    off, _ = s.slots[i]
    return bytes(memoryview(s.arena)[off + layer * LAYER:off + (layer + 1) * LAYER])


def test_a_stream_through_the_service_lands_every_layer(served):
    client, _ = served
    assert isinstance(client, LayerStreams)
    keys, data = on_nvme(client, 6, 1)
    s = client.stream_slots(keys, [SIZE] * 6, LAYERS, request_id="s1")
    try:
        for layer in range(LAYERS):
            assert s.wait_layer(layer, 10.0) == [True] * 6
            for i in range(6):
                assert layer_bytes(s, i, layer) == data[i][layer * LAYER:(layer + 1) * LAYER]
        assert s.outcomes(10.0) == [Outcome.DONE] * 6
    finally:
        s.release()
    assert client.locate(keys) == ["dram"] * 6
    again = client.stream_slots(keys, [SIZE] * 6, LAYERS)  # DRAM hits: every layer there at once
    try:
        assert again.wait_layer(LAYERS - 1, 1.0) == [True] * 6
        assert again.outcomes(1.0) == [Outcome.DONE] * 6
    finally:
        again.release()
    assert client.stats()["streamed_blocks"] == 6


ATTEMPTS = 5  # streams tried until one is stopped before it finished (its reads land within milliseconds)


def test_the_service_killed_during_a_stream_is_a_miss_and_nothing_hangs(served):
    """The service is stopped (SIGSTOP, waited for until every thread of it
    has stopped) as soon as `stream_slots` returns and killed while stopped:
    the blocks of every part of the stream it had not finished then are
    misses, the client noticed the hang-up (so no wait polls on to its
    timeout), and a layer reported landed is the stored bytes. A stream the
    service finished before it stopped proves nothing: it is given back and
    another one is tried."""
    client, proc = served
    for attempt in range(ATTEMPTS):
        keys, data = on_nvme(client, 12, 2 + 100 * attempt)
        s = client.stream_slots(keys, [SIZE] * 12, LAYERS)
        freeze(proc)  # every thread stopped mid-stream: what it finished is final in the words
        finished = [part.view is not None and part.view.finished() for part in s.parts]
        if not all(finished):
            break
        proc.send_signal(signal.SIGCONT)  # it was done before it stopped: again, with other blocks
        s.release()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cut = [i for part, done in zip(s.parts, finished) if not done for i in range(part.first, part.first + part.n)]
    try:
        assert cut, f"in {ATTEMPTS} streams every part had finished before the service was stopped"
        for layer in range(LAYERS):
            ok = s.wait_layer(layer, 10.0)
            for i, landed in enumerate(ok):
                if landed:
                    assert layer_bytes(s, i, layer) == data[i][layer * LAYER:(layer + 1) * LAYER]
        out = s.outcomes(10.0)
        assert all(out[i] in (Outcome.MISSING, Outcome.FAILED) for i in cut), out  # a miss, never DONE
        assert all(part.dead for part, done in zip(s.parts, finished) if not done)  # the hang-up was seen
    finally:
        s.release()
    later = client.stream_slots(keys, [SIZE] * 12, LAYERS)  # no service: every block a miss at once
    try:
        assert all(part.dead for part in later.parts)
        assert later.wait_layer(0, 1.0) == [False] * 12
        assert set(later.outcomes(1.0)) == {Outcome.FAILED}
    finally:
        later.release()


def test_a_refused_first_chunk_leaves_the_later_chunks_served(served, monkeypatch):
    client, _ = served
    keys, data = on_nvme(client, 6, 3)
    monkeypatch.setattr(client, "_chunks", lambda sizes, **_: [(0, 2), (2, len(sizes))])
    real = client._begin_fill
    calls = []

    def refuse_first(op, args):
        calls.append(op)
        if len(calls) == 1:
            from ucm.service.client.cache_client import ServiceUnavailable
            raise ServiceUnavailable("refused for the test")
        return real(op, args)

    monkeypatch.setattr(client, "_begin_fill", refuse_first)
    s = client.stream_slots(keys, [SIZE] * 6, LAYERS)
    try:
        assert s.wait_layer(LAYERS - 1, 10.0) == [False, False] + [True] * 4
        for i in range(2, 6):
            for layer in range(LAYERS):
                assert layer_bytes(s, i, layer) == data[i][layer * LAYER:(layer + 1) * LAYER]
        assert s.outcomes(10.0)[2:] == [Outcome.DONE] * 4
    finally:
        s.release()
