"""Zero-shot eval batch jobs: many models x many tasks through lm-evaluation-harness, resumable.

    moe-pipeline eval runs/tiny                                  # teacher and student, the bundled tasks
    moe-pipeline eval runs/tiny other/student --tasks tiny_lastword,piqa --batch-size 32 --out evals/cmp
    moe-pipeline eval runs/tiny --include-path my_tasks/ --tasks my_task --limit 200
    moe-pipeline eval runs/tiny --nproc 2                        # expert parallel over 2 ranks

For every (model, task) cell `lm_eval.simple_evaluate` runs the task zero-shot on our adapter
(`eval.adapter.MoEPipelineLM`) and the cell's result is written at once to
`OUT/cells/<model>/<task>.json` (lm-eval's result schema for that one task, plus wall time), so a
killed job restarted with the same arguments skips what is done. Tasks: any lm-eval task or
group name, the `--include-path` folders' YAMLs, and the bundled offline tasks (`eval.tasks`,
always on the search path). A task whose data cannot be loaded (offline and not cached, say) is
reported in one line naming it and why, and the other tasks still run.

Outputs, rewritten after every cell from all cells on disk:
  results.json   {model name: lm-eval's result dict (results, versions, n-shot, higher_is_better,
                  n-samples, configs, config)} plus "_retention" and "_failed";
  results.md     models as rows, tasks as columns (the main metric, ± lm-eval's stderr), then each
                 student's retention of its teacher's score in % (higher-is-better metrics: student
                 / teacher; lower-is-better ones such as perplexity or bits per byte: teacher /
                 student), then every metric of every task;
  results.png    one panel per task, a bar per model with its stderr.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.files import atomic_write_text

# the metric a task's column shows: the first of these the task reports, else its first metric
MAIN_METRICS = ("acc", "exact_match", "bits_per_byte", "word_perplexity", "perplexity", "acc_norm", "f1", "mcc")


@dataclass
class Cell:
    model: str
    task: str
    path: Path


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "__", name).strip("_") or "model"


def task_manager(include_path: list[str] | None):
    """lm-eval's TaskManager over its own tasks, the bundled ones and `include_path` folders."""
    from lm_eval.tasks import TaskManager

    from eval.tasks import bundled_task_dir

    paths = [str(bundled_task_dir())] + [str(Path(p).resolve()) for p in include_path or []]
    for p in paths:
        if not Path(p).is_dir():
            raise FileNotFoundError(f"--include-path {p}: not a directory of task YAMLs")
    return TaskManager(include_path=paths)


def check_tasks(tm, tasks: list[str]) -> tuple[list[str], dict[str, str]]:
    """(tasks that load, {task: one-line reason} for those that do not), loading each task's data once."""
    ok, failed = [], {}
    known = set(tm.all_tasks)
    for task in tasks:
        if task not in known:
            failed[task] = "unknown task (not in lm-eval, the bundled tasks or --include-path); `lm-eval ls tasks` lists them"
            continue
        try:
            tm.load_task_or_group([task])
        except Exception as err:  # noqa: BLE001 - any loader error: report it, go on with the others
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
            why = f"its data could not be loaded{' offline (not in the local cache)' if offline else ''}: "
            failed[task] = why + f"{type(err).__name__}: {first[:200]}"
        else:
            ok.append(task)
    return ok, failed


def _json_default(obj):
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(obj)


def run_cell(lm, task: str, tm, limit: float | None, bootstrap_iters: int) -> dict:
    import lm_eval

    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, limit=limit, num_fewshot=0,
                                  bootstrap_iters=bootstrap_iters, log_samples=False, verbosity="WARNING")
    keep = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
    out = {k: res[k] for k in keep if k in res}
    out["config"] = {k: v for k, v in res.get("config", {}).items() if k not in ("model",)}
    out["config"]["model"] = "moe-pipeline"
    out["wall_seconds"] = round(time.perf_counter() - t0, 2)
    out["limit"] = limit
    return json.loads(json.dumps(out, default=_json_default))


