"""The compression study: what compressing the small recipe's teacher costs, measured four ways on ONE teacher.

    .venv/bin/python research/compression_ablation.py --teacher-run research/results/compression_ablation/teacher_run
    .venv/bin/python research/compression_ablation.py --dry-run          # every run it would make, trains nothing
    .venv/bin/python research/compression_ablation.py --parts B C --budget 200 --candidates 4   # a part of it

Held-out loss on the whole validation split (nats/token) is the primary metric of every trained model. The
protocol is fixed by flags with defaults before the first run (the KD stop `--kd-stop 60%`, `--seeds`, the
student budget `--budget B` = the recipe's `student.train.steps`, `--candidates 8` trained for `--candidate-steps`
= B/4 each); whatever ordering comes out is reported.

  A. The paper's protocol (kd_ablation.py's runs: research/common.py's `PaperRuns`, into OUT/paper/; or reusing,
     read only, the finished runs of an earlier `kd_ablation.py --out` of this teacher, `--paper-out`): students from
     random weights trained `--paper-steps` (default: the teacher's own steps, its token budget) without KD
     (`no_kd_scratch`), with KD all the way (`kd_all_scratch`) and with KD for the first 60% (`staged_scratch`); the `--spread-variant` (default no_kd_scratch) with both
     `--seeds`, the others with the first. Reported: held-out loss, gap to the teacher, the seed-to-seed spread,
     and whether the recipe is "capacity-limited": the no-KD student at least 2x that spread above the teacher.
  B. The practical protocol (OUT/practical/): students started from the teacher's layers (`student.init:
     teacher`, the recipe's depth and layer rule), B steps of the recipe's staged KD: `full` (the kept layers'
     experts), and `experts75` / `experts50` (`student.experts` = 75% / 50% of the kept layers' counts, at least
     model.top_k, chosen by `--expert-selection`, default saliency). Against the compute-matched baseline
     (OUT/baseline/): the teacher itself trained B more steps. Reported: retention = baseline held-out loss /
     student held-out loss, and with `--tasks` the bundled zero-shot tasks (`moe-pipeline eval`, OUT/eval/).
  C. The plan's ranking (OUT/plan/, OUT/ranking/): `moe-pipeline plan RECIPE --measure --run-dir TEACHER --json`
     (reused when OUT/plan/ or TEACHER/plan/ holds one for this teacher and block count) scores candidates cut
     from the teacher before training. `--candidates N` of them (see "What the recipe refused") are trained from
     the teacher's layers for B/4 steps with the same KD; Spearman's rho (scipy) between the untrained and the
     trained held-out loss, with n.
  D. The wall time of every run (its stages' DONE.json, and as measured here).

Resumable: a run whose stage has its DONE.json is not trained again (a killed one resumes from its last DeepSpeed
checkpoint), so the same arguments pick up where a run stopped. A reused run is checked first: its stored
recipe must be the one these arguments make, and its teacher stage must come from this teacher (else: another
--out). Results: a table on stdout, `compression_ablation.json` and `compression_ablation.png` (held-out loss
per run with the teacher and baseline lines; the plan-vs-trained scatter with rho) under `--out` (default
research/results/compression_study/, git-ignored, which also holds the runs and their logs).

Wall time on 2 CPU cores (small.yaml, B = 500): 4 part A runs (~20-28 min each), the baseline (~20 min), 3 part B
students (~19-25 min each), 8 part C candidates at 125 steps (~5-7 min each): about 3-4 h in all (`--dry-run`
prints its estimate from the teacher's own time per step). Reusing the finished part A runs of an earlier
`kd_ablation.py --recipe recipes/small.yaml --seeds 1234 1235 --variants no_kd_scratch kd_all_scratch
staged_scratch` on the same teacher (`--paper-out THAT_OUT`) leaves about 2-2.5 h.

What the recipe and the CLI refused, and what is done instead:
  * "The teacher trained B more steps" cannot be made with `moe-pipeline teacher` on a copy of the teacher run:
    a finished stage is skipped; a run directory refuses a changed recipe (teacher.train.steps) unless --redo,
    which deletes the teacher; and the training loop checkpoints only before its last step (here step 400 of
    500, so a resume would train 100 + B steps) and stretches its cosine over the new total (the learning rate
    would jump back up at the resumed step). So the baseline is made by this script's own worker with the
    pipeline's functions: the finished teacher's final weights (`load_weights`), then `train_model` for exactly
    B steps with the teacher's optimizer settings and the students' schedule (warmup scaled to B, cosine to
    min_lr over B), on the same batches the students see (same seed and batch size), into a run directory whose
    `teacher` stage describes itself (DONE.json: `continued_from`, `steps` = B). A fresh optimizer state and a
    re-warmed rate, as the students get: compute-matched, not a bit-exact continuation.
  * The plan's expert-pruning rows keep the teacher's depth, which the student stage refuses (`student.layers
    must be < teacher layers`). So part C's pruned candidates prune the recipe's student (its depth and layer
    rule, then 75% / 50% experts), scored untrained here with the plan's own functions on the plan's held-out
    blocks (`distill.measure`'s code path; one plan row is rescored as a check, `plan_check` in the JSON). The
    depth candidates are the plan's table rows, deduplicated by kept layers and picked evenly along its loss.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: research.common, pipeline/
from research.common import (ROOT, PaperRuns, cli_command, ensure_teacher, run_logged,  # noqa: E402
                             scaled_warmup, set_flags, stage_done, stage_records, yaml_value)

RECIPE = "recipes/small.yaml"
PAPER_VARIANTS = ("no_kd_scratch", "kd_all_scratch", "staged_scratch")
FRACTIONS = (0.75, 0.5)
EXPERT_RULES = ("frequency", "saliency")


# -- recipes and run directories ----------------------------------------------------------------

def _recipe_path(text: str) -> Path:
    path = Path(text)
    return path.resolve() if path.is_file() else (ROOT / text).resolve()


def _load(recipe_file: Path, overrides: dict | list = ()):
    from pipeline.recipe import load_recipe

    items = [f"{k}={yaml_value(v)}" for k, v in overrides.items()] if isinstance(overrides, dict) else list(overrides)
    return load_recipe(recipe_file, items)


def study_recipe(a, extra: dict | None = None):
    """The recipe every run uses, with `extra` on top: OUT/recipe.yaml once written (with --set), else the recipe
    with the --set overrides (a dry run writes nothing, so OUT/recipe.yaml may not exist yet)."""
    items = [f"{k}={yaml_value(v)}" for k, v in (extra or {}).items()]
    if a.recipe_file.is_file():
        return _load(a.recipe_file, items)
    return _load(a.recipe_base, [*a.overrides, *items])


def check_reused(run: Path, recipe_file: Path, overrides: dict, teacher_stage: Path | None) -> None:
    """A run directory made earlier must hold the recipe these arguments make, cut from this teacher."""
    from pipeline.recipe import diff_recipes, load_stored_recipe

    stored = run / "recipe.yaml"
    if stored.is_file():
        changes = diff_recipes(load_stored_recipe(stored), _load(recipe_file, overrides))
        if changes:
            raise SystemExit(f"{run} holds another run ({'; '.join(changes[:3])}): pass another --out, "
                             f"or remove that run directory")
    done = stage_done(run / "teacher")
    if teacher_stage is not None and done and done.get("loaded_from") not in (None, str(teacher_stage.resolve())):
        raise SystemExit(f"{run} was distilled from {done['loaded_from']}, not {teacher_stage}: pass another --out")


def _status(stage_dir: Path) -> str:
    if stage_done(stage_dir) is not None:
        return "done"
    return "partial" if stage_dir.with_name(stage_dir.name + ".partial").exists() else "new"


def kept_counts(recipe, scores: list[float] | None = None) -> list[int]:
    """Experts of the teacher layers the recipe's student keeps (before any pruning)."""
    from distill.student import select_layers
    from pipeline.build import teacher_config

    teacher = teacher_config(recipe)
    s = recipe.student
    kept = select_layers(teacher, s.layers, recipe.moe_layer_count(s.layers), s.layer_selection, scores)
    return [teacher.experts_at(t) for t in kept if teacher.is_moe(t)]


