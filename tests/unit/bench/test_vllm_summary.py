"""`ucm bench vllm`: rounds of hit measurements and the summary (no engine needed)."""
from __future__ import annotations

import copy

import ucm.bench.engines.vllm_bench as bv


def _phase(ttft, first_tokens, cached=2944):
    return {"ttft_s": list(ttft), "tokens": [[t] for t in first_tokens], "cached": [cached] * len(ttft)}


def _results(docs=2, rounds=3):
    hit = [11, 22] * rounds
    return {
        "none": {"pass1": _phase([8.0, 7.0], [5, 6], 0)},
        "apc": {"pass1": _phase([8.1, 7.1], [5, 6], 0), "pass2": _phase([0.30, 0.32, 0.31, 0.90, 0.30, 0.33], hit),
                "check": {"tokens": [[11, 1], [22, 2]]}},
        "example": {"pass1": _phase([8.2, 7.2], [5, 6], 0), "pass2": _phase([0.35] * 6, hit),
                    "disk": _phase([0.45] * 6, hit)},
        "ucm": {"pass1": _phase([8.0, 7.4], [5, 6], 0), "pass2": _phase([0.33, 0.31, 0.32, 0.34, 0.31, 2.0], hit),
                "nvme": _phase([0.44, 0.42, 0.43, 0.41, 0.40, 0.45], hit), "check": {"tokens": [[11, 1], [22, 2]]},
                "tiers_nvme_phase": [{"nvme": 46}] * rounds, "promotions": 46 * rounds},
        "ucm_stream_off": {"hit": _phase([0.50, 0.52, 0.51, 0.55, 0.50, 0.53], hit),
                           "tiers_before": [{"nvme": 46}] * rounds, "streamed_blocks": 0},
        "ucm_stream_on": {"hit": _phase([0.34] * 6, hit), "tiers_before": [{"dram": 46}] * rounds,
                          "streamed_blocks": 276},
    }


def test_summary_is_medians_over_documents_and_rounds():
    r = bv.summarize(_results(), docs=2, doc_tokens=3000, pass1_tokens=3020, pass2_tokens=3021, repeat=3,
                     service={"lookups": 1, "tiers": {}})
    assert r["statistic"] == "median" and r["repeat"] == 3
    assert r["apc_hit_ttft_s"] == 0.315  # one slow sample (0.90) does not move it
    assert r["ucm_dram_hit_ttft_s"] == 0.325
    assert r["mean_ttft_s"]["ucm_dram_hit"] == round((0.33 + 0.31 + 0.32 + 0.34 + 0.31 + 2.0) / 6, 4)
    assert r["no_connector_ttft_s"] == 7.5 and r["ucm_cold_ttft_s"] == 7.7
    assert r["ratios"]["ucm_dram_hit_over_example_hit"] == round(0.325 / 0.35, 3)
    assert r["outputs_equal"] is True
    assert len(r["per_doc_ttft_s"]["ucm_nvme_hit"]) == 6
    assert r["ucm_service"] == {"lookups": 1}
    # Streaming on and off side by side: the NVMe-only hit streamed (the ucm
    # engine, 0.425) and loaded asynchronously (0.515), the DRAM hit streamed.
    assert r["ucm_nvme_hit_stream_off_ttft_s"] == 0.515 and r["ucm_dram_hit_streamed_ttft_s"] == 0.34
    assert r["ratios"]["ucm_nvme_hit_over_dram_hit"] == round(0.425 / 0.325, 3)
    assert r["ratios"]["ucm_nvme_hit_stream_off_over_apc_hit"] == round(0.515 / 0.315, 3)
    assert r["ratios"]["ucm_dram_hit_streamed_over_dram_hit"] == round(0.34 / 0.325, 3)
    assert r["ucm_streamed_blocks"] == {"stream_off": 0, "stream_on": 276}


