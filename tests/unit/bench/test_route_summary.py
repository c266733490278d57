"""`ucm bench route`'s figures from its rows (ucm.bench.engines.route_bench):
the JSON the issue names, repeats sent to their holder, outputs checked
against the reference, and the refusals before anything starts."""
import argparse

from ucm.apps.demo.report import summarize
from ucm.bench.engines import route_bench


def row(i, cls, ttft, node, holders=(), text="out", engine=0, ucm=0):
    return {"index": i, "cls": cls, "prompt_tokens": 1000, "ttft_s": ttft, "wall_s": ttft, "tokens": text,
            "node": node, "holders": list(holders), "engine_tokens": engine, "ucm_tokens": ucm,
            "ucm_dram_tokens": ucm, "ucm_nvme_tokens": 0}


def test_the_json_has_the_variants_figures_and_the_share_of_repeats_sent_to_their_holder():
    first, again = "doc, first ask", "doc, asked again"
    ref = {"name": "reference", "rows": [row(0, first, 1.0, 1), row(1, first, 1.0, 1), row(2, again, 0.2, 1),
                                         row(3, again, 0.2, 1)]}
    kv = {"name": "kv_ucm_events", "rows": [row(0, first, 1.0, 1), row(1, first, 1.0, 2),
                                            row(2, again, 0.1, 1, holders=[1], ucm=900),
                                            row(3, again, 0.1, 2, holders=[2], ucm=900)]}
    rr = {"name": "round_robin", "rows": [row(0, first, 1.0, 1), row(1, first, 1.0, 2),
                                          row(2, again, 1.0, 1, holders=[2]),
                                          row(3, again, 1.0, 2, holders=[2], text="other")]}
    runs = [ref, rr, kv]
    classes = {r["index"]: r["cls"] for r in ref["rows"]}
    r = route_bench._result(runs, summarize(runs, classes), ref["rows"], {"engine_pages": 16}, "machine")
    assert r["outputs_equal"] is False  # round robin's request 3 differs
    v, w = r["variants"]["kv_ucm_events"], r["variants"]["round_robin"]
    assert v["repeats_to_holder"] == 1.0 and w["repeats_to_holder"] == 0.5
    assert v["repeat_ttft_sum_s"] == 0.2 and v["ttft_sum_s"] == 2.2 and w["repeat_ttft_sum_s"] == 2.0
    assert v["outputs_equal"] == 4 and w["outputs_equal"] == 3
    for k in ("ttft_sum_s", "repeat_ttft_sum_s", "ttft_p50_s", "ttft_p90_s", "repeats_to_holder"):
        assert k in v
    r["plot"] = "out/route_ttft.png"
    text = route_bench._routing_table(r)
    assert "100% of 2" in text and "50% of 2" in text


def test_unknown_variants_are_refused_naming_the_allowed_ones(capsys):
    args = argparse.Namespace(variants="kv_ucm_events,fastest", inside=False)
    assert route_bench.run(args) == 2
    err = capsys.readouterr().err
    assert "fastest" in err and "round_robin" in err


def test_the_run_inside_the_namespace_gets_the_same_flags():
    p = argparse.ArgumentParser()
    route_bench._add_args(p)
    args = p.parse_args(["--json", "--quick", "--variants", "kv_ucm_events", "--docs", "4", "--plot", "/x/y.png",
                         "--shared-prefix"])
    again = p.parse_args(route_bench._flags(args))
    assert vars(again) == vars(args)