def pruned(counts: list[int], fraction: float, top_k: int, ep: int | None) -> list[int]:
    """`fraction` of each count, at least top_k (and a multiple of ep_size if set): distill/measure.py's rule."""
    out = []
    for e in counts:
        keep = max(top_k, round(fraction * e))
        if ep:
            keep = max(ep, keep // ep * ep)
        out.append(min(keep, e))
    return out


# -- the study: its arguments, recipe and teacher, and how one student run is made ------------------------------

class Study:
    """The arguments, the recipe, the teacher, the progress counter, and the student runs parts B and C make (the
    parts themselves are the functions `part_a`, `part_b`, `part_c` below)."""

    def __init__(self, args):
        self.args = args
        self.recipe = study_recipe(args)
        self.out = args.out
        self.t0 = time.perf_counter()
        self.runs_total = 0
        self.runs_started = 0

    def progress(self, label: str) -> None:
        self.runs_started += 1
        elapsed = time.perf_counter() - self.t0
        print(f"[{label}] run {self.runs_started} of at most {self.runs_total} this call, {elapsed / 60:.1f} min so "
              f"far", flush=True)

    def load_teacher(self) -> None:
        """The finished teacher (--teacher-run, or trained into OUT/teacher_run), checked against the recipe."""
        a = self.args
        self.teacher_run, done = ensure_teacher(str(a.recipe_file), self.out, a.timeout, a.teacher_run)
        self.teacher_stage = self.teacher_run / "teacher"
        self.teacher_done = done
        from pipeline.teacher import check_loadable

        check_loadable(self.recipe, self.teacher_stage)  # once, here, rather than in every run's teacher.load

    def student_sets(self, steps: int, evals: int, extra: dict) -> dict:
        """The overrides of a student run from the teacher's layers: `steps` steps, `evals` evaluations, `extra`."""
        r = self.recipe
        return {"teacher.load": str(self.teacher_stage), "seed": self.args.seeds[0],
                "student.train.steps": steps,
                "student.train.warmup_steps": scaled_warmup(r.student.train.warmup_steps, steps, r.student.train.steps),
                "student.train.eval_every": max(1, steps // evals),
                "student.train.eval_batches": self.args.eval_batches_yaml,
                "teacher.eval.eval_batches": self.args.eval_batches_yaml,
                "student.init": "teacher", "kd.stop_at": self.args.kd_stop, **extra}

    def train_student(self, part: str, name: str, run: Path, sets: dict, log: Path) -> dict:
        """`moe-pipeline distill` into `run` unless its student stage is done; its row."""
        check_reused(run, self.args.recipe_file, sets, self.teacher_stage)
        wall = None
        if stage_done(run / "student") is None:
            self.progress(f"{part} {name}")
            print(f"[{part} {name}] {sets['student.train.steps']} steps into {run} (log {log}) ...", flush=True)
            wall = run_logged([*cli_command(), "distill", str(self.args.recipe_file), "--run-dir", str(run),
                               *set_flags(sets)], log, self.args.timeout)
        else:
            print(f"[{part} {name}] already finished: {run}/student", flush=True)
        done, link = stage_done(run / "student"), stage_done(run / "teacher") or {}
        selection = json.loads((run / "student" / "selection.json").read_text())
        recs = stage_records(run, "student")
        row = {"name": name, "run_dir": str(run), "overrides": sets, "val_loss": done["val_loss"],
               "teacher_val_loss": done["teacher_val_loss"], "gap": done["val_loss"] - done["teacher_val_loss"],
               "layers": len(done["kept_teacher_layers"]), "kept_teacher_layers": done["kept_teacher_layers"],
               "experts": selection["experts"], "kept_experts": selection.get("kept_experts"),
               "params": done.get("params"), "steps": done["steps"], "kd_stop_step": done.get("kd_stop_step"),
               "resumed_from_step": done.get("resumed_from_step"),
               "wall": {"student_stage_s": done.get("wall_seconds"), "student_train_s": done.get("train_seconds"),
                        "teacher_link_stage_s": link.get("wall_seconds"),
                        "bench_s": None if wall is None else round(wall, 1)},
               "val_curve": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r]}
        print(f"[{part} {name}] held-out loss {row['val_loss']:.4f} (teacher {row['teacher_val_loss']:.4f}), "
              f"student stage {row['wall']['student_stage_s']:.0f}s", flush=True)
        return row


# -- part A: the paper's protocol ---------------------------------------------------------------------------------

def paper_protocol(a, recipe) -> PaperRuns:
    """Part A's runs: kd_ablation.py's, into --paper-out (default OUT/paper) at --paper-steps."""
    return PaperRuns(recipe=str(a.recipe_file), out=a.paper_out, steps=a.paper_steps, evals=a.evals,
                     timeout=a.timeout, recipe_seed=recipe.seed, recipe_student_steps=recipe.student.train.steps,
                     recipe_student_warmup=recipe.student.train.warmup_steps)


def paper_runs(a) -> list[tuple[str, int]]:
    """(variant, seed): every paper variant with the first seed, the spread variant with all of them."""
    out = [(name, a.seeds[0]) for name in PAPER_VARIANTS]
    out += [(a.spread_variant, s) for s in a.seeds[1:]]
    return out


def part_a(study: Study) -> dict:
    a = study.args
    runs = paper_protocol(a, study.recipe)
    rows, failed = [], {}
    for name, seed in paper_runs(a):
        label = f"A {name} seed {seed}"
        run = runs.run_dir(name, seed)
        check_reused(run, a.recipe_file, runs.overrides(name, seed, study.teacher_stage), study.teacher_stage)
        if a.paper_reuse_only and stage_done(run / "student") is None:  # never train into another study's directory
            print(f"[{label}] not finished in --paper-out {a.paper_out}: left out (not trained there)", flush=True)
            failed[label] = f"{run}: no student/DONE.json in --paper-out (only reused there, never trained)"
            continue
        try:
            if stage_done(run / "student") is None:
                study.progress(label)
            rows.append(runs.run(name, study.teacher_run, seed))
        except RuntimeError as err:
            print(f"[{label}] FAILED: {err}", file=sys.stderr, flush=True)
            failed[label] = str(err)
    return summarise_a(rows, failed, a.spread_variant, a.seeds)


# -- part B: the practical protocol against the teacher trained B more steps --------------------------------------

def practical_variants(study: Study, scores: list[float] | None = None) -> list[tuple[str, dict]]:
    """Part B's students: (name, overrides). `scores`: block importance, for a recipe that keeps layers by it."""
    r, a = study.recipe, study.args
    full = kept_counts(r, scores)
    out = [("full", {})]
    for f in a.fractions:
        counts = pruned(full, f, r.model.top_k, r.distributed.ep_size)
        if counts != full:
            out.append((f"experts{round(100 * f)}", {"student.experts": counts,
                                                     "student.expert_selection": a.expert_selection}))
    return out


def baseline_sets(study: Study) -> dict:
    a, t = study.args, study.recipe.teacher.train
    s = study.recipe.student.train
    return {"teacher.train.steps": a.budget,
            "teacher.train.warmup_steps": scaled_warmup(s.warmup_steps, a.budget, s.steps),
            "teacher.train.eval_every": max(1, a.budget // a.evals),
            "teacher.train.eval_batches": a.eval_batches_yaml,
            "teacher.train.checkpoint_every": min(t.checkpoint_every, a.budget), "seed": a.seeds[0]}


def baseline_dir(study: Study) -> Path:
    return study.out / "baseline" / f"teacher_plus{study.args.budget}"


def train_baseline(study: Study) -> dict:
    """The teacher trained B more steps (see the module docstring), by this script's worker."""
    run, sets = baseline_dir(study), baseline_sets(study)
    check_reused(run, study.args.recipe_file, sets, None)
    wall = None
    if stage_done(run / "teacher") is None:
        study.progress("B baseline")
        request = run.parent / f"{run.name}.request.json"
        request.parent.mkdir(parents=True, exist_ok=True)
        request.write_text(json.dumps({"recipe": str(study.args.recipe_file), "overrides": sets,
                                       "source": str(study.teacher_stage), "run_dir": str(run)}, indent=1))
        print(f"[B baseline] the teacher + {study.args.budget} steps into {run} ...", flush=True)
        wall = run_logged([sys.executable, str(Path(__file__).resolve()), "--baseline-worker", str(request)],
                          run.parent / f"{run.name}.log", study.args.timeout)
    else:
        print(f"[B baseline] already finished: {run}/teacher", flush=True)
    done = stage_done(run / "teacher")
    if done.get("continued_from") != str(study.teacher_stage.resolve()):
        raise SystemExit(f"{run} continues {done.get('continued_from')}, not {study.teacher_stage}: another --out")
    recs = stage_records(run, "teacher")
    logged_steps = max((r["step"] for r in recs if "loss" in r), default=0)
    row = {"name": "baseline", "run_dir": str(run), "overrides": sets, "val_loss": done["val_loss"],
           "steps": done["steps"], "logged_steps": logged_steps,
           "total_teacher_steps": done["continued_from_steps"] + done["steps"],
           "resumed_from_step": done.get("resumed_from_step"), "params": done.get("params"),
           "wall": {"stage_s": done.get("wall_seconds"), "train_s": done.get("train_seconds"),
                    "bench_s": None if wall is None else round(wall, 1)},
           "val_curve": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r]}
    print(f"[B baseline] held-out loss {row['val_loss']:.4f} after {row['steps']} more steps "
          f"({row['total_teacher_steps']} in all; teacher {study.teacher_done['val_loss']:.4f})", flush=True)
    return row


def eval_tasks(study: Study, base: dict, students: list[dict]) -> dict:
    """`moe-pipeline eval` of the teacher, the baseline and the students on --tasks, into OUT/eval/."""
    a = study.args
    out = study.out / "eval"
    models = [str(study.teacher_stage), str(Path(base["run_dir"]) / "teacher")] + \
             [str(Path(s["run_dir"]) / "student") for s in students]
    cmd = [*cli_command(), "eval", *models, "--out", str(out)]
    cmd += [] if a.tasks == "bundled" else ["--tasks", a.tasks]
    cmd += [] if a.tasks_limit is None else ["--limit", str(a.tasks_limit)]
    print(f"[B eval] {len(models)} models on {a.tasks} tasks -> {out} ...", flush=True)
    wall = run_logged(cmd, study.out / "eval.log", a.timeout)
    return read_tasks(out / "results.json", models, wall)


def part_b(study: Study) -> dict:
    a = study.args
    students, failed = [], {}
    base = None
    try:
        base = train_baseline(study)
    except RuntimeError as e:
        print(f"[B baseline] FAILED: {e}", file=sys.stderr, flush=True)
        failed["baseline"] = str(e)
    scores = measure_plan(study)["block_importance"] if study.recipe.student.layer_selection == "importance" else None
    for name, extra in practical_variants(study, scores):
        run = study.out / "practical" / f"{name}_s{a.budget}"
        try:
            row = study.train_student("B", name, run, study.student_sets(a.budget, a.evals, extra),
                                      run.parent / f"{name}_s{a.budget}.log")
            students.append(row)
        except RuntimeError as e:
            print(f"[B {name}] FAILED: {e}", file=sys.stderr, flush=True)
            failed[name] = str(e)
    tasks = None
    if a.tasks and base is not None and students:
        try:
            tasks = eval_tasks(study, base, students)
        except RuntimeError as e:
            print(f"[B eval] FAILED: {e}", file=sys.stderr, flush=True)
            failed["eval"] = str(e)
    return summarise_b(base, students, failed, tasks, study.teacher_done)


# -- part C: the plan's untrained ranking against the trained one ------------------------------------------------

def plan_file_ok(study: Study, path: Path) -> bool:
    """Whether `path` is a plan measurement of this teacher on the blocks --plan-blocks asks for."""
    if not path.is_file():
        return False
    d = json.loads(path.read_text())
    s = study.recipe.student
    micro = s.train.micro_batch_size
    want_tokens = max(1, study.args.plan_blocks // micro) * micro * study.recipe.data.seq_len
    return (d.get("teacher") == str(study.teacher_stage.resolve()) and d.get("held_out_tokens") == want_tokens
            and d.get("calibration_batches") == s.calibration_batches)


def measure_plan(study: Study) -> dict:
    """`moe-pipeline plan --measure` of the teacher (OUT/plan/measure.json), or one made before (OUT/plan/ or
    TEACHER/plan/) that `plan_file_ok` accepts."""
    a = study.args
    mine, theirs = study.out / "plan" / "measure.json", study.teacher_run / "plan" / "measure.json"
    for path in (mine, theirs):
        if plan_file_ok(study, path):
            print(f"[C plan] reusing {path}", flush=True)
            return {**json.loads(path.read_text()), "path": str(path), "bench_s": None}
    study.progress("C plan")
    cmd = [*cli_command(), "plan", str(a.recipe_file), "--measure", "--run-dir", str(study.teacher_run), "--json",
           "--blocks", str(a.plan_blocks), "--out", str(mine.parent)]
    print(f"[C plan] {' '.join(cmd[len(cli_command()):])} ...", flush=True)
    wall = run_logged(cmd, study.out / "plan.log", a.timeout)
    if not plan_file_ok(study, mine):
        raise SystemExit(f"{mine}: the plan did not write a measurement of {study.teacher_stage}")
    return {**json.loads(mine.read_text()), "path": str(mine), "bench_s": round(wall, 1)}


def choose_candidates(plan: dict, study: Study, n: int) -> list[dict]:
    """`n` candidates: the plan's depth rows (deduplicated by kept layers) picked evenly along their untrained
    loss, and about a third pruned students (the recipe's depth and rule, then 75% / 50% experts by each rule)."""
    r = study.recipe
    depth, seen = [], set()
    for row in sorted((x for x in plan["candidates"] if x["kind"] == "depth"), key=lambda x: x["val_loss"]):
        if tuple(row["kept_teacher_layers"]) in seen:
            continue
        seen.add(tuple(row["kept_teacher_layers"]))
        depth.append({"name": row["name"], "kind": "depth", "source": "plan", "layers": row["layers"],
                      "rule_layers": row["rule"], "rule_experts": r.student.expert_selection, "experts_override": None,
                      "kept_teacher_layers": row["kept_teacher_layers"], "experts": row["experts"], "kept_experts": {},
                      "pre_val_loss": row["val_loss"], "slug": f"depth{row['layers']}_{row['rule']}"})
    combos = pruned_candidates(plan, study)
    n_combo = min(len(combos), max(1, round(n / 3)), n)
    n_depth = min(len(depth), n - n_combo)
    n_combo = min(len(combos), n - n_depth)
    picks = sorted({round(i * (len(depth) - 1) / max(1, n_depth - 1)) for i in range(n_depth)}) if n_depth else []
    return [depth[i] for i in picks] + combos[:n_combo]


def pruned_candidates(plan: dict, study: Study) -> list[dict]:
    """The recipe's student (its depth, its layer rule) with 75% / 50% of the kept layers' experts, the chosen
    rule first, with the kept experts the student stage will choose (the plan's expert scores)."""
    from distill.student import select_experts, select_layers
    from pipeline.build import teacher_config

    r, a = study.recipe, study.args
    teacher = teacher_config(r)
    s = r.student
    kept = select_layers(teacher, s.layers, r.moe_layer_count(s.layers), s.layer_selection,
                         plan["block_importance"] if s.layer_selection == "importance" else None)
    moe = [t for t in kept if teacher.is_moe(t)]
    full = [teacher.experts_at(t) for t in moe]
    rules = [a.expert_selection] + [x for x in EXPERT_RULES if x != a.expert_selection]
    order = [(rules[0], FRACTIONS[0]), (rules[0], FRACTIONS[1]), (rules[1], FRACTIONS[1]), (rules[1], FRACTIONS[0])]
    out = []
    for rule, f in order:
        counts = pruned(full, f, r.model.top_k, r.distributed.ep_size)
        if counts == full:
            continue
        scores = plan["expert_scores"][rule]
        kept_experts = {str(t): select_experts(scores[str(t)], n) for t, n, e in zip(moe, counts, full) if n < e}
        out.append({"name": f"{s.layers} layers ({s.layer_selection}) + experts {counts} ({rule})", "kind": "experts",
                    "source": "scored here", "layers": s.layers, "rule_layers": s.layer_selection,
                    "rule_experts": rule, "experts_override": counts, "kept_teacher_layers": kept, "experts": counts,
                    "kept_experts": kept_experts, "pre_val_loss": None,
                    "slug": f"depth{s.layers}_{s.layer_selection}_experts{round(100 * f)}_{rule}"})
    return out


def candidate_overrides(c: dict) -> dict:
    """A part C candidate's student overrides (its depth, layer rule, expert counts and expert rule)."""
    return {"student.layers": c["layers"], "student.layer_selection": c["rule_layers"],
            "student.experts": c["experts_override"], "student.expert_selection": c["rule_experts"]}


def score_untrained(recipe, teacher_dir: Path, specs: list[tuple], held_out_tokens: int) -> dict[str, float]:
    """distill.measure's scoring of (name, kept layers, experts, kept experts) candidates, untrained."""
    from distill.student import init_from_teacher, student_config
    from pipeline import data as data_lib
    from pipeline.artifacts import cache_root, read_model_config
    from pipeline.dist import Ranks, device
    from pipeline.model import GPT
    from pipeline.train import evaluate

    on = device()
    teacher_cfg = read_model_config(teacher_dir)
    prepared = data_lib.prepare_data(recipe.data, cache_root())
    val = data_lib.PackedTokens(prepared.val, teacher_cfg.seq_len, prepared.eod_id, name="val")
    micro = recipe.student.train.micro_batch_size
    batches = held_out_tokens // (micro * teacher_cfg.seq_len)
    one = Ranks(rank=0, world=1, local_rank=0, local_world=1)
    out = {}
    for name, kept, experts, kept_experts in specs:
        model = GPT(student_config(teacher_cfg, kept, experts), moe_impl="reference")
        init_from_teacher(model, teacher_dir, kept, {int(t): ids for t, ids in kept_experts.items()})
        out[name] = round(evaluate(model.to(on).requires_grad_(False), val, batches, micro, one), 5)
        del model
    return out


def score_extra(study: Study, cands: list[dict], plan: dict) -> dict:
    """The untrained held-out loss of candidates the plan's table has no row for, by distill.measure's code
    path on the plan's blocks (cached in OUT/plan/extra.json); plus one plan row rescored (`_check`)."""
    cache_path = study.out / "plan" / "extra.json"
    key = f"{study.teacher_stage.resolve()}|{plan['held_out_tokens']}"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    cache = cache if cache.get("key") == key else {"key": key, "scores": {}}
    check_row = next(r for r in plan["candidates"] if r["kind"] == "depth")
    todo = [c for c in cands if c["name"] not in cache["scores"]]
    if todo or "_check" not in cache:
        print(f"[C plan] scoring {len(todo)} pruned candidate(s) untrained (and rescoring "
              f"'{check_row['name']}' as a check) ...", flush=True)
        specs = [(c["name"], c["kept_teacher_layers"], c["experts"], c["kept_experts"]) for c in todo]
        specs.append(("_check", check_row["kept_teacher_layers"], check_row["experts"], {}))
        cache["scores"].update(score_untrained(study.recipe, study.teacher_stage, specs, plan["held_out_tokens"]))
        cache["_check"] = {"name": check_row["name"], "plan": check_row["val_loss"],
                           "rescored": cache["scores"].pop("_check")}
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cache, indent=1))
    return {**cache["scores"], "_check": cache["_check"]}