def test_one_wrong_token_in_any_round_is_not_equal():
    res = _results()
    bad = copy.deepcopy(res)
    bad["ucm"]["nvme"]["tokens"][5] = [99]  # the third round's second document
    r = bv.summarize(bad, 2, 3000, 3020, 3021, 3, {})
    assert r["outputs_equal"] is False
    assert r["outputs_equal_detail"]["ucm_nvme_hit_vs_apc_first_token"] is False
    assert r["outputs_equal_detail"]["ucm_dram_hit_vs_apc_first_token"] is True
    short = copy.deepcopy(res)
    short["example"]["disk"] = _phase([0.45] * 4, [11, 22] * 2)  # a round missing
    assert bv.summarize(short, 2, 3000, 3020, 3021, 3, {})["outputs_equal"] is False


def test_rounds_run_before_each_and_keep_every_sample():
    from ucm.bench.engines.vllm_engine import rounds

    calls = []

    def fake_phase(llm, prompts, max_tokens=1):
        calls.append("phase")
        n = len(calls)
        return {"ttft_s": [float(n)] * len(prompts), "tokens": [[n]] * len(prompts), "cached": [n] * len(prompts)}

    out = rounds(None, [[1], [2]], 2, before=lambda: calls.append("before"), one=fake_phase)
    assert calls == ["before", "phase", "before", "phase"]
    assert out["ttft_s"] == [2.0, 2.0, 4.0, 4.0]
    assert out["tokens"] == [[2], [2], [4], [4]]


def _codec_run(first_tokens, check, ttft=(0.40, 0.42, 0.41, 0.43, 0.40, 0.44)):
    return {"pass1": _phase([8.0, 7.0], [5, 6], 0), "nvme": _phase(ttft, first_tokens),
            "check": {"tokens": check}, "tiers_before": [{"nvme": 46}] * 4,
            "codec_stats": {"codec_fallback": 0}, "nvme_stats": {"bytes_used": 1}}


def test_codec_hits_are_summarized_and_only_lossless_codecs_must_equal():
    res = _results()
    hit = [11, 22] * 3
    res["codecs"] = {"lossless": _codec_run(hit, [[11, 1], [22, 2]]),
                     "int8": _codec_run([11, 23] * 3, [[11, 1], [22, 3]], ttft=[0.33] * 6)}
    r = bv.summarize(res, 2, 3000, 3020, 3021, 3, {})
    c = r["ucm_nvme_codecs"]
    assert c["lossless"]["nvme_hit_ttft_s"] == 0.415
    assert c["lossless"]["nvme_hit_over_dram_hit"] == round(0.415 / 0.325, 3)
    assert (c["lossless"]["first_token_agreement"], c["lossless"]["check_tokens_equal"]) == (1.0, 2)
    assert (c["int8"]["first_token_agreement"], c["int8"]["check_tokens_equal"]) == (0.5, 1)
    assert r["outputs_equal"] is True  # int8 disagreeing is reported, not an error
    res["codecs"]["lossless"]["check"]["tokens"][1] = [22, 9]
    r = bv.summarize(res, 2, 3000, 3020, 3021, 3, {})
    assert r["outputs_equal"] is False
    assert r["outputs_equal_detail"]["ucm_nvme_hit_lossless_codecs_vs_apc"] is False


def test_a_codec_config_has_its_own_socket_and_nvme_directory(tmp_path):
    import yaml

    from ucm.bench.engines.vllm_bench_codec import codec_config
    from ucm.config.schema import load_config

    cfg = {"block_tokens": 128,
           "tiers": [{"adapter": "dram", "capacity": "64MiB"},
                     {"adapter": "nvme", "capacity": "1024MiB", "options": {"path": str(tmp_path / "nvme")}}],
           "service": {"name": "b", "socket": str(tmp_path / "ucm.sock")}}
    path = codec_config(cfg, tmp_path, "int8")
    got = yaml.safe_load(path.read_text())
    assert got["tiers"][1]["codec"] == "int8" and got["tiers"][1]["options"]["path"] == str(tmp_path / "nvme-int8")
    assert got["service"]["socket"] == str(tmp_path / "ucm-int8.sock") and cfg["service"]["socket"].endswith("ucm.sock")
    assert load_config(str(path)).tiers[1].codec == "int8"


