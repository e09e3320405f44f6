"""`moe-pipeline distill` end to end on the real corpus: staged KD, files, and a 2-rank run that resumes after SIGKILL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, SMALL_RUN, cli, killed_at_checkpoint, sets

pytestmark = pytest.mark.slow

RUN = SMALL_RUN


@pytest.fixture(scope="module")
def distilled(small_run) -> Path:
    return small_run


def records(run: Path, stage: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == stage]


def test_distill_runs_both_stages_and_writes_the_student(distilled):
    stage = distilled / "student"
    assert sorted(p.name for p in stage.iterdir()) == ["DONE.json", "checkpoints", "config.json", "model.safetensors",
                                                      "selection.json", "tokenizer", "world_size"]
    selection = json.loads((stage / "selection.json").read_text())
    assert selection["kept_teacher_layers"] == [0, 2, 3] and selection["experts"] == [4]  # 4 -> 3 layers, paper rule
    config = json.loads((stage / "config.json").read_text())
    assert config["layers"] == 3 and config["moe_layers"] == [2]
    done = json.loads((stage / "DONE.json").read_text())
    assert done["kd_stop_step"] == 6 and done["params"]["total"] < done["teacher_params"]["total"]
    # the last step writes a checkpoint too (its fp32 masters and optimizer state), named by `latest`
    assert (stage / "checkpoints" / "latest").read_text() == f"global_step{done['steps']}"
    assert (stage / "checkpoints" / f"global_step{done['steps']}").is_dir()


def test_staged_kd_is_logged_and_stops(distilled):
    train = [r for r in records(distilled, "student") if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert [r["beta"] for r in train] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # steps 0-5 distil, 6-11 do not
    assert all(r["kd_loss"] > 0 for r in train[:3]) and all(r["kd_loss"] == 0 for r in train[3:])
    assert all({"lm_loss", "aux_loss", "lr", "tokens_per_s"} <= set(r) for r in train)
    val = [r for r in records(distilled, "student") if "val_loss" in r]
    assert [r["step"] for r in val] == [6, 12] and all("teacher_val_loss" in r for r in val)


def test_the_monitor_section_feeds_deepspeeds_csv_monitor(distilled):
    """monitor.csv=true (in SMALL_RUN): DeepSpeed's csv_monitor writes its own lr events and every metrics.jsonl
    quantity of both stages, against the samples trained on (8 a step)."""
    import csv

    def rows(job: str, name: str) -> list[list[str]]:
        with open(distilled / "monitor" / job / f"{name}.csv") as f:
            return list(csv.reader(f))

    lr = rows("tiny-teacher", "Train_Samples_lr")
    assert lr[0] == ["step", "lr"] and len(lr) == 1 + 8  # DeepSpeed's own event, every teacher step
    loss = rows("tiny-student", "Train_student_kd_loss")
    assert [int(r[0]) for r in loss[1:]] == [16, 32, 48, 64, 80, 96]  # logged every 2 steps of 8 samples
    train = [r for r in records(distilled, "student") if "kd_loss" in r]
    assert [float(r[1]) for r in loss[1:]] == [r["kd_loss"] for r in train]
    val = rows("tiny-student", "Val_student_teacher_val_loss")
    assert len(val) == 1 + 2 and rows("tiny-teacher", "Val_teacher_val_loss")[0] == ["step", "val_loss"]


def test_rerun_skips_both_stages(distilled):
    done = [distilled / stage / "DONE.json" for stage in ("teacher", "student")]
    before = [d.stat().st_mtime_ns for d in done]
    cli("distill", "recipes/tiny.yaml", "--run-dir", str(distilled), *sets(*RUN))
    assert [d.stat().st_mtime_ns for d in done] == before


def test_two_rank_distill_finishes_and_resumes_after_sigkill(tmp_path):
    straight = tmp_path / "straight"
    cli("distill", "recipes/tiny.yaml", "--nproc", "2", "--run-dir", str(straight), *sets(*RUN))
    assert json.loads((straight / "student" / "DONE.json").read_text())["world_size"] == 2

    killed = tmp_path / "killed"  # same teacher, student stage interrupted
    killed.mkdir()
    shutil.copy(straight / "recipe.yaml", killed / "recipe.yaml")
    shutil.copytree(straight / "teacher", killed / "teacher")
    killed_at_checkpoint("distill", "recipes/tiny.yaml", "--nproc", "2", "--run-dir", str(killed), *sets(*RUN),
                         latest=killed / "student.partial" / "checkpoints" / "latest")
    assert not (killed / "student").exists()

    cli("distill", "recipes/tiny.yaml", "--nproc", "2", "--run-dir", str(killed), *sets(*RUN))
    assert json.loads((killed / "student" / "DONE.json").read_text())["resumed_from_step"] > 0
    a = json.loads((straight / "student" / "model.safetensors.index.json").read_text())["weight_map"]
    for f in sorted(set(a.values())):
        resumed, uninterrupted = load_file(killed / "student" / f), load_file(straight / "student" / f)
        for k in uninterrupted:
            assert (resumed[k] == uninterrupted[k]).all(), f"{k} differs after resume"


def test_student_experts_above_the_kept_layers_stop_before_training(distilled, tmp_path):
    run = tmp_path / "bad"
    # uniform keeps teacher MoE layer 1 (2 experts) of [1, 3]
    proc = cli("distill", "recipes/tiny.yaml", "--run-dir", str(run),
               *sets(*RUN, "student.experts=[4]", "student.layer_selection=uniform", f"teacher.load={distilled / 'teacher'}"),
               check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("recipe error: student.experts.0 = 4: between model.top_k (1) and "
                                                    "the experts of its teacher layer 1 (2); fewer prunes experts")
    assert not (run / "metrics.jsonl").exists() or "student" not in (run / "metrics.jsonl").read_text()
    proc = cli("distill", "recipes/tiny.yaml", "--run-dir", str(run), *sets(*RUN, "student.experts=[5]"), check=False)
    assert proc.returncode == 2 and "student.experts.0 = 5: at most the teacher's largest MoE layer (4 experts)" in proc.stderr


def test_a_pruned_student_keeps_the_same_experts_on_one_rank_and_on_two(distilled, tmp_path):
    """student.experts=[2] prunes the kept 4-expert layer by saliency: 2 expert-parallel ranks (each holding two of
    the teacher's experts, then one of the student's) score and keep the same experts as 1 rank."""
    prune = [*RUN, "student.experts=[2]", "student.expert_selection=saliency", f"teacher.load={distilled / 'teacher'}",
             "student.train.steps=2", "student.train.warmup_steps=1", "student.train.eval_every=2",
             "student.train.checkpoint_every=2", "kd.stop_at=null"]
    selections = {}
    for nproc in (1, 2):
        run = tmp_path / f"r{nproc}"
        # each rank scores its own calibration batches, the next ones in the training order: 1 rank x 4 batches
        # are the same tokens as 2 ranks x 2
        cli("distill", "recipes/tiny.yaml", "--run-dir", str(run), "--nproc", str(nproc),
            *sets(*prune, f"student.calibration_batches={4 // nproc}"))
        selections[nproc] = json.loads((run / "student" / "selection.json").read_text())
        config = json.loads((run / "student" / "config.json").read_text())
        assert config["experts"] == [2] and selections[nproc]["experts"] == [2]
        assert {"expert_scores", "expert_selection", "kept_experts"} <= set(selections[nproc])
    one, two = selections[1], selections[2]
    assert one["kept_experts"] == two["kept_experts"] and len(one["kept_experts"]["3"]) == 2
    assert two["expert_scores"]["3"] == pytest.approx(one["expert_scores"]["3"], rel=1e-4)
def test_the_teacher_is_frozen_with_fp32_gates_and_does_not_run_after_the_stop(distilled):
    """The KD teacher in a bf16 student run: eval mode, no gradients, bf16 weights but fp32 gates (as packages and
    the runtime keep them); its forward is called while beta > 0 and never after kd.stop_at."""
    import torch

    from distill.stage import load_teacher, make_kd_step
    from pipeline import dist
    from pipeline.build import build_model
    from pipeline.artifacts import read_model_config
    from pipeline.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [*RUN, "student.train.precision=bf16",
                                                               "student.train.zero_stage=1"])
    teacher = load_teacher(distilled / "teacher", recipe, dist.init())
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    dtypes = {n: p.dtype for n, p in teacher.named_parameters()}
    gates = [n for n in dtypes if n.endswith("gate.wg.weight")]
    assert gates and all(dtypes[n] == torch.float32 for n in gates)
    assert {d for n, d in dtypes.items() if n not in gates} == {torch.bfloat16}
    calls = []
    teacher.register_forward_hook(lambda *args: calls.append(1))
    student = build_model(read_model_config(distilled / "student"), impl="reference", groups=False)
    step = make_kd_step(teacher, recipe)
    ids = torch.randint(0, student.cfg.vocab_size, (2, 16))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(2, 16)}
    stop = recipe.kd_stop_step()
    _, parts = step(student, batch, 0)
    assert len(calls) == 1 and parts["kd_loss"] > 0
    for s in (stop, stop + 1, recipe.student.train.steps - 1):
        step(student, batch, s)
    assert len(calls) == 1  # not a zero-weighted teacher forward: no forward at all
