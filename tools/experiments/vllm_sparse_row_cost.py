"""The cost of one sparse decode row in vLLM's CPU attention impl
(docs/connectors/vllm.md, "What it costs"): SmolLM2's shapes (9 query / 3 KV heads of
64, float32), synthetic paged KV in a shuffled block table, one decode row
per forward, the context growing by one token per forward as in decode
(each new token written through the impl's own cache update). Per context
length: the stock kernel, and ucm's impl at a 1,024-token budget with
`reselect_every` 1 and 4, with `selector` (quest by default; lowrank's
first forward also fits its basis and summarises every page again); mean
(median) milliseconds per forward over `calls` forwards, one thread.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/vllm_sparse_row_cost.py 200 [selector]
"""
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

QH, H, D, BT = 9, 3, 64, 128


def run(contexts=(1024, 4096, 8192), calls=200, selector="quest"):
    from vllm import _custom_ops as ops
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa

    from ucm.connectors.vllm import sparse_backend as sb

    torch.set_num_threads(1)
    cpu_attn.get_current_vllm_config = lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    isa = _get_attn_isa(torch.float32, BT, D)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    print(f"kernel {isa}; {selector}; mean (median) ms per forward, one decode row, {calls} forwards")
    print("| context | stock kernel | sparse, reselect_every 1 | sparse, reselect_every 4 |")
    print("|---|---|---|---|")
    for n0 in contexts:
        nb = math.ceil((n0 + calls) / BT)
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(nb + 4, H, BT, 2 * D, generator=g)
        table = torch.randperm(nb + 4, generator=g)[:nb].to(torch.int32).unsqueeze(0)
        row = []
        for name, every in (("stock", 0), ("s1", 1), ("s4", 4)):
            if every:
                os.environ["UCM_VLLM_SPARSE"] = (f"{{selector: {selector}, budget: {{tokens: 1024}}, "
                                                 f"min_context_tokens: 256, reselect_every: {every}}}")
                cls = sb.UcmSparseCpuImpl
            else:
                cls = CPUAttentionBackendImpl
            impl = cls(num_heads=QH, head_size=D, scale=1 / math.sqrt(D), num_kv_heads=H, alibi_slopes=None,
                       sliding_window=None, kv_cache_dtype="auto")
            times = []
            for i in range(calls):
                n = n0 + i
                slot = int(table[0, (n - 1) // BT]) * BT + (n - 1) % BT
                k_new, v_new = torch.randn(2, 1, H, D, generator=g)
                impl.do_kv_cache_update(layer, k_new, v_new, kv, torch.tensor([slot]))
                starts = torch.tensor([0, 1], dtype=torch.int32)
                seq = torch.tensor([n], dtype=torch.int32)
                sched = ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=1, num_heads=QH, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=torch.float32,
                    query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
                    dynamic_causal=None, kv_cache_dtype="auto")
                md = CPUAttentionMetadata(num_actual_tokens=1, max_query_len=1, query_start_loc=starts,
                                          max_seq_len=n, seq_lens=seq, block_table=table,
                                          slot_mapping=torch.zeros(0, dtype=torch.int64), scheduler_metadata=sched)
                q = torch.randn(1, QH, D, generator=g)
                out = torch.zeros_like(q)
                t0 = time.perf_counter()
                impl.forward(layer, q, None, None, kv, md, out)
                times.append(time.perf_counter() - t0)
            row.append((statistics.mean(times) * 1e3, statistics.median(times) * 1e3))
        print(f"| {n0:,} | " + " | ".join(f"{a:.2f} ({m:.2f}) ms" for a, m in row) + " |")


if __name__ == "__main__":
    run(calls=int(sys.argv[1]) if len(sys.argv) > 1 else 200, selector=sys.argv[2] if len(sys.argv) > 2 else "quest")