def part_c(study: Study) -> dict:
    a = study.args
    plan = measure_plan(study)
    picked = choose_candidates(plan, study, a.candidates)
    scored = score_extra(study, [c for c in picked if c["source"] != "plan"], plan)
    for c in picked:
        if c["source"] != "plan":
            c["pre_val_loss"] = scored[c["name"]]
    rows, failed = [], {}
    steps = a.candidate_steps
    for c in picked:
        run = study.out / "ranking" / f"{c['slug']}_s{steps}"
        try:
            row = study.train_student("C", c["name"], run, study.student_sets(steps, 1, candidate_overrides(c)),
                                      run.parent / f"{c['slug']}_s{steps}.log")
        except RuntimeError as e:
            print(f"[C {c['name']}] FAILED: {e}", file=sys.stderr, flush=True)
            failed[c["name"]] = str(e)
            continue
        row.update(kind=c["kind"], source=c["source"], pre_val_loss=c["pre_val_loss"],
                   matches_candidate=row["kept_teacher_layers"] == c["kept_teacher_layers"]
                   and list(row["experts"]) == c["experts"]
                   and {str(k): v for k, v in (row["kept_experts"] or {}).items()} == c["kept_experts"])
        rows.append(row)
    return summarise_c(rows, failed, plan, scored.get("_check"), steps)


