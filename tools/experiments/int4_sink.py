"""int4 and the sink token, docs/lab/benchmarks.md ("int4: the sink token kept
exact"): the same harness and metrics as int4_variants.py (real SmolLM2
KV in float32, each variant's decoded 2,048-token prefix against the exact
one; teacher-forced KL and agreement over 256 tokens, greedy over 64).

Names:
- `old`: int4 without the sink test (codec id 5's bytes: every block's
  values over 32 channels, nothing kept);
- `new`: int4 as shipped (codec id 6: a block whose token 0 is a sink
  keeps its K and V rows exact, its values over 64 channels);
- `v64`: every block's values over 64 channels, nothing kept (3.60x);
- `old+sink`: `old`, then the first block's token 0 put back exact (what
  the sink alone buys: `new` with the sink block's values over 32
  channels, 23,040 bytes over the size budget for that block);
- `old+sinks`: `old` with every block's token 0 exact (what a codec that
  keeps token 0 without looking would give, 864,554 bytes per block);
- `v64+sink`: `v64` with every block's token 0 exact (3.505x, no test).

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/int4_sink.py "old;new" 48
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int4_variants as iv  # noqa: E402
from ucm.bench.engines.codec_bench import CodecRun  # noqa: E402
from ucm.codecs.layout import planar_layout  # noqa: E402
from ucm.codecs.quant import Int4Codec  # noqa: E402


class Old(Int4Codec):
    keeps_sinks = False


class V64(Old):
    def params(self, layout, sink=False):
        p = super().params(layout)
        return None if p is None else (*p[:3], 64, p[4])


_runs = {}


def variant(name, blocks):
    if not _runs:
        lay = planar_layout("float32", blocks.shape[1], blocks.shape[3], blocks.shape[4], blocks.shape[5])
        for key, codec in (("old", Old()), ("new", Int4Codec()), ("v64", V64())):
            _runs[key] = CodecRun("int4", lay)
            _runs[key].codec = codec
    if name in _runs:
        return _runs[name].roundtrip(blocks)
    if name == "old+sink":
        dec = _runs["old"].roundtrip(blocks).clone()
        dec[0, :, :, :, :1] = blocks[0, :, :, :, :1]
        return dec
    if name == "old+sinks":
        dec = _runs["old"].roundtrip(blocks).clone()
        dec[:, :, :, :, :1] = blocks[:, :, :, :, :1]
        return dec
    if name == "v64+sink":
        dec = _runs["v64"].roundtrip(blocks).clone()
        dec[:, :, :, :, :1] = blocks[:, :, :, :, :1]
        return dec
    raise SystemExit(name)


iv.variant = variant

if __name__ == "__main__":
    iv.main(sys.argv[1].split(";"), docs=int(sys.argv[2]) if len(sys.argv) > 2 else 4)
