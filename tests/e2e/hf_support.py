"""What the transformers connector's tests compare against: plain generate,
transformers' own prefix reuse (a DynamicCache of an earlier prompt cropped
to the cached length), generate through a connector's cache, and the check
that a cold run stores and a later prompt restores bit-equal KV."""
from __future__ import annotations

import torch

TINY = dict(layers=4, kv_heads=2, head=32)  # tiny_llama's shape
TINY_ID = "tiny-llama-seed0"  # random weights name no files: the connector's namespace takes this id


def tiny_llama(device="cpu", dtype=torch.float32):
    """A 4-layer Llama with random, seeded weights on `device`: the
    connector's paths depend on shapes and bytes, not on what weights
    learnt, and no model file is needed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=TINY["layers"],
                      num_attention_heads=4, num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head"],
                      max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def plain(model, ids, new, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                              max_new_tokens=new, do_sample=False)


def reference(model, earlier, ids, cached, new, mask_earlier=None, mask=None):
    """transformers' own prefix reuse: `earlier` through the model into a
    DynamicCache, cropped to `cached` positions, continued with `ids`."""
    from transformers import DynamicCache

    ref = DynamicCache(config=model.config)
    positions = None
    if mask_earlier is not None:  # as generate numbers a left-padded row's tokens
        positions = (mask_earlier.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(earlier, attention_mask=mask_earlier, position_ids=positions, past_key_values=ref)
        ref.crop(cached - earlier.shape[1])
        out = model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                             past_key_values=ref, max_new_tokens=new, do_sample=False)
    return out, ref


def generate(conn, ids, new, mask=None):
    """generate through the connector's cache for `ids` (cache_for)."""
    cache = conn.cache_for(ids, mask)
    with torch.no_grad():
        out = conn.model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                                  past_key_values=cache, max_new_tokens=new, do_sample=False)
    cache.finish()
    return out, cache


def cold_then_restored(conn, model, a, b, cached, new):
    """`a` cold equals plain generate and stores its blocks; then, before
    b's prefill, `cached` tokens of b are restored, on the model's device,
    bit-equal to a DynamicCache of `a` cropped to that length. Returns
    transformers' own output for b with that prefix reused."""
    cold, c0 = generate(conn, a, new)
    assert c0.restored_tokens == 0 and torch.equal(cold, plain(model, a, new))
    assert conn.wait_stores()
    probe = conn.cache_for(b)
    assert probe.restored_tokens == cached
    out_ref, ref = reference(model, a, b, cached, new)
    for mine, theirs in zip(probe.layers, ref.layers):
        assert mine.keys.device == theirs.keys.device
        assert torch.equal(mine.keys, theirs.keys[:, :, :cached])
        assert torch.equal(mine.values, theirs.values[:, :, :cached])
    probe.finish(0)
    return out_ref
