"""KD ablation on the tiny recipe: does staged KD (Mixture-of-Students) beat no KD and KD all the way?

    .venv/bin/python research/kd_ablation.py                      # ~30-40 minutes on 2 CPU cores
    .venv/bin/python research/kd_ablation.py --steps 20 --teacher-steps 20 --out /tmp/kd   # a quick check
    .venv/bin/python research/kd_ablation.py --teacher-run runs/tiny   # reuse a finished teacher run
    .venv/bin/python research/kd_ablation.py --recipe recipes/small.yaml --seeds 1234 1235 \
        --variants no_kd_scratch kd_all_scratch staged_scratch     # the paper's protocol, seed-to-seed spread

The paper's small-scale claim (DeepSpeed-MoE, "Mixture-of-Students and staged KD"): a 21-layer
student distilled with KD for the first ~60% of its steps and then on the LM loss alone ends at
least as good as one distilled all the way, which beats one trained without KD, and lands within
a few percent of its teacher. Here with our own code path (`moe-pipeline`), on `recipes/tiny.yaml`:

  1. ONE teacher: `moe-pipeline teacher recipes/tiny.yaml --run-dir <out>/teacher_run` (skipped when
     that run is finished; or `--teacher-run DIR` names an existing finished run instead).
  2. For each variant a run directory `<out>/runs/<variant>_s<steps>` with its own resolved recipe,
     made by `moe-pipeline distill recipes/tiny.yaml --run-dir ... --set teacher.load=<teacher>`:
     the teacher stage links the finished teacher's weights (and evaluates it), the student stage
     then trains the student. The variants (everything else is the recipe's):

       no_kd_scratch              student.init=random, kd.beta=0 (no KD; the teacher never runs)
       kd_all_scratch             student.init=random, kd.stop_at=null (KD all the way)
       staged_scratch             student.init=random, kd.stop_at="60%" (the paper's MoS)
       staged_teacher_paper       student.init=teacher, layer_selection=paper, kd.stop_at="60%"
       staged_teacher_importance  student.init=teacher, layer_selection=importance, kd.stop_at="60%"

All variants train the same number of student steps (`student.train.steps`, or `--steps`) on the
same data order (the recipe's seed), and the three from-scratch ones start from the same random
weights (seed + 1): they differ only in the KD schedule. Each validates on the whole held-out split
`--evals` times (`student.train.eval_every = steps // evals`), so it logs a short curve.

A finished variant (its `student/DONE.json` exists) is not trained again: a killed run, restarted
with the same arguments, resumes (an interrupted stage resumes from its last DeepSpeed checkpoint).

Read back: the final held-out loss (`val_loss`) and the teacher's (`teacher_val_loss`) from each
`student/DONE.json`, the validation curve from `metrics.jsonl` (records with stage "student" and
`val_loss`), the training CE/KD curves likewise. Results: one table on stdout, `kd_ablation.json` and
`kd_ablation.png` (final held-out loss per variant with the teacher as a line; validation curves)
under `--out` (default `research/results/kd_ablation/`, git-ignored, which also holds the runs). The runs and
how a variant is read back are research/common.py's (`PaperRuns`, `ensure_teacher`), shared with the compression
study's part A.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: research.common, pipeline/
from research.common import ROOT, VARIANTS, PaperRuns, ensure_teacher  # noqa: E402

RECIPE = "recipes/tiny.yaml"


# -- report --------------------------------------------------------------------------------------

def print_table(teacher: dict, rows: list[dict], failed: dict[str, str], steps: int, recipe: str = RECIPE) -> None:
    print()
    print(f"== KD ablation, {recipe}: {steps} student steps each, one teacher, "
          "held-out loss on the whole validation split (nats/token) ==")
    print(f"{'variant':<27} {'setup':<41} {'held-out':>8} {'gap':>8} {'gap %':>6} {'stage s':>7} {'train s':>7} "
          f"{'tok/s KD':>8} {'tok/s LM':>8}")
    print(f"{'teacher':<27} {'PR-MoE teacher, ' + str(teacher.get('steps')) + ' steps':<41} "
          f"{teacher['val_loss']:>8.4f} {'':>8} {'':>6} {teacher.get('wall_seconds', float('nan')):>7.0f} "
          f"{teacher.get('train_seconds', float('nan')):>7.0f}")
    for r in rows:
        tok = [f"{v:>8.0f}" if v else f"{'-':>8}" for v in (r["tokens_per_s_kd"], r["tokens_per_s_lm"])]
        label = r["variant"] if r.get("seed") in (None, teacher.get("seed")) else f"{r['variant']} seed {r['seed']}"
        print(f"{label:<27} {r['description']:<41} {r['val_loss']:>8.4f} {r['gap']:>+8.4f} {r['gap_pct']:>+5.1f}% "
              f"{r['student_wall_s']:>7.0f} {r['student_train_s']:>7.0f} {tok[0]} {tok[1]}")
    for name, err in failed.items():
        print(f"{name:<27} FAILED: {err.splitlines()[0]}")
    if rows:
        best = min(rows, key=lambda r: r["val_loss"])
        print(f"best: {best['variant']} ({best['val_loss']:.4f}). gap = student - teacher held-out loss; "
              "'stage s' = the student stage's wall time (teacher evaluation, layer choice, training, evaluations, "
              "checkpoints), 'train s' = its training loop; tok/s KD / LM = median training tokens/s of the logged "
              "windows with the teacher running (beta > 0) / without it")
        for name in dict.fromkeys(r["variant"] for r in rows):
            losses = [r["val_loss"] for r in rows if r["variant"] == name]
            if len(losses) > 1:
                print(f"{name}: {len(losses)} seeds, held-out loss {statistics.mean(losses):.4f} mean, "
                      f"spread (max - min) {max(losses) - min(losses):.4f}")
        by = {r["variant"]: r["val_loss"] for r in rows if r.get("seed") in (None, teacher.get("seed"))}
        if all(k in by for k in ("no_kd_scratch", "kd_all_scratch", "staged_scratch")):
            order = sorted(("no_kd_scratch", "kd_all_scratch", "staged_scratch"), key=by.get)
            print("from scratch, best to worst: " + " < ".join(f"{k} ({by[k]:.4f})" for k in order)
                  + "   (paper's shape: staged <= KD all the way <= no KD)")


def save(out: Path, result: dict) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "kd_ablation.json", out / "kd_ablation.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, teacher = result["variants"], result["teacher"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
    ax = axes[0]
    if rows:
        losses = [r["val_loss"] for r in rows]
        ax.bar(range(len(rows)), losses, color=[f"C{i}" for i in range(len(rows))])
        for i, v in enumerate(losses):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(teacher["val_loss"], color="k", ls="--", lw=1, label=f"teacher {teacher['val_loss']:.3f}")
        seed = teacher.get("seed")
        ax.set_xticks(range(len(rows)), ["\n".join(r["variant"].rsplit("_", 1))
                                         + ("" if r.get("seed") in (None, seed) else f"\nseed {r['seed']}")
                                         for r in rows], fontsize=7)
        lo = min(losses + [teacher["val_loss"]])
        hi = max(losses + [teacher["val_loss"]])
        ax.set_ylim(lo - 0.15 * (hi - lo + 0.05), hi + 0.15 * (hi - lo + 0.05))
        ax.legend(fontsize=8)
    ax.set_ylabel("held-out loss (nats/token)", fontsize=9)
    ax.set_title(f"final held-out loss, {result['steps']} student steps", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax = axes[1]
    for i, r in enumerate(rows):
        if r["val_curve"]:
            steps, vals = zip(*r["val_curve"])
            ax.plot(steps, vals, "o-", color=f"C{i}", ms=3, label=r["variant"])
    ax.axhline(teacher["val_loss"], color="k", ls="--", lw=1, label="teacher")
    stops = {r["kd_stop_step"] for r in rows if r.get("kd_stop_step") is not None}
    for s in stops:
        ax.axvline(s, color="gray", ls=":", lw=1)
        ax.text(s, ax.get_ylim()[1], " KD off", fontsize=7, va="top", color="gray")
    ax.set_xlabel("student step", fontsize=9)
    ax.set_title("held-out loss during student training", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return json_path, png_path


def parse_args(argv: list[str] | None):
    """The flags, with the recipe's values the runs derive from (seed, steps, warmups) added to them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "research" / "results" / "kd_ablation",
                   help="JSON, PNG, logs and the run directories (default research/results/kd_ablation)")
    p.add_argument("--steps", type=int, default=None, help="student steps per variant (default: the recipe's)")
    p.add_argument("--teacher-run", type=Path, default=None,
                   help="a finished teacher run directory to reuse (holds teacher/DONE.json)")
    p.add_argument("--teacher-steps", type=int, default=None,
                   help="teacher steps when training it here (default: the recipe's)")
    p.add_argument("--evals", type=int, default=3, help="held-out evaluations per student run (curve points)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--timeout", type=float, default=None, help="seconds per CLI command (default: none)")
    p.add_argument("--recipe", default=RECIPE, help=f"the recipe (default {RECIPE})")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="student seeds per variant (data order and init; default: the recipe's seed)")
    args = p.parse_args(argv)
    os.chdir(ROOT)
    from pipeline.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    args.recipe_seed = recipe.seed
    args.seeds = args.seeds or [recipe.seed]
    args.recipe_student_steps = recipe.student.train.steps
    args.recipe_student_warmup = recipe.student.train.warmup_steps
    args.recipe_teacher_steps = recipe.teacher.train.steps
    args.recipe_teacher_warmup = recipe.teacher.train.warmup_steps
    args.steps = args.steps or args.recipe_student_steps
    if args.steps < 1 or args.evals < 1:
        p.error("--steps and --evals must be positive")
    args.out = args.out.resolve()
    return args, recipe


