"""The eval command: zero-shot evaluation of runs, stages or packages with lm-evaluation-harness."""

from __future__ import annotations

import sys
from pathlib import Path

from cli.common import relaunch_if_asked
from pipeline.artifacts import is_run_dir


def cmd_eval(args, argv: list[str]) -> int:
    if (code := relaunch_if_asked(args, argv)) is not None:
        return code
    from eval.jobs import run_eval
    from eval.models import resolve

    try:
        for spec in args.models:
            resolve(spec)
        out = args.out
        if out is None:
            first = Path(args.models[0])
            out = first / "eval" if len(args.models) == 1 and is_run_dir(first) else \
                Path("evals") / "+".join(Path(m).resolve().name for m in args.models)
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
        run_eval(args.models, tasks, out, batch_size=args.batch_size, limit=args.limit,
                 include_path=args.include_path, dtype=args.dtype, ep_size=args.ep_size,
                 bootstrap_iters=args.bootstrap_iters)
    except (FileNotFoundError, ValueError) as err:
        print(f"eval error: {err}", file=sys.stderr)
        return 2
    return 0
