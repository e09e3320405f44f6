"""Expert placement (export/serve/placement/): replica tables under a budget, balanced splits, outputs unchanged."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import model_config
from export.serve.placement.algo import (balancedness, count_replicas, native_table, plan_replicas, rank_loads,
                                         replica_slots, split_load)


def test_split_load_evens_out_a_replicated_hot_expert():
    holders = [[0], [0], [1], [1]]
    demand = [60.0, 10.0, 20.0, 10.0]
    assert rank_loads(demand, holders, 2) == [70.0, 30.0]
    holders[0] = [0, 1]  # a replica of the hot expert on rank 1
    assert rank_loads(demand, holders, 2) == [50.0, 50.0]
    pieces = split_load(demand, holders, 2, integer=True)
    assert sum(n for _, n in pieces[0]) == 60 and pieces[1] == [(0, 10.0)]
    assert balancedness([50.0, 50.0]) == 1.0 and balancedness([100.0, 0.0]) == 0.5


@pytest.mark.parametrize("hedge", [False, True])
@pytest.mark.parametrize("budget", [0.0, 0.25, 0.5, 1.0])
def test_replica_table_respects_the_budget_and_never_hurts(budget, hedge):
    cfg = model_config(experts=(4, 8))
    gen = torch.Generator().manual_seed(0)
    slots = replica_slots(cfg, 2, budget)
    assert slots == int(budget * (2 + 4))
    for _ in range(20):
        demand = [(torch.rand(n, generator=gen) ** 4 * 100).tolist() for n in cfg.experts]  # skewed
        table = plan_replicas(cfg, 2, demand, slots, hedge=hedge)
        assert max(count_replicas(table, 2)) <= slots
        for i, layer in enumerate(table):
            assert all(len(set(h)) == len(h) and h[0] == native_table(cfg, 2)[i][e][0] for e, h in enumerate(layer))
            before = max(rank_loads(demand[i], native_table(cfg, 2)[i], 2))
            assert max(rank_loads(demand[i], layer, 2)) <= before + 1e-9


def test_skewed_layers_get_balanced_as_far_as_the_budget_allows():
    cfg = model_config(experts=(4, 8))
    demand = [[80.0, 5.0, 10.0, 5.0], [50.0, 2.0, 2.0, 2.0, 10.0, 10.0, 12.0, 12.0]]
    native = [balancedness(rank_loads(d, t, 2)) for d, t in zip(demand, native_table(cfg, 2))]
    one = plan_replicas(cfg, 2, demand, slots=1)  # rank 1's one slot: the first layer's hot expert
    assert [round(balancedness(rank_loads(d, t, 2)), 3) for d, t in zip(demand, one)] == [1.0, round(native[1], 3)]
    two = plan_replicas(cfg, 2, demand, slots=2)
    assert [balancedness(rank_loads(d, t, 2)) for d, t in zip(demand, two)] == [1.0, 1.0]
    assert count_replicas(two, 2) == [0, 2]


def test_a_hedged_table_fills_the_slots_the_expected_loads_leave_most_demanded_first():
    """A forecast's expected loads are level after a replica or two, and the plain greedy stops there; hedged
    (the predictive policy's), the slots left go to the most demanded experts (by their share of their layer),
    each onto a rank with room: the plain table's replicas stay, no layer's expected maximum rises."""
    cfg = model_config(experts=(4, 8))
    demand = [[80.0, 5.0, 10.0, 5.0], [50.0, 2.0, 2.0, 2.0, 10.0, 10.0, 12.0, 12.0]]
    plain, hedged = plan_replicas(cfg, 2, demand, slots=3), plan_replicas(cfg, 2, demand, slots=3, hedge=True)
    assert count_replicas(plain, 2) == [0, 2] and count_replicas(hedged, 2) == [3, 3]
    for d, p, h in zip(demand, plain, hedged):
        assert all(a == b[:len(a)] for a, b in zip(p, h))  # only added to
        assert max(rank_loads(d, h, 2)) <= max(rank_loads(d, p, 2)) + 1e-9
    # rank 0's three: copies of rank 1's most demanded experts of layer 1 (7 and 6: 12% each, then a 10%);
    # rank 1's third: layer 0's expert 1 (5%: the one left there with a rank that has room)
    added = {(i, e, r) for i, (p, h) in enumerate(zip(plain, hedged)) for e, (a, b) in enumerate(zip(p, h)) for r in b[len(a):]}
    assert {(1, 7, 0), (1, 6, 0)} <= added and all(r == 0 or (i, e) == (0, 1) for i, e, r in added)


def test_a_controller_sends_a_table_once_and_its_stats_count_it():
    """The engine's one interface to a policy (export/serve/placement/controller.py): `none` never directs; the
    reactive controller plans from the loads it was shown, sends a table when it changes (else only the experts to
    prefetch), its stats snapshot counts the change, and a directive survives the JSON trip to the other ranks."""
    import json

    from export.serve.placement.controller import Controller, Directive, ReactiveController

    cfg = model_config(experts=(4, 8))
    assert Controller(cfg, 2, 0.5).before_forward("decode", []) is None
    ctl = ReactiveController(cfg, 2, 0.5, replan_every=2)
    ctl.after_forward([[30, 1, 1, 1], [20, 1, 1, 1, 1, 1, 1, 1]], "decode", [])
    directives = [ctl.before_forward("decode", []) for _ in range(4)]  # re-planned at the 2nd and the 4th
    assert [d.table is not None for d in directives] == [False, True, False, False]  # the 4th: the same table
    assert all(d.expect[0][0] == 0 and d.expect[1][0] == 0 for d in directives)  # the hot experts first
    sent = directives[1]
    assert Directive.from_json(json.loads(json.dumps(sent.to_json()))) == sent
    stats = ctl.stats()
    assert stats.name == "reactive" and stats.table_changes == 1 and stats.recall is None
    assert sum(stats.replicas) == sum(count_replicas(sent.table, 2)) > 0


@pytest.fixture(scope="module")
def package(small_run, tmp_path_factory):
    from conftest import cli

    out = tmp_path_factory.mktemp("placement") / "pkg"
    cli("export", str(small_run), "--out", str(out))
    return out


@pytest.mark.parametrize("policy, resident", [("none", 1.0), ("reactive", 1.0), ("reactive", 0.25)])
def test_placed_experts_give_the_reference_outputs(package, policy, resident):
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.request import SamplingParams

    ref = Engine.from_config(ServeConfig(package=package))
    placed = Engine.from_config(ServeConfig(package=package, placement=policy, replica_budget=0.5,
                                            resident_experts=resident))
    prompts = [ref.encode(p) for p in ("And God said", "To be, or not to be", "The LORD", "O Romeo, Romeo")]
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        assert torch.allclose(ref.model(ids).logits, placed.model(ids).logits, atol=1e-5)
    want = generate(ref, prompts, SamplingParams(max_tokens=12))
    got = generate(placed, prompts, SamplingParams(max_tokens=12))
    assert [s.generated for s in got] == [s.generated for s in want]
    ex = placed.placement_stats().exchange
    held = ex.residency
    assert ex.forwards > 0 and held.hits + held.misses > 0
    assert held.native_bytes <= max(resident * held.native_bytes_all_resident, held.expert_bytes) + 1
    if resident < 1:
        assert held.misses > 0  # some experts were not resident


@pytest.fixture(scope="module")
def predicted_package(package, tmp_path_factory):
    """The package with a predictor, trained by the CLI as a user would."""
    import shutil

    from conftest import cli

    pkg = tmp_path_factory.mktemp("predicted") / "pkg"
    shutil.copytree(package, pkg)
    cli("predictor", "train", str(pkg), "--train-blocks", "300", "--val-blocks", "80", "--steps", "200")
    return pkg


def test_predictor_is_stored_verifiable_and_beats_the_frequency_baseline(predicted_package):
    import json

    from conftest import cli

    cli("verify", str(predicted_package))  # predictor files listed with checksums
    info = json.loads((predicted_package / "predictor.json").read_text())
    held = info["held_out"]
    assert held["demand_error"] < held["frequency_demand_error"]
    for layer in held["layers"]:  # (top-1 accuracy need not beat always-the-commonest on a barely trained router)
        assert 0 < layer["top1_accuracy"] <= 1 and 0 < layer["topk_recall"] <= 1


def test_predictive_placement_keeps_outputs_and_its_thread_stops(predicted_package):
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.request import SamplingParams

    ref = Engine.from_config(ServeConfig(package=predicted_package))
    eng = Engine.from_config(ServeConfig(package=predicted_package, placement="predictive", replica_budget=0.5,
                                         resident_experts=0.5))
    prompts = [ref.encode(p) for p in ("And God said", "To be, or not to be", "The LORD", "O Romeo, Romeo")] * 2
    want = generate(ref, prompts, SamplingParams(max_tokens=10))
    got = generate(eng, prompts, SamplingParams(max_tokens=10))
    assert [s.generated for s in got] == [s.generated for s in want]
    policy, stats = eng.controller, eng.placement_stats()
    assert policy.thread.is_alive() and len(stats.controller.recall) == len(eng.cfg.experts) and policy.recall_n > 0
    assert stats.exchange.residency.prefetched > 0
    # requests that end at their prefill (lm-eval's echo log-likelihood ones), aborted ones and decoded ones all
    # leave the policy holding nothing once its thread has caught up (it kept every prefill-only one's state)
    scored = [eng.submit(p, SamplingParams(max_tokens=1, echo=True, logprobs=1)) for p in prompts]
    dropped = eng.submit(prompts[0], SamplingParams(max_tokens=20))
    eng.abort(dropped)
    while eng.pending():
        eng.step()
    assert all(s.finish_reason == "length" for s in scored) and dropped.finish_reason == "abort"
    deadline = time.time() + 10
    while policy.held() and time.time() < deadline:
        time.sleep(0.05)
    assert policy.held() == 0
    eng.close()
    assert not policy.thread.is_alive()


def test_placement_flags_and_predictor_training_fail_clearly(package, tmp_path):
    from conftest import cli

    r = cli("serve", str(package), "--placement", "predictive", check=False)
    assert r.returncode == 2 and "moe-pipeline predictor train" in r.stderr
    r = cli("serve", str(package), "--resident-experts", "0.5", check=False)
    assert r.returncode == 2 and "--resident-experts needs --placement" in r.stderr
    r = cli("serve", str(package), "--placement", "none", "--resident-experts", "1.5", check=False)
    assert r.returncode == 2 and "--resident-experts" in r.stderr
    r = cli("predictor", "train", str(tmp_path / "nothing"), check=False)
    assert r.returncode == 2 and "predictor error" in r.stderr


def test_a_package_file_changed_under_offloaded_experts_fails_requests_not_the_server(package, tmp_path):
    """--resident-experts < 1 keeps the package mapped for the server's lifetime: a shard truncated underneath it
    used to kill the process (SIGBUS) at the next on-demand load; now the request that needs it fails with a
    message and the engine goes on."""
    import shutil

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine
    from export.serve.request import SamplingParams

    pkg = tmp_path / "pkg"
    shutil.copytree(package, pkg)
    eng = Engine.from_config(ServeConfig(package=pkg, placement="none", resident_experts=0.25))
    prompt = eng.encode("And God said unto Moses and Aaron")
    weights = pkg / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    reqs = [eng.submit(prompt, SamplingParams(max_tokens=8)) for _ in range(3)]
    while eng.pending():
        eng.step()
    assert {r.finish_reason for r in reqs} == {"error"}
    assert all("changed since it was verified" in r.text for r in reqs)
    assert eng.stats["failed"] == 3 and not eng.running and eng.scheduler.pools[0].used() == 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_serving_route_is_the_models_route(top_k):
    """export/serve/placement/exchange.py's lean routing (no balancing loss, no capacity) gives what pipeline/model.py's
    route + group_by_expert give at inference, pair for pair."""
    import torch

    from export.serve.placement.exchange import serving_route
    from pipeline.model import group_by_expert, route, router_logits

    g = torch.Generator().manual_seed(top_k)
    xs, wg = torch.randn(37, 16, generator=g), torch.randn(6, 16, generator=g)
    r = route(router_logits(xs, wg), top_k, top_k > 1)
    token, choice, per_expert = group_by_expert(r, 6)
    weights, t2, c2, p2 = serving_route(xs, wg, top_k, 6)
    assert torch.equal(token, t2) and torch.equal(choice, c2) and per_expert == p2
    torch.testing.assert_close(weights, r.weights)
    empty = serving_route(xs[:0], wg, top_k, 6)
    assert empty[1].numel() == 0 and empty[3] == [0] * 6