def main(argv: list[str] | None = None) -> int:
    args, recipe = parse_args(argv)
    t0 = time.perf_counter()
    teacher_run, teacher = ensure_teacher(args.recipe, args.out, args.timeout, args.teacher_run, args.teacher_steps,
                                          recipe.teacher.train)
    runs = PaperRuns(recipe=args.recipe, out=args.out, steps=args.steps, evals=args.evals, timeout=args.timeout,
                     recipe_seed=args.recipe_seed, recipe_student_steps=args.recipe_student_steps,
                     recipe_student_warmup=args.recipe_student_warmup)
    rows, failed = [], {}
    for name in args.variants:
        for seed in args.seeds:
            try:
                rows.append(runs.run(name, teacher_run, seed))
            except RuntimeError as err:  # report it and go on with the others
                print(f"[{name} seed {seed}] FAILED: {err}", file=sys.stderr, flush=True)
                failed[f"{name} seed {seed}"] = str(err)

    total = time.perf_counter() - t0
    import torch

    teacher_info = {k: teacher.get(k) for k in ("val_loss", "steps", "train_seconds", "wall_seconds",
                                                 "val_unigram_entropy", "params", "bench_wall_s", "reused")}
    teacher_info["run_dir"] = str(teacher_run)
    teacher_info["seed"] = recipe.seed
    result = {
        "meta": {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                 "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "recipe": args.recipe, "seed": recipe.seed,
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "total_seconds": round(total, 1)},
        "steps": args.steps,
        "teacher": teacher_info,
        "variants": rows,
        "failed": failed,
    }
    print_table(teacher_info, rows, failed, args.steps, args.recipe)
    json_path, png_path = save(args.out, result)
    print(f"\nwrote {json_path} and {png_path}; total {total:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
