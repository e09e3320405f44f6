"""benchmarks/decode_bandwidth.py, benchmarks/ep_scale_model.py and benchmarks/int8_kernels.py on tiny
configurations: their real code paths (a random package served by the engine, the model's modules timed, the
kernels), seconds each."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_bandwidth  # noqa: E402
import ep_scale_model  # noqa: E402
import int8_kernels  # noqa: E402
import moe_layer_bench  # noqa: E402

TINY = ["model.hidden=64", "model.heads=4", "model.experts=[2, 4]", "data.seq_len=128"]


@pytest.fixture(scope="module")
def decode_result(tmp_path_factory):
    work, out = tmp_path_factory.mktemp("work"), tmp_path_factory.mktemp("out")
    threads = torch.get_num_threads()
    try:
        res = decode_bandwidth.run(["fp32"], work, out, layers=4, overrides=TINY, threads=1, new_tokens=12, repeats=2,
                                   buffer_gib=1 / 64, breakdown_tokens=6)
    finally:
        torch.set_num_threads(threads)  # the later tests' thread pool as it was
    return res, out


def test_decode_bandwidth_measures_the_engine_against_the_bound(decode_result):
    res, out = decode_result
    (r,) = res["results"]
    assert json.loads((out / "decode_bandwidth.json").read_text())["results"][0]["dtype"] == "float32"
    assert (out / "decode_bandwidth.png").stat().st_size > 0
    engine = r["variants"]["engine"]
    assert [run["decode_tokens"] for run in engine["runs"]] == [11, 11]  # first token to last: prefill excluded
    assert engine["tok_s_best"] >= engine["tok_s_median"] > 0
    assert r["bound_tok_s"] == pytest.approx(r["bandwidth"]["bytes_per_s"] / r["active_bytes_per_token"]["total"])
    assert engine["ratio"] == pytest.approx(engine["tok_s_best"] / r["bound_tok_s"])
    assert set(engine["breakdown"]["seconds_per_token"]) == set(decode_bandwidth.CATEGORIES)
    assert r["bandwidth"]["op"] in ("sum_fp32", "mv_fp32")
    assert list(r["variants"]) == ["engine", "onednn", "F.linear"]  # (d): the engine on each linear backend
    for name in ("onednn", "F.linear"):
        assert 0 <= r["variants"][name]["same_tokens"] <= len(engine["tokens"])
        assert r["variants"][name]["ratio_paired_median"] > 0
    assert "ratio (target >= 60%)" in decode_bandwidth.table(res["results"])
    # greedy steps read the head through its int8 screen (1 byte a weight: a quarter of fp32's), timed as lm_head
    act = r["active_bytes_per_token"]
    assert engine["head_screen"] and engine["read_bytes_per_token"] == act["total"] - act["lm_head"] * 3 / 4
    assert engine["breakdown"]["seconds_per_token"]["lm_head"] > 0
    assert not r["variants"]["onednn"]["head_screen"] and not r["variants"]["F.linear"]["head_screen"]


def test_int8_kernels_times_both_layers_side_by_side(tmp_path):
    """benchmarks/int8_kernels.py on two small weights: both kernels timed at a row count of each path (one pass, and
    two), the speedup their ratio, the table and the plot written; a small MoE layer's experts both ways."""
    results = int8_kernels.run({"a": (64, 128), "b": (33, 40)}, [1, 9], repeats=1, cold_bytes=1e5)
    assert [(r["weight"], r["rows"]) for r in results] == [("a", 1), ("a", 9), ("b", 1), ("b", 9)]
    assert all(r["int4_speedup"] == pytest.approx(r["bf16_ms"] / r["int4_ms"]) for r in results[:2])
    assert all(r["int4_ms"] is None for r in results[2:])  # 40 inputs: no whole group of 128
    for r in results:
        assert r["bf16_ms"] > 0 and r["int8_ms"] > 0 and r["speedup"] == pytest.approx(r["bf16_ms"] / r["int8_ms"])
        assert r["int8_gb_s"] == pytest.approx(r["shape"][0] * r["shape"][1] / r["int8_ms"] / 1e6)
    assert "int8 / bf16" in int8_kernels.table(results)
    layer = int8_kernels.run_experts(4, 2, 64, 32, [1, 3], repeats=1, cold_bytes=1e5)
    assert [(r["tokens"], r["experts_run"]) for r in layer] == [(1, 2), (3, 4)]  # pairs spread, empty experts left out
    assert all(r["speedup"] == pytest.approx(r["bf16_ms"] / r["int8_ms"]) for r in layer)
    assert "MoE layer" in int8_kernels.experts_table(layer)
    int8_kernels.plot(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_head_screen_times_the_screens_against_the_whole_layer(tmp_path):
    """benchmarks/head_screen.py on a small random head: each row count's calls timed, both screens' tokens checked
    against the few-row kernel's (the script stops otherwise), candidates counted, the JSON and the plot written."""
    import head_screen

    from export.serve import kernels

    if kernels.kernel() is None:
        pytest.skip("no kernel on this machine")
    assert head_screen.main(["--random", "3000", "200", "--rows", "1", "9", "--repeats", "1", "--out",
                             str(tmp_path)]) == 0
    r = json.loads((tmp_path / "head_screen.json").read_text())
    assert r["shape"] == [3000, 200] and [x["rows"] for x in r["results"]] == [1, 9]
    one, nine = r["results"]
    assert one["ms"]["whole"] > 0 and one["ms"]["bf16 x int8"] > 0 and one["candidates"]["bf16 x int8"] >= 1
    vnni = hasattr(kernels.kernel(), "screen_argmax_vnni")
    assert ("int8 x int8" in nine["ms"]) == vnni and "bf16 x int8" not in nine["ms"]  # past its 8 rows
    assert (tmp_path / "head_screen.png").stat().st_size > 0


def test_int8_kernels_decodes_a_package_both_ways(tmp_path):
    """benchmarks/int8_kernels.py --package: the package served as it is and with --quantize int8 and int4, alternated,
    each run's tokens/s and their medians, the paired ratio, the tokens compared."""
    import common
    from common import random_package

    from export.serve.kernels import kernel

    pkg = random_package(tmp_path / "pkg", layers=4, overrides=["model.hidden=128", "model.heads=4",
                                                                "model.experts=[4, 8]", "data.seq_len=128"], dtype="fp32")
    threads = torch.get_num_threads()
    try:
        res = int8_kernels.decode(pkg, threads=1, new_tokens=6, repeats=2, bandwidth_gib=0.02)
    finally:
        torch.set_num_threads(threads)
    assert res["tokens"] == 6 and res["dtype"] == "float32" and all(0 <= n <= 6 for n in res["same_tokens"].values())
    assert all(len(v) == 2 and min(v) > 0 for v in res["runs_tok_s"].values())
    w8a8 = {"w8a8"} if hasattr(kernel(), "w8a8_linear") else set()
    assert min(res["paired"].values()) > 0 and set(res["tok_s"]) == {"package", int8_kernels.UNSCREENED, "int8", "int4",
                                                                      "int8+head", "int4+head", *w8a8}
    # the bytes a token reads: the screen reads the head at 1 byte a weight of 4, int8 and int4 the linears at 1 and
    # 0.53; the unscreened package's are common.active_bytes' total
    from export.package import model_config_of

    b, act = res["read_bytes"], common.active_bytes(model_config_of(pkg), torch.float32)
    assert b[int8_kernels.UNSCREENED] == act["total"]
    assert b["package"] == act["total"] - act["lm_head"] * 3 / 4
    assert b[int8_kernels.UNSCREENED] > b["package"] > b["int8"] > b["int4"] > b["int4+head"]
    assert b["int8+head"] == b["int8"]  # the head in int8 either way
    if w8a8:
        assert b["w8a8"] == b["int8"]
    assert res["bound_tok_s"]["int4"] == pytest.approx(res["bandwidth_bytes_per_s"] / b["int4"])
    assert "of bound" in int8_kernels.decode_table(res)
    int8_kernels.plot_decode(res, tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 0


def test_active_bytes_count_top_k_experts_the_whole_tied_head_and_fp32_gates():
    """benchmarks/common.active_bytes, the bound of decode_bandwidth.py and ep_scale_model.py."""
    import common

    from pipeline.build import teacher_config
    from pipeline.recipe import load_recipe

    cfg = teacher_config(load_recipe(ROOT / "recipes" / "tiny.yaml"))
    fp32, bf16 = (common.active_bytes(cfg, d) for d in (torch.float32, torch.bfloat16))
    H, V = cfg.hidden, cfg.vocab_size
    expert = (8 * H * H + 5 * H) * cfg.top_k * len(cfg.experts)
    assert fp32["experts"] == 4 * expert and bf16["experts"] == 2 * expert
    assert fp32["lm_head"] == 4 * V * H  # tied: the embedding, read whole as the head
    assert fp32["gate_routing"] == bf16["gate_routing"] == 4 * H * sum(cfg.experts)  # gates stay fp32
    assert fp32["total"] == sum(v for k, v in fp32.items() if k != "total")


@pytest.fixture(scope="module")
def projection(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    res = ep_scale_model.run(ROOT / "recipes" / "1.3b.yaml", out, [8, 16, 64, 128], batch=32, context=64,
                             measure_hidden=64, buffer_gib=1 / 64)
    return res, out


def test_ep_projection_terms_and_files(projection):
    res, out = projection
    saved = json.loads((out / "ep_scale_model.json").read_text())
    assert {"notice", "student", "cpu_measured", "assumptions", "stated_sources", "projection",
            "sensitivity"} <= set(saved)
    assert "NOT A MEASUREMENT" in saved["notice"] and (out / "ep_scale_model.png").stat().st_size > 0
    s = res["student"]
    assert s["layers"] == 21 and s["hidden"] == 2048 and s["experts"] == [64] * 8 + [128] * 2
    rows = {r["ep"]: r for r in res["projection"]}
    held = [rows[ep]["expert_bytes_held_per_gpu"] for ep in (8, 16, 64, 128)]
    assert held == sorted(held, reverse=True) and held[0] == pytest.approx(2 * held[1])  # more EP: fewer bytes
    assert rows[8]["experts_us"] > rows[128]["experts_us"]
    assert all(r["all_to_all_us"] > 0 for r in rows.values())
    # 20 all-to-alls a step: within the node at EP 8, across nodes above
    a = res["assumptions"]
    assert rows[8]["all_to_all_us"] >= 20 * a["latency_intra_us"]
    assert rows[16]["all_to_all_us"] >= 20 * a["latency_inter_us"] > rows[8]["all_to_all_us"]
    assert rows[64]["slice_allreduce_us"] == 0 < rows[128]["slice_allreduce_us"]  # 64 experts on 128 GPUs: sliced
    for r in rows.values():
        assert r["tok_s_per_gpu"] == pytest.approx(32 / (r["step_us"] * 1e-6))
    assert set(res["sensitivity"]["dominant"].values()) <= set(ep_scale_model.ASSUMED)
    assert "PROJECTION ON PAPER" in ep_scale_model.report(res)


def test_ep_projection_all_to_all_grows_with_latency():
    s = ep_scale_model.shapes(ep_scale_model.student_config(ROOT / "recipes" / "1.3b.yaml"))
    a = {k: v[0] for k, v in ep_scale_model.STATED.items()} | {"batch": 32, "context": 128, "eff_dense": 1.0,
                                                               "eff_expert": 1.0}
    slow = ep_scale_model.project(s, 64, {**a, "latency_inter_us": 2 * a["latency_inter_us"]})
    fast = ep_scale_model.project(s, 64, a)
    assert slow["all_to_all_us"] - fast["all_to_all_us"] == pytest.approx(20 * a["latency_inter_us"])
    assert slow["tok_s_per_gpu"] < fast["tok_s_per_gpu"]
    assert fast["dense_weights_us"] == pytest.approx(s["dense_bytes"] / (a["hbm_tbps"] * 1e12) * 1e6)


def test_balancedness_ceilings_of_a_skewed_workload():
    """benchmarks/placement_bench.py's ceilings: every token of layer 1 to expert 0 (rank 0's), layer 2 even. The
    native table is half balanced there; one replica slot a rank lets a table split expert 0 in two."""
    import placement_bench

    from conftest import model_config

    cfg = model_config()  # experts (2, 4) on 2 ranks: 3 native experts a rank
    routes = torch.zeros(4, 6, 2, dtype=torch.long)  # 4 prompts x 6 tokens x 2 MoE layers
    routes[..., 1] = torch.arange(4)[:, None].expand(4, 6)  # layer 2: prompt p's tokens to expert p
    c = placement_bench.balancedness_ceilings(cfg, routes, concurrency=4, budget=0.34)
    assert c["slots_per_rank"] == 1 and c["forwards"] == 1 + 6  # one prefill, six decode forwards
    assert c["none"] == pytest.approx((0.5 + 1.0) / 2)  # layer 1 all on rank 0; layer 2 experts 0-3 even
    assert c["best static"] == pytest.approx(1.0) and c["oracle"] == pytest.approx(1.0)
    assert placement_bench.balancedness_ceilings(cfg, routes, 4, budget=0.0)["oracle"] == pytest.approx(0.75)


@pytest.mark.slow
def test_hf_import_memory_measures_each_layout_against_the_model_bytes(tmp_path):
    """benchmarks/hf_import_memory.py at hidden 256: a sharded Mixtral-layout checkpoint, imported in fresh processes
    at 1 rank and at EP 2 (the launcher), RSS growth over the model's bytes; an EP-2 rank holds about half."""
    import hf_import_memory

    assert hf_import_memory.main(["--hidden", "256", "--gb", "0.2", "--shard-mb", "64", "--skip-transformers",
                                  "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "hf_import_memory.json").read_text())
    assert res["shards"] > 1 and res["model_bytes"] > 0.19e9
    one, = res["runs"]["1 rank"]["ranks"]
    ep = res["runs"]["EP 2"]["ranks"]
    # (at this size a process's fixed costs weigh: the benchmark checks its ratios at >= 4 GB)
    assert one["ratio"] > 0.9 and len(ep) == 2 and all(r["ratio"] < one["ratio"] for r in ep)
    assert all(r["param_bytes"] < 0.7 * one["param_bytes"] for r in ep)  # each rank holds its half of the experts
    assert (tmp_path / "out" / "hf_import_memory.png").stat().st_size > 0


def test_the_benchmarks_clean_child_environment_drops_every_launcher_variable(monkeypatch):
    """benchmarks/common.child_env drops pipeline.dist's LAUNCH_VARS and keeps the rest, offline and unbuffered."""
    import common

    from pipeline.dist import LAUNCH_VARS

    for name in LAUNCH_VARS:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("MOE_PIPELINE_BENCH_KEPT", "yes")
    env = common.child_env()
    assert not set(LAUNCH_VARS) & set(env) and env["MOE_PIPELINE_BENCH_KEPT"] == "yes"
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == env["PYTHONUNBUFFERED"] == "1"


def test_quantized_quality_scores_each_package_against_bf16(small_run, tmp_path):
    """benchmarks/quantized_quality.py on the session's finished run, round to nearest only: the bf16, int8 and int4
    packages exported (and the int8 one scored again with its inputs rounded to int8, as w8a8), each scored on the whole held-out split (loss, its change against bf16, the top-1 routing
    agreement with bf16: 1 for bf16 itself), smaller packages for fewer bits, the JSON and the plot written."""
    import quantized_quality

    assert quantized_quality.main([str(small_run), "--methods", "rtn", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "quantized_quality.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["bf16", "int8 rtn", "int4 rtn", "w8a8 rtn"]
    assert rows[0]["loss_vs_bf16_pct"] == 0 and rows[0]["top1_routing_agreement"] == 1.0
    assert all(0.5 < r["top1_routing_agreement"] <= 1 and abs(r["loss_vs_bf16_pct"]) < 20 for r in rows)
    assert rows[0]["weights_bytes"] > rows[1]["weights_bytes"] > rows[2]["weights_bytes"]
    # w8a8: the int8 package again, its linears' inputs rounded to int8 too: another loss from the same weights
    assert rows[3]["package"] == rows[1]["package"] and rows[3]["val_loss"] != rows[1]["val_loss"]
    assert (tmp_path / "quantized_quality.png").stat().st_size > 0


def test_the_peer_race_target_is_met_only_where_ours_and_a_peer_both_ran():
    """benchmarks/peer_bench.py's verdict: a missed cell below TARGET x the faster peer, and a cell where ours failed
    or no peer ran is not a pass (a run of ours alone must not print MET)."""
    import peer_bench

    fast = {"tok_s": 100.0 * peer_bench.TARGET}
    assert peer_bench.verdict({"ours": {1: fast, 8: fast}, "llama": {1: {"tok_s": 100.0}, 8: {"tok_s": 100.0}}},
                              [1, 8]) == []
    slow = peer_bench.verdict({"ours": {1: {"tok_s": 90.0}}, "vllm": {1: {"tok_s": 100.0}}}, [1])
    assert slow == ["concurrency 1: 0.90x the faster peer"]
    assert peer_bench.verdict({"ours": {1: fast}, "vllm": None, "llama": None}, [1]) == [
        "concurrency 1: not measured (no peer ran)"]
    assert peer_bench.verdict({"ours": None, "llama": {1: {"tok_s": 1.0}}}, [1]) == [
        "concurrency 1: not measured (ours did not run)"]


def test_moe_layer_bench_times_the_placed_layer_and_counts_what_each_format_reads(tmp_path, monkeypatch):
    """benchmarks/moe_layer_bench.py on a tiny shape: the served MoE layer (PlacedMoE) timed in bf16 and int4, the
    bytes each call reads (every expert with a token, in its own format: int4 a quarter of bf16 plus its scales),
    the flops, and the targets' verdicts."""
    monkeypatch.setitem(moe_layer_bench.SHAPES, "tiny", dict(hidden=128, experts=8, width=128, top_k=2))
    monkeypatch.setattr(moe_layer_bench, "COLD_BYTES", 3 * 8 * 3 * 128 * 128 * 2)  # three layers
    cfg, src = moe_layer_bench.layer_dir("tiny", tmp_path)
    assert cfg.layers == 3 and cfg.experts == (8, 8, 8) and cfg.top_k == 2
    bf16 = {r["rows"]: r for r in moe_layer_bench.measure(cfg, src, "bf16", [1, 16], budget_s=0.05)}
    int4 = {r["rows"]: r for r in moe_layer_bench.measure(cfg, src, "int4", [1, 16], budget_s=0.05)}
    gate = 8 * 128 * 4
    for rows, r in bf16.items():
        assert 1 <= r["active_experts"] <= 8 and r["calls"] >= 3 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["bytes"] == pytest.approx(r["active_experts"] * 3 * 128 * 128 * 2 + gate)
        assert r["flops"] == 2 * rows * 2 * 3 * 128 * 128 + 2 * rows * 128 * 8
    assert bf16[1]["active_experts"] == 2
    per_expert_int4 = (int4[1]["bytes"] - gate) / int4[1]["active_experts"]
    # packed nibbles (a quarter of bf16's bytes) and one fp32 scale per 128 inputs of a row
    assert per_expert_int4 == 3 * 128 * 128 / 2 + (2 * 128 + 128) * 4
    cell = {"rows": 1, "bw_fraction": 0.5, "bound_fraction": 0.5}
    assert "85%" in moe_layer_bench.verdict(cell) and moe_layer_bench.verdict({**cell, "bw_fraction": 0.9}) is None
    assert moe_layer_bench.verdict({"rows": 32, "bw_fraction": 0.1, "bound_fraction": 0.4}) is not None
    assert moe_layer_bench.verdict({"rows": 8, "bw_fraction": 0.1, "bound_fraction": 0.1}) is None  # no target at 8
    assert moe_layer_bench.peak_for("AVX2", "bf16", {"fp32": 100, "bf16": None, "int8": None}) == ("fp32", 100)
    assert moe_layer_bench.peak_for("AVX512_BF16", "w8a8", {"fp32": 100, "bf16": 200, "int8": 400}) == ("int8", 400)
