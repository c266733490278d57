"""End to end: ucm's blocks in vLLM's own KV event stream (issue 46).

vLLM for CPU with SmolLM2: two engines on one ucm service (DRAM of 6
blocks over NVMe of 12), each publishing vLLM's `kv_events_config` stream
over ZMQ (ipc sockets: nothing listens on a network). Document A is asked
of engine 1, then five other documents push it down to NVMe and then out
of ucm; engine 2 only gets short requests. A subscriber per engine decodes
every batch with vLLM's own msgspec types.

Must hold: ucm's `BlockStored` events for A carry exactly the hashes,
parent links and token ids of engine 1's own GPU-tier events for the same
pages; A's medium goes CPU_TIER1 -> DISK -> removed, each move a removal
from the old medium before the store in the new one; at the end ucm
claims none of A's pages; engine 2's stream advertises A's blocks too
(the shared service's), with the same hashes. The file is also the driver
(vLLM needs the `__main__` guard)."""
from __future__ import annotations

import importlib.util
import json
import random
import threading
import time
from pathlib import Path

import pytest
from vllm_support import DTYPE_BYTES, E2E_DTYPE, close_engine, driver_main, run_driver  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
BLOCK_TOKENS = 256
PAGE = 128
DOC_TOKENS = 1024
DOCS = 6
BLOCK_BYTES = 30 * 2 * 3 * 64 * DTYPE_BYTES * BLOCK_TOKENS


