"""`moe-pipeline plan`: counts come from the model code and match the paper's reference counts."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, cli
from distill.plan import plan
from pipeline.recipe import load_recipe

# PAPER.md: a GPT-2-style count reproduces the paper's sizes (4B/3.5B, 31B/27B) to its rounding
# (reference teacher, reference student, paper's teacher label, its student label, decimals in the labels)
REFERENCE = {"350m": (4.12e9, 3.54e9, 4, 3.5, (0, 1)), "1.3b": (31.39e9, 26.94e9, 31, 27, (0, 0))}


@pytest.mark.parametrize("name", ["350m", "1.3b"])
def test_paper_sizes(name):
    result = plan(load_recipe(ROOT / "recipes" / f"{name}.yaml"), world=128)
    teacher_ref, student_ref, teacher_b, student_b, (t_digits, s_digits) = REFERENCE[name]
    t, s = result["teacher"]["params_total"], result["student"]["params_total"]
    assert abs(t - teacher_ref) / teacher_ref < 0.01 and abs(s - student_ref) / student_ref < 0.01
    assert round(t / 1e9, t_digits) == teacher_b and round(s / 1e9, s_digits) == student_b
    assert result["teacher"]["layers"] == 24 and result["student"]["layers"] == 21
    assert len(result["student"]["experts"]) == 10


def test_memory_shrinks_with_expert_parallelism_and_zero():
    recipe = load_recipe(ROOT / "recipes" / "1.3b.yaml")
    small = plan(recipe, world=8)["teacher"]
    big = plan(recipe, world=128)["teacher"]
    assert big["ep_size"] == [64] * 10 + [128] * 2 and small["ep_size"] == [8] * 12
    assert big["memory_per_rank_bytes"] < small["memory_per_rank_bytes"]
    fp32 = ["teacher.train.precision=fp32", "student.train.precision=fp32"]
    zero0, zero1 = (plan(load_recipe(ROOT / "recipes" / "1.3b.yaml", [*fp32, f"teacher.train.zero_stage={z}"]),
                         world=128)["teacher"] for z in (0, 1))
    assert zero1["memory_per_rank_breakdown"]["optimizer"] < zero0["memory_per_rank_breakdown"]["optimizer"]
    zero2 = plan(load_recipe(ROOT / "recipes" / "1.3b.yaml", ["teacher.train.zero_stage=2"]), world=128)["teacher"]
    assert zero2["memory_per_rank_breakdown"]["gradients"] < big["memory_per_rank_breakdown"]["gradients"]


def test_plan_json_cli():
    proc = cli("plan", "recipes/1.3b.yaml", "--world-size", "128", "--json")
    result = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(result) == {"teacher", "student"}
    keys = {"params_total", "params_active_per_token", "layers", "experts", "ep_size", "memory_per_rank_bytes",
            "tokens_per_step", "total_steps"}
    assert keys <= set(result["teacher"]) and keys <= set(result["student"])
    assert result["teacher"]["tokens_per_step"] == 512 * 2048 and result["teacher"]["total_steps"] == 286103


def test_plan_rejects_world_size_that_experts_cannot_split():
    proc = cli("plan", "recipes/tiny.yaml", "--world-size", "3", "--set", "teacher.train.global_batch_size=24",
               "--set", "student.train.global_batch_size=24", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "recipe error: model.experts.0 = 4: experts split evenly over 3 ranks")
    assert "distributed.ep_size" in proc.stderr


def test_fp16_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = cli("teacher", "recipes/tiny.yaml", "--set", "teacher.train.precision=fp16", "--set",
               "teacher.train.zero_stage=1", "--run-dir", str(tmp_path / "r"), check=False)
    assert proc.returncode == 2 and "teacher.train.precision = 'fp16': bf16 or fp32" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_pruned_student_plans_with_its_expert_counts():
    full = plan(load_recipe(ROOT / "recipes" / "1.3b.yaml"), world=128)["student"]
    pruned = plan(load_recipe(ROOT / "recipes" / "1.3b.yaml", ["student.experts=[32, 32, 32, 32, 32, 32, 32, 32, 64, 64]"]),
                  world=128)["student"]
    assert pruned["experts"] == [32] * 8 + [64] * 2 and full["experts"] == [64] * 8 + [128] * 2
    assert pruned["params_total"] < 0.6 * full["params_total"]
    # top-1: one expert a token either way; the routers lose their pruned experts' rows (hidden 2048 each)
    hidden = load_recipe(ROOT / "recipes" / "1.3b.yaml").model.hidden
    assert full["params_active_per_token"] - pruned["params_active_per_token"] == (32 * 8 + 64 * 2) * hidden


@pytest.mark.slow
def test_plan_measure_scores_candidates_cut_from_the_trained_teacher(small_run, tmp_path):
    from conftest import SMALL_RUN, sets

    out = tmp_path / "plan"
    proc = cli("plan", "recipes/tiny.yaml", *sets(*SMALL_RUN), "--measure", "--run-dir", str(small_run), "--json",
               "--blocks", "8", "--out", str(out))
    result = json.loads(proc.stdout)
    rows = result["candidates"]
    assert [(r["kind"], r["rule"], r["layers"]) for r in rows] == [
        ("teacher", "-", 4),
        ("depth", "paper", 3), ("depth", "uniform", 3), ("depth", "importance", 3),
        ("depth", "paper", 2), ("depth", "uniform", 2), ("depth", "importance", 2),
        ("experts", "frequency", 4), ("experts", "frequency", 4), ("experts", "saliency", 4), ("experts", "saliency", 4)]
    assert [r["experts"] for r in rows if r["kind"] == "experts"] == [[2, 3], [1, 2], [2, 3], [1, 2]]
    # the paper rule's 3 layers are the student the distill stage starts from
    paper3 = rows[1]
    assert paper3["kept_teacher_layers"] == json.loads((small_run / "student" / "selection.json").read_text())[
        "kept_teacher_layers"]
    # the teacher row is the teacher stage's own held-out loss: the same 8 blocks (2 eval batches of 4)
    done = json.loads((small_run / "teacher" / "DONE.json").read_text())
    assert rows[0]["val_loss"] == pytest.approx(done["val_loss"], abs=1e-4) and rows[0]["retention"] == 1.0
    assert all(r["params_total"] < rows[0]["params_total"] for r in rows[1:])
    assert all(r["retention"] == pytest.approx(rows[0]["val_loss"] / r["val_loss"], abs=1e-4) for r in rows)
    assert len(result["block_importance"]) == 4 and set(result["expert_scores"]) == {"frequency", "saliency"}
    assert json.loads((out / "measure.json").read_text())["candidates"] == rows
    assert (out / "measure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from distill.measure import format_table

    table = format_table(result)  # what the command prints without --json
    assert all(r["name"][:33] in table for r in rows) and "retention" in table
    # weight-only quantisation: the teacher and the recipe's student (the paper rule's 3 layers), fp32, int8, int4
    quantized = {r["name"]: r for r in result["quantized"]}
    assert list(quantized) == ["teacher fp32", "teacher int8", "teacher int4", "student fp32", "student int8",
                               "student int4"]
    assert quantized["teacher fp32"]["val_loss"] == rows[0]["val_loss"]
    assert quantized["student fp32"]["val_loss"] == paper3["val_loss"]
    for target in ("teacher", "student"):
        plain, int8, int4 = (quantized[f"{target} {s}"] for s in ("fp32", "int8", "int4"))
        assert abs(int8["loss_vs_unquantized_pct"]) < 0.5 and abs(int4["loss_vs_unquantized_pct"]) < 3
        for r in (int8, int4):
            assert r["loss_vs_unquantized"] == pytest.approx(r["val_loss"] - plain["val_loss"], abs=2e-5)
        assert plain["weight_bytes"] > int8["weight_bytes"] > int4["weight_bytes"]
        assert plain["top1_routing_agreement"] == 1.0 and int8["top1_routing_agreement"] >= 0.98
        assert 0.5 < int4["top1_routing_agreement"] <= 1.0
    assert "weight-only quantisation" in table and "student int4" in table


# a Hugging Face teacher's shape from its config.json alone (recipes/hf/): the student ~12% shallower
HF_STUDENTS = {"mixtral": (28, 46.70e9, 8), "qwen2_moe": (21, 14.32e9, 4), "qwen3_moe": (42, 30.53e9, 8),
               "olmoe": (14, 6.92e9, 8)}


@pytest.mark.parametrize("family", sorted(HF_STUDENTS))
def test_plan_reads_a_hugging_face_teacher_from_its_config_alone(family):
    layers, total, ep = HF_STUDENTS[family]
    recipe = load_recipe(ROOT / "recipes" / "1.3b.yaml", [f"teacher.architecture=recipes/hf/{family}.json",
                                                          "model=null", f"student.layers={layers}",
                                                          "data.seq_len=4096", f"distributed.ep_size={ep}"], world_size=64)
    assert recipe.model is None and recipe.vocab_size() == {"mixtral": 32000, "olmoe": 50304}.get(family, 151936)
    result = plan(recipe, world=64)
    t, s = result["teacher"], result["student"]
    assert abs(t["params_total"] - total) < 0.005e9
    assert s["layers"] == layers and len(s["experts"]) == layers  # every published layer is an MoE layer
    assert s["params_total"] < t["params_total"] and t["ep_size"] == [ep] * t["layers"]
    # imported, not trained: the teacher's memory is its weights in the student's precision, held beside the student
    assert t["total_steps"] == 0 and t["memory_per_rank_breakdown"]["optimizer"] == 0
    assert s["memory_per_rank_with_teacher_bytes"] == s["memory_per_rank_bytes"] + t["memory_per_rank_bytes"]
    assert t["tokens_per_step"] == s["tokens_per_step"] == 512 * 4096  # the data's sequence, not the model's context


def test_a_hugging_face_teacher_and_a_model_section_must_agree():
    from pipeline.recipe import RecipeError

    base = ["teacher.architecture=recipes/hf/olmoe.json", "student.layers=14", "data.seq_len=2048"]
    with pytest.raises(RecipeError, match=r"model.layers = 24: the teacher checkpoint's 16 \(olmoe\): leave the "
                                          "model section out, or make it agree"):
        load_recipe(ROOT / "recipes" / "1.3b.yaml", base, world_size=8)
    with pytest.raises(RecipeError, match="model = None: required: the PR-MoE teacher's shape"):
        load_recipe(ROOT / "recipes" / "1.3b.yaml", ["model=null"], world_size=8)
    with pytest.raises(RecipeError, match="teacher.architecture = 'recipes/tiny.yaml'.*not JSON"):
        load_recipe(ROOT / "recipes" / "1.3b.yaml", ["teacher.architecture=recipes/tiny.yaml", "model=null"],
                    world_size=8)
    with pytest.raises(RecipeError, match="data.seq_len = 8192: at most the teacher's context"):
        load_recipe(ROOT / "recipes" / "1.3b.yaml", [*base, "model=null", "data.seq_len=8192"], world_size=8)


def test_the_teacher_stage_refuses_an_architecture_without_weights_before_writing_anything(tmp_path):
    proc = cli("teacher", "recipes/tiny.yaml", "--run-dir", str(tmp_path / "run"), "--set",
               "teacher.architecture=recipes/hf/olmoe.json", "--set", "model=null", "--set", "student.layers=14",
               check=False)
    assert proc.returncode == 2 and "teacher.architecture" in proc.stderr and "set teacher.load" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_plan_measure_refuses_a_teacher_larger_than_the_free_memory_before_allocating_it():
    import torch

    from distill.measure import check_fits
    from pipeline.build import meta_counts, teacher_config
    from pipeline.recipe import RecipeError

    cfg = teacher_config(load_recipe(ROOT / "recipes" / "1.3b.yaml", ["model.hidden=16384", "model.heads=128"]))
    size = meta_counts(cfg)["total"] * 2 / 2**30  # bf16: ~8 TiB, more than any host here
    with pytest.raises(RecipeError, match=rf"--measure = 'runs/big/teacher': plan --measure holds the whole teacher "
                                          rf"on one device: {size:.1f} GiB in bfloat16, with .* GiB free on cpu"):
        check_fits(cfg, torch.bfloat16, torch.device("cpu"), "runs/big/teacher")
    check_fits(teacher_config(load_recipe(ROOT / "recipes" / "tiny.yaml")), torch.float32, torch.device("cpu"))
