"""A probe of Dynamo 1.6.1's KV router with fake engines
(tools/dynamo_probe/fake_engine.py): which KV-event media it credits as
which tier, and ucm/connectors/dynamo/worker.py checked without a vLLM
engine (the mapping in docs/operations.md, "KV events for routers").

Run inside a loopback-only network namespace: a `dynamo.frontend` with the
KV router, two thin workers each with its own fake engine, BlockStored
events for a prefix from worker 2 only, then `/v1/completions` with that
prefix, reporting which worker served it; then, per KV-event `medium`, the
per-tier overlap the router credits (`KvRouter.get_overlap_scores` on a
probe router subscribed to the same events) and where the frontend routes.

    ip netns exec NS python tools/dynamo_probe/media_probe.py --dynamo-python .venv-dynamo/bin/python \
        --model-dir ~/.cache/ucm/models/smollm2-135m-instruct --workdir /tmp/dynfake
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any, Optional

FAKE_ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_engine.py")


# ---------------------------------------------------------------------------
# scenario driver
# ---------------------------------------------------------------------------

PAGE = 128
PREFIX_PAGES = 4
MEDIA = [None, "GPU", "CPU", "CPU_PINNED", "CPU_TIER1", "CPU_TIER2", "DISK", "NVME", "STORAGE", "EXTERNAL",
         "SHARED", "cpu_tier1", "BOGUS"]


def http(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_for(pred, timeout: float, what: str, step: float = 0.5):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # not up yet
            last = e
        time.sleep(step)
    raise TimeoutError(f"timed out waiting for {what}: {last!r}")


def prefix_tokens(seed: int, n: int = PAGE * PREFIX_PAGES) -> list[int]:
    # Distinct, valid token ids for SmolLM2 (vocab 49152), one sequence per seed.
    return [100 + ((seed * 7919 + i * 31) % 40000) for i in range(n)]


def stored_events(tokens: list[int], seed: int, medium: Optional[str], parent: Optional[int] = None,
                  first_page: int = 0) -> list[dict]:
    # One BlockStored per page, each chained to the previous, as vLLM does.
    out = []
    prev = parent
    for p in range(first_page, len(tokens) // PAGE):
        h = seed * 1000 + p + 1
        out.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": prev,
                    "token_ids": tokens[p * PAGE:(p + 1) * PAGE], "block_size": PAGE, "medium": medium})
        prev = h
    return out


PROBE = r'''
import asyncio, json, os, sys
from dynamo.runtime import DistributedRuntime
from dynamo.llm import KvRouter, KvRouterConfig

async def main():
    ns, block, cmd_fifo = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    ep = rt.endpoint(f"{ns}.backend.generate")
    cfg = KvRouterConfig(host_cache_hit_weight=float(os.environ.get("PROBE_HOST_W", "0.75")),
                         disk_cache_hit_weight=float(os.environ.get("PROBE_DISK_W", "0.25")))
    router = KvRouter(ep, block, cfg)
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        req = json.loads(line)
        try:
            if req["op"] == "overlap":
                res = await router.get_overlap_scores(req["tokens"])
            elif req["op"] == "best":
                res = list(await router.best_worker(req["tokens"]))
            elif req["op"] == "loads":
                res = await router.get_potential_loads(req["tokens"])
            elif req["op"] == "dump":
                res = json.loads(await router.dump_events())
            else:
                res = {"error": "op"}
            print(json.dumps({"ok": True, "result": res}, default=str), flush=True)
        except Exception as e:
            print(json.dumps({"ok": False, "error": repr(e)}), flush=True)
    rt.shutdown()

asyncio.run(main())
'''


class Probe:
    def __init__(self, py: str, ns: str, env: dict, log):
        self.p = subprocess.Popen([py, "-c", PROBE, ns, str(PAGE), "-"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, env=env, text=True, bufsize=1)
        line = self.p.stdout.readline()
        assert json.loads(line).get("ready"), line

    def ask(self, **req) -> Any:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        res = json.loads(self.p.stdout.readline())
        if not res.get("ok"):
            raise RuntimeError(res)
        return res["result"]

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(10)
        except Exception:
            self.p.kill()


def scenario(args: argparse.Namespace) -> None:
    wd = os.path.abspath(args.workdir)
    os.makedirs(wd, exist_ok=True)
    disc = os.path.join(wd, "discovery")
    os.makedirs(disc, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.update({
        "DYN_FILE_KV": disc, "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_LOG": args.dyn_log, "PYTHONUNBUFFERED": "1",
    })
    procs: list[subprocess.Popen] = []
    logs = {}

    def spawn(name, cmd):
        f = open(os.path.join(wd, name + ".log"), "w")
        logs[name] = f
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=repo)
        procs.append(p)
        return p

    fport = args.http_port
    results: dict[str, Any] = {"media": {}}
    try:
        spawn("frontend", [args.dynamo_python, "-m", "dynamo.frontend", "--router-mode", "kv",
                           "--discovery-backend", "file", "--http-host", "127.0.0.1", "--http-port", str(fport),
                           "--namespace", args.namespace,
                           "--router-host-cache-hit-weight", str(args.host_weight),
                           "--router-disk-cache-hit-weight", str(args.disk_weight)])
        engines = []
        for i in (1, 2):
            hp, zp = 8100 + i, 5556 + i
            spawn(f"engine{i}", [sys.executable, FAKE_ENGINE, "--name", f"engine{i}",
                                 "--http-port", str(hp), "--zmq-port", str(zp), "--tokens", "4",
                                 "--record", os.path.join(wd, f"engine{i}.jsonl")])
            engines.append(f"http://127.0.0.1:{hp}")
        for u in engines:
            wait_for(lambda: http("GET", u + "/health"), 30, u)
        for i in (1, 2):
            idf = os.path.join(wd, f"worker{i}.id")
            if os.path.exists(idf):
                os.remove(idf)
            spawn(f"worker{i}", [args.dynamo_python, os.path.join(repo, "ucm/connectors/dynamo/worker.py"),
                                 "--namespace", args.namespace, "--model-path", args.model_dir,
                                 "--served-model-name", "smollm2", "--page-tokens", str(PAGE),
                                 "--engine-url", engines[i - 1], "--kv-events-endpoint", f"tcp://127.0.0.1:{5556 + i}",
                                 "--discovery-dir", disc, "--worker-id-file", idf, "--total-kv-blocks", "1024",
                                 "--context-length", "8192"])
        wid = {}
        for i in (1, 2):
            idf = os.path.join(wd, f"worker{i}.id")
            wid[i] = int(wait_for(lambda: open(idf).read().strip() if os.path.exists(idf) else None, 120, idf))
        results["worker_ids"] = {"worker1": wid[1], "worker2": wid[2]}
        name_of = {wid[1]: "worker1", wid[2]: "worker2"}
        print("worker ids:", results["worker_ids"], flush=True)
        wait_for(lambda: any(m.get("id") == "smollm2" for m in http("GET", f"http://127.0.0.1:{fport}/v1/models")["data"]),
                 120, "model on frontend")
        time.sleep(2)  # let the frontend's router see both instances

        probe = Probe(args.dynamo_python, args.namespace, env, logs.setdefault("probe", open(os.path.join(wd, "probe.log"), "w")))

        def complete(tokens):
            before = [len(http("GET", u + "/fake/requests")) for u in engines]
            r = http("POST", f"http://127.0.0.1:{fport}/v1/completions",
                     {"model": "smollm2", "prompt": tokens, "max_tokens": 4, "temperature": 0,
                      "nvext": {"extra_fields": ["worker_id"]}}, timeout=60)
            after = [len(http("GET", u + "/fake/requests")) for u in engines]
            served = [f"worker{i + 1}" for i in range(2) if after[i] > before[i]]
            return served, r

        def last_selected():
            import re
            with open(os.path.join(wd, "frontend.log"), errors="replace") as f:
                lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in f if "Selected worker" in ln]
            if not lines:
                return None
            m = re.search(r"worker_id=(\d+).*?(logit=\S+ host_pinned_blocks=\d+ disk_blocks=\d+)", lines[-1])
            return f"{name_of.get(int(m.group(1)), m.group(1))} {m.group(2)}" if m else lines[-1].strip()

        def publish(i, events):
            http("POST", engines[i - 1] + "/fake/publish", {"events": events})

        def overlap(tokens):
            res = probe.ask(op="overlap", tokens=tokens)
            rows = {}
            for w in res.get("workers", []):
                key = name_of.get(int(w.get("worker_id", -1)), str(w.get("worker_id")))
                rows[key] = {k: v for k, v in w.items() if k not in ("worker_id", "dp_rank")}
            return rows, res

        # 0. warm-up: ZMQ subscriptions (engine -> worker relay -> router) join
        # asynchronously and nothing is replayed, so wait until the probe
        # router sees a sentinel prefix of each worker
        for i in (1, 2):
            t = prefix_tokens(900 + i, PAGE)
            publish(i, stored_events(t, 900 + i, "GPU"))
            wait_for(lambda: (overlap(t)[0].get(f"worker{i}") or {}).get("device_blocks") == 1
                     or publish(i, stored_events(t, 900 + i, "GPU")), 60, f"probe sees worker{i}", step=1.0)

        # 1. the basic check: a 512-token prefix stored on worker 2's GPU only
        toks = prefix_tokens(1)
        publish(2, stored_events(toks, 1, args.basic_medium))
        time.sleep(1.5)
        rows, raw = overlap(toks)
        served, resp = complete(toks)
        results["basic"] = {"medium": args.basic_medium, "served_by": served, "overlap": rows,
                            "nvext": resp.get("nvext"), "usage": resp.get("usage"),
                            "text": resp["choices"][0].get("text")}
        print("basic:", json.dumps(results["basic"]), flush=True)
        results["overlap_raw_example"] = raw

        # 2. per medium: a fresh prefix on worker 2 with that medium
        for k, medium in enumerate(MEDIA):
            seed = 10 + k
            t = prefix_tokens(seed)
            publish(2, stored_events(t, seed, medium))
            time.sleep(1.5)
            rows, _ = overlap(t)
            served, resp = complete(t)
            results["media"][str(medium)] = {"overlap": rows, "served_by": served, "nvext": resp.get("nvext"),
                                             "frontend": last_selected()}
            print(f"medium {medium!r}: served_by={served} worker2 overlap={json.dumps(rows.get('worker2'))} "
                  f"frontend: {last_selected()}", flush=True)

        # 3. BlockStored whose parent the router never saw
        t = prefix_tokens(40)
        publish(2, stored_events(t, 40, None, parent=987654321, first_page=0))
        time.sleep(1.5)
        rows, _ = overlap(t)
        results["unknown_parent_first"] = rows
        t = prefix_tokens(41)
        ev = stored_events(t, 41, None)
        publish(2, ev[1:])  # pages 2..4 only: their parent (page 1) was never announced
        time.sleep(1.5)
        rows, _ = overlap(t)
        results["unknown_parent_mid"] = rows
        publish(2, ev[:1])  # now page 1
        time.sleep(1.5)
        rows, _ = overlap(t)
        results["unknown_parent_mid_after_parent"] = rows
        t = prefix_tokens(42)
        publish(2, stored_events(t, 42, "CPU_TIER1")[1:])  # host tier, parent never announced
        time.sleep(1.5)
        results["unknown_parent_host_tier"] = overlap(t)[0]
        for k in ("unknown_parent_first", "unknown_parent_mid", "unknown_parent_mid_after_parent",
                  "unknown_parent_host_tier"):
            print(k, results[k].get("worker2"), flush=True)

        # 4. same blocks on two tiers, then BlockRemoved with a medium
        t = prefix_tokens(50)
        h = [50 * 1000 + p + 1 for p in range(PREFIX_PAGES)]
        steps = [("two_tiers", None),
                 ("after_remove_GPU_p4", {"block_hashes": [h[3]], "medium": "GPU"}),
                 ("after_remove_None_p3", {"block_hashes": [h[2]], "medium": None}),
                 ("after_remove_CPU_TIER1_p4", {"block_hashes": [h[3]], "medium": "CPU_TIER1"}),
                 ("after_remove_CPU_TIER1_p1", {"block_hashes": [h[0]], "medium": "CPU_TIER1"}),
                 ("after_remove_DISK_p2_not_stored_there", {"block_hashes": [h[1]], "medium": "DISK"})]
        publish(1, stored_events(t, 50, "GPU") + stored_events(t, 50, "CPU_TIER1"))
        results["removal"] = {}
        for name, rm in steps:
            if rm:
                publish(1, [dict(type="BlockRemoved", **rm)])
            time.sleep(1.5)
            results["removal"][name] = overlap(t)[0].get("worker1")
            print("removal", name, results["removal"][name], flush=True)

        # 5. a host-tier suffix whose parent is known only on the GPU tier
        t = prefix_tokens(70)
        ev_gpu = stored_events(t[:2 * PAGE], 70, "GPU")
        ev_host = stored_events(t, 70, "CPU_TIER1", parent=70 * 1000 + 2, first_page=2)
        publish(1, ev_gpu + ev_host)
        time.sleep(1.5)
        results["cross_tier_parent"] = overlap(t)[0].get("worker1")
        print("cross-tier parent:", results["cross_tier_parent"], flush=True)

        # 6. AllBlocksCleared clears every tier of that worker
        publish(1, [{"type": "AllBlocksCleared"}])
        time.sleep(1.5)
        results["after_all_cleared"] = overlap(t)[0].get("worker1")
        print("after AllBlocksCleared:", results["after_all_cleared"], flush=True)

        # 7. routing: 2 GPU pages on worker 1 vs 4 pages of tier X on worker 2
        results["gpu2_vs_tier4"] = {}
        for k, medium in enumerate(["GPU", "CPU_TIER1", "DISK", "EXTERNAL"]):
            seed = 80 + k
            t = prefix_tokens(seed)
            # the same block hashes on both workers, as engines with the same
            # hash seed produce (see section 8 for differing hashes)
            publish(1, stored_events(t[:2 * PAGE], seed, "GPU"))
            publish(2, stored_events(t, seed, medium))
            time.sleep(1.5)
            served, _ = complete(t)
            results["gpu2_vs_tier4"][medium] = {"overlap": overlap(t)[0], "served_by": served,
                                                "frontend": last_selected()}
            print(f"gpu2 (worker1) vs {medium} x4 (worker2): served_by={served} "
                  f"frontend: {last_selected()}", flush=True)
        # 8. one prefix on both workers' GPU tier: worker 1 holds 2 pages, worker 2 all 4
        results["shared_prefix"] = {}
        cases = [("different_hashes_w1_first", 90, 190, 1, False),
                 ("same_hashes_w1_first", 91, 91, 1, False),
                 ("different_hashes_one_event", 92, 192, 1, True),
                 ("different_hashes_w2_first", 93, 193, 2, False)]
        for name, s1, s2, first, one_event in cases:
            t = prefix_tokens(s1)
            ev1 = stored_events(t[:2 * PAGE], s1, "GPU")
            ev2 = stored_events(t, s2, "GPU")
            if one_event:
                ev2 = [dict(ev2[0], block_hashes=[e["block_hashes"][0] for e in ev2], token_ids=t)]
            for w in ((1, 2) if first == 1 else (2, 1)):
                publish(w, ev1 if w == 1 else ev2)
                time.sleep(0.5)
            time.sleep(1.5)
            rows = overlap(t)[0]
            results["shared_prefix"][name] = {w: (r["device_blocks"]) for w, r in rows.items()}
            print("shared prefix", name, "device blocks:", results["shared_prefix"][name], flush=True)

        try:
            results["dump_events_len"] = len(probe.ask(op="dump"))
        except Exception as e:
            results["dump_events_error"] = repr(e)
        probe.close()
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()
        with open(os.path.join(wd, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        print("results in", os.path.join(wd, "results.json"), flush=True)


def main(argv=None) -> None:
    s = argparse.ArgumentParser(description="frontend + 2 thin workers + 2 fake engines")
    s.add_argument("--dynamo-python", default=".venv-dynamo/bin/python")
    s.add_argument("--model-dir", default=os.path.expanduser("~/.cache/ucm/models/smollm2-135m-instruct"))
    s.add_argument("--workdir", default="/tmp/dynfake")
    s.add_argument("--namespace", default="dynamo")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--host-weight", type=float, default=0.75)
    s.add_argument("--disk-weight", type=float, default=0.25)
    s.add_argument("--basic-medium", default="GPU")
    s.add_argument("--dyn-log", default="info")
    scenario(s.parse_args(argv))


if __name__ == "__main__":
    main()
