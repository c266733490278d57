"""ucm bench codec: the codecs of the tiers below DRAM on a real model's KV.

The model (`--model`) computes the KV of prose it was not tuned on (Newton's
*Opticks*, shipped with tvm-ffi in this environment, or a text given with
`--text`); every full 128-token block of a prefix goes through each codec
(encode, decode, exactly as a tier stores and stages it) and the model
continues from the decoded cache. Against the exact cache it reports:

- size: raw bytes / stored bytes (frame, layout, scales, outliers
  included), encode and decode GB/s of raw bytes on 1 and 2 threads
  (two blocks at a time);
- relative K and V error (Frobenius, over every block);
- teacher-forced next-token agreement and mean KL(exact || codec) over the
  256 tokens after a 2,048-token hit;
- greedy agreement over 64 tokens (positions equal, and the first
  divergence);
- passkey accuracy (a 5-digit key hidden at a random depth of filler
  prose, generated with a seed) at 1K to 8K tokens, codec against the
  exact cache on the same prompts.

Reference rows that are not codecs (`ucm.bench.engines.codec_floors`, measured
here only, never stored): `naive-int4`, the floor the issue names; `ulp`,
the exact cache moved by one unit in the last place per element, and
`rechunk`, the same KV computed by the model in two forwards: how far a
cache that differs from the exact one only by rounding carries the greedy
tokens (the noise floor a lossy codec's greedy agreement is read
against).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from ucm.bench import common
from ucm.bench.engines import codec_floors

BLOCK_TOKENS = 128
CODECS = ("lossless", "int8", "int4", "naive-int4", "ulp", "rechunk")


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "codec", help="codec size, speed and quality on a real model's KV",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=int, default=4, help="documents (default 4)")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="tokens of each hit (default 2048)")
    p.add_argument("--forced-tokens", type=int, default=256, help="teacher-forced tokens after it (default 256)")
    p.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens compared (default 64)")
    p.add_argument("--passkey-lengths", default="1024,2048,4096,8192",
                   help="passkey prompt tokens (default 1024,2048,4096,8192)")
    p.add_argument("--passkey-trials", type=int, default=2, help="passkey prompts per length (default 2)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model and KV dtype")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"codecs (default {','.join(CODECS)})")
    p.add_argument("--text", default=None, help="a UTF-8 prose file (default: Opticks from tvm-ffi)")
    common.add_model_flag(p)
    p.add_argument("--seed", type=int, default=21)
    common.add_json_flag(p)


def find_text(path: Optional[str]) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    for cand in [*site.glob("tvm_ffi/3rdparty/libbacktrace/*Opticks*.txt"), Path("/usr/share/common-licenses/GPL-3")]:
        if cand.is_file():
            return cand.read_text(encoding="utf-8", errors="replace")
    raise ValueError("no prose text found; give one with --text")


def blocks_of(cache, n_blocks: int):
    """[n, layers, 2, heads, 128, dim] of the cache's first n full blocks."""
    import torch

    ks = [layer.keys[0] for layer in cache.layers]  # [heads, seq, dim]
    vs = [layer.values[0] for layer in cache.layers]
    h, _, d = ks[0].shape
    out = torch.empty(n_blocks, len(ks), 2, h, BLOCK_TOKENS, d, dtype=ks[0].dtype)
    for l, (k, v) in enumerate(zip(ks, vs)):
        for j, t in enumerate((k, v)):
            out[:, l, j] = t[:, :n_blocks * BLOCK_TOKENS].reshape(h, n_blocks, BLOCK_TOKENS, d).transpose(0, 1)
    return out