PARTS = {"A": part_a, "B": part_b, "C": part_c}


# -- summaries ----------------------------------------------------------------------------------

def spearman(x: list[float], y: list[float]) -> dict:
    """Spearman's rho (scipy.stats.spearmanr; without scipy, Pearson's r of average ranks) and n."""
    n = len(x)
    if n < 2 or len(set(x)) < 2 or len(set(y)) < 2:  # a constant side: no ranking to compare
        return {"rho": None, "p_value": None, "n": n, "method": None}
    try:
        from scipy.stats import spearmanr

        res = spearmanr(x, y)
        rho, p = float(res.statistic), float(res.pvalue)
        method = "scipy.stats.spearmanr"
    except ImportError:
        rho, p, method = _rank_corr(x, y), None, "ranks with ties averaged (no scipy)"
    if rho is None or not math.isfinite(rho):
        return {"rho": None, "p_value": None, "n": n, "method": method}
    return {"rho": rho, "p_value": p if p is not None and math.isfinite(p) else None, "n": n, "method": method}


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _rank_corr(x: list[float], y: list[float]) -> float | None:
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a in rx)), math.sqrt(sum((b - my) ** 2 for b in ry))
    return sxy / (sx * sy) if sx and sy else None


def summarise_a(rows: list[dict], failed: dict, spread_variant: str, seeds: list[int]) -> dict:
    first = {r["variant"]: r for r in rows if r["seed"] == seeds[0]}
    teacher = next(iter(first.values()))["teacher_val_loss"] if first else None
    losses = [r["val_loss"] for r in rows if r["variant"] == spread_variant]
    spread = max(losses) - min(losses) if len(losses) > 1 else None
    nokd = first.get("no_kd_scratch")
    gap = nokd["val_loss"] - teacher if nokd else None
    limited = None if spread is None or gap is None else gap >= 2 * spread
    for r in rows:
        r["gap_pct"] = 100 * (r["val_loss"] / r["teacher_val_loss"] - 1)
    order = sorted(first, key=lambda k: first[k]["val_loss"])
    return {"teacher_val_loss": teacher, "variants": rows, "failed": failed,
            "spread": {"variant": spread_variant, "seeds": seeds, "val_losses": losses, "max_minus_min": spread},
            "no_kd_gap": gap, "capacity_limited": limited,
            "capacity_rule": "no_kd_scratch's held-out loss - the teacher's >= 2 x the spread variant's seed spread",
            "ordering": order}