@pytest.mark.timeout(900)
def test_ucm_blocks_carry_the_engines_hashes_and_follow_their_tier(tmp_path):
    r = run_driver(HERE, tmp_path, 850)
    gpu, ucm = r["gpu_a"], r["ucm_events"]
    print(f"{len(ucm)} ucm events; A's GPU pages: {len(gpu['hashes'])}; phases: {r['phases']}")
    pages = DOC_TOKENS // PAGE
    assert len(gpu["hashes"]) >= pages and gpu["tokens"][:DOC_TOKENS] == r["doc_a"]
    a_hashes = gpu["hashes"][:pages]
    # ucm's stores of A's blocks: the engine's own hashes, parents and tokens, in CPU_TIER1 first.
    stored = [e for e in ucm if e["type"] == "BlockStored" and set(e["hashes"]) & set(a_hashes)]
    first = [e for e in stored if e["medium"] == "CPU_TIER1"][:DOC_TOKENS // BLOCK_TOKENS]
    assert [h for e in first for h in e["hashes"]] == a_hashes
    assert [t for e in first for t in e["tokens"]] == r["doc_a"]
    assert first[0]["parent"] is None and all(e["block_size"] == PAGE for e in first)
    assert [e["parent"] for e in first[1:]] == [e["hashes"][-1] for e in first[:-1]]
    # Each page of A: stored in CPU_TIER1, moved to DISK, then removed; never a removal of what was not stored.
    for h in a_hashes:
        trail, held = [], None
        for e in ucm:
            if h not in e["hashes"]:
                continue
            if e["type"] == "BlockStored":
                assert held is None, (h, trail)
                held = e["medium"]
            else:
                assert e["type"] == "BlockRemoved" and held == e["medium"], (h, trail)
                held = None
            trail.append((e["type"], e["medium"]))
        assert trail[0] == ("BlockStored", "CPU_TIER1"), trail
        assert ("BlockStored", "DISK") in trail, trail
        assert trail[-1] == ("BlockRemoved", "DISK") and held is None, trail
    # Engine 2 never saw A, yet advertises A's blocks from the shared service, with the same hashes.
    other = [h for e in r["engine2_ucm_events"] if e["type"] == "BlockStored" for h in e["hashes"]]
    assert set(a_hashes) <= set(other)


# ---- the driver (runs in its own process) -------------------------------------
def _subscribe(endpoint: str, sink: list, stop: threading.Event) -> threading.Thread:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    def run() -> None:
        while not stop.is_set():
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                sink.extend(decoder.decode(payload).events)
        sub.close(0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _row(e) -> dict:
    name = type(e).__name__
    row = {"type": name, "medium": getattr(e, "medium", None), "hashes": list(getattr(e, "block_hashes", []))}
    if name == "BlockStored":
        row.update(parent=e.parent_block_hash, tokens=list(e.token_ids), block_size=e.block_size)
    return row


def _driver(out: Path, work: Path) -> int:
    import subprocess
    import sys

    import yaml
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    model = subprocess.run([sys.executable, "-m", "ucm.cli", "model", "prepare", "smollm2"],
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    mib = lambda blocks: f"{-(-blocks * BLOCK_BYTES // (1 << 20))}MiB"  # noqa: E731
    (work / "nvme").mkdir(exist_ok=True)
    cfg = {"block_tokens": BLOCK_TOKENS, "policy": {"name": "lru"},
           "tiers": [{"adapter": "dram", "capacity": mib(6)},
                     {"adapter": "nvme", "capacity": mib(12),
                      "options": {"path": str(work / "nvme"), "region_size": mib(2)}}],
           "service": {"name": f"kv-events-{int(time.time() * 1000) % 10**9}"}}
    (work / "ucm.yaml").write_text(yaml.safe_dump(cfg))

    def engine(i: int):
        endpoint = f"ipc://{work}/kv-events-{i}.sock"
        llm = LLM(model=model, dtype=E2E_DTYPE, max_model_len=DOC_TOKENS + 256, enforce_eager=True,
                  enable_prefix_caching=True, seed=0,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                      kv_role="kv_both", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"ucm_config": str(work / "ucm.yaml")}),
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                                                  topic=""))
        sink: list = []
        return llm, sink, _subscribe(endpoint, sink, stop)

    stop = threading.Event()
    llm, events, sub = engine(1)
    llm2, events2, sub2 = engine(2)
    rng = random.Random(46)
    docs = [[rng.randrange(1000, 40000) for _ in range(DOC_TOKENS)] for _ in range(DOCS)]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def ask(engine, tokens: list[int]) -> None:
        engine.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)

    def settle(engine, sink: list) -> None:
        """Short requests until ucm's events stop coming (the engine publishes on its steps)."""
        quiet, deadline = 0, time.monotonic() + 30
        while quiet < 3 and time.monotonic() < deadline:
            n = len(sink)
            ask(engine, [rng.randrange(1000, 40000) for _ in range(8)])
            time.sleep(0.3)
            quiet = quiet + 1 if len(sink) == n else 0

    phases = []
    time.sleep(1.0)  # the subscribers join before the first batch
    for i, doc in enumerate(docs):
        ask(llm, doc + [7, 8, 9])
        settle(llm, events)
        if i == 0:
            settle(llm2, events2)  # engine 2 advertises what engine 1 stored
        phases.append(len(events))
    stop.set()
    sub.join(5)
    sub2.join(5)
    close_engine(llm2)
    close_engine(llm)
    rows = [_row(e) for e in events]
    gpu = [r for r in rows if r["type"] == "BlockStored" and r["medium"] in (None, "GPU")]
    a = next(r for r in gpu if r["tokens"][:PAGE] == docs[0][:PAGE])
    chain = [a]
    while len(chain) < len(gpu):  # the engine may store A's pages over more than one event
        nxt = next((r for r in gpu if r["parent"] == chain[-1]["hashes"][-1]), None)
        if nxt is None:
            break
        chain.append(nxt)
    out.write_text(json.dumps({
        "doc_a": docs[0], "phases": phases,
        "gpu_a": {"hashes": [h for r in chain for h in r["hashes"]], "tokens": [t for r in chain for t in r["tokens"]]},
        "ucm_events": [r for r in rows if r["medium"] not in (None, "GPU")],
        "engine2_ucm_events": [r for r in map(_row, events2) if r["medium"] not in (None, "GPU")],
    }))
    return 0


if __name__ == "__main__":
    driver_main(_driver)
