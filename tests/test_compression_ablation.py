"""research/compression_ablation.py (the compression study): its dry-run plan, and parts B and C end to end on the tiny
recipe cut down to the stage tests' sizes (SMALL), a few steps per run, in a temporary directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, SMALL, child_env, sets

sys.path.insert(0, str(ROOT))  # the checkout's root: the studies are the package `research`
from research import compression_ablation  # noqa: E402

SCRIPT = ROOT / "research" / "compression_ablation.py"
TEACHER = ["teacher.train.steps=8", "teacher.train.checkpoint_every=4", "teacher.train.eval_every=8"]


def test_dry_run_lists_every_run_with_its_overrides_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "study"
    assert compression_ablation.main(["--dry-run", "--recipe", "recipes/tiny.yaml", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert not out.exists()  # nothing trained, nothing written
    # part A: three paper variants with the first seed, the spread variant (no KD) with the second as well
    for run in ("no_kd_scratch_s300 ", "kd_all_scratch_s300 ", "staged_scratch_s300 ", "no_kd_scratch_s300_seed1235 "):
        assert f"paper/runs/{run}" in text
    assert "--set kd.beta=0.0" in text and "--set seed=1235" in text
    # part B: the teacher + 300 steps, the recipe's student (5 layers, experts [4, 8]) and 75% / 50% of its experts
    assert "baseline/teacher_plus300 with --set teacher.train.steps=300" in text
    assert "practical/full_s300 " in text
    assert "--set student.experts=[3, 6] --set student.expert_selection=saliency" in text
    assert "--set student.experts=[2, 4] --set student.expert_selection=saliency" in text
    assert text.count("--set student.init=teacher --set kd.stop_at=60%") == 3
    # part C: the plan first (no teacher yet), its candidates at B/4 steps
    assert f"plan {ROOT / 'recipes/tiny.yaml'} --measure --run-dir {out / 'teacher_run'} --json --blocks 128" in text
    assert "8 candidates" in text and "75 steps each" in text
    assert f"moe-pipeline teacher {ROOT / 'recipes/tiny.yaml'} --run-dir {out / 'teacher_run'}" in text
    # a budget B of its own: part A keeps the teacher's steps (its token budget), B and C take B
    assert compression_ablation.main(["--dry-run", "--recipe", "recipes/tiny.yaml", "--out", str(out),
                                      "--budget", "120"]) == 0
    text = capsys.readouterr().out
    assert "paper/runs/no_kd_scratch_s300 " in text and "--set student.train.steps=300" in text
    assert "practical/full_s120 " in text and "baseline/teacher_plus120 " in text and "30 steps each" in text


def test_dry_run_with_overrides_names_the_recipe_the_runs_will_use(tmp_path, capsys):
    out = tmp_path / "study"
    assert compression_ablation.main(["--dry-run", "--recipe", "recipes/tiny.yaml", "--set", "student.train.steps=40",
                                      "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert not out.exists()  # OUT/recipe.yaml is written by a real run only
    assert f"distill {out / 'recipe.yaml'} --run-dir {out / 'practical' / 'full_s40'} " in text


def test_protocol_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        compression_ablation.main(["--dry-run", "--recipe", "recipes/tiny.yaml", "--kd-stop", "50%"])
    assert "part A runs kd_ablation's staged_scratch" in capsys.readouterr().err


def test_spearman_and_ranks_with_ties():
    assert compression_ablation._ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert compression_ablation.spearman([1, 2, 3], [10, 30, 20])["rho"] == pytest.approx(0.5)
    assert compression_ablation._rank_corr([1, 2, 3, 3], [4, 3, 2, 2]) == pytest.approx(-1.0)
    assert compression_ablation.spearman([1, 2], [5, 5])["rho"] is None  # constant: undefined, not nan
    assert compression_ablation.pruned([4, 8, 8], 0.75, 1, None) == [3, 6, 6]
    assert compression_ablation.pruned([2, 4], 0.5, 1, 2) == [2, 2]


def test_paper_runs_directories_and_overrides(tmp_path):
    """research/common.py's paper protocol (kd_ablation.py's runs, compression part A): where a (variant, seed) goes
    and the --set flags it is distilled with."""
    from research.common import PaperRuns, scaled_warmup, set_flags

    runs = PaperRuns(recipe="recipes/tiny.yaml", out=tmp_path, steps=60, evals=3, timeout=None, recipe_seed=1234,
                     recipe_student_steps=300, recipe_student_warmup=30)
    assert runs.run_dir("staged_scratch", 1234) == (tmp_path / "runs" / "staged_scratch_s60").resolve()
    assert runs.run_dir("no_kd_scratch", 1235).name == "no_kd_scratch_s60_seed1235"  # another seed: a suffix
    teacher = tmp_path / "teacher_run" / "teacher"
    assert set_flags(runs.overrides("no_kd_scratch", 1235, teacher)) == [
        "--set", f"teacher.load={teacher}", "--set", "seed=1235", "--set", "student.train.steps=60",
        "--set", "student.train.warmup_steps=6", "--set", "student.train.eval_every=20",
        "--set", "student.init=random", "--set", "kd.beta=0.0", "--set", "kd.stop_at=null"]
    assert scaled_warmup(30, 1, 300) == 1 and scaled_warmup(0, 60, 300) == 0
    assert set_flags({"a": None, "b": [3, 6]}) == ["--set", "a=null", "--set", "b=[3, 6]"]


@pytest.mark.slow
def test_parts_b_and_c_end_to_end_and_resume(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, str(SCRIPT), "--recipe", "recipes/tiny.yaml", *sets(*SMALL, *TEACHER), "--out", str(out),
           "--parts", "B", "C", "--budget", "8", "--candidates", "3", "--fractions", "0.5", "--eval-batches", "2",
           "--plan-blocks", "16", "--evals", "1", "--timeout", "300"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "compression_ablation.json").read_text())
    assert (out / "compression_ablation.png").stat().st_size > 0
    assert set(result) == {"meta", "protocol", "teacher", "parts", "runs"} and set(result["parts"]) == {"B", "C"}
    assert result["protocol"]["budget"] == 8 and result["protocol"]["candidate_steps"] == 2
    assert result["teacher"]["steps"] == 8 and not result["teacher"]["reused"]  # trained here, into OUT

    b = result["parts"]["B"]
    base = b["baseline"]
    assert base["steps"] == base["logged_steps"] == 8 and base["total_teacher_steps"] == 16  # exactly B more
    assert [s["name"] for s in b["students"]] == ["full", "experts50"]
    assert [s["experts"] for s in b["students"]] == [[4], [2]]  # SMALL: the student keeps the 4-expert layer
    for s in b["students"]:
        assert s["retention"] > 0 and s["retention"] == pytest.approx(base["val_loss"] / s["val_loss"])
        assert s["steps"] == 8 and s["layers"] == 3 and math.isfinite(s["val_loss"])
    assert sorted(b["ordering"]) == ["baseline", "experts50", "full"] and not b["failed"]

    c = result["parts"]["C"]
    assert len(c["candidates"]) == 3 and not c["failed"]
    assert {r["kind"] for r in c["candidates"]} == {"depth", "experts"}
    assert all(r["matches_candidate"] and r["steps"] == 2 for r in c["candidates"])
    rho = c["spearman"]["rho"]
    assert c["spearman"]["n"] == 3 and isinstance(rho, float) and -1 <= rho <= 1
    assert c["plan_check"]["rescored"] == pytest.approx(c["plan_check"]["plan"], abs=1e-3)
    assert (out / "plan" / "measure.json").is_file()
    assert all(r["bench_s"] is not None for r in result["runs"] if r["name"] != "teacher")  # part D, all measured

    again = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rerun = json.loads((out / "compression_ablation.json").read_text())
    assert all(r["bench_s"] is None for r in rerun["runs"])  # every run reused, nothing trained again
    assert rerun["parts"]["C"]["spearman"] == c["spearman"]
