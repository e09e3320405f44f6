"""Shared by the studies (kd_ablation.py, compression_ablation.py): the paper's KD variants and how one is trained
and read back (`PaperRuns`), one teacher trained or reused (`ensure_teacher`), a stage's DONE.json and a run's
metrics, recipe overrides as `--set` flags.

The CLI is started as the benchmarks start it (benchmarks/common.py's `cli_command` and `run_logged`: our own
`moe-pipeline` in a clean environment, its output in a log). A study imports this module as `research.common`
with the checkout's root on sys.path (each script puts it there first).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, cli_command, run_logged

__all__ = ["ROOT", "VARIANTS", "PaperRuns", "cli_command", "ensure_teacher", "run_logged", "scaled_warmup",
           "set_flags", "stage_done", "stage_records", "yaml_value"]

# the paper protocol's students: name -> (--set overrides, one-line description)
VARIANTS: dict[str, tuple[dict[str, str], str]] = {
    "no_kd_scratch": ({"student.init": "random", "kd.beta": "0.0", "kd.stop_at": "null"},
                      "random init, no KD"),
    "kd_all_scratch": ({"student.init": "random", "kd.stop_at": "null"},
                       "random init, KD all the way"),
    "staged_scratch": ({"student.init": "random", "kd.stop_at": "60%"},
                       "random init, KD for 60% (MoS)"),
    "staged_teacher_paper": ({"student.init": "teacher", "student.layer_selection": "paper", "kd.stop_at": "60%"},
                             "teacher init (paper layers), KD 60%"),
    "staged_teacher_importance": ({"student.init": "teacher", "student.layer_selection": "importance",
                                   "kd.stop_at": "60%"},
                                  "teacher init (importance layers), KD 60%"),
}


# -- recipe overrides, stages and metrics ------------------------------------------------------------------------

def yaml_value(v) -> str:
    """A --set value as YAML: null for None, [3, 6] for a list."""
    return "null" if v is None else json.dumps(v) if isinstance(v, (list, tuple)) else str(v)


def set_flags(overrides: dict) -> list[str]:
    """`--set KEY=VALUE` for each override, in order."""
    out = []
    for key, value in overrides.items():
        out += ["--set", f"{key}={yaml_value(value)}"]
    return out


def stage_done(stage_dir: Path) -> dict | None:
    """A finished stage's DONE.json (pipeline.runs.RunDir's reading), or None."""
    from pipeline.runs import RunDir

    return RunDir(stage_dir.parent).done(stage_dir.name)


def stage_records(run_dir: Path, stage: str) -> list[dict]:
    """The records of `stage` in the run's metrics.jsonl (pipeline.runs.read_metrics: torn lines skipped)."""
    from pipeline.artifacts import METRICS
    from pipeline.runs import read_metrics

    return [r for r in read_metrics(run_dir / METRICS) if r.get("stage") == stage]


def scaled_warmup(warmup: int, steps: int, recipe_steps: int) -> int:
    """The recipe's warmup, scaled with the step budget (and never more than the steps)."""
    return min(steps, max(1, round(warmup * steps / recipe_steps))) if warmup else 0


# -- the teacher ------------------------------------------------------------------------------------------------

def ensure_teacher(recipe: str, out: Path, timeout: float | None, teacher_run: Path | None = None,
                   teacher_steps: int | None = None, teacher_train=None) -> tuple[Path, dict]:
    """The finished teacher run directory and its DONE.json: `teacher_run` reused, else trained into
    OUT/teacher_run (OUT/teacher_run_s<steps> for `teacher_steps`, the warmup scaled from `teacher_train`, the
    recipe's teacher.train) unless that run is finished already."""
    if teacher_run is not None:
        run = teacher_run.resolve()
        done = stage_done(run / "teacher")
        if done is None:
            raise SystemExit(f"--teacher-run {run}: {run}/teacher/DONE.json is missing (not a finished teacher run)")
        print(f"[teacher] reusing {run}/teacher (held-out loss {done['val_loss']:.4f})", flush=True)
        return run, {**done, "bench_wall_s": None, "reused": True}
    overrides = {}
    name = "teacher_run"
    if teacher_steps is not None:
        overrides = {"teacher.train.steps": teacher_steps,
                     "teacher.train.warmup_steps": scaled_warmup(teacher_train.warmup_steps, teacher_steps,
                                                                 teacher_train.steps)}
        name = f"teacher_run_s{teacher_steps}"
    run = (out / name).resolve()
    done = stage_done(run / "teacher")
    if done is not None:
        print(f"[teacher] already finished: {run}/teacher (held-out loss {done['val_loss']:.4f})", flush=True)
        return run, {**done, "bench_wall_s": None, "reused": True}
    print(f"[teacher] training {recipe} into {run} ...", flush=True)
    wall = run_logged([*cli_command(), "teacher", recipe, "--run-dir", str(run), *set_flags(overrides)],
                      run.parent / f"{name}.log", timeout)
    done = stage_done(run / "teacher")
    print(f"[teacher] done in {wall:.0f}s: held-out loss {done['val_loss']:.4f}", flush=True)
    return run, {**done, "bench_wall_s": round(wall, 1), "reused": False}