def with_blocks(cache, blocks, n_tokens: Optional[int] = None):
    """A copy of `cache` whose first blocks are `blocks` (the decoded ones),
    cut to the blocks' tokens (a hit covers full blocks only)."""
    import copy

    c = copy.deepcopy(cache)
    n = blocks.shape[0]
    end = n * BLOCK_TOKENS
    for l, layer in enumerate(c.layers):
        for j, name in enumerate(("keys", "values")):
            t = getattr(layer, name)[:, :, :end].clone()
            t[0] = blocks[:, l, j].transpose(0, 1).reshape(t.shape[1], end, t.shape[3])
            setattr(layer, name, t)
    return c


class CodecRun:
    """Encodes and decodes real blocks with one codec; keeps sizes and times."""

    def __init__(self, name: str, layout) -> None:
        from ucm.codecs import load_codec_class

        self.name = name
        self.layout = layout
        self.codec = None if name in codec_floors.FLOORS else load_codec_class(name)()
        self.seed = 0
        self.raw = self.stored = 0
        self.err = {"k": [0.0, 0.0], "v": [0.0, 0.0]}  # sum of squared error, sum of squares

    def roundtrip(self, blocks, recompute: Optional[Callable[[], Any]] = None):
        """The blocks as the model continues from them: decoded by the codec,
        or a reference row's (`recompute` gives `rechunk`'s blocks)."""
        import torch

        from ucm.codecs.frame import frame_bytes

        if self.codec is None:
            self.raw += blocks.numel() * blocks.element_size()
            if self.name == "naive-int4":
                out = codec_floors.naive_int4(blocks)
                self.stored += codec_floors.naive_int4_stored_bytes(blocks)
            elif self.name == "ulp":
                self.seed += 1
                out = codec_floors.one_ulp(blocks, self.seed)
                self.stored += blocks.numel() * blocks.element_size()
            else:
                if recompute is None:
                    raise ValueError(f"{self.name} needs the model to recompute the blocks")
                out = recompute()
                self.stored += blocks.numel() * blocks.element_size()
        else:
            out = torch.empty_like(blocks)
            for i in range(blocks.shape[0]):
                raw = memoryview(blocks[i].contiguous().view(torch.uint8).numpy().reshape(-1))
                enc = self.codec.encode(raw, self.layout)
                if enc is None:
                    raise ValueError(f"codec {self.name} did not encode a block")
                dst = memoryview(out[i].view(torch.uint8).numpy().reshape(-1))
                if not self.codec.decode(memoryview(enc.meta), memoryview(enc.body), dst):
                    raise ValueError(f"codec {self.name} did not decode its own block")
                self.raw += len(raw)
                self.stored += frame_bytes(len(enc.meta), len(enc.body))
        for j, kind in enumerate("kv"):
            a, b = blocks[:, :, j].float(), out[:, :, j].float()
            self.err[kind][0] += float(((a - b) ** 2).sum())
            self.err[kind][1] += float((a ** 2).sum())
        return out

    def speed(self, blocks) -> dict[str, float]:
        """GB/s of raw bytes, encode and decode, on 1 and 2 threads."""
        import torch

        raws = [memoryview(blocks[i].contiguous().view(torch.uint8).numpy().reshape(-1)) for i in
                range(blocks.shape[0])]
        encs = [self.codec.encode(r, self.layout) for r in raws]
        outs = [memoryview(bytearray(len(r))) for r in raws]
        total = sum(len(r) for r in raws)
        res = {}
        for threads in (1, 2):
            with ThreadPoolExecutor(threads) as pool:
                for what, fn in (("encode", lambda i: self.codec.encode(raws[i], self.layout)),
                                 ("decode", lambda i: self.codec.decode(memoryview(encs[i].meta),
                                                                        memoryview(encs[i].body), outs[i]))):
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        list(pool.map(fn, range(len(raws))))
                        best = min(best, time.perf_counter() - t0)
                    res[f"{what}_gbps_{threads}t"] = round(total / best / 1e9, 3)
        return res


