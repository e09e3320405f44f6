"""Throughput of the lm-eval adapter's `loglikelihood` in requests/s, by batch size, on a tiny model.

    .venv/bin/python benchmarks/eval_throughput.py                          # runs/tiny/student, batches 1 8 32
    .venv/bin/python benchmarks/eval_throughput.py --model runs/tiny/teacher --requests 512 --batch-sizes 1 32

The requests are the real ones lm-eval builds for the bundled `tiny_lastword` task (passage,
" final word"), the first `--requests` of them, tokenized once; each batch size then scores all
of them with `MoEPipelineLM._loglikelihood_tokens` (sorting, padding, forward, log-softmax of the
continuation positions, is_greedy), after one untimed warm-up pass, `--repeats` times (median).
The answers at every batch size must agree (checked: the same scores within 1e-3, the same
is_greedy flags), so the speed-up is not bought with different results. Target: batch 32 at least
5x batch 1. Results: a table on stdout, `eval_throughput.json` under `--out`.
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

ROOT = Path(__file__).resolve().parents[1]
TARGET = 5.0


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny" / "student",
                   help="a stage directory or package (default runs/tiny/student: run README command 1 first)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--task", default="tiny_lastword", choices=["tiny_lastword", "tiny_nextline"],
                   help="whose requests: LAMBADA-style passages (~70 tokens) or 4-way multiple choice (~40)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="run the model in this dtype (default: the model's own, fp32 for a stage directory)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if not args.model.is_dir():
        p.error(f"--model {args.model}: no such directory; run `moe-pipeline distill recipes/tiny.yaml` first "
                "or name a stage directory")
    return args


def task_requests(lm, task_name: str, n: int) -> tuple[list, int]:
    """The first `n` loglikelihood requests lm-eval builds for the bundled task, tokenized by the adapter, and
    the tokens they score."""
    from lm_eval.tasks import TaskManager

    from eval.tasks import bundled_task_dir

    task = TaskManager(include_path=str(bundled_task_dir()), include_defaults=False).load_task_or_group(
        [task_name])[task_name]
    task.build_all_requests(limit=n, rank=0, world_size=1)
    requests = []
    for inst in task.instances[:n]:
        ctx, cont = inst.args
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        requests.append(((ctx, cont), ctx_ids, cont_ids))
    tokens = sum(len((c + d)[-(lm.max_length + 1):]) - 1 for _, c, d in requests)
    return requests, tokens


def time_batch_sizes(lm, requests: list, tokens: int, batch_sizes: list[int], repeats: int) -> tuple[list, dict]:
    """Each batch size's median seconds over `repeats` passes over every request (after a warm-up), and its
    answers."""
    rows, answers = [], {}
    for bs in batch_sizes:
        lm._loglikelihood_tokens(requests[:max(bs, 8)], disable_tqdm=True, override_bs=bs)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            answers[bs] = lm._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=bs)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        rows.append({"batch_size": bs, "seconds": round(t, 3), "requests_per_s": round(len(requests) / t, 2),
                     "tokens_per_s": round(tokens / t, 1)})
    ref = rows[0]["requests_per_s"]
    for r in rows:
        r["speedup_vs_first"] = round(r["requests_per_s"] / ref, 2)
    return rows, answers


def check_answers(answers: dict, first: int, dtype_name: str) -> None:
    """Every batch size's scores equal the first's (within 1e-3 in fp32, with the same is_greedy flags)."""
    base = answers[first]
    for bs, ans in answers.items():
        tol = 1e-3 if dtype_name == "float32" else 0.5  # bf16: padding changes matmul shapes, so rounding
        assert all(abs(a[0] - b[0]) < tol and (a[1] == b[1] or dtype_name != "float32") for a, b in zip(ans, base)), \
            f"batch {bs} differs"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from eval.adapter import MoEPipelineLM

    lm = MoEPipelineLM(path=str(args.model), batch_size=1, dtype=args.dtype, progress=False)
    dtype_name = str(next(lm.model.parameters()).dtype).replace("torch.", "")
    requests, tokens = task_requests(lm, args.task, args.requests)
    rows, answers = time_batch_sizes(lm, requests, tokens, args.batch_sizes, args.repeats)
    check_answers(answers, args.batch_sizes[0], dtype_name)

    print(f"\n== lm-eval loglikelihood, {args.model} ({lm.model.cfg.layers} layers, experts "
          f"{list(lm.model.cfg.experts)}, context {lm.max_length}), {len(requests)} {args.task} requests "
          f"({tokens} tokens), {torch.get_num_threads()} threads, {dtype_name}, median of {args.repeats} ==")
    print(f"{'batch':>5} {'seconds':>8} {'req/s':>8} {'tok/s':>9} {'x batch ' + str(args.batch_sizes[0]):>10}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['seconds']:>8.2f} {r['requests_per_s']:>8.1f} {r['tokens_per_s']:>9.0f} "
              f"{r['speedup_vs_first']:>10.2f}")
    big = next((r for r in rows if r["batch_size"] == 32), None)
    if big is not None and args.batch_sizes[0] == 1:
        print(f"batch 32 / batch 1 = {big['speedup_vs_first']:.2f} (target >= {TARGET}: "
              f"{'ok' if big['speedup_vs_first'] >= TARGET else 'MISSED'}); every batch size gave the same answers")
    result = {"task": args.task,
              "meta": {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                       "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                       "load_avg_1m": os.getloadavg()[0], "torch": torch.__version__, "model": str(args.model),
                       "dtype": dtype_name},
              "requests": len(requests), "tokens": tokens, "rows": rows, "target_batch32_over_batch1": TARGET}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "eval_throughput" + ("" if args.task == "tiny_lastword" else f"_{args.task}") \
        + ("" if dtype_name == "float32" else f"_{dtype_name}") + ".json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