def run_eval(models: list[str], tasks: list[str] | None, out: Path, batch_size: int = 16, limit: float | None = None,
             include_path: list[str] | None = None, dtype: str | None = None, ep_size: int | None = None,
             bootstrap_iters: int = 1000) -> dict:
    """Evaluate every model on every task, resuming from cells already on disk. Collective over ranks."""
    from tqdm import tqdm

    from eval.adapter import MoEPipelineLM
    from eval.models import resolve
    from eval.tasks import BUNDLED_TASKS
    from pipeline import dist

    ranks = dist.init()
    refs = [ref for spec in models for ref in resolve(spec)]
    names = _unique([r.name for r in refs])
    tasks = list(tasks or BUNDLED_TASKS)
    out = Path(out)
    tm = task_manager(include_path)
    ok_tasks, failed = check_tasks(tm, tasks)
    if ranks.rank == 0:
        for task, why in failed.items():
            print(f"[eval] {task}: skipped: {why}", flush=True)
    cells = [Cell(name, task, out / "cells" / slug(name) / f"{slug(task)}.json")
             for name in names for task in ok_tasks]
    pending = [c for c in cells if not c.path.is_file()]  # decided before any rank writes
    dist.barrier()
    if ranks.rank == 0:
        print(f"[eval] {len(names)} model(s) x {len(ok_tasks)} task(s): {len(cells) - len(pending)} done before, "
              f"{len(pending)} to run -> {out}", flush=True)
    bar = tqdm(total=len(cells), initial=len(cells) - len(pending), desc="eval cells", unit="cell",
               disable=ranks.rank != 0)
    os.environ["MOE_EVAL_QUIET"] = "1"  # one bar for the whole job, not one per request type
    for ref, name in zip(refs, names):
        todo = [c for c in pending if c.model == name]
        if not todo:
            continue
        lm = MoEPipelineLM(path=str(ref.path), batch_size=batch_size, dtype=dtype, ep_size=ep_size)
        lm.ref = type(ref)(name, ref.path, ref.stage, ref.run)
        for cell in todo:
            bar.set_postfix_str(f"{name} {cell.task}")
            try:
                result = run_cell(lm, cell.task, tm, limit, bootstrap_iters)
            except Exception as err:  # noqa: BLE001 - one cell failing does not stop the job
                first = (str(err).strip().splitlines() or [""])[0]
                failed[f"{name}:{cell.task}"] = f"{type(err).__name__}: {first[:200]}"
                if ranks.rank == 0:
                    print(f"\n[eval] {name} on {cell.task} failed: {type(err).__name__}: {first[:200]}", flush=True)
                bar.update(1)
                continue
            if ranks.rank == 0:
                result["model"] = {"name": name, "stage": ref.stage, "run": ref.run, **lm.get_model_info()}
                cell.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(cell.path, json.dumps(result, indent=1) + "\n")
                write_reports(out, names, refs, ok_tasks, failed)
            bar.update(1)
        del lm
    bar.close()
    summary = {}
    if ranks.rank == 0:
        summary = write_reports(out, names, refs, ok_tasks, failed)
        print(f"[eval] results: {out / 'results.md'}, {out / 'results.json'}, chart {out / 'results.png'}", flush=True)
    dist.barrier()
    return summary


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


# -- reports ---------------------------------------------------------------------------------------

def _metrics(task_result: dict) -> dict[str, tuple[float, float | None]]:
    """{'acc': (value, stderr)} from lm-eval's 'acc,none' / 'acc_stderr,none' keys."""
    out = {}
    for key, value in task_result.items():
        if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
            continue
        metric, flt = key.split(",", 1)
        err = task_result.get(f"{metric}_stderr,{flt}")
        out[metric if flt == "none" else f"{metric} ({flt})"] = (
            float(value), float(err) if isinstance(err, (int, float)) and math.isfinite(err) else None)
    return out


def main_metric(metrics: dict) -> str | None:
    for m in MAIN_METRICS:
        if m in metrics:
            return m
    return next(iter(metrics), None)


def collect(out: Path, names: list[str], tasks: list[str]) -> dict:
    """{model: {task: cell dict}} for the cells on disk."""
    table: dict[str, dict[str, dict]] = {}
    for name in names:
        for task in tasks:
            path = out / "cells" / slug(name) / f"{slug(task)}.json"
            if path.is_file():
                table.setdefault(name, {})[task] = json.loads(path.read_text())
    return table


def retention(table: dict, refs, names: list[str], tasks: list[str]) -> dict:
    """{student name: {task: % of its run's teacher's main metric}} for students whose teacher was evaluated."""
    by_run = {(r.run, r.stage): n for r, n in zip(refs, names) if r.run}
    out: dict[str, dict[str, float]] = {}
    for (run, stage), student in by_run.items():
        teacher = by_run.get((run, "teacher"))
        if stage != "student" or teacher is None:
            continue
        for task in tasks:
            s_cell, t_cell = table.get(student, {}).get(task), table.get(teacher, {}).get(task)
            if not s_cell or not t_cell:
                continue
            s_m, t_m = _metrics(s_cell["results"].get(task, {})), _metrics(t_cell["results"].get(task, {}))
            metric = main_metric(t_m)
            if metric is None or metric not in s_m:
                continue
            higher = t_cell.get("higher_is_better", {}).get(task, {}).get(metric, True)
            s, t = s_m[metric][0], t_m[metric][0]
            if higher and t:
                out.setdefault(student, {})[task] = 100 * s / t
            elif not higher and s:
                out.setdefault(student, {})[task] = 100 * t / s
    return out


