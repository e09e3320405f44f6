"""Data-parallel serving: each rank its own sequences, tokens crossing ranks only in the expert
all-to-all, batched and chunked prefill; the same greedy tokens as 1 rank. Real 2-rank runs (DeepSpeed's
launcher, gloo) of tests/workers/dp_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env, cli, reference_greedy
from pipeline.dist import free_port

pytestmark = pytest.mark.slow
WORKER = "tests/workers/dp_engine.py"


@pytest.fixture(scope="module")
def package(small_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "pkg"
    cli("export", str(small_run), "--out", str(out))
    cli("predictor", "train", str(out), "--train-blocks", "200", "--val-blocks", "40", "--steps", "100")
    return out


def scenarios(pkg, out, placement: str = "-", ranks: int = 1, exchange: str = "auto", native: bool = False) -> dict:
    """tests/workers/dp_engine.py's results; `native`: with the CPU kernels on every weight (these are below the size
    the runtime serves them from), so that decode forwards run in one call of csrc/decode_model.cpp's DecodeModel."""
    launcher = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port()),
         "--no_local_rank"]
    proc = subprocess.run([*launcher, WORKER, str(pkg), str(out), placement, exchange, "native" if native else "-"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank(package, tmp_path_factory):
    return scenarios(package, tmp_path_factory.mktemp("dp1") / "out.json")


def tokens(requests: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in requests]


def test_one_rank_batched_and_chunked_prefill_keep_every_requests_tokens(one_rank, package):
    from workers.dp_engine import LONG

    burst = one_rank["burst"]
    assert tokens(burst["batched"]) == tokens(burst["single"])
    assert burst["batched_prefill_forwards"] == 2  # 6 prompts, 4 rows: 4 in one forward, then 2
    chunked = one_rank["chunked"]
    assert chunked["prefill_forwards"] >= chunked["long_prompt_tokens"] // 8
    assert chunked["requests"][1]["tokens"] == reference_greedy(package, LONG, 10)[1]
    scored = one_rank["scored"]
    assert scored["chunked"][0] is None and scored["chunked"][1:] == pytest.approx(scored["whole"][1:], abs=1e-5)
    assert scored["chunked_top"] == scored["whole_top"] and scored["tokens"][0] == scored["tokens"][1]
    assert one_rank["blocks_in_use"] == [0] and one_rank["stats"]["failed"] == 0


@pytest.mark.parametrize("placement, exchange, native", [("-", "all-to-all", False), ("-", "auto", False),
                                                        ("-", "auto", True), ("reactive", "auto", True),
                                                        ("predictive", "all-to-all", False)])
def test_two_ranks_data_parallel_serve_the_one_rank_tokens(one_rank, package, tmp_path, placement, exchange, native):
    """Both exchanges (all-to-all; auto: DeepSpeed's shared-memory all-reduce on this CPU machine); `native`: decode
    forwards in csrc/decode_model.cpp's DecodeModel."""
    two = scenarios(package, tmp_path / "out.json", placement, ranks=2, exchange=exchange, native=native)
    assert two["dp"] == 2 and two["exchange"] == ("all-reduce" if exchange == "auto" else exchange)
    # on one machine (the shared-memory all-reduce) decode batches' MoE layers run gathered: route, expert_pairs and
    # combine_pairs between two all-reduces (a replica table's hot experts split between their holders)
    assert (two["gathered_layers"] > 0) == (two["exchange"] == "all-reduce")
    # natively, inside the one-call decode step (its all-reduces called from C++) while the table gives each expert
    # one holder; a rank without rows, a prefill and a replica's split run the module's way, the same collectives
    assert (two["native_experts"] == "gathered") == native
    if native and placement != "-":  # the kernel took the replica tables too (their pairs split by the exchange)
        assert two["table_changes"] >= 1 and two["native_tables"] >= 2
    for name in ("staggered", "chunked"):
        assert tokens(two[name]["requests"]) == tokens(one_rank[name]["requests"]), name
    # the sequences really were split between the ranks, and one rank sat with no rows while the other decoded
    assert {r["rank"] for r in two["staggered"]["requests"]} == {0, 1}
    assert two["staggered"]["alone_steps"] >= 1
    # 6 prompts on 2 x 4 rows: one batched prefill forward; one at a time gives the same tokens
    assert two["burst"]["batched_prefill_forwards"] == 1
    assert tokens(two["burst"]["batched"]) == tokens(two["burst"]["single"]) == tokens(one_rank["burst"]["batched"])
    assert two["scored"]["chunked"][1:] == pytest.approx(one_rank["scored"]["whole"][1:], abs=1e-5)
    # the load each rank's experts took is measured in the all-to-all: both ranks worked in every MoE layer
    assert all(min(layer) > 0 for layer in two["rank_expert_tokens"])
    assert sum(two["rank_expert_tokens"][0]) == sum(one_rank["rank_expert_tokens"][0])
    assert two["blocks_in_use"] == [0, 0] and two["stats"]["failed"] == 0
    if placement != "-":
        assert all(0 < b <= 1 for b in two["placement_balancedness"])
    else:  # each rank its own requests and scheduler (coordinator.py OwnRequests): the one-rank tokens, a rank with none joining
        from workers.dp_engine import PROMPTS

        own = two["own"]
        assert own["tokens"] == tokens(one_rank["burst"]["batched"])
        assert own["alone"] == one_rank["burst"]["batched"][0]["tokens"] and own["alone_steps"] >= 8
        assert own["blocks_in_use"] == [0] and own["stats"]["failed"] == 0
        # as the server runs it: rank 0 spreads what it is given; the other rank's tokens stream back through the
        # step's gather to rank 0's stand-ins, which finish them at the same token
        served = two["own_served"]
        assert served["tokens"] == tokens(one_rank["burst"]["batched"]) and set(served["remote"]) == {True, False}
        assert served["streamed"] == [8] * len(served["tokens"]) and served["reasons"] == ["length"] * 6
        for status in (served["idle_status"], served["busy_status"]):  # pings while idle and while stepping
            assert sorted(s["rank"] for s in status) == [0, 1]
        reason, made, remote = served["aborted"]
        assert remote and reason == "abort" and made < 30 and served["here"] == reference_greedy(package, PROMPTS[0], 30)[1]
        # /health's and /metrics' counts over both ranks: 2 running (1 a rank), a KV block each; none when done
        assert served["queues"] == [[2, 0], 2.0, [0, 0], 0.0]
        over_ranks, rank0, prompts = served["queried"]  # rank 0's own count is part of it, rank 1's the rest
        assert over_ranks == prompts and 0 < rank0 < prompts
        assert served["scored_remote"] and served["scored"][0] is None
        assert served["scored"][1:] == pytest.approx(one_rank["scored"]["whole"][1:], abs=1e-5)
        assert served["scored_tokens"] == one_rank["scored"]["tokens"][1]
        assert served["left"] == [0, 0] and served["blocks_in_use"] == [0, 0] and served["stats"]["failed"] == 0


def test_own_requests_need_several_data_parallel_ranks(package):
    """OwnRequests' mode on one rank: refused, naming what it needs."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine

    with pytest.raises(ValueError, match="several data-parallel ranks"):
        Engine.from_config(ServeConfig(package=package, checksums=False), own_requests=True)


@pytest.fixture(scope="module")
def int8_package(small_run, tmp_path_factory):
    """`export --quantize int8` of the same run (GPTQ on 32 calibration blocks)."""
    out = tmp_path_factory.mktemp("dp-int8") / "pkg"
    cli("export", str(small_run), "--out", str(out), "--quantize", "int8", "--calibration-blocks", "32")
    return out


def test_a_quantized_package_serves_the_one_rank_tokens_on_two_ranks(int8_package, tmp_path):
    """An int8 package (its stored values and scales through the int8 kernels on every rank, decode forwards in the
    native decoder) on 2 data-parallel ranks: each request's tokens those of 1 rank on the same package."""
    one = scenarios(int8_package, tmp_path / "one.json", native=True)
    two = scenarios(int8_package, tmp_path / "two.json", ranks=2, native=True)
    assert two["dp"] == 2 and two["native_experts"] == "gathered"
    for name in ("staggered", "chunked"):
        assert tokens(two[name]["requests"]) == tokens(one[name]["requests"]), name
    assert {r["rank"] for r in two["staggered"]["requests"]} == {0, 1}
    assert tokens(two["burst"]["batched"]) == tokens(one["burst"]["batched"])
    assert two["stats"]["failed"] == 0