def summarise_b(base: dict | None, students: list[dict], failed: dict, tasks: dict | None, teacher: dict) -> dict:
    for s in students:
        s["retention"] = base["val_loss"] / s["val_loss"] if base else None
        s["retention_vs_teacher"] = s["teacher_val_loss"] / s["val_loss"]
    losses = {s["name"]: s["val_loss"] for s in students} | ({"baseline": base["val_loss"]} if base else {})
    order = sorted(losses, key=losses.get)
    return {"baseline": base, "students": students, "failed": failed, "tasks": tasks, "ordering": order,
            "teacher_val_loss": students[0]["teacher_val_loss"] if students else teacher.get("val_loss"),
            "retention_rule": "baseline held-out loss / student held-out loss"}


def summarise_c(rows: list[dict], failed: dict, plan: dict, check: dict | None, steps: int) -> dict:
    rho = spearman([r["pre_val_loss"] for r in rows], [r["val_loss"] for r in rows])
    pre_rank, post_rank = _ranks([r["pre_val_loss"] for r in rows]), _ranks([r["val_loss"] for r in rows])
    for r, a, b in zip(rows, pre_rank, post_rank):
        r["pre_rank"], r["trained_rank"] = a, b
    return {"plan": {"path": plan["path"], "teacher": plan["teacher"], "held_out_tokens": plan["held_out_tokens"],
                     "seconds": plan.get("seconds"), "bench_s": plan.get("bench_s"), "rows": len(plan["candidates"])},
            "plan_check": check, "steps": steps, "candidates": rows, "failed": failed, "spearman": rho}


def read_tasks(results: Path, models: list[str], wall: float) -> dict:
    """Each model's main metric per task from `moe-pipeline eval`'s results.json, and the retention of the baseline's."""
    from eval.report import _metrics, main_metric

    data = json.loads(results.read_text())
    names = [k for k in data if not k.startswith("_")]
    table = {}
    for name in names:
        for task, res in data[name]["results"].items():
            m = _metrics(res)
            metric = main_metric(m)
            if metric:
                higher = data[name].get("higher_is_better", {}).get(task, {}).get(metric, True)
                table.setdefault(name, {})[task] = {"metric": metric, "value": m[metric][0], "stderr": m[metric][1],
                                                    "higher_is_better": higher}
    base = next((n for n in names if n.startswith("teacher_plus")), None)
    keep = {}
    for name in names:
        if base is None or name == base:
            continue
        for task, cell in table.get(name, {}).items():
            ref = table.get(base, {}).get(task)
            if ref and cell["value"] and ref["value"]:
                keep.setdefault(name, {})[task] = (cell["value"] / ref["value"] if cell["higher_is_better"]
                                                   else ref["value"] / cell["value"])
    return {"results": str(results), "models": table, "retention_vs_baseline": keep, "bench_s": round(wall, 1),
            "failed": data.get("_failed", {})}


# -- report -------------------------------------------------------------------------------------

def print_report(result: dict) -> None:
    """The tables of every part run, then part D (wall times)."""
    t = result["teacher"]
    p = result["protocol"]
    held_out = "the whole validation split" if p["eval_batches"] is None else f"{p['eval_batches']} batches"
    print(f"\n== compression study, {result['meta']['recipe']}: one teacher ({t['val_loss_protocol']:.4f} held-out, "
          f"{t.get('steps')} steps), part A {p.get('paper_steps')} student steps, budget B = {p['budget']} student "
          f"steps, KD stop {p['kd_stop']}, held-out loss on {held_out} ==")
    parts = result["parts"]
    if "A" in parts:
        report_a(parts["A"], p["seeds"])
    if "B" in parts:
        report_b(parts["B"])
    if "C" in parts:
        report_c(parts["C"])
    report_d(result["runs"], result["meta"]["total_seconds"])


def report_a(a: dict, seeds: list[int]) -> None:
    print("\nA. paper's protocol (random init, B steps)")
    print(f"{'variant':<30}{'held-out':>10}{'gap':>9}{'gap %':>8}{'stage s':>9}")
    for r in a["variants"]:
        label = r["variant"] + ("" if r["seed"] == seeds[0] else f" seed {r['seed']}")
        print(f"{label:<30}{r['val_loss']:>10.4f}{r['gap']:>+9.4f}{r['gap_pct']:>+7.1f}%"
              f"{r['student_wall_s'] or 0:>9.0f}")
    for k, v in a["failed"].items():
        print(f"{k:<30} FAILED: {v.splitlines()[0]}")
    sp = a["spread"]
    if sp["max_minus_min"] is not None:
        print(f"seed spread of {sp['variant']} over seeds {sp['seeds']}: {sp['max_minus_min']:.4f}; no-KD gap to "
              f"the teacher {a['no_kd_gap']:+.4f}: capacity-limited = {a['capacity_limited']} "
              f"(gap >= 2 x spread = {2 * sp['max_minus_min']:.4f})")
    if a["ordering"]:
        print("best to worst: " + " < ".join(a["ordering"]))


def report_b(b: dict) -> None:
    print("\nB. practical protocol (teacher init, B steps, staged KD) against the teacher + B steps")
    print(f"{'run':<14}{'layers':>7}{'experts':>16}{'held-out':>10}{'retention':>11}{'vs teacher':>12}"
          f"{'stage s':>9}")
    if b["baseline"]:
        base = b["baseline"]
        print(f"{'baseline':<14}{'all':>7}{'all':>16}{base['val_loss']:>10.4f}{1.0:>11.3f}{'':>12}"
              f"{base['wall']['stage_s'] or 0:>9.0f}")
    for s in b["students"]:
        ret = f"{s['retention']:>11.3f}" if s["retention"] is not None else f"{'-':>11}"
        print(f"{s['name']:<14}{s['layers']:>7}{s['experts']!s:>16}{s['val_loss']:>10.4f}{ret}"
              f"{s['retention_vs_teacher']:>12.3f}{s['wall']['student_stage_s'] or 0:>9.0f}")
    for k, v in b["failed"].items():
        print(f"{k:<14} FAILED: {v.splitlines()[0]}")
    print("retention = baseline held-out loss / student's; vs teacher = teacher's / student's. best to worst: "
          + " < ".join(b["ordering"]))
    if b["tasks"]:
        for name, per in b["tasks"]["models"].items():
            print(f"  {name}: " + ", ".join(f"{task} {c['metric']} {c['value']:.4f}" for task, c in per.items()))
        for name, per in b["tasks"]["retention_vs_baseline"].items():
            print(f"  {name} retention of the baseline's score: "
                  + ", ".join(f"{task} {v:.3f}" for task, v in per.items()))


def report_c(c: dict) -> None:
    print(f"\nC. plan ranking: untrained held-out loss ({c['plan']['held_out_tokens']:,} tokens) vs trained "
          f"({c['steps']} steps each)")
    print(f"{'candidate':<48}{'untrained':>10}{'trained':>9}{'ranks':>10}{'stage s':>9}")
    for r in c["candidates"]:
        mark = "" if r["matches_candidate"] else " (!)"
        print(f"{(r['name'] + mark)[:47]:<48}{r['pre_val_loss']:>10.4f}{r['val_loss']:>9.4f}"
              f"{r['pre_rank']:>5.1f}{r['trained_rank']:>5.1f}{r['wall']['student_stage_s'] or 0:>9.0f}")
    for k, v in c["failed"].items():
        print(f"{k[:47]:<48} FAILED: {v.splitlines()[0]}")
    sp = c["spearman"]
    rho = "undefined" if sp["rho"] is None else f"{sp['rho']:+.3f}"
    print(f"Spearman rho = {rho} over n = {sp['n']} ({sp['method']}"
          + (f", p = {sp['p_value']:.3g})" if sp["p_value"] is not None else ")"))
    if c["plan_check"]:
        ch = c["plan_check"]
        print(f"check: '{ch['name']}' rescored here {ch['rescored']:.5f}, in the plan {ch['plan']:.5f}")


