"""Result tables and plots of a zero-shot eval job: results.json, results.md, results.png.

`moe-pipeline eval` (eval/jobs.py) calls `write_reports` on rank 0 after every finished cell,
with all the cells on disk, so the three files always show everything done so far:

    moe-pipeline eval runs/tiny              # writes runs/tiny/eval/results.{json,md,png}

    from eval.report import write_reports
    summary = write_reports(out, table, names, refs, tasks, failed)   # table: {model: {task: cell}}

A cell is one model's result on one task, as `eval.jobs.run_cell` stores it: lm-eval's result dict
for that task (`results`, `versions`, `n-shot`, `higher_is_better`, `n-samples`, `configs`,
`config`) plus `model` (name, stage, run, path and what the adapter reports about the model).

  results.json   {model name: lm-eval's result dict (results, versions, n-shot, higher_is_better,
                  n-samples, configs, config)} plus "_retention" and "_failed";
  results.md     models as rows, tasks as columns (the main metric, ± lm-eval's stderr), then each
                 student's retention of its teacher's score in % (higher-is-better metrics: student
                 / teacher; lower-is-better ones such as perplexity or bits per byte: teacher /
                 student), then every metric of every task, then what was not evaluated and why;
  results.png    one panel per task, a bar per model with its stderr (matplotlib, Agg backend).

A task's main metric is the first of `MAIN_METRICS` it reports, else its first metric. A student
has a retention row when its run's teacher was evaluated in the same job.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from pipeline.artifacts import atomic_write_text

# the metric a task's column shows: the first of these the task reports, else its first metric
MAIN_METRICS = ("acc", "exact_match", "bits_per_byte", "word_perplexity", "perplexity", "acc_norm", "f1", "mcc")


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


def retention(table: dict, refs, names: list[str], tasks: list[str]) -> dict:
    """{student name: {task: % of its run's teacher's main metric}} for students whose teacher was evaluated.

    `refs` are the models' `eval.models.ModelRef`s (their `run` and `stage`), in the order of `names`.
    """
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


def summary(table: dict, keep: dict, failed: dict[str, str]) -> dict:
    """results.json: each model's cells merged into one lm-eval result dict, plus retention and failures."""
    merged = {}
    for name, cells in table.items():
        res = {"results": {}, "versions": {}, "n-shot": {}, "higher_is_better": {}, "n-samples": {}, "configs": {}}
        for cell in cells.values():
            for k in res:
                res[k].update(cell.get(k, {}))
            res["config"] = {**cell.get("config", {}), "model_args": str(cell.get("model", {}).get("path", ""))}
            res["model"] = cell.get("model")
        merged[name] = res
    return {**merged, "_retention": keep, "_failed": failed}


def write_reports(out: Path, table: dict, names: list[str], refs, tasks: list[str], failed: dict[str, str]) -> dict:
    """Write results.json, results.md and results.png under `out` from `table` ({model: {task: cell}}).

    `failed` maps a task (or 'model:task') to why it was not evaluated. Returns results.json's content.
    """
    keep = retention(table, refs, names, tasks)
    result = summary(table, keep, failed)
    atomic_write_text(out / "results.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "results.md", markdown(table, keep, names, tasks, failed))
    plot(out / "results.png", table, names, tasks)
    return result


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
    """results.png: one panel per task with a result, a bar per model (its main metric, stderr as error bar)."""
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
