"""The int4 variants of docs/lab/benchmarks.md ("2026-12-03 17:25: where int4's
loss comes from"): real SmolLM2-135M KV in float32, 4 documents x 2,048
tokens of the bench's Opticks text, each variant's decoded prefix against
the exact one (K / V relative error, teacher-forced KL and agreement over
256 tokens, greedy agreement over 64), as `ucm bench codec` measures.

Not part of the package: an experiment record, run with the development
install (`PYTHONPATH=. .venv/bin/python tools/experiments/int4_variants.py
"int4;k4_only;v4_only;k:sink1;c:B"`). Names: `int4` the shipped codec;
`p:ktr,ktc,vtr,vtc,permille` the native codec with other tile shapes and
outliers (the frame records them); the others a torch model of the same
asymmetric 4-bit groups (`k:` keys only, values exact; `c:` both).
"""
import sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from ucm.apps.model import prepare
from ucm.bench.engines.codec_bench import find_text, blocks_of, with_blocks, greedy_after_hit, CodecRun, BLOCK_TOKENS
from ucm.codecs.layout import planar_layout

torch.set_num_threads(2)

def q_asym(x, dim, group, bits=4, clip=1.0):
    """asymmetric uniform quantisation along `dim` in groups of `group`."""
    x = x.movedim(dim, -1)
    shp = x.shape
    g = x.reshape(*shp[:-1], shp[-1] // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    if clip != 1.0:
        mid = (lo + hi) / 2
        lo, hi = mid + (lo - mid) * clip, mid + (hi - mid) * clip
    L = 2 ** bits - 1
    s = ((hi - lo) / L).clamp_min(1e-12)
    z = torch.round(lo / s)
    q = torch.clamp(torch.round(g / s) - z, 0, L)
    out = ((q + z) * s).reshape(shp)
    return out.movedim(-1, dim)

def q_clipsearch(x, dim, group, bits=4):
    best = None
    x_ = x.movedim(dim, -1)
    shp = x_.shape
    g = x_.reshape(*shp[:-1], shp[-1] // group, group)
    for c in (1.0, 0.95, 0.9, 0.85, 0.8):
        o = q_asym(x, dim, group, bits, c).movedim(dim, -1).reshape(g.shape)
        e = ((o - g) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, be = o, e
        else:
            m = e < be
            best = torch.where(m, o, best); be = torch.where(m, e, be)
    return best.reshape(shp).movedim(-1, dim)

def key_outliers(g, frac):
    """g [n, L, H, groups, 32, D] (key tiles over their 32 tokens): the
    `frac` of each (block, layer) segment farthest from their tile mean."""
    n, L = g.shape[:2]
    dev = (g - g.mean(-2, keepdim=True)).abs().reshape(n, L, -1)
    m = max(1, int(dev.shape[-1] * frac))
    thr = dev.topk(m, dim=-1).values[..., -1:]
    return (dev >= thr).reshape(g.shape)

def q_out(k, frac):
    """K per channel over 32 tokens, `frac` of each (block, layer) segment kept exact:
    the elements farthest from their tile mean; the tile's range excludes them."""
    n, L, H_, T, D = k.shape
    g = k.reshape(n, L, H_, T // 32, 32, D)
    out_mask = key_outliers(g, frac)
    big = torch.finfo(torch.float32).max
    lo = torch.where(out_mask, torch.full_like(g, big), g).amin(-2, keepdim=True)
    hi = torch.where(out_mask, torch.full_like(g, -big), g).amax(-2, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-12)
    z = torch.round(lo / s)
    q = torch.clamp(torch.round(g / s) - z, 0, 15)
    deq = (q + z) * s
    return torch.where(out_mask, g, deq).reshape(k.shape)

def q_out_v(v, group, frac):
    """V per token over `group` channels, `frac` of each segment exact (farthest from tile mean)."""
    n, L, H_, T, D = v.shape
    g = v.reshape(n, L, H_, T, D // group, group)
    mean = g.mean(-1, keepdim=True)
    big = torch.finfo(torch.float32).max
    if frac > 0:
        dev = (g - mean).abs().reshape(n, L, -1)
        m = max(1, int(dev.shape[-1] * frac))
        thr = dev.topk(m, dim=-1).values[..., -1:]
        out_mask = (dev >= thr).reshape(g.shape)
    else:
        out_mask = torch.zeros_like(g, dtype=torch.bool)
    lo = torch.where(out_mask, torch.full_like(g, big), g).amin(-1, keepdim=True)
    hi = torch.where(out_mask, torch.full_like(g, -big), g).amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-12)
    z = torch.round(lo / s)
    q = torch.clamp(torch.round(g / s) - z, 0, 15)
    return torch.where(out_mask, g, (q + z) * s).reshape(v.shape)

H = None
def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5

def variant(name, blocks):
    # blocks [n, L, 2, H, T, D]
    k, v = blocks[:, :, 0].float(), blocks[:, :, 1].float()
    Kq = lambda: q_asym(k, -2, 32)        # per channel over 32 tokens
    Vq = lambda: q_asym(v, -1, 32)        # per token over 32 channels
    if name == "k4_only": k2, v2 = Kq(), v
    elif name == "v4_only": k2, v2 = k, Vq()
    elif name == "both_emul": k2, v2 = Kq(), Vq()
    elif name == "k_g16": k2, v2 = q_asym(k, -2, 16), Vq()
    elif name == "v_g64": k2, v2 = Kq(), q_asym(v, -1, 64)
    elif name == "clip": k2, v2 = q_clipsearch(k, -2, 32), q_clipsearch(v, -1, 32)
    elif name == "v_clip": k2, v2 = Kq(), q_clipsearch(v, -1, 32)
    elif name == "had_k_tok":  # rotate head dim, quantise K per token over 32 channels
        Hm = hadamard(k.shape[-1]); kr = k @ Hm
        k2, v2 = q_asym(kr, -1, 32) @ Hm.T, Vq()
    elif name == "had_kv_tok":
        Hm = hadamard(k.shape[-1])
        k2 = q_asym(k @ Hm, -1, 32) @ Hm.T; v2 = q_asym(v @ Hm, -1, 32) @ Hm.T
    elif name == "had_v":
        Hm = hadamard(k.shape[-1]); k2 = Kq(); v2 = q_asym(v @ Hm, -1, 32) @ Hm.T
    elif name == "sink4":  # both emul, first 4 tokens of block 0 exact
        k2, v2 = Kq(), Vq()
        k2[0, :, :, :4] = k[0, :, :, :4]; v2[0, :, :, :4] = v[0, :, :, :4]
    elif name == "k5":  # 5-bit K reference (over budget)
        k2, v2 = q_asym(k, -2, 32, 5), Vq()
    elif name == "v5":
        k2, v2 = Kq(), q_asym(v, -1, 32, 5)
    elif name == "c:cur":
        k2, v2 = q_out(k, 0.002), q_out_v(v, 32, 0.002)
    elif name == "c:A":
        k2, v2 = q_out(k, 0.01), q_out_v(v, 64, 0)
    elif name == "c:B":
        k2 = q_out(k, 0.008); k2[:, :, :, :1] = k[:, :, :, :1]; v2 = q_out_v(v, 64, 0)
    elif name == "c:C":
        k2 = q_out(k, 0.01); v2 = q_out_v(v, 64, 0.002)
    elif name.startswith("k:"):  # K-only variants, V exact
        v2 = v
        opt = name[2:]
        if opt == "sink4":
            k2 = Kq(); k2[0, :, :, :4] = k[0, :, :, :4]
        elif opt == "sink1":
            k2 = Kq(); k2[0, :, :, :1] = k[0, :, :, :1]
        elif opt.startswith("exactL"):
            ls = [int(x) for x in opt[6:].split("-")]
            k2 = Kq(); k2[:, ls] = k[:, ls]
        elif opt == "had":
            Hm = hadamard(k.shape[-1]); k2 = q_asym(k @ Hm, -1, 32) @ Hm.T
        elif opt == "had_ch":
            Hm = hadamard(k.shape[-1]); k2 = q_asym(k @ Hm, -2, 32) @ Hm.T
        elif opt == "g16":
            k2 = q_asym(k, -2, 16)
        elif opt.startswith("out"):
            k2 = q_out(k, float(opt[3:]) / 100)
        elif opt == "tok32":
            k2 = q_asym(k, -1, 32)
        elif opt == "b5":
            k2 = q_asym(k, -2, 32, 5)
        else:
            raise SystemExit(name)
    else:
        raise SystemExit(name)
    return torch.stack([k2, v2], 2).to(blocks.dtype)

from ucm.codecs.quant import Int4Codec

class Int4P(Int4Codec):
    paired_keys = False  # the id-4 key format (every key tile at 4 bits) its `p:` rows were measured with
    keeps_sinks = False  # and no sink kept (codec id 6 keeps it; five parameters)

    def __init__(self, p):
        super().__init__()
        self.p = p
    def params(self, layout):
        return self.p

def parse_p(n):  # "p:ktr,ktc,vtr,vtc,permille"
    return tuple(int(x) for x in n[2:].split(","))

def bf16_ratio(p):
    lay = planar_layout("bfloat16", 30, 3, 128, 64)
    return lay.block_bytes / Int4P(p).encoded_bytes(lay)

def main(names, docs=4, prefix_tokens=2048, forced_tokens=256, greedy=64):
    model_dir = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    layout = planar_layout("float32", cfg.num_hidden_layers, cfg.num_key_value_heads, BLOCK_TOKENS, cfg.hidden_size // cfg.num_attention_heads)
    text_ids = tok.encode(find_text(None), add_special_tokens=False)
    need = prefix_tokens + forced_tokens
    stride = len(text_ids) // docs
    res = {n: {"kl": [], "forced": [], "greedy": [], "fd": [], "ek": 0, "ev": 0} for n in names}
    real = CodecRun("int4", layout)
    runs = {}
    for n in names:
        if n.startswith("p:"):
            runs[n] = CodecRun("int4", layout); runs[n].codec = Int4P(parse_p(n))
            print(n, "bf16 ratio", round(bf16_ratio(parse_p(n)), 4), flush=True)
    with torch.inference_mode():
        for d in range(docs):
            ids = torch.tensor([text_ids[d * stride:d * stride + need]])
            prefix, forced = ids[:, :prefix_tokens], ids[:, prefix_tokens:]
            exact = model(prefix, use_cache=True).past_key_values
            blocks = blocks_of(exact, prefix_tokens // BLOCK_TOKENS)
            ref_logits = model(forced, past_key_values=with_blocks(exact, blocks)).logits[0].float()
            ref_greedy = greedy_after_hit(model, prefix, with_blocks(exact, blocks), greedy)
            for n in names:
                dec = real.roundtrip(blocks) if n == "int4" else runs[n].roundtrip(blocks) if n in runs else variant(n, blocks)
                for j, kk in enumerate("kv"):
                    a, b = blocks[:, :, j].float(), dec[:, :, j].float()
                    res[n]["e" + kk] += float(((a - b) ** 2).sum() / (a ** 2).sum()) / docs
                logits = model(forced, past_key_values=with_blocks(exact, dec)).logits[0].float()
                lp, lq = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
                res[n]["kl"].append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
                res[n]["forced"].append(float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()))
                gen = greedy_after_hit(model, prefix, with_blocks(exact, dec), greedy)
                eq = gen[:greedy] == ref_greedy[:greedy]
                res[n]["greedy"].append(float(eq.float().mean()))
                res[n]["fd"].append(int(eq.logical_not().nonzero()[0, 0]) if not eq.all() else greedy)
            print(f"doc {d} done {time.strftime('%X')}", flush=True)
    for n in names:
        r = res[n]; m = lambda xs: sum(xs) / len(xs)
        print(f"{n:12s} relK {r['ek']**.5:.4f} relV {r['ev']**.5:.4f} KL {m(r['kl']):.5f} forced {m(r['forced']):.3f} greedy {m(r['greedy']):.3f} fd {r['fd']}", flush=True)

if __name__ == "__main__":
    main(sys.argv[1].split(";"))