def report_d(runs: list[dict], total_seconds: float) -> None:
    print("\nD. wall time per run (stage: DONE.json; here: measured by this call, - when reused)")
    for r in runs:
        here = "-" if r["bench_s"] is None else f"{r['bench_s']:.0f}s"
        print(f"  {r['part']} {r['name'][:44]:<45} stage {r['stage_s'] or 0:>6.0f}s  here {here}")
    print(f"  sum of stage times {sum(r['stage_s'] or 0 for r in runs) / 60:.1f} min; this call "
          f"{total_seconds / 60:.1f} min")


def save(out: Path, result: dict) -> tuple[Path, Path]:
    """compression_ablation.json and compression_ablation.png (trained held-out losses; plan vs trained)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "compression_ablation.json", out / "compression_ablation.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_c) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=80, gridspec_kw={"width_ratios": [1.4, 1]})
    plot_losses(ax_l, result)
    plot_ranking(ax_c, result["parts"].get("C"))
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return json_path, png_path


def plot_losses(ax, result: dict) -> None:
    """A bar per trained run (part A blue, B orange, C green), the teacher and the baseline as lines."""
    parts = result["parts"]
    bars, colors = [], []
    for r in parts.get("A", {}).get("variants", []):
        label = r["variant"].replace("_scratch", "") + ("" if r["seed"] == result["protocol"]["seeds"][0]
                                                          else f"\nseed {r['seed']}")
        bars.append((f"A {label}", r["val_loss"]))
        colors.append("C0")
    b = parts.get("B", {})
    for s in b.get("students", []):
        bars.append((f"B {s['name']}\n{s['experts']}", s["val_loss"]))
        colors.append("C1")
    for r in parts.get("C", {}).get("candidates", []):
        bars.append((f"C {r['name'].replace(' layers', 'L').replace('experts ', 'e')}", r["val_loss"]))
        colors.append("C2")
    if bars:
        ax.bar(range(len(bars)), [v for _, v in bars], color=colors)
        ax.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=6, rotation=60, ha="right")
        for i, (_, v) in enumerate(bars):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=6)
    teacher = result["teacher"]["val_loss_protocol"]
    ref = [teacher]
    ax.axhline(teacher, color="k", ls="--", lw=1, label=f"teacher {teacher:.3f}")
    if b.get("baseline"):
        v = b["baseline"]["val_loss"]
        ref.append(v)
        ax.axhline(v, color="C3", ls=":", lw=1.5, label=f"teacher + B steps {v:.3f}")
    vals = [v for _, v in bars] + ref
    lo, hi = min(vals), max(vals)
    ax.set_ylim(lo - 0.1 * (hi - lo + 0.05), hi + 0.1 * (hi - lo + 0.05))
    ax.set_ylabel("held-out loss (nats/token)", fontsize=8)
    ax.set_title("trained held-out loss: A paper protocol (blue), B practical (orange), C ranking (green)",
                 fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, loc="best")


def plot_ranking(ax, c: dict | None) -> None:
    """Part C's candidates: untrained against trained held-out loss, with Spearman's rho."""
    if not (c and c["candidates"]):
        ax.set_axis_off()
        ax.set_title("part C not run", fontsize=8)
        return
    xs, ys = [r["pre_val_loss"] for r in c["candidates"]], [r["val_loss"] for r in c["candidates"]]
    shown = set()
    for r, x, y in zip(c["candidates"], xs, ys):
        label = {"depth": "depth (plan's row)", "experts": "depth + pruned experts"}[r["kind"]]
        ax.scatter([x], [y], color="C2" if r["kind"] == "depth" else "C4", s=25,
                   label=None if label in shown else label)
        shown.add(label)
        ax.annotate(r["name"], (x, y), fontsize=5, xytext=(3, 2), textcoords="offset points")
    ax.legend(fontsize=7)
    rho = c["spearman"]["rho"]
    ax.set_title(f"plan vs trained ({c['steps']} steps): Spearman rho = "
                 f"{'n/a' if rho is None else f'{rho:+.2f}'}, n = {c['spearman']['n']}", fontsize=8)
    ax.set_xlabel("untrained held-out loss (plan --measure)", fontsize=8)
    ax.set_ylabel("trained held-out loss", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.margins(0.2)


def run_rows(parts: dict, teacher: dict) -> list[dict]:
    """Part D: every run's wall time."""
    rows = [{"part": "-", "name": "teacher", "stage_s": teacher.get("wall_seconds"), "bench_s": teacher.get("bench_wall_s")}]
    for r in parts.get("A", {}).get("variants", []):
        rows.append({"part": "A", "name": f"{r['variant']} seed {r['seed']}", "stage_s": r["student_wall_s"],
                     "bench_s": r["bench_wall_s"]})
    b = parts.get("B", {})
    if b.get("baseline"):
        rows.append({"part": "B", "name": "baseline (teacher + B)", "stage_s": b["baseline"]["wall"]["stage_s"],
                     "bench_s": b["baseline"]["wall"]["bench_s"]})
    for s in b.get("students", []):
        rows.append({"part": "B", "name": s["name"], "stage_s": s["wall"]["student_stage_s"],
                     "bench_s": s["wall"]["bench_s"]})
    if b.get("tasks"):
        rows.append({"part": "B", "name": "eval --tasks", "stage_s": None, "bench_s": b["tasks"]["bench_s"]})
    c = parts.get("C")
    if c:
        rows.append({"part": "C", "name": "plan --measure", "stage_s": c["plan"]["seconds"],
                     "bench_s": c["plan"]["bench_s"]})
        for r in c["candidates"]:
            rows.append({"part": "C", "name": r["name"], "stage_s": r["wall"]["student_stage_s"],
                         "bench_s": r["wall"]["bench_s"]})
    return rows


# -- dry run ------------------------------------------------------------------------------------

CLI = "moe-pipeline"


