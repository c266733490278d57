"""UCMConnector's block namespace names the weights, not vLLM's served alias
or path: vLLM's own ModelConfig (built offline from small fake model
directories) goes through build_namespace."""
import json
import os
import struct
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from vllm.config import CacheConfig, ModelConfig, ParallelConfig  # noqa: E402

from ucm.connectors.vllm.namespace import build_namespace  # noqa: E402
from ucm.connectors.vllm.settings import ConnectorSettings  # noqa: E402
from ucm.keys import block_keys  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
          "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


def _model_dir(path, payload=b"\x01" * 64, config=CONFIG):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return path


def _vllm_config(model, served="smol"):
    mc = ModelConfig(model=str(model), served_model_name=served, skip_tokenizer_init=True)
    return SimpleNamespace(model_config=mc, parallel_config=ParallelConfig(),
                           cache_config=CacheConfig(block_size=128))


def test_same_alias_other_weights_share_no_block_keys(tmp_path):
    a = _model_dir(tmp_path / "a" / "smol")
    b = _model_dir(tmp_path / "b" / "smol", payload=b"\x02" * 64)  # same size, other bytes
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    os.utime(b / "model.safetensors", ns=(mtime, mtime))
    na, nb = (build_namespace(_vllm_config(d), 128) for d in (a, b))
    assert na.model != nb.model
    tokens = list(range(256))
    assert not set(block_keys(na, tokens)) & set(block_keys(nb, tokens))
    assert "smol" not in na.model  # the served alias is a label, not the identity


def test_other_config_under_the_same_path_differs_and_the_same_dir_is_stable(tmp_path):
    a = _model_dir(tmp_path / "m")
    first = build_namespace(_vllm_config(a), 128)
    assert build_namespace(_vllm_config(a, served="another-alias"), 128) == first
    (a / "config.json").write_text(json.dumps(dict(CONFIG, rope_theta=500000.0)))
    assert build_namespace(_vllm_config(a), 128).model != first.model


def test_a_touched_weight_file_changes_the_namespace(tmp_path):
    a = _model_dir(tmp_path / "m")
    first = build_namespace(_vllm_config(a), 128)
    w = a / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert build_namespace(_vllm_config(a), 128).model != first.model


def test_model_dtype_counts(tmp_path):
    a = _model_dir(tmp_path / "m")
    bf16 = build_namespace(_vllm_config(a), 128)
    cfg = _vllm_config(a)
    cfg.model_config = ModelConfig(model=str(a), served_model_name="smol", dtype="float16", skip_tokenizer_init=True)
    cfg.cache_config = CacheConfig(block_size=128, cache_dtype="bfloat16")  # same KV dtype, other compute
    fp16 = build_namespace(cfg, 128)
    assert (fp16.kv_dtype, bf16.kv_dtype) == ("bfloat16", "bfloat16")
    assert fp16.model != bf16.model


def test_explicit_model_id_wins(tmp_path):
    a = _model_dir(tmp_path / "a")
    b = _model_dir(tmp_path / "b", payload=b"\x03" * 64)
    na = build_namespace(_vllm_config(a), 128, model_id="team/llama-ft-7")
    nb = build_namespace(_vllm_config(b), 128, model_id="team/llama-ft-7")
    assert na == nb and na.model == "team/llama-ft-7"
    s = ConnectorSettings.from_extra({"ucm_model_id": "team/llama-ft-7"})
    assert s.model_id == "team/llama-ft-7"


def test_namespace_shape_comes_from_vllms_model_config(tmp_path):
    ns = build_namespace(_vllm_config(_model_dir(tmp_path / "m")), 256)
    assert (ns.num_layers, ns.num_kv_heads, ns.head_size, ns.block_tokens, ns.kv_dtype) == (2, 2, 16, 256,
                                                                                           "bfloat16")
    assert ns.model.startswith("weights:")