def greedy_after_hit(model, prefix, cache, n_tokens: int):
    """`n_tokens` greedy tokens after a hit of the whole prefix, as an engine
    continues one: the last prefix position is recomputed from the cached
    rest, then decoding goes on from its cache. The exact cache goes the
    same way, so a bit-exact codec gives the same tokens by construction."""
    import torch

    cache.crop(-1)
    step = model(prefix[:, -1:], past_key_values=cache)
    g0 = step.logits[:, -1:].argmax(-1)
    out = model.generate(torch.cat([prefix, g0], 1), past_key_values=step.past_key_values,
                         max_new_tokens=n_tokens - 1, min_new_tokens=n_tokens - 1, do_sample=False)
    return out[0, prefix.shape[1]:]


def measure(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ucm.apps.model import prepare
    from ucm.codecs.layout import planar_layout

    torch.manual_seed(args.seed)
    model_dir = str(prepare(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    layout = planar_layout(args.dtype, cfg.num_hidden_layers, heads, BLOCK_TOKENS, dim)
    text_ids = tok.encode(find_text(args.text), add_special_tokens=False)
    need = args.prefix_tokens + args.forced_tokens
    if args.prefix_tokens % BLOCK_TOKENS or len(text_ids) < args.docs * need:
        raise ValueError(f"need {args.docs} x {need} tokens of text (got {len(text_ids)}) and a prefix that is a "
                         f"multiple of {BLOCK_TOKENS}")
    names = [c.strip() for c in args.codecs.split(",") if c.strip()]
    runs = {n: CodecRun(n, layout) for n in names}
    q = {n: {"forced_agree": [], "kl": [], "greedy_equal": [], "first_divergence": []} for n in names}
    stride = len(text_ids) // args.docs
    speed_blocks = None
    n_blocks = args.prefix_tokens // BLOCK_TOKENS
    with torch.inference_mode():
        for d in range(args.docs):
            ids = torch.tensor([text_ids[d * stride:d * stride + need]])
            prefix, forced = ids[:, :args.prefix_tokens], ids[:, args.prefix_tokens:]
            exact = model(prefix, use_cache=True).past_key_values
            blocks = blocks_of(exact, n_blocks)
            if speed_blocks is None:
                speed_blocks = blocks[:8].clone()
            ref_logits = model(forced, past_key_values=with_blocks(exact, blocks)).logits[0].float()
            ref_greedy = greedy_after_hit(model, prefix, with_blocks(exact, blocks), args.greedy_tokens)
            rechunk = lambda: blocks_of(codec_floors.rechunked_prefix_cache(model, prefix), n_blocks)  # noqa: E731
            for n in names:
                dec = runs[n].roundtrip(blocks, rechunk)
                logits = model(forced, past_key_values=with_blocks(exact, dec)).logits[0].float()
                lp, lq = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
                q[n]["kl"].append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
                q[n]["forced_agree"].append(float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()))
                gen = greedy_after_hit(model, prefix, with_blocks(exact, dec), args.greedy_tokens)
                eq = (gen[:args.greedy_tokens] == ref_greedy[:args.greedy_tokens])
                q[n]["greedy_equal"].append(float(eq.float().mean()))
                q[n]["first_divergence"].append(int(eq.logical_not().nonzero()[0, 0]) if not eq.all()
                                                else args.greedy_tokens)
            log(f"doc {d + 1}/{args.docs}: " + ", ".join(
                f"{n} greedy {q[n]['greedy_equal'][-1]:.3f} forced {q[n]['forced_agree'][-1]:.3f}" for n in names))
        passkey = measure_passkey(model, tok, text_ids, runs, args, log)
    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "block_tokens": BLOCK_TOKENS,
                              "block_bytes": layout.block_bytes, "docs": args.docs,
                              "prefix_tokens": args.prefix_tokens, "text": "Opticks" if not args.text else args.text,
                              "codecs": {}}
    for n in names:
        r = runs[n]
        m = lambda xs: round(sum(xs) / len(xs), 5)  # noqa: E731
        entry = {"size_ratio": round(r.raw / r.stored, 4),
                 "rel_err_k": round((r.err["k"][0] / r.err["k"][1]) ** 0.5, 5),
                 "rel_err_v": round((r.err["v"][0] / r.err["v"][1]) ** 0.5, 5),
                 "forced_agreement": m(q[n]["forced_agree"]), "forced_kl": m(q[n]["kl"]),
                 "greedy_agreement": m(q[n]["greedy_equal"]), "first_divergence": q[n]["first_divergence"],
                 "passkey": passkey[n]}
        if r.codec is not None:
            entry.update(r.speed(speed_blocks))
        elif n == "naive-int4":
            entry["size_ratio_note"] = "estimated (bench-only floor, not stored)"
        else:
            entry["size_ratio_note"] = "reference row: the exact bytes perturbed, not a codec"
        result["codecs"][n] = entry
    result["passkey_exact"] = passkey["exact"]
    return result


def measure_passkey(model, tok, text_ids, runs, args, log) -> dict[str, dict[str, float]]:
    import torch

    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x.strip()]
    names = list(runs)
    hits = {n: {str(L): 0 for L in lengths} for n in ["exact", *names]}
    question = tok.encode("\nWhat is the pass key? The pass key is", add_special_tokens=False)
    for L in lengths:
        for trial in range(args.passkey_trials):
            key = str(rng.randrange(10000, 99999))
            needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                                add_special_tokens=False)
            start = rng.randrange(0, len(text_ids) - L)
            filler = text_ids[start:start + L - len(needle) - len(question) - 8]  # room for the answer
            at = rng.randrange(0, len(filler))
            ids = torch.tensor([filler[:at] + needle + filler[at:] + question])
            body = ids.shape[1] - len(question)
            n_blocks = body // BLOCK_TOKENS
            hit = n_blocks * BLOCK_TOKENS
            out = model(ids[:, :hit], use_cache=True)
            blocks = blocks_of(out.past_key_values, n_blocks)
            hit_ids = ids[:, :hit]
            rechunk = lambda: blocks_of(codec_floors.rechunked_prefix_cache(model, hit_ids), n_blocks)  # noqa: E731
            for n in ["exact", *names]:
                dec = blocks if n == "exact" else runs[n].roundtrip(blocks, rechunk)
                c = with_blocks(out.past_key_values, dec)
                gen = model.generate(ids, past_key_values=c, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
                hits[n][str(L)] += key in tok.decode(gen)
            log(f"passkey {L} trial {trial + 1}: " + ", ".join(f"{n} {hits[n][str(L)]}" for n in hits))
    return {n: {L: round(v / args.passkey_trials, 3) for L, v in h.items()} for n, h in hits.items()}


def run(args: argparse.Namespace) -> int:
    return common.run_measured(args, "codec", lambda log: measure(args, log), table)


def table(r: dict[str, Any]) -> str:
    """One row per codec: size ratio, speeds, errors, agreement, passkey."""
    lines = [f"{'codec':11s} {'ratio':>6s} {'enc 1t':>7s} {'dec 1t':>7s} {'dec 2t':>7s} {'K err':>7s} {'V err':>7s} "
             f"{'forced':>7s} {'KL':>8s} {'greedy':>7s} passkey (exact {r['passkey_exact']})"]
    for n, e in r["codecs"].items():
        lines.append(f"{n:11s} {e['size_ratio']:6.3f} {e.get('encode_gbps_1t', 0):7.2f} "
                     f"{e.get('decode_gbps_1t', 0):7.2f} {e.get('decode_gbps_2t', 0):7.2f} {e['rel_err_k']:7.4f} "
                     f"{e['rel_err_v']:7.4f} {e['forced_agreement']:7.3f} {e['forced_kl']:8.5f} "
                     f"{e['greedy_agreement']:7.3f} {e['passkey']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(common.main("python -m ucm.bench.engines.codec_bench", __doc__, _add_args, run))
