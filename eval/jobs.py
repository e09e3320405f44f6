"""Zero-shot eval batch jobs: many models x many tasks through lm-evaluation-harness, resumable.

    moe-pipeline eval runs/tiny                                  # teacher and student, the bundled tasks
    moe-pipeline eval runs/tiny other/student --tasks tiny_lastword,piqa --batch-size 32 --out evals/cmp
    moe-pipeline eval runs/tiny --include-path my_tasks/ --tasks my_task --limit 200
    moe-pipeline eval runs/tiny --nproc 2                        # expert parallel over 2 ranks

    from eval.jobs import run_eval
    run_eval(["runs/tiny"], ["tiny_lastword"], Path("runs/tiny/eval"), limit=100)   # collective over ranks

For every (model, task) cell `lm_eval.simple_evaluate` runs the task zero-shot on our adapter
(`eval.adapter.MoEPipelineLM`, its own progress bars off: the job shows one bar over all cells)
and the cell's result is written at once to `OUT/cells/<model>/<task>.json` (lm-eval's result
schema for that one task, plus wall time), so a killed job restarted with the same arguments
skips what is done. A cell also records what it was made from (`job`: the model's fingerprint,
`eval.models.fingerprint`, --limit and --dtype): one made from other weights or settings is run
again, with a line saying what changed. Tasks: any lm-eval task or group name, the `--include-path` folders' YAMLs,
and the bundled offline tasks (`eval.tasks`, always on the search path). A task whose data cannot
be loaded (offline and not cached, say) is reported in one line naming it and why, and the other
tasks still run.

After every cell, rank 0 rewrites `OUT/results.json`, `OUT/results.md` and `OUT/results.png` from
all cells on disk (`eval.report`, which describes the three files).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eval.report import write_reports
from pipeline.artifacts import atomic_write_text


@dataclass
class Cell:
    model: str
    task: str
    path: Path


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "__", name).strip("_") or "model"


def cell_path(out: Path, model: str, task: str) -> Path:
    """Where a cell's result lives: OUT/cells/<model>/<task>.json."""
    return out / "cells" / slug(model) / f"{slug(task)}.json"


def cell_job(path: Path, limit: float | None, dtype: str | None) -> dict:
    """What a cell's scores depend on beyond its task: the model's weights (`fingerprint`), --limit and --dtype."""
    from eval.models import fingerprint

    return {"model": fingerprint(path), "limit": limit, "dtype": dtype}


def stale(cell: Cell, job: dict) -> str | None:
    """Why the cell on disk cannot stand for `job` ("" when it is missing), or None when it can."""
    if not cell.path.is_file():
        return ""
    try:
        stored = json.loads(cell.path.read_text()).get("job")
    except (OSError, ValueError):
        return "its file is unreadable"
    if stored == job:
        return None
    if not isinstance(stored, dict):
        return "it does not say what it was made from (an older version wrote it)"
    what = {"model": "the model's weights changed", "limit": f"--limit was {stored.get('limit')}",
            "dtype": f"--dtype was {stored.get('dtype')}"}
    return ", ".join(why for k, why in what.items() if stored.get(k) != job[k])