def test_a_streamed_codec_run_is_keyed_apart_and_lossless_still_must_equal():
    """`--codec-streaming off,auto`: the same codec measured twice, keyed
    `int8` and `int8_streamed`, each with its codec and mode; a streamed
    lossless run that disagrees with vLLM's own hit fails the bench."""
    res = _results()
    hit = [11, 22] * 3
    res["codecs"] = {"int8": {**_codec_run(hit, [[11, 1], [22, 2]]), "codec": "int8", "load_streaming": "off"},
                     "int8_streamed": {**_codec_run(hit, [[11, 1], [22, 2]], ttft=[0.36] * 6), "codec": "int8",
                                       "load_streaming": "auto"},
                     "lossless_streamed": {**_codec_run(hit, [[11, 1], [22, 9]]), "codec": "lossless",
                                           "load_streaming": "auto"}}
    c = bv.summarize(res, 2, 3000, 3020, 3021, 3, {})["ucm_nvme_codecs"]
    assert (c["int8"]["load_streaming"], c["int8_streamed"]["load_streaming"]) == ("off", "auto")
    assert c["int8_streamed"]["codec"] == "int8" and c["int8_streamed"]["nvme_hit_ttft_s"] == 0.36
    r = bv.summarize(res, 2, 3000, 3020, 3021, 3, {})
    assert r["outputs_equal_detail"]["ucm_nvme_hit_lossless_codecs_vs_apc"] is False


def test_codec_runs_per_streaming_mode_get_their_own_service(tmp_path, monkeypatch):
    """run_codecs: one private service and one engine spec per codec and
    mode, the mode passed to the engine as `codec_streaming`."""
    import ucm
    from ucm.bench.engines import vllm_bench_codec as vc

    class FakeClient:
        connected = True

        def stats(self):
            return {"tiers": {"nvme": {"adapter": {"codec_ratio": 1.9, "other": 1}, "bytes_used": 5}}}

        def close(self):
            pass

    opened = []
    monkeypatch.setattr(ucm, "connect", lambda path: opened.append(path) or FakeClient())
    cfg = {"block_tokens": 128,
           "tiers": [{"adapter": "dram", "capacity": "64MiB"},
                     {"adapter": "nvme", "capacity": "1024MiB", "options": {"path": str(tmp_path / "nvme")}}],
           "service": {"name": "b", "socket": str(tmp_path / "ucm.sock")}}
    specs = []
    out = vc.run_codecs(["int8"], cfg, tmp_path, {"repeat": 1}, lambda spec: specs.append(spec) or {},
                        lambda *a: None, ("off", "auto"))
    assert list(out) == ["int8", "int8_streamed"]
    assert [s["codec_streaming"] for s in specs] == ["off", "auto"]
    assert len(set(opened)) == 2 and (tmp_path / "nvme-int8_streamed").is_dir()
    assert out["int8_streamed"]["codec_stats"] == {"codec_ratio": 1.9}
    assert (out["int8_streamed"]["codec"], out["int8_streamed"]["load_streaming"]) == ("int8", "auto")


def test_a_bad_codec_streaming_mode_is_refused_before_any_engine_starts():
    import pytest

    with pytest.raises(ValueError, match=r"--codec-streaming: got \['on'\]; allowed: "):
        bv.measure(1, 256, codecs=("int8",), codec_streaming=("on",))


def test_an_unknown_codec_is_refused_before_any_engine_starts():
    import pytest

    with pytest.raises(ValueError, match=r"--codecs: unknown codec\(s\) \['zip'\]; allowed: "):
        bv.measure(1, 256, codecs=("zip",))
