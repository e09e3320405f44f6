"""The teacher stage end to end on the real bundled corpus: files, skip on re-run, load, and resume after SIGKILL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import SMALL, cli, killed_at_checkpoint, sets

pytestmark = pytest.mark.slow

RUN = SMALL + ["teacher.train.steps=16", "teacher.train.checkpoint_every=4", "teacher.train.eval_every=8"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "a"
    cli("teacher", "recipes/tiny.yaml", "--run-dir", str(run), *sets(*RUN))
    return run


def test_stage_writes_exactly_its_files(finished):
    stage = finished / "teacher"
    assert sorted(p.name for p in finished.iterdir()) == ["metrics.jsonl", "metrics.png", "recipe.yaml", "teacher"]
    assert (finished / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the training curves, drawn
    top = sorted(p.name for p in stage.iterdir())
    assert top == ["DONE.json", "checkpoints", "config.json", "model.safetensors", "tokenizer", "world_size"]
    ckpts = sorted(p.name for p in (stage / "checkpoints").iterdir())
    assert ckpts == ["global_step12", "global_step16", "latest"]  # checkpoint_keep: 2, the last step's included
    assert (stage / "tokenizer" / "tokenizer.json").is_file()
    done = json.loads((stage / "DONE.json").read_text())
    assert done["steps"] == 16 and done["world_size"] == 1
    assert done["skipped_steps"] == 0  # recorded for fp16's loss scaler; fp32 skips no update
    assert set(done["outputs"]) >= {"config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    assert done["params"]["total"] > done["params"]["active_per_token"] > 0
    records = [json.loads(line) for line in (finished / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(2, 17, 2))
    assert all({"lm_loss", "aux_loss", "lr", "tokens_per_s"} <= set(r) for r in train)
    assert [r["step"] for r in records if "val_loss" in r] == [8, 16]
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]  # it learns


def test_rerun_skips_a_finished_stage(finished):
    before = (finished / "teacher" / "DONE.json").stat().st_mtime_ns
    cli("teacher", "recipes/tiny.yaml", "--run-dir", str(finished), *sets(*RUN))
    assert (finished / "teacher" / "DONE.json").stat().st_mtime_ns == before


def test_another_recipe_in_the_same_run_dir_is_refused(finished):
    proc = cli("teacher", "recipes/tiny.yaml", "--run-dir", str(finished), *sets(*RUN, "seed=7"), check=False)
    assert proc.returncode == 2
    assert "holds a run of another recipe (seed: 1234 -> 7)" in proc.stderr


def test_teacher_load_uses_an_existing_teacher(finished, tmp_path):
    run = tmp_path / "loaded"
    cli("teacher", "recipes/tiny.yaml", "--run-dir", str(run),
        *sets(*RUN, f"teacher.load={finished / 'teacher'}"))
    done = json.loads((run / "teacher" / "DONE.json").read_text())
    original = json.loads((finished / "teacher" / "DONE.json").read_text())
    assert done["loaded_from"] == str((finished / "teacher").resolve())
    assert done["val_loss"] == pytest.approx(original["val_loss"], rel=1e-5)
    a = load_file(run / "teacher" / "model.safetensors")
    b = load_file(finished / "teacher" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_teacher_load_of_another_architecture_is_refused(finished, tmp_path):
    run = tmp_path / "mismatch"
    proc = cli("teacher", "recipes/tiny.yaml", "--run-dir", str(run),
               *sets(*RUN, "model.hidden=128", f"teacher.load={finished / 'teacher'}"), check=False)
    assert proc.returncode == 2
    assert "differs in hidden 64 (recipe: 128)" in proc.stderr.splitlines()[-1]
    assert not run.exists()


def test_sigkill_then_rerun_resumes_to_the_same_weights(finished, tmp_path):
    run = tmp_path / "killed"
    killed_at_checkpoint("teacher", "recipes/tiny.yaml", "--run-dir", str(run), *sets(*RUN),
                         latest=run / "teacher.partial" / "checkpoints" / "latest")
    assert not (run / "teacher").exists() and (run / "teacher.partial").exists()

    other = cli("teacher", "recipes/tiny.yaml", "--run-dir", str(run), "--nproc", "2", *sets(*RUN), check=False)
    assert other.returncode == 2 and "resumes only with --nproc 1" in other.stderr

    cli("teacher", "recipes/tiny.yaml", "--run-dir", str(run), *sets(*RUN))
    assert json.loads((run / "teacher" / "DONE.json").read_text())["resumed_from_step"] > 0
    resumed = load_file(run / "teacher" / "model.safetensors")
    straight = load_file(finished / "teacher" / "model.safetensors")
    assert resumed.keys() == straight.keys()
    for k in straight:
        assert (resumed[k] == straight[k]).all(), f"{k} differs after resume"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(2, 17, 2))  # no step logged twice
