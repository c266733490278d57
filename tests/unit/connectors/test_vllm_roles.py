"""UCMConnector itself: vLLM finds it at its module path, builds it by its
own three-argument constructor over vLLM's real config types, and it
delegates by role to the side it built, over a cache passed in (owned by
the caller, never closed by the connector).

Geometry: vLLM pages of 16 tokens, ucm blocks of 32 tokens (2 pages), two
layers of 2 KV heads x head size 16 in bf16 (K and V): 2 KiB per layer and page, so
a block is 2 x 2 x 2 KiB = 8 KiB."""
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from connector_fakes import FakeCache  # noqa: E402
from ucm.connectors.vllm import UCMConnector  # noqa: E402
from ucm.connectors.vllm.metadata import LoadJob, StoreJob, UCMConnectorMetadata  # noqa: E402
from ucm.connectors.vllm.scheduler import _ReqState as _State  # noqa: E402
from ucm.errors import ConfigError, UcmError  # noqa: E402

PAGE, BLOCK = 16, 32
BLOCK_BYTES = 2 * 2 * 2048
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
          "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return ModelConfig(model=str(d), skip_tokenizer_init=True)


@pytest.fixture
def make(model_config):
    def build(role, block_tokens=BLOCK, tiers=None, **extra):
        cache = FakeCache()
        tiers = tiers or [{"adapter": "dram", "capacity": 64 * BLOCK_BYTES}]
        ucm_config = {"block_tokens": block_tokens, "tiers": tiers}
        ktc = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"ucm_config": ucm_config, **extra})
        vllm_config = SimpleNamespace(model_config=model_config, parallel_config=ParallelConfig(),
                                      cache_config=CacheConfig(block_size=PAGE), kv_transfer_config=ktc)
        spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
        kcc = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
        return UCMConnector(vllm_config, role, kcc, cache=cache), cache

    return build


def test_vllm_finds_the_connector_at_its_module_path():
    ktc = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                           kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is UCMConnector


def test_the_scheduler_instance_delegates_to_its_side_over_the_cache_given(make):
    conn, cache = make(KVConnectorRole.SCHEDULER)
    side = conn.scheduler_side
    assert side.max_waiting_pin_blocks == 64 // 4  # by default a quarter of the landing tier
    tokens = list(range(70))
    for k in side.request_keys(Request("r", tokens, SamplingParams(max_tokens=4), None)):
        cache.tiers[k] = "dram"
    req = Request("r1", tokens, SamplingParams(max_tokens=4), None)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, False)
    assert conn.request_finished(req, []) == (False, None)
    assert cache.events == [("begin", "r1", 2), ("finish", "r1", 2, 0)]
    with pytest.raises(UcmError, match="worker-side call on the SCHEDULER instance"):
        conn.get_finished(set())
    conn.shutdown()
    assert not cache.closed  # the caller's cache


def test_the_pin_cap_setting_is_counted_in_blocks(make):
    conn, _ = make(KVConnectorRole.SCHEDULER, ucm_max_waiting_pin_bytes=5 * BLOCK_BYTES + 1)
    assert conn.scheduler_side.max_waiting_pin_blocks == 5


def test_the_pin_cap_leaves_out_the_tiers_below_the_landing_one(make, tmp_path):
    """Pins of blocks below DRAM hold no DRAM room: the cap does not count them."""
    tiers = [{"adapter": "dram", "capacity": 64 * BLOCK_BYTES},
             {"adapter": "nvme", "capacity": 1024 * BLOCK_BYTES, "options": {"path": str(tmp_path / "nvme")}}]
    conn, _ = make(KVConnectorRole.SCHEDULER, tiers=tiers)
    side = conn.scheduler_side
    assert side._below == frozenset({"nvme"})
    assert not side._charged(_State([]), b"k", "nvme")
    assert side._charged(_State([]), b"k", "dram") and side._charged(_State([]), b"k", None)


def test_the_worker_instance_copies_pages_with_the_bound_metadata(make):
    conn, cache = make(KVConnectorRole.WORKER)
    kv = {n: torch.randn(10, 2, PAGE, 32).to(torch.bfloat16) for n in NAMES}
    before = {n: t.clone() for n, t in kv.items()}
    conn.register_kv_caches(kv)
    a = b"A" * 16
    conn.bind_connector_metadata(UCMConnectorMetadata(stores=[StoreJob("r1", [a], [[1, 2]], None)]))
    conn.start_load_kv(None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(UCMConnectorMetadata(loads=[LoadJob("r2", [a], [[5, 6]], True)]))
    conn.start_load_kv(None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    conn.shutdown()  # waits for the background copies
    for n in NAMES:
        assert torch.equal(kv[n][5:7], before[n][1:3])
    assert conn.get_finished({"r1"}) == ({"r1"}, {"r2"})
    assert conn.get_block_ids_with_load_errors() == set()
    with pytest.raises(UcmError, match="scheduler-side call on the WORKER instance"):
        conn.build_connector_meta(None)
    assert not cache.closed


def test_a_block_that_is_not_whole_vllm_pages_is_refused_at_construction(make):
    with pytest.raises(ConfigError, match=r"block_tokens: 24 is not a multiple of vLLM's page size .* 16"):
        make(KVConnectorRole.SCHEDULER, block_tokens=24)
