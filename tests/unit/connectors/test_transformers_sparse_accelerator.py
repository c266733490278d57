"""Sparse decode in transformers is the `sparse` accelerator of the cache's
config (ucm/connectors/transformers/connector.py, sparse.py): with the
YAML entry the connector's `generate` decodes sparsely with that
accelerator's settings and reports to it; without it nothing changes; a
decoder made with SparseDecodeConfig's options builds the same
accelerator those options give in the YAML. A small random Llama: what is
checked depends on shapes and bytes, not on what weights learnt."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ucm.accelerators.sparse import Budget, SelectionConfig, SparseAccelerator  # noqa: E402
from ucm.cache.unified import UnifiedCache  # noqa: E402
from ucm.connectors.transformers import TransformersConnector  # noqa: E402
from ucm.connectors.transformers.sparse import SparseDecodeConfig, SparseDecoder  # noqa: E402
from ucm.errors import ArgumentError, ConfigError  # noqa: E402

BT, PROMPT, NEW, LAYERS, HEAD = 16, 96, 4, 2, 32
SINK, LOCAL = 16, 16


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def dense(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


def cache(tmp_path, *accelerators):
    return UnifiedCache({"block_tokens": BT, "policy": {"name": "lru"}, "accelerators": list(accelerators),
                         "tiers": [{"adapter": "dram", "capacity": "16MiB", "options": {"prefault": False}}]})


def sparse_entry(**options):
    return {"name": "sparse", "options": {"sink_tokens": SINK, "local_tokens": LOCAL, **options}}


def connector(model, c, **kw):
    return TransformersConnector(model, c, model_id="tiny-llama-sparse", **kw)


def generate(conn, ids):
    with torch.no_grad():
        return conn.generate(ids, max_new_tokens=NEW, do_sample=False)


def test_the_yaml_entry_makes_generate_decode_sparsely_with_its_settings(tmp_path, model, ids, dense):
    with cache(tmp_path, sparse_entry(selector="quest", budget={"ratio": 1.0}, reselect_every=2)) as c:
        conn = connector(model, c)
        try:
            assert isinstance(conn.sparse, SparseAccelerator) and conn.sparse.cache is c
            assert c.accelerators.get(SparseAccelerator) is None  # the engine's chain holds it, not the cache's
            assert conn.sparse_decoder.sparse is conn.sparse
            assert conn.sparse_decoder.selection == SelectionConfig(Budget.ratio(1.0), SINK, LOCAL)
            out = generate(conn, ids)
            assert out[0, PROMPT:].tolist() == dense[0, PROMPT:].tolist()  # the whole context selected: as dense
            got = conn.stats()["accelerators"]["sparse"]
            assert got["decode_steps"] == NEW - 1 and got["sparse_layer_steps"] == LAYERS * (NEW - 1)
            assert got["selections"] == LAYERS * len(range(0, NEW - 1, 2))  # reselect_every 2
            assert got["dense_fallbacks"] == 0 and got["errors"] == 0
            assert got["attended_tokens"] == got["context_tokens"]
            assert got["bytes_read_dram"] > 0  # the candidate pages were read from the DRAM tier
            assert model.config._attn_implementation == "eager"  # switched for the call only
        finally:
            conn.close()


def test_a_small_budget_from_the_yaml_attends_fewer_tokens(tmp_path, model, ids):
    with cache(tmp_path, sparse_entry(selector="quest", budget={"tokens": 16})) as c:
        conn = connector(model, c)
        try:
            generate(conn, ids)
            got = conn.sparse.counters()
            assert got["sparse_layer_steps"] == LAYERS * (NEW - 1)
            assert got["attended_tokens"] < got["context_tokens"]
        finally:
            conn.close()


def test_without_the_entry_generate_is_not_touched(tmp_path, model, ids, dense):
    with cache(tmp_path) as c:
        conn = connector(model, c)
        try:
            assert conn.sparse is None and conn.sparse_decoder is None and not conn.accelerators
            assert generate(conn, ids)[0, PROMPT:].tolist() == dense[0, PROMPT:].tolist()
            assert "accelerators" not in conn.stats()
        finally:
            conn.close()


def test_decode_config_options_build_the_accelerator_the_yaml_entry_builds(tmp_path, model, ids):
    with cache(tmp_path) as c:
        conn = connector(model, c)
        try:
            dec = SparseDecoder(conn, SparseDecodeConfig(selector="quest", budget=Budget.tokens(16), sink_tokens=SINK,
                                                         local_tokens=LOCAL, reselect_every=2))
            with cache(tmp_path, sparse_entry(selector="quest", budget={"tokens": 16}, reselect_every=2)) as c2:
                yaml = connector(model, c2)
                try:
                    assert dec.sparse.options == yaml.sparse.options
                    assert dec.selection == yaml.sparse.selection
                finally:
                    yaml.close()
            assert dec.sparse is not conn.sparse and conn.sparse is None  # its own, not the connector's
            with torch.no_grad():
                dec.generate(ids, max_new_tokens=NEW, do_sample=False)
            s = dec.stats()
            figures = dec.sparse.counters()  # the decoder's figures reach its accelerator
            assert figures["sparse_layer_steps"] == s["sparse_layer_steps"] == LAYERS * (NEW - 1)
            assert figures["pages_copied"] == s["pages_copied"] and figures["selections"] == s["selections"]
        finally:
            conn.close()


def test_a_decoder_made_by_hand_takes_the_connectors_accelerator_and_decodes_alone(tmp_path, model, ids):
    with cache(tmp_path, sparse_entry(selector="quest", budget={"tokens": 16})) as c:
        conn = connector(model, c)
        try:
            dec = SparseDecoder(conn, SparseDecodeConfig(base="sdpa"))
            assert dec.sparse is conn.sparse and dec.config.base == "sdpa"
            with torch.no_grad():
                dec.generate(ids, max_new_tokens=NEW, do_sample=False)
            # the hand-made decoder decoded the call; the connector's own did not run a second session inside
            assert dec.stats()["sparse_layer_steps"] == LAYERS * (NEW - 1)
            assert conn.sparse_decoder.stats()["decode_steps"] == 0
            assert conn.sparse.counters()["sparse_layer_steps"] == LAYERS * (NEW - 1)
        finally:
            conn.close()


def test_settings_the_model_cannot_take_are_refused_at_construction(tmp_path, model):
    with cache(tmp_path, sparse_entry(selector="hybrid", rank=HEAD + 1)) as c:
        with pytest.raises(ConfigError, match=rf"options\.rank {HEAD + 1} must be at most the model's head size "
                                              rf"{HEAD}"):
            connector(model, c)
    with cache(tmp_path, sparse_entry(page_tokens=16)) as c:
        with pytest.raises(ConfigError, match=r"page_tokens 16 does not divide the engine's block size 8"):
            connector(model, c, block_tokens=8)
    with cache(tmp_path) as c:
        conn = connector(model, c)
        try:
            with pytest.raises(ConfigError, match=r"page_tokens 32 does not divide block_tokens 16"):
                SparseDecoder(conn, SparseDecodeConfig(page_tokens=32))
            defaults = SparseDecoder(conn).sparse  # no entry, no options: the defaults
            assert defaults.options.selector == "hybrid" and defaults.selection.budget == Budget.tokens(1024)
            with pytest.raises(ArgumentError, match="not both"):
                SparseDecoder(conn, SparseDecodeConfig(selector="quest"), sparse=defaults)
        finally:
            conn.close()


@pytest.mark.parametrize("bad, match", [({"base": "flash"}, r"SparseDecodeConfig\.base 'flash' not one of"),
                                        ({"reselect_every": 0}, r"SparseDecodeConfig\.reselect_every"),
                                        ({"selector": "magic"}, r"unknown selector 'magic'"),
                                        ({"window": 3}, r"SparseDecodeConfig\.window: unknown key")])
def test_bad_decode_configs_name_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        SparseDecodeConfig(**bad)