def task_manager(include_path: list[str] | None):
    """lm-eval's TaskManager over its own tasks, the bundled ones and `include_path` folders."""
    from lm_eval.tasks import TaskManager

    from eval.lm_eval_cli import include_paths

    paths = include_paths([str(Path(p).resolve()) for p in include_path or []])
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
    if res is None:  # lm-eval returns the results on rank 0 only: another rank's part is done
        return None
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
    if ranks.world > 1:  # every rank runs the same cells: a task that fails to load on any rank is skipped on all
        for rank, theirs in enumerate(dist.gather_json(failed)):
            for task, why in theirs.items():
                failed.setdefault(task, why if rank == ranks.rank else f"on rank {rank}: {why}")
        ok_tasks = [t for t in ok_tasks if t not in failed]
    if ranks.rank == 0:
        for task, why in failed.items():
            print(f"[eval] {task}: skipped: {why}", flush=True)
    cells = [Cell(name, task, cell_path(out, name, task)) for name in names for task in ok_tasks]
    jobs = {name: cell_job(ref.path, limit, dtype) for ref, name in zip(refs, names)}
    why = [stale(c, jobs[c.model]) for c in cells]
    pending = [c for c, w in zip(cells, why) if w is not None]  # decided before any rank writes
    dist.barrier()
    if ranks.rank == 0:
        for c, w in zip(cells, why):
            if w:
                print(f"[eval] {c.model} on {c.task}: the stored cell is run again: {w}", flush=True)
        print(f"[eval] {len(names)} model(s) x {len(ok_tasks)} task(s): {len(cells) - len(pending)} done before, "
              f"{len(pending)} to run -> {out}", flush=True)
    bar = tqdm(total=len(cells), initial=len(cells) - len(pending), desc="eval cells", unit="cell",
               disable=ranks.rank != 0)
    for ref, name in zip(refs, names):
        todo = [c for c in pending if c.model == name]
        if not todo:
            continue
        # progress off: one bar for the whole job, not one per request type and cell
        lm = MoEPipelineLM(path=str(ref.path), batch_size=batch_size, dtype=dtype, ep_size=ep_size, progress=False)
        lm.ref = type(ref)(name, ref.path, ref.stage, ref.run)
        for cell in todo:
            bar.set_postfix_str(f"{name} {cell.task}")
            # the ranks start each cell together: rank 0 writes the last one first (lm-eval's metrics and their
            # bootstrap run on rank 0 alone), so that a rank failing in this cell stops the job after it is kept
            dist.barrier()
            try:
                result = run_cell(lm, cell.task, tm, limit, bootstrap_iters)
            except Exception as err:  # noqa: BLE001 - on one rank, one cell failing does not stop the job
                first = (str(err).strip().splitlines() or [""])[0]
                if ranks.world > 1:
                    # the other ranks may be inside this cell's collectives, waiting for this one: they cannot go on
                    # in step. This rank exits at once (pipeline/dist.py `_shutdown`), and DeepSpeed's launcher stops
                    # the others; the cells finished so far are on disk, and the same command resumes from them
                    print(f"\n[eval] rank {ranks.rank}: {name} on {cell.task} failed: {type(err).__name__}: "
                          f"{first[:200]}; stopping every rank (finished cells are kept: run again to resume)",
                          file=sys.stderr, flush=True)
                    raise
                failed[f"{name}:{cell.task}"] = f"{type(err).__name__}: {first[:200]}"
                if ranks.rank == 0:
                    print(f"\n[eval] {name} on {cell.task} failed: {type(err).__name__}: {first[:200]}", flush=True)
                bar.update(1)
                continue
            if ranks.rank == 0:
                result["model"] = {"name": name, "stage": ref.stage, "run": ref.run, **lm.get_model_info()}
                result["job"] = jobs[name]
                cell.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(cell.path, json.dumps(result, indent=1) + "\n")
                write_reports(out, collect(out, names, ok_tasks, jobs), names, refs, ok_tasks, failed)
            bar.update(1)
        del lm
    bar.close()
    summary = {}
    if ranks.rank == 0:
        summary = write_reports(out, collect(out, names, ok_tasks, jobs), names, refs, ok_tasks, failed)
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


# -- the cells on disk --------------------------------------------------------------------------

def collect(out: Path, names: list[str], tasks: list[str], jobs: dict[str, dict] | None = None) -> dict:
    """{model: {task: cell dict}} for the cells on disk (with `jobs`, {model: cell_job}: those made for it alone)."""
    table: dict[str, dict[str, dict]] = {}
    for name in names:
        for task in tasks:
            path = cell_path(out, name, task)
            if path.is_file():
                cell = json.loads(path.read_text())
                if jobs is None or cell.get("job") == jobs[name]:
                    table.setdefault(name, {})[task] = cell
    return table
