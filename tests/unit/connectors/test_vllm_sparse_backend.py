"""ucm's sparse CPU attention impl (ucm/connectors/vllm/sparse_backend.py)
with vLLM's own CPU kernels, without a model: one mixed batch (a prefill
row, a long decode row, a short decode row) through the stock impl and
through ucm's; the plugin and the settings (the `sparse` accelerator of
the ucm config vLLM names, switched on and overridden by UCM_VLLM_SPARSE).

- full budget: every row equals the stock kernel's (the long decode row
  through ucm's gather and torch attention, the others through the stock
  kernel over those rows alone);
- sinklocal with no budget: the long decode row equals a reference softmax
  over exactly the sink and local tokens of the logical K/V; the other rows
  still equal the stock kernel's.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pydantic import ValidationError  # noqa: E402

from ucm.accelerators.sparse import Budget, SparseOptions  # noqa: E402
from ucm.config.schema import load_config  # noqa: E402
from ucm.connectors.vllm.sparse_config import ENV_SPARSE, parse_sparse, sparse_accelerator, sparse_from_env  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402

BT, H, QH, D = 128, 2, 4, 64
NUM_BLOCKS = 24
ROWS = ((40, 300), (1, 700), (1, 100))  # (query tokens, seq_len): a prefill chunk, a long decode, a short decode


def _batch(seed=0, rows=ROWS):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(NUM_BLOCKS, H, BT, 2 * D, generator=g)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    table = torch.zeros(len(rows), 8, dtype=torch.int32)
    at = 0
    for r, (_, n) in enumerate(rows):
        nb = math.ceil(n / BT)
        table[r, :nb] = torch.tensor(perm[at:at + nb])
        at += nb
    q_lens = [q for q, _ in rows]
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    isa = _get_attn_isa(torch.float32, BT, D)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(rows), num_heads=QH, num_kv_heads=H, head_dim=D, seq_lens=seq_lens, dtype=torch.float32,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
        dynamic_causal=None, kv_cache_dtype="auto")

    def metadata():
        return CPUAttentionMetadata(num_actual_tokens=sum(q_lens), max_query_len=max(q_lens), query_start_loc=starts,
                                    max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table,
                                    slot_mapping=torch.zeros(0, dtype=torch.int64), scheduler_metadata=sched)

    query = torch.randn(sum(q_lens), QH, D, generator=g)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    return kv, table, query, layer, metadata, starts.tolist()


def _impl(cls, monkeypatch):
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    return cls(num_heads=QH, head_size=D, scale=1 / math.sqrt(D), num_kv_heads=H, alibi_slopes=None,
               sliding_window=None, kv_cache_dtype="auto")


def _forward(impl, kv, query, layer, md):
    out = torch.zeros_like(query)
    impl.forward(layer, query, None, None, kv, md, out)
    return out


def _logical(kv, table, r, n):
    """Row r's K and V `[n, H, D]`, read page by page."""
    from ucm.connectors.vllm.sparse_pages import vec_kv_views

    k, v = vec_kv_views(kv)
    idx = torch.arange(n)
    b = table[r][idx // BT].long()
    return k[b, :, idx % BT], v[b, :, idx % BT]


def test_vec_views_read_what_the_cpu_kernel_writes():
    """The kernel's own cache write (`cpu_attn_reshape_and_cache`, `vec`)
    puts token t's K and V where `vec_kv_views` reads them."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ucm.connectors.vllm.sparse_pages import vec_kv_views

    isa = _get_attn_isa(torch.float32, BT, D)
    if isa != "vec":
        pytest.skip(f"this CPU's kernel is {isa!r}, not 'vec'")
    kv = torch.zeros(4, H, BT, 2 * D)
    stock_k, stock_v = kv.view(4, H, 2 * BT, D).chunk(2, dim=2)
    g = torch.Generator().manual_seed(7)
    key, value = torch.randn(5, H, D, generator=g), torch.randn(5, H, D, generator=g)
    slots = torch.tensor([BT + 0, BT + 1, BT + 77, 3 * BT + 5, 127])
    ops.cpu_attn_reshape_and_cache(key, value, stock_k, stock_v, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    k, v = vec_kv_views(kv)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k[slot // BT, :, slot % BT], key[i])
        assert torch.equal(v[slot // BT, :, slot % BT], value[i])


def test_full_budget_mixed_batch_equals_the_stock_kernel(monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from ucm.connectors.vllm import sparse_backend as sb

    monkeypatch.setenv(ENV_SPARSE, "{budget: {ratio: 1.0}, min_context_tokens: 256}")
    kv, table, query, layer, metadata, starts = _batch()
    ref = _forward(_impl(CPUAttentionBackendImpl, monkeypatch), kv, query, layer, metadata())
    sb.reset_counters()
    got = _forward(_impl(sb.UcmSparseCpuImpl, monkeypatch), kv, query, layer, metadata())
    c = sb.counters()
    assert c["sparse_layer_rows"] == 1 and c["stock_layer_rows"] == 2 and c["fallbacks"] == 0
    assert c["attended_tokens"] == c["context_tokens"] == 700
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_sinklocal_row_attends_exactly_sink_and_local(monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from ucm.connectors.vllm import sparse_backend as sb

    monkeypatch.setenv(ENV_SPARSE, "{selector: sinklocal, budget: {tokens: 0}, sink_tokens: 64, local_tokens: 128, "
                                   "min_context_tokens: 256}")
    kv, table, query, layer, metadata, starts = _batch(seed=1)
    ref = _forward(_impl(CPUAttentionBackendImpl, monkeypatch), kv, query, layer, metadata())
    sb.reset_counters()
    got = _forward(_impl(sb.UcmSparseCpuImpl, monkeypatch), kv, query, layer, metadata())
    assert sb.counters()["attended_tokens"] == 64 + (700 - 560)  # local widened to its first page: 560..700
    t = starts[1]
    k, v = _logical(kv, table, 1, 700)
    pos = torch.cat([torch.arange(64), torch.arange(560, 700)])
    for h in range(QH):
        w = torch.softmax(k[pos, h // (QH // H)].double() @ query[t, h].double() / math.sqrt(D), dim=0)
        torch.testing.assert_close(got[t, h].double(), w @ v[pos, h // (QH // H)].double(), rtol=1e-5, atol=1e-5)
    others = [i for i in range(query.shape[0]) if i != t]
    torch.testing.assert_close(got[others], ref[others], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[t], ref[t], atol=1e-3)  # the row really attended fewer tokens


@pytest.mark.parametrize("selector", ["quest", "mean", "moment", "blend", "lowrank", "hybrid"])
def test_scored_row_attends_what_the_selector_picks_from_exact_summaries(monkeypatch, selector):
    """The long decode row attends exactly the pages the selector picks from
    summaries computed straight from the row's logical keys (so the page
    summaries kept over vLLM's blocks hold what the selector reads: min,
    max and, for `mean`, `moment` and `blend`, the mean; for `lowrank`
    and `hybrid` every token's key projected on the basis fitted on the
    row's full pages)."""
    from ucm.accelerators.sparse.base import LayerStep
    from ucm.accelerators.sparse.lowrank import fit_key_basis
    from ucm.accelerators.sparse.selectors import make_selector
    from ucm.accelerators.sparse.summaries import units_from_keys
    from ucm.connectors.vllm import sparse_backend as sb
    from ucm.connectors.vllm.sparse_pages import range_positions, vec_kv_views

    monkeypatch.setenv(ENV_SPARSE, f"{{selector: {selector}, budget: {{tokens: 128}}, sink_tokens: 64, "
                                   f"local_tokens: 128, min_context_tokens: 256}}")
    kv, table, query, layer, metadata, starts = _batch(seed=2)
    # keys that make the pick depend on each summary: a per-page offset along
    # some channels (the mean) and a per-page spread (min / max)
    g = torch.Generator().manual_seed(3)
    kv2 = kv.clone()
    kk, _ = vec_kv_views(kv2)
    for page in range(700 // 16):
        idx = torch.arange(page * 16, page * 16 + 16)
        b = table[1][idx // BT].long()
        shift = torch.randn(H, D, generator=g) * 0.8
        widen = 0.5 + 2 * torch.rand(H, 1, D, generator=g)
        kk[b, :, idx % BT] = (kk[b, :, idx % BT] * widen.transpose(0, 1) + shift).contiguous()
    k, v = _logical(kv2, table, 1, 700)
    t = starts[1]
    sb.reset_counters()
    impl = _impl(sb.UcmSparseCpuImpl, monkeypatch)
    got = _forward(impl, kv2, query, layer, metadata())
    basis = None
    if selector in ("lowrank", "hybrid"):  # fitted once, on the keys of the row's 43 full pages
        basis = fit_key_basis([k[:688].transpose(0, 1).numpy()], 16).vectors[0]  # the default rank
        np.testing.assert_allclose(impl.summaries.basis, basis, atol=1e-5)
        assert sb.counters()["bases_fitted"] == 1
    # the layer keeps what its selector reads: no bounds for lowrank and mean, no mean for quest, lowrank, hybrid
    assert (impl.summaries.min is None) == (selector in ("lowrank", "mean"))
    assert (impl.summaries.mean is None) == (selector in ("lowrank", "quest", "hybrid"))
    assert (impl.summaries.proj is None) == (selector not in ("lowrank", "hybrid"))
    step = LayerStep(query[t].numpy(), 700, 16, H, summaries=units_from_keys(k.transpose(0, 1).numpy(), 16, basis),
                     scale=1 / math.sqrt(D))
    sel = make_selector(selector).select(step, impl.sparse.selection)
    pos = range_positions(sel.ranges)
    assert sel.extra_tokens == 128 and len(sel.units) == 8
    assert sb.counters()["attended_tokens"] == pos.numel() < 700
    for h in range(QH):
        w = torch.softmax(k[pos, h // (QH // H)].double() @ query[t, h].double() / math.sqrt(D), dim=0)
        torch.testing.assert_close(got[t, h].double(), w @ v[pos, h // (QH // H)].double(), rtol=1e-5, atol=1e-5)


def test_reselect_every_holds_the_selection_and_adds_the_decoded_tokens(monkeypatch):
    """reselect_every 3: the long row selects at 700 tokens; at 701 and 702
    it attends that selection plus the tokens decoded since, with its new
    query (not what the new query would pick); at 703 it selects again."""
    from ucm.accelerators.sparse.base import LayerStep
    from ucm.accelerators.sparse.selectors import make_selector
    from ucm.accelerators.sparse.summaries import units_from_keys
    from ucm.connectors.vllm import sparse_backend as sb
    from ucm.connectors.vllm.sparse_pages import range_positions

    monkeypatch.setenv(ENV_SPARSE, "{selector: quest, budget: {tokens: 128}, sink_tokens: 64, local_tokens: 128, "
                                   "min_context_tokens: 256, reselect_every: 3}")
    kv, table, query, layer, metadata, starts = _batch(seed=4)
    impl = _impl(sb.UcmSparseCpuImpl, monkeypatch)
    sb.reset_counters()
    g = torch.Generator().manual_seed(5)
    t = starts[1]
    slot = int(table[1][700 // BT]) * BT + 700 % BT  # token 700 lands here, 701 and 702 after it

    def pick(q, n):
        k, _ = _logical(kv, table, 1, n)
        step = LayerStep(q.numpy(), n, 16, H, summaries=units_from_keys(k.transpose(0, 1).numpy(), 16),
                         scale=1 / math.sqrt(D))
        return range_positions(make_selector("quest").select(step, impl.sparse.selection).ranges)

    first = pick(query[t], 700)
    _forward(impl, kv, query, layer, metadata())
    held_steps = []
    for n in (701, 702, 703):
        new_kv = torch.randn(2, 1, H, D, generator=g)
        impl.do_kv_cache_update(layer, new_kv[0], new_kv[1], kv, torch.tensor([slot + n - 701]))
        _, _, q2, _, md, _ = _batch(seed=4, rows=((40, 300), (1, n), (1, 100)))
        q2 = torch.randn(q2.shape, generator=g)
        got = _forward(impl, kv, q2, layer, md())
        pos = torch.cat([first, torch.arange(700, n)]) if n < 703 else pick(q2[t], n)
        if n < 703:
            held_steps.append(not torch.equal(pick(q2[t], n), pos))
        k, v = _logical(kv, table, 1, n)
        for h in range(QH):
            w = torch.softmax(k[pos, h // (QH // H)].double() @ q2[t, h].double() / math.sqrt(D), dim=0)
            torch.testing.assert_close(got[t, h].double(), w @ v[pos, h // (QH // H)].double(), rtol=1e-5,
                                       atol=1e-5)
    c = sb.counters()
    assert (c["selections"], c["selections_reused"], c["fallbacks"]) == (2, 2, 0)
    assert any(held_steps)  # a fresh pick would have differed: the test sees the held selection


def test_the_impl_refuses_to_run_with_sparse_off(monkeypatch):
    from ucm.connectors.vllm import sparse_backend as sb

    monkeypatch.delenv(ENV_SPARSE, raising=False)
    with pytest.raises(ConfigError, match=ENV_SPARSE):
        _impl(sb.UcmSparseCpuImpl, monkeypatch)


def test_plugin_off_registers_nothing_and_on_points_cpu_attn_at_ucm(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ucm.connectors.vllm import sparse_plugin
    from ucm.connectors.vllm.sparse_backend import BACKEND_PATH

    stock = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    AttentionBackendEnum.CPU_ATTN.clear_override()
    try:
        monkeypatch.delenv(ENV_SPARSE, raising=False)
        sparse_plugin.register()
        assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == stock
        monkeypatch.setenv(ENV_SPARSE, "on")
        sparse_plugin.register()
        sparse_plugin.register()  # vLLM may load a plugin more than once
        assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
        assert AttentionBackendEnum.CPU_ATTN.get_class().get_name() == "CPU_ATTN"
        monkeypatch.setenv(ENV_SPARSE, "{selector: nope}")
        with pytest.raises(ConfigError, match=r"UCM_VLLM_SPARSE.selector: unknown selector 'nope'"):
            sparse_plugin.register()
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()


@pytest.mark.parametrize("value, message", [
    ("{budget: {tokens: 1.5}}", r"UCM_VLLM_SPARSE.budget: Budget tokens: value must be an int >= 0"),
    ("{budget: {ratio: 0.5, tokens: 3}}", r"UCM_VLLM_SPARSE.budget: must be a mapping with one key of"),
    ("{budget: {top_p: 0}}", r"UCM_VLLM_SPARSE.budget: Budget top_p: value must be a number in \(0, 1\]"),
    ("{local: 3}", r"UCM_VLLM_SPARSE.local: unknown key; allowed: \['budget', 'local_tokens'"),
    ("{page_tokens: 0}", r"UCM_VLLM_SPARSE.page_tokens"),
    ("{rank: 0}", r"UCM_VLLM_SPARSE.rank: Input should be greater than or equal to 1"),
    ("{min_context_tokens: 31}", r"UCM_VLLM_SPARSE.min_context_tokens: 31 is below rank \+ page_tokens \(16 \+ 16\)"),
    ("{rank: 8, page_tokens: 32, min_context_tokens: 39}",
     r"UCM_VLLM_SPARSE.min_context_tokens: 39 is below rank \+ page_tokens \(8 \+ 32\)"),
    ("[quest]", r"UCM_VLLM_SPARSE: expected a mapping"),
    ("{a: [", r"UCM_VLLM_SPARSE: the value is not valid YAML"),
])
def test_bad_settings_name_the_key_and_what_is_allowed(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_sparse(value)


def test_options_built_by_hand_are_checked_as_those_read_from_the_environment():
    """The lowrank basis check is part of the options' validation: options
    built in code cannot skip it (it once lived in parse_sparse only)."""
    with pytest.raises(ValidationError, match=r"min_context_tokens\n.*31 is below rank \+ page_tokens"):
        SparseOptions(min_context_tokens=31)
    assert SparseOptions(selector="quest", min_context_tokens=0).min_context_tokens == 0  # no basis to fit
    assert SparseOptions(min_context_tokens=32).min_context_tokens == 32


def test_settings_off_on_and_values():
    assert sparse_from_env({}) is None
    for off in ("", "off", "false", "0"):
        assert sparse_from_env({ENV_SPARSE: off}) is None
    on = sparse_from_env({ENV_SPARSE: "on"})
    assert (on.selector, on.budget.kind, on.budget.value, on.page_tokens, on.rank) == ("hybrid", "tokens", 1024, 16, 16)
    got = parse_sparse('{"selector": "mean", "budget": {"top_p": 0.9}, "sink_tokens": 32}')
    assert (got.selector, got.budget.kind, got.budget.value, got.sink_tokens) == ("mean", "top_p", 0.9, 32)
    assert parse_sparse("{page_tokens: 32, rank: 8}").model_fields_set == {"page_tokens", "rank"}
    defaults = load_config({}, environ={})
    with pytest.raises(ConfigError, match=r"options.page_tokens 32 does not divide the engine's block size 48"):
        sparse_accelerator(defaults, {ENV_SPARSE: "{page_tokens: 32}"}).check_block_tokens(48)
    with pytest.raises(ConfigError, match=r"options.page_tokens 48 does not divide block_tokens 256"):
        sparse_accelerator(defaults, {ENV_SPARSE: "{page_tokens: 48}"})


def _ucm(tmp_path, **options):
    return load_config({"block_tokens": 256, "accelerators": [{"name": "sparse", "options": options}],
                        "tiers": [{"adapter": "dram", "capacity": "1MiB", "options": {"path": str(tmp_path)}}]},
                       environ={})


def test_the_yaml_entry_gives_the_options_and_the_variable_switches_and_overrides(tmp_path):
    cfg = _ucm(tmp_path, selector="quest", budget={"tokens": 256}, sink_tokens=64, min_context_tokens=512)
    assert sparse_accelerator(cfg, {}) is None  # the variable is the switch: the entry alone runs nothing
    assert sparse_accelerator(cfg, {ENV_SPARSE: "off"}) is None
    on = sparse_accelerator(cfg, {ENV_SPARSE: "on"})
    assert (on.options.selector, on.selection.budget, on.selection.sink_tokens, on.options.min_context_tokens) == (
        "quest", Budget.tokens(256), 64, 512)
    assert on.cache is None
    over = sparse_accelerator(cfg, {ENV_SPARSE: "{budget: {ratio: 0.5}, local_tokens: 32}"})
    assert (over.options.selector, over.selection.budget, over.selection.sink_tokens, over.selection.local_tokens) == (
        "quest", Budget.ratio(0.5), 64, 32)
    alone = sparse_accelerator(load_config({}, environ={}), {ENV_SPARSE: "{selector: mean}"})
    assert alone.options == SparseOptions(selector="mean")
    with pytest.raises(ConfigError, match=r"accelerators\.0\.options\.min_context_tokens: 512 is below rank"):
        sparse_accelerator(cfg, {ENV_SPARSE: "{selector: lowrank, rank: 500}"})  # checked as merged


def test_the_backend_reads_the_ucm_config_vllm_names_once_per_process(tmp_path, monkeypatch):
    """The ucm config path in vLLM's kv_connector_extra_config (the current
    vLLM config, set while vLLM builds the model) gives the backend its
    options; every layer's impl shares the one accelerator."""
    import vllm.config

    from ucm.connectors.vllm import sparse_backend as sb

    path = tmp_path / "ucm.yaml"
    path.write_text("accelerators:\n  - name: sparse\n    options: {selector: quest, sink_tokens: 64, "
                    "min_context_tokens: 300}\n")
    current = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"ucm_config": str(path)}),
                              parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)
    monkeypatch.setenv(ENV_SPARSE, "{local_tokens: 32}")
    first, second = _impl(sb.UcmSparseCpuImpl, monkeypatch), _impl(sb.UcmSparseCpuImpl, monkeypatch)
    assert first.sparse is second.sparse
    o = first.options
    assert (o.selector, o.sink_tokens, o.local_tokens, o.min_context_tokens) == ("quest", 64, 32, 300)
    monkeypatch.setenv(ENV_SPARSE, "{selector: lowrank, rank: 128}")  # above the head size (64)
    with pytest.raises(ConfigError, match=r"options\.rank 128 must be at most the model's head size 64"):
        _impl(sb.UcmSparseCpuImpl, monkeypatch)


def test_ucm_config_does_not_read_the_sparse_variable_as_a_key():
    from ucm.config.schema import load_config

    load_config({}, environ={ENV_SPARSE: "on"})  # would be "unknown key 'vllm_sparse'" otherwise
