"""The peer race's workload in one serving engine, without the server: what our step costs, apart from HTTP.

    .venv/bin/python benchmarks/engine_race.py                                  # peer_bench.py's bf16 package
    .venv/bin/python benchmarks/engine_race.py --package PKG --concurrency 32 --tokens 1024 2048 4096

Waves of --concurrency requests, each --input-len random prompt tokens and --output-len greedy tokens (ignore_eos),
submitted together to `Engine` (export/serve/engine.py) and stepped until all finish, as `vllm bench serve` keeps
that many in flight in benchmarks/peer_bench.py; the engine's own threads (OMP_NUM_THREADS, default every core). One
warm-up wave, then --rounds rounds of --seconds each for every --max-batched-tokens value in turn (the memory's speed
drifts on these machines: interleaved rounds share it out). Prints the CPU, output tokens/s and ms a step per value
(median over the rounds): set beside peer_bench.py's figure through the server, the difference is the server's path
(HTTP, streaming, detokenising). Writes engine_race.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, cpu_info, cpu_line  # noqa: E402


def wave(engine, concurrency: int, input_len: int, output_len: int, rng: random.Random) -> int:
    """One wave: `concurrency` requests submitted at once, stepped until every one finishes; returns the steps."""
    from export.serve.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [engine.submit([rng.randrange(1000, 40000) for _ in range(input_len)], params)
                for _ in range(concurrency)]
    steps = 0
    while not all(r.finished for r in requests):
        engine.step()
        steps += 1
    return steps


def child(args) -> dict:
    """One run: an engine over the package with --tokens[0] as its --max-batched-tokens, a warm-up wave, then waves
    for --seconds; prints RESULT {json}."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine

    engine = Engine.from_config(ServeConfig(package=args.package, max_batch=args.concurrency,
                                            max_batched_tokens=args.tokens[0]))
    rng = random.Random(args.seed)
    wave(engine, args.concurrency, args.input_len, args.output_len, rng)
    t0, waves, steps = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < args.seconds:
        steps += wave(engine, args.concurrency, args.input_len, args.output_len, rng)
        waves += 1
    dt = time.perf_counter() - t0
    r = {"tok_s": waves * args.concurrency * args.output_len / dt, "ms_step": 1000 * dt / steps, "waves": waves,
         "steps": steps, "seconds": round(dt, 2)}
    print("RESULT " + json.dumps(r), flush=True)
    return r


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", type=Path, help="a package (default: peer_bench.py's bf16 package of its checkpoint)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048], help="--max-batched-tokens values to compare")
    ap.add_argument("--seconds", type=float, default=20.0, help="waves run for about this long a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine_race")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run, in its own process
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        os._exit(0)  # the engine's threads and process group need no orderly teardown
    cpu = cpu_info()
    print(f"CPU: {cpu_line(cpu)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    package = args.package
    if package is None:
        from peer_bench import PEERS, derived_dir, make_checkpoint, our_package

        ckpt = make_checkpoint(PEERS / "work")
        package = our_package(ckpt, derived_dir(ckpt, PEERS / "work"), args.out / "convert.log")
    runs: dict[int, list[dict]] = {t: [] for t in args.tokens}
    for k in range(args.rounds):
        for tokens in args.tokens:  # each run its own process: one engine (and its ranks' setup) a process
            cmd = [sys.executable, __file__, "--child", "--package", str(package), "--tokens", str(tokens),
                   "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--seconds", str(args.seconds), "--seed", str(k)]
            proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=1800)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"engine run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            r = json.loads(lines[-1][len("RESULT "):])
            runs[tokens].append(r)
            print(f"[round {k + 1}] --max-batched-tokens {tokens}: {r['tok_s']:.1f} output tok/s, "
                  f"{r['ms_step']:.1f} ms a step ({r['waves']} waves)", flush=True)
    table = {t: {"tok_s": statistics.median(r["tok_s"] for r in rs),
                 "ms_step": statistics.median(r["ms_step"] for r in rs)} for t, rs in runs.items()}
    print(f"\n## {args.concurrency} requests of {args.input_len} + {args.output_len} tokens in one engine "
          f"({cpu['model']}, {cpu['cores']} cores), medians of {args.rounds} rounds\n")
    print("| --max-batched-tokens | output tok/s | ms a step |\n|---|---|---|")
    for t, r in table.items():
        print(f"| {t} | {r['tok_s']:.1f} | {r['ms_step']:.1f} |")
    report = {"cpu": cpu, "package": str(package), "args": {k: str(v) for k, v in vars(args).items()},
              "runs": runs, "medians": table}
    (args.out / "engine_race.json").write_text(json.dumps(report, indent=1))
    print(f"\n{args.out / 'engine_race.json'}")
    return report


if __name__ == "__main__":
    main()