def write_reports(out: Path, names: list[str], refs, tasks: list[str], failed: dict[str, str]) -> dict:
    table = collect(out, names, tasks)
    keep = retention(table, refs, names, tasks)
    merged = {}
    for name, cells in table.items():
        res = {"results": {}, "versions": {}, "n-shot": {}, "higher_is_better": {}, "n-samples": {}, "configs": {}}
        for cell in cells.values():
            for k in res:
                res[k].update(cell.get(k, {}))
            res["config"] = {**cell.get("config", {}), "model_args": str(cell.get("model", {}).get("path", ""))}
            res["model"] = cell.get("model")
        merged[name] = res
    summary = {**merged, "_retention": keep, "_failed": failed}
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "results.md", markdown(table, keep, names, tasks, failed))
    plot(out / "results.png", table, names, tasks)
    return summary


def _fmt(value: float, err: float | None) -> str:
    digits = 4 if abs(value) < 10 else 2
    return f"{value:.{digits}f}" + (f" ± {err:.{digits}f}" if err is not None else "")


def markdown(table: dict, keep: dict, names: list[str], tasks: list[str], failed: dict[str, str]) -> str:
    rows = [n for n in names if n in table]
    done_tasks = [t for t in tasks if any(t in table[n] for n in rows)]
    main = {}
    for t in done_tasks:
        first = next(table[n][t] for n in rows if t in table[n])
        main[t] = main_metric(_metrics(first["results"].get(t, {})))
    lines = ["# Zero-shot evaluation (lm-evaluation-harness)", ""]
    lines += ["| model | " + " | ".join(f"{t} ({main[t]})" for t in done_tasks) + " |",
              "|---|" + "---:|" * len(done_tasks)]
    for n in rows:
        vals = []
        for t in done_tasks:
            m = _metrics(table[n][t]["results"].get(t, {})) if t in table[n] else {}
            vals.append(_fmt(*m[main[t]]) if main[t] in m else "–")
        lines.append(f"| {n} | " + " | ".join(vals) + " |")
    if keep:
        lines += ["", "Student's retention of its teacher's score (%; for lower-is-better metrics teacher / student):", "",
                  "| student | " + " | ".join(done_tasks) + " | mean |", "|---|" + "---:|" * (len(done_tasks) + 1)]
        for student, per in keep.items():
            vals = [f"{per[t]:.1f}" if t in per else "–" for t in done_tasks]
            mean = sum(per.values()) / len(per) if per else float("nan")
            lines.append(f"| {student} | " + " | ".join(vals) + f" | {mean:.1f} |")
    lines += ["", "## All metrics", "", "| model | task | metric | value | stderr | n |", "|---|---|---|---:|---:|---:|"]
    for n in rows:
        for t in done_tasks:
            if t not in table[n]:
                continue
            cell = table[n][t]
            n_samples = cell.get("n-samples", {}).get(t, {}).get("effective", "")
            for metric, (v, e) in _metrics(cell["results"].get(t, {})).items():
                lines.append(f"| {n} | {t} | {metric} | {v:.4f} | {'' if e is None else f'{e:.4f}'} | {n_samples} |")
    if failed:
        lines += ["", "## Not evaluated", ""] + [f"- `{k}`: {v}" for k, v in failed.items()]
    return "\n".join(lines) + "\n"


def plot(path: Path, table: dict, names: list[str], tasks: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [n for n in names if n in table]
    done_tasks = [t for t in tasks if any(t in table[n] for n in rows)]
    if not done_tasks:
        return
    fig, axes = plt.subplots(1, len(done_tasks), figsize=(3.6 * len(done_tasks), 3.4), dpi=90, squeeze=False)
    for ax, t in zip(axes[0], done_tasks):
        first = next(table[n][t] for n in rows if t in table[n])
        metric = main_metric(_metrics(first["results"].get(t, {})))
        vals, errs, labels = [], [], []
        for n in rows:
            m = _metrics(table[n][t]["results"].get(t, {})) if t in table[n] else {}
            if metric in m:
                vals.append(m[metric][0])
                errs.append(m[metric][1] or 0.0)
                labels.append(n)
        ax.bar(range(len(vals)), vals, yerr=errs, capsize=3, color=[f"C{i}" for i in range(len(vals))])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        higher = first.get("higher_is_better", {}).get(t, {}).get(metric, True)
        ax.set_title(f"{t}\n{metric} ({'higher' if higher else 'lower'} is better)", fontsize=8)
        ax.set_xticks(range(len(vals)), [lab.replace("/", "/\n") for lab in labels], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("zero-shot evaluation (lm-eval), error bars: stderr", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
