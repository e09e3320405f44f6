"""benchmarks/peer_bench.py's pure parts: the agreement statistics and the tables (no servers, no model)."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import peer_bench  # noqa: E402


def test_common_prefix():
    assert peer_bench.common_prefix(["a", "b", "c"], ["a", "b", "x"]) == 2
    assert peer_bench.common_prefix(["a"], ["a", "b"]) == 1
    assert peer_bench.common_prefix([], ["a"]) == 0


def test_compare_counts_identical_prefixes_and_top5():
    a = [{"tokens": ["x", "y"], "top5": {"x": -1.0, "y": -2.0, "z": -3.0, "u": -4.0, "v": -5.0}},
         {"tokens": ["p", "q"], "top5": {"p": -0.5, "q": -1.5, "r": -2.5, "s": -3.5, "t": -4.5}}]
    b = [{"tokens": ["x", "y"], "top5": {"x": -1.25, "y": -2.0, "z": -3.0, "u": -4.0, "w": -5.0}},
         {"tokens": ["p", "r"], "top5": {"p": -0.5, "q": -1.5, "r": -2.5, "s": -3.5, "t": -4.5}}]
    r = peer_bench.compare(a, b)
    assert r == {"prompts": 2, "identical": 1, "mean_prefix": 1.5, "top5_overlap": 4.5, "max_abs_dlogprob": 0.25}
    assert peer_bench.compare(a, a)["max_abs_dlogprob"] == 0.0


def _run(tok_s):
    return {"tok_s": tok_s, "tpot_p50_ms": 10.0, "ttft_p50_ms": 50.0, "ttft_p99_ms": 90.0, "tpot_p99_ms": 12.0,
            "completed": 8, "failed": 0, "mean_output_len": 128.0}


def test_throughput_table_ratios_and_missing_peers():
    results = {"ours": {1: _run(30.0), 8: _run(120.0)}, "vllm": {1: _run(20.0), 8: _run(240.0)},
               "llama": "not installed"}
    lines = peer_bench.throughput_table(results, [1, 8]).splitlines()
    assert lines[0].startswith("| concurrency | ours tok/s (TPOT ms p50) | vLLM CPU | llama.cpp |")
    assert lines[2] == "| 1 | 30.0 (10.0) | 20.0 (10.0) | not installed | 1.50x | - |"
    assert lines[3] == "| 8 | 120.0 (10.0) | 240.0 (10.0) | not installed | 0.50x | - |"


def test_latency_and_agreement_tables():
    lat = peer_bench.latency_table({"ours": {1: _run(30.0)}, "vllm": "failed", "llama": "not run"}, [1])
    assert lat.splitlines()[2] == "| ours | 1 | 50.0 | 90.0 | 12.0 | 8 | 0 | 128.0 |"
    agree = peer_bench.agreement_table({"ours vs vLLM CPU": {"prompts": 16, "identical": 12, "mean_prefix": 14.25,
                                                             "top5_overlap": 4.9, "max_abs_dlogprob": None}})
    assert agree.splitlines()[2] == "| ours vs vLLM CPU | 12 / 16 | 14.2 | 4.9 / 5 | - |"


def test_rounds_median_takes_each_figure_s_median_and_sums_the_counts():
    runs = [{**_run(t), "errors": e} for t, e in ((30.0, []), (50.0, ["timeout"]), (40.0, []))]
    runs[1]["tpot_p50_ms"] = 20.0
    m = peer_bench.rounds_median(runs)
    assert m["tok_s"] == 40.0 and m["tpot_p50_ms"] == 10.0 and m["ttft_p99_ms"] == 90.0
    assert m["completed"] == 24 and m["failed"] == 0 and m["errors"] == ["timeout"]
    assert m["rounds_tok_s"] == [30.0, 50.0, 40.0]