class DryRun:
    """Every run the arguments make, with its command, its state (new, partial, done) and a rough wall-time
    estimate from the finished teacher's time per step; trains nothing."""

    def __init__(self, study: Study):
        a, r = study.args, study.recipe
        teacher_run = (a.teacher_run or a.out / "teacher_run").resolve()
        study.teacher_run, study.teacher_stage = teacher_run, teacher_run / "teacher"
        self.study, self.args, self.r = study, a, r
        self.tdone = stage_done(study.teacher_stage)
        self.recipe = str(a.recipe_file)
        # seconds per teacher training step, from the finished teacher (its train time includes its evaluations)
        self.per_step = self.tdone["train_seconds"] / self.tdone["steps"] if self.tdone else None
        stop = study_recipe(a, {"kd.stop_at": a.kd_stop}).kd_stop_step()
        self.share = (stop if stop is not None else r.student.train.steps) / r.student.train.steps  # KD's share

    def est(self, steps: int, layers: int, kd_share: float) -> float:
        """A student step ~ layers/teacher layers of a teacher step, plus a third of one while the teacher runs."""
        return steps * self.per_step * (layers / self.r.model.layers + kd_share / 3) + 45 if self.per_step else 0.0

    def distill(self, run: Path, sets: dict) -> str:
        return f"{CLI} distill {self.recipe} --run-dir {run} " + " ".join(set_flags(sets))

    def teacher(self) -> list[tuple]:
        study = self.study
        if self.tdone is None:
            return [("-", "teacher", f"{CLI} teacher {self.recipe} --run-dir {study.teacher_run}", "new",
                     self.r.teacher.train.steps * 2.7)]
        return [("-", "teacher", f"reuse {study.teacher_stage} (held-out {self.tdone['val_loss']:.4f})", "done", 0)]

    def part_a(self) -> list[tuple]:
        a, r, lines = self.args, self.r, []
        runs = paper_protocol(a, r)
        for name, seed in paper_runs(a):
            kd_share = 0.0 if name == "no_kd_scratch" else (1.0 if name == "kd_all_scratch" else 0.6)
            run = runs.run_dir(name, seed)
            lines.append(("A", f"{name} seed {seed}", self.distill(run, runs.overrides(name, seed,
                                                                                      self.study.teacher_stage)),
                          _status(run / "student"), self.est(a.paper_steps, r.student.layers, kd_share)))
        return lines

    def part_b(self) -> list[tuple]:
        a, r, study = self.args, self.r, self.study
        run = baseline_dir(study)
        lines = [("B", "baseline", f"worker: load {study.teacher_stage} weights, train_model into {run} with "
                  + " ".join(set_flags(baseline_sets(study))), _status(run / "teacher"),
                  a.budget * (self.per_step or 0) + 45 * bool(self.per_step))]
        if r.student.layer_selection == "importance":  # the kept layers' experts need the plan's scores
            variants = []
            lines.append(("B", "students", "full and pruned: decided once the plan's importance scores exist", "new",
                          (1 + len(a.fractions)) * self.est(a.budget, r.student.layers, self.share)))
        else:
            variants = practical_variants(study)
        for name, extra in variants:
            run = a.out / "practical" / f"{name}_s{a.budget}"
            lines.append(("B", name, self.distill(run, study.student_sets(a.budget, a.evals, extra)),
                          _status(run / "student"), self.est(a.budget, r.student.layers, self.share)))
        if a.tasks:
            lines.append(("B", "eval", f"{CLI} eval <teacher, baseline, students> --tasks {a.tasks}", "new", 0))
        return lines

    def part_c(self) -> list[tuple]:
        a, r, study = self.args, self.r, self.study
        for path in (a.out / "plan" / "measure.json", study.teacher_run / "plan" / "measure.json"):
            if self.tdone and plan_file_ok(study, path):
                plan = {**json.loads(path.read_text()), "path": str(path)}
                break
        else:
            cmd = (f"{CLI} plan {self.recipe} --measure --run-dir {study.teacher_run} --json "
                   f"--blocks {a.plan_blocks} --out {a.out / 'plan'}")
            return [("C", "plan", cmd, "new", 90),
                    ("C", f"{a.candidates} candidates",
                     f"chosen from the plan's table once it exists, {a.candidate_steps} steps each", "new",
                     a.candidates * self.est(a.candidate_steps, r.student.layers, self.share))]
        lines = [("C", "plan", f"reuse {path}", "done", 0)]
        for c in choose_candidates(plan, study, a.candidates):
            run = a.out / "ranking" / f"{c['slug']}_s{a.candidate_steps}"
            lines.append(("C", c["name"],
                          self.distill(run, study.student_sets(a.candidate_steps, 1, candidate_overrides(c))),
                          _status(run / "student"), self.est(a.candidate_steps, c["layers"], self.share)))
        return lines

    def print(self, lines: list[tuple]) -> None:
        total = 0.0
        print(f"dry run: {len(lines)} runs under {self.args.out} (recipe {self.recipe}); nothing is trained")
        for part, name, cmd, state, seconds in lines:
            todo = seconds if state != "done" else 0
            total += todo
            print(f"[{part}] {name} ({state}{f', ~{todo / 60:.0f} min' if todo else ''})\n    {cmd}")
        if self.per_step:
            print(f"estimated wall time of what is left: {total / 3600:.1f} h on this machine alone "
                  f"(from the teacher's {self.per_step:.2f} s per training step; a KD step adds about a third of one)")
        else:
            print("no finished teacher yet: no wall-time estimate (the teacher's own time per step sets it)")


def dry_run(study: Study) -> int:
    """Every run the arguments make, with its overrides and state, and a rough wall-time estimate; trains nothing."""
    d = DryRun(study)
    lines = d.teacher()
    for part in ("A", "B", "C"):
        if part in study.args.parts:
            lines += getattr(d, f"part_{part.lower()}")()
    d.print(lines)
    return 0


# -- the baseline's worker (a child process: DeepSpeed's process group is one per process) -------------------

def continue_teacher(request_path: Path) -> int:
    """Train the finished teacher `source` for exactly `teacher.train.steps` more steps into `run_dir`'s teacher
    stage: its final weights, a fresh optimizer, the recipe's warmup and cosine over those steps. Resumes from the
    stage's own checkpoints; a finished stage is left alone."""
    req = json.loads(Path(request_path).read_text())
    from pipeline import data as data_lib
    from pipeline import dist
    from pipeline.artifacts import TOKENIZER
    from pipeline.build import build_model, meta_counts, teacher_config
    from pipeline.recipe import RecipeError
    from pipeline.runs import RunDir, check_world_size
    from pipeline.teacher import STAGE, check_loadable, prepare, write_stage_files
    from pipeline.train import train_model
    from pipeline.weights import load_weights, save_weights

    t0 = time.time()
    recipe = _load(Path(req["recipe"]), req["overrides"])
    source, run = Path(req["source"]).resolve(), RunDir(Path(req["run_dir"]))
    run.check_recipe(recipe)
    if run.done(STAGE):
        print(f"[baseline] already done: {run.stage(STAGE)}", flush=True)
        return 0
    source_done = stage_done(source)
    if source_done is None:
        raise SystemExit(f"{source}/DONE.json is missing: not a finished teacher stage")
    check_loadable(recipe, source)  # the network the recipe describes
    ranks = dist.init()
    prepared = prepare(recipe, ranks)
    if data_lib.load_tokenizer(source / TOKENIZER).get_vocab() != prepared.tokenizer.get_vocab():
        raise RecipeError("data.tokenizer", recipe.data.tokenizer, f"the tokenizer of {source}")
    run.write_recipe(recipe)
    work = run.start(STAGE)
    check_world_size(work, ranks)
    cfg = teacher_config(recipe)
    model = build_model(cfg, ranks.world, recipe.distributed.ep_size, groups=False)
    load_weights(model, source)  # replaced by the stage's own checkpoint when resuming
    train = data_lib.PackedTokens(prepared.train, recipe.data.seq_len, prepared.eod_id)
    val = data_lib.PackedTokens(prepared.val, recipe.data.seq_len, prepared.eod_id)
    summary = train_model(model, recipe.teacher.train, train, val, run, STAGE, work, recipe.seed, ranks,
                          monitor=recipe.monitor, job=f"{recipe.name}-baseline")
    save_weights(model, work, {"stage": STAGE, "recipe": recipe.name})
    write_stage_files(work, cfg, prepared)
    info = {"inputs": {"recipe_sha256": run.recipe_sha256(), "data_cache": prepared.cache_dir.name,
                       "teacher": str(source)},
            **summary, "continued_from": str(source), "continued_from_steps": source_done["steps"],
            "params": meta_counts(cfg), "world_size": ranks.world, "wall_seconds": round(time.time() - t0, 1)}
    run.finish(STAGE, info)
    print(f"[baseline] done in {info['wall_seconds']:.0f}s: validation loss {summary['val_loss']:.4f} after "
          f"{summary['steps']} more steps -> {run.stage(STAGE)}", flush=True)
    return 0