# -- the paper protocol's students ------------------------------------------------------------------------------

@dataclass
class PaperRuns:
    """The students of `VARIANTS` distilled from one teacher, each into OUT/runs/<variant>_s<steps>[_seed<seed>]
    by `moe-pipeline distill RECIPE --set teacher.load=<teacher>`: the same steps, data order and (from scratch)
    initial weights for a seed; only the KD schedule and the initialisation differ."""

    recipe: str  # the recipe file
    out: Path
    steps: int  # student steps of every run
    evals: int  # held-out evaluations per run (curve points)
    timeout: float | None  # seconds per CLI command
    recipe_seed: int  # the recipe's own seed: its runs' directories carry no seed suffix
    recipe_student_steps: int
    recipe_student_warmup: int

    def run_dir(self, name: str, seed: int) -> Path:
        # the recipe's own seed keeps the directory name of runs made before --seeds existed
        suffix = "" if seed == self.recipe_seed else f"_seed{seed}"
        return (self.out / "runs" / f"{name}_s{self.steps}{suffix}").resolve()

    def overrides(self, name: str, seed: int, teacher_stage: Path) -> dict:
        return {"teacher.load": str(teacher_stage), "seed": seed,
                "student.train.steps": self.steps,
                "student.train.warmup_steps": scaled_warmup(self.recipe_student_warmup, self.steps,
                                                            self.recipe_student_steps),
                "student.train.eval_every": max(1, self.steps // self.evals),
                **VARIANTS[name][0]}

    def run(self, name: str, teacher_run: Path, seed: int) -> dict:
        """Train the variant unless its student stage is done; its row (held-out loss, gap to the teacher, the
        curves, the KD and LM phases' training tokens/s)."""
        text = VARIANTS[name][1]
        run, sets = self.run_dir(name, seed), self.overrides(name, seed, teacher_run / "teacher")
        suffix = "" if seed == self.recipe_seed else f"_seed{seed}"
        wall = None
        if stage_done(run / "student") is None:
            print(f"[{name}] {text}: {self.steps} steps into {run} ...", flush=True)
            wall = run_logged([*cli_command(), "distill", self.recipe, "--run-dir", str(run), *set_flags(sets)],
                              run.parent / f"{name}{suffix}.log", self.timeout)
        else:
            print(f"[{name}] already finished: {run}/student", flush=True)
        return variant_row(name, seed, text, run, sets, wall)


def variant_row(name: str, seed: int, text: str, run: Path, sets: dict, wall: float | None) -> dict:
    """A finished variant's row, read from its student/DONE.json, selection.json and metrics.jsonl."""
    done = stage_done(run / "student")
    recs = stage_records(run, "student")
    val_curve = [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r]
    train_curve = [{k: r[k] for k in ("step", "loss", "lm_loss", "kd_loss", "beta", "tokens_per_s") if k in r}
                   for r in recs if "lm_loss" in r]
    # real training throughput while the teacher runs (beta > 0) and after the stop (beta = 0)
    speed = {phase: [r["tokens_per_s"] for r in train_curve if "tokens_per_s" in r and (r.get("beta", 0) > 0) == kd_on]
             for phase, kd_on in (("kd", True), ("lm", False))}
    selection = json.loads((run / "student" / "selection.json").read_text())
    row = {"variant": name, "seed": seed, "description": text, "run_dir": str(run), "overrides": sets,
           "val_loss": done["val_loss"], "teacher_val_loss": done["teacher_val_loss"],
           "gap": done["val_loss"] - done["teacher_val_loss"],
           "gap_pct": 100 * (done["val_loss"] / done["teacher_val_loss"] - 1),
           "kd_stop_step": done.get("kd_stop_step"), "kept_teacher_layers": done.get("kept_teacher_layers"),
           "selection_scores": selection.get("scores"),
           "student_wall_s": done.get("wall_seconds"), "student_train_s": done.get("train_seconds"),
           "tokens_per_s_kd": statistics.median(speed["kd"]) if speed["kd"] else None,
           "tokens_per_s_lm": statistics.median(speed["lm"]) if speed["lm"] else None,
           "resumed_from_step": done.get("resumed_from_step"), "bench_wall_s": None if wall is None else round(wall, 1),
           "val_curve": val_curve, "train_curve": train_curve}
    print(f"[{name}] held-out loss {row['val_loss']:.4f} (teacher {row['teacher_val_loss']:.4f}, "
          f"gap {row['gap']:+.4f}), student stage {row['student_wall_s']:.0f}s", flush=True)
    return row