# -- main ---------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=RECIPE, help=f"the recipe (default {RECIPE})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="a recipe override for every run (the resolved recipe is written to OUT/recipe.yaml)")
    p.add_argument("--out", type=Path, default=ROOT / "research" / "results" / "compression_study",
                   help="JSON, PNG, logs and the runs (default research/results/compression_study)")
    p.add_argument("--teacher-run", type=Path, default=None,
                   help="a finished teacher run to reuse (holds teacher/DONE.json); default: train one into OUT")
    p.add_argument("--paper-out", type=Path, default=None,
                   help="an earlier `kd_ablation.py --out` whose finished part A runs (same recipe, budget, seeds, "
                        "teacher: checked) are reused; only read, a run missing there is reported, not trained "
                        "(default: part A trains into OUT/paper)")
    p.add_argument("--parts", nargs="+", choices=["A", "B", "C"], default=["A", "B", "C"])
    p.add_argument("--budget", type=int, default=None, help="B, the steps of parts B and C's students and of the "
                   "baseline (default: student.train.steps)")
    p.add_argument("--paper-steps", type=int, default=None, help="part A's student steps (default: "
                   "teacher.train.steps, the teacher's token budget at the same batch)")
    p.add_argument("--candidate-steps", type=int, default=None, help="part C's steps per candidate (default B/4)")
    p.add_argument("--candidates", type=int, default=8, help="part C's candidates to train (default 8)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="part A's seeds (default: the recipe's and the next); B and C use the first")
    p.add_argument("--spread-variant", choices=PAPER_VARIANTS, default="no_kd_scratch",
                   help="the part A variant trained with every seed (default no_kd_scratch)")
    p.add_argument("--kd-stop", default="60%", help='kd.stop_at of parts B and C (default "60%%", part A\'s)')
    p.add_argument("--expert-selection", choices=EXPERT_RULES, default="saliency",
                   help="which experts part B's pruned students keep (default saliency)")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                   help="part B: experts kept per layer (default 0.75 0.5)")
    p.add_argument("--evals", type=int, default=3, help="held-out evaluations per part A/B run (curve points)")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="held-out micro-batches per evaluation (default: the whole validation split)")
    p.add_argument("--plan-blocks", type=int, default=128,
                   help="held-out blocks the plan scores on (default 128: twice the plan's own, less noise for a "
                        "ranking; the shared small teacher's plan used 128)")
    p.add_argument("--tasks", default=None,
                   help="part B: also run `moe-pipeline eval` on these comma-separated tasks ('bundled': its default)")
    p.add_argument("--tasks-limit", type=float, default=None, help="documents per task (eval --limit)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per CLI command (default: none)")
    p.add_argument("--dry-run", action="store_true", help="print every run and its overrides; train nothing")
    p.add_argument("--baseline-worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None):
    """The flags, resolved against the recipe (its seeds and steps fill the defaults) and checked; with --set, the
    resolved recipe written to OUT/recipe.yaml, which every run then uses."""
    p = parser()
    args = p.parse_args(argv)
    if args.baseline_worker is not None:
        return args
    args.out = args.out.resolve()
    args.paper_reuse_only = args.paper_out is not None
    args.paper_out = (args.paper_out or args.out / "paper").resolve()
    base = _recipe_path(args.recipe)
    recipe = _load(base, args.overrides)  # errors name the key, before anything runs
    args.recipe_base = args.recipe_file = base
    if args.overrides:
        args.recipe_file = args.out / "recipe.yaml"
        if not args.dry_run:
            from pipeline.recipe import dump_recipe

            args.out.mkdir(parents=True, exist_ok=True)
            text = dump_recipe(recipe)
            if not args.recipe_file.is_file() or args.recipe_file.read_text() != text:
                args.recipe_file.write_text(text)
    args.seeds = args.seeds or [recipe.seed, recipe.seed + 1]
    args.budget = args.budget or recipe.student.train.steps
    args.paper_steps = args.paper_steps or recipe.teacher.train.steps
    args.candidate_steps = args.candidate_steps or max(1, args.budget // 4)
    check_protocol(p, args, recipe)
    args.eval_batches_yaml = "null" if args.eval_batches is None else args.eval_batches
    if args.teacher_run is not None:
        args.teacher_run = args.teacher_run.resolve()
    return args


def check_protocol(p: argparse.ArgumentParser, args, recipe) -> None:
    """Exit 2 (argparse's error) on flags that make no protocol: non-positive budgets, a part A that would not be
    kd_ablation's, held-out blocks that differ between the parts."""
    if min(args.budget, args.paper_steps, args.candidate_steps, args.evals) < 1 or args.candidates < 2:
        p.error("--budget, --paper-steps, --candidate-steps and --evals must be positive, --candidates at least 2")
    if "A" in args.parts and args.kd_stop != "60%":
        p.error("--kd-stop: part A runs kd_ablation's staged_scratch, whose stop is 60%; drop A or keep 60%")
    if not all(0 < f < 1 for f in args.fractions):
        p.error("--fractions: shares in (0, 1)")
    if "A" in args.parts and args.eval_batches != recipe.student.train.eval_batches:
        p.error(f"--eval-batches {args.eval_batches}: part A (kd_ablation) evaluates on the recipe's "
                f"student.train.eval_batches ({recipe.student.train.eval_batches}); make them match (--set "
                f"student.train.eval_batches=...) so every part scores the same held-out blocks")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.baseline_worker is not None:
        return continue_teacher(args.baseline_worker)
    study = Study(args)
    if args.dry_run:
        return dry_run(study)
    study.runs_total = sum({"A": len(paper_runs(args)), "B": 2 + len(args.fractions) + bool(args.tasks),
                            "C": 1 + args.candidates}[p] for p in args.parts)
    study.load_teacher()
    parts, failed = {}, False
    for part in ("A", "B", "C"):
        if part in args.parts:
            print(f"\n== part {part} ==", flush=True)
            parts[part] = PARTS[part](study)
            failed |= bool(parts[part]["failed"])
    total = time.perf_counter() - study.t0
    result = result_of(study, parts, total, sys.argv[1:] if argv is None else argv)
    print_report(result)
    json_path, png_path = save(args.out, result)
    print(f"\nwrote {json_path} and {png_path}; this call {total / 60:.1f} min")
    return 1 if failed else 0


def result_of(study: Study, parts: dict, total: float, argv: list[str]) -> dict:
    """compression_ablation.json: the machine, the protocol, the teacher, every part's summary, part D's rows."""
    import torch

    args, t = study.args, study.teacher_done
    teacher = {k: t.get(k) for k in ("val_loss", "steps", "train_seconds", "wall_seconds", "val_unigram_entropy",
                                     "params", "bench_wall_s", "reused")}
    teacher["run_dir"] = str(study.teacher_run)
    # the teacher as the students' stage scores it (the protocol's held-out blocks); its own DONE.json's otherwise
    rows = [*parts.get("B", {}).get("students", []), *parts.get("C", {}).get("candidates", []),
            *parts.get("A", {}).get("variants", [])]
    teacher["val_loss_protocol"] = rows[0]["teacher_val_loss"] if rows else t.get("val_loss")
    result = {
        "meta": {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                 "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "recipe": args.recipe, "recipe_file": str(args.recipe_file), "overrides": args.overrides,
                 "argv": argv, "total_seconds": round(total, 1)},
        "protocol": {"budget": args.budget, "paper_steps": args.paper_steps, "candidate_steps": args.candidate_steps,
                     "candidates": args.candidates, "seeds": args.seeds, "spread_variant": args.spread_variant,
                     "kd_stop": args.kd_stop, "expert_selection": args.expert_selection, "fractions": args.fractions,
                     "evals": args.evals, "eval_batches": args.eval_batches, "plan_blocks": args.plan_blocks,
                     "metric": "held-out loss (nats/token)"},
        "teacher": teacher,
        "parts": parts,
    }
    result["runs"] = run_rows(parts, teacher)
    return result


if __name__ == "__main__":
    sys.exit(main())
