"""`moe-pipeline serve` against Hugging Face `generate` on the same package, plus latency under load.

    .venv/bin/python benchmarks/serve_bench.py                     # runs/tiny/package (README command 1, then export)
    .venv/bin/python benchmarks/serve_bench.py --teacher runs/tiny/teacher-package --new-tokens 64
    python benchmarks/serve_bench.py --package PKG --device cuda   # server and HF on the GPU (benchmarks/gpu_check.py)

One run, side by side (each throughput the median of --repeats runs; same package, same dtype, same threads, greedy, `--new-tokens` tokens each):
  (a) one request: our server (HTTP, continuous batching) vs `AutoModelForCausalLM.generate` (its KV cache);
  (b) 16 concurrent requests: our server (they share decode steps) vs HF one after another, as a
      plain HF deployment would serve them;
  (c) the student's server tokens/s against the teacher's (`--teacher PACKAGE`, optional);
  (d) batch-1 decode against the memory-bandwidth bound: active parameter bytes read per token ÷ a
      measured copy bandwidth (the fastest a token could come if weights were read once per token);
  (e) latency percentiles (p50, p99) of 32 concurrent clients x 10 requests each (--latency-requests), and the failures;
  (f) with --layouts: multi-rank layouts (ep2: data parallel + expert parallel; tp2; expert-slicing-4) against
      1 rank at 16 and 32 concurrent requests (--layout-requests x concurrency requests a run, that many in
      flight throughout), runs interleaved (target for ep2: at least 1.1x at 32), and ep2's
      ceiling on these cores: in this process, without a server, `Engine.step` of 32 rows on --threads threads
      against 16 rows on half of them (one data-parallel rank's share with every expert, no exchange and no step
      message), alternated: the most 2 ranks splitting the cores could gain over 1; and the same side by side (two
      engines of 16 rows at once, each a process on a core of its own, against one of 32 rows: what the two
      ranks' sharing of caches and memory leaves of it).
Targets: (b) at least 1.5x HF, (a) not slower than HF. Results: a table on stdout and
`serve_bench.json` under `--out`. The server runs as a separate process (`moe-pipeline serve`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, start_server, stop_server  # noqa: E402
from pipeline.artifacts import is_package, read_manifest  # noqa: E402

PROMPTS = ["And God said", "To be, or not to be", "In the beginning", "Now the serpent was more subtil",
           "What light through yonder window", "Blessed are the meek", "Friends, Romans, countrymen",
           "The LORD is my shepherd", "All the world's a stage", "Let there be light", "O Romeo, Romeo",
           "For God so loved the world", "Once more unto the breach", "Vanity of vanities", "Is this a dagger",
           "Honour thy father"]


LAYOUTS = {"ep2": ["--ep-size", "2"], "tp2": ["--nproc", "2", "--tp-size", "2"],
           "expert-slicing-4": ["--nproc", "4", "--ep-size", "2"]}


def server_run(url: str, prompts: list[str], new_tokens: int, concurrency: int) -> tuple[float, int, list[float], int]:
    """(seconds, tokens generated, per-request latencies, failures) for `prompts` sent `concurrency` at a time."""
    import requests

    local = threading.local()

    def one(p):
        t0 = time.perf_counter()
        if not hasattr(local, "session"):
            local.session = requests.Session()
        try:
            r = local.session.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": new_tokens, "temperature": 0},
                              timeout=600)
            ok = r.status_code == 200
            n = r.json()["usage"]["completion_tokens"] if ok else 0
        except requests.RequestException:
            ok, n = False, 0
        return time.perf_counter() - t0, n, ok

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    return time.perf_counter() - t0, sum(r[1] for r in results), [r[0] for r in results], sum(not r[2] for r in results)


def median_run(results: list):
    """The median-time result (each result starts with its seconds)."""
    results = sorted(results, key=lambda r: r[0])
    return results[len(results) // 2]


def load_hf(pkg: Path, device: str = "cpu"):
    """The package through transformers (its remote code) on `device` in the package's dtype, warmed up:
    (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, read_manifest(pkg)["dtype"])
    model = AutoModelForCausalLM.from_pretrained(str(pkg), trust_remote_code=True, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(pkg), trust_remote_code=True)
    with torch.no_grad():
        model.generate(torch.tensor([tok.encode(PROMPTS[0])], device=device), max_new_tokens=4, do_sample=False)
    return model, tok


def hf_run(hf, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    """HF generate, one prompt after another (greedy, its own KV cache)."""
    import torch

    model, tok = hf
    t0, total = time.perf_counter(), 0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)], device=model.device)
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
            total += out.shape[1] - ids.shape[1]
    if model.device.type == "cuda":
        torch.cuda.synchronize()  # the time of the work, not of queueing it
    return time.perf_counter() - t0, total


def copy_bandwidth(device: str = "cpu") -> float:
    """Bytes read + written per second by a tensor copy on `device` (64 MiB on a CPU, 2 GiB on a GPU: well past
    its L2), the mean of 10 copies after one."""
    import torch

    n = (2 << 30) if device != "cpu" else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 2 * a.numel() * 10 / (time.perf_counter() - t0)


LAYOUT_CONCURRENCY = (16, 32)


def layout_runs(args, server_env, n: int, device: str) -> dict:
    """(f): each multi-rank layout against 1 rank at 16 and 32 concurrent requests, both servers up and their runs
    interleaved (1 rank, layout, 1 rank, ...): the machine's drift falls on both alike. Medians of --repeats. On the
    CPU, ep2's row also gets its ceiling on these cores (`ep2_ceiling`), once the servers are down."""
    out = {}
    one, one_url = start_server(args.package, threads=args.threads, env=server_env)
    try:
        for name in args.layouts:
            proc, url = start_server(args.package, LAYOUTS[name], threads=args.threads, env=server_env)
            try:
                for u in (one_url, url):
                    server_run(u, PROMPTS[:2], 4, 2)  # warm-up
                row = {"args": LAYOUTS[name], "one_rank": {}, "layout": {}, "paired": {}}
                for c in LAYOUT_CONCURRENCY:
                    k = c * args.layout_requests  # c in flight the whole run, as `vllm bench serve` keeps them
                    prompts = (PROMPTS * (k // len(PROMPTS) + 1))[:k]
                    runs = {"one_rank": [], "layout": []}
                    for _ in range(args.repeats):
                        runs["one_rank"].append(server_run(one_url, prompts, n, c))
                        runs["layout"].append(server_run(url, prompts, n, c))
                    for key, rs in runs.items():
                        m = median_run(rs)
                        row[key][str(c)] = {"tok_s": m[1] / m[0], "failures": sum(r[3] for r in rs),
                                            "runs_tok_s": [r[1] / r[0] for r in rs]}
                    row["paired"][str(c)] = [(b[1] / b[0]) / (a[1] / a[0])
                                             for a, b in zip(runs["one_rank"], runs["layout"])]
                out[name] = row
            finally:
                stop_server(proc)
    finally:
        stop_server(one)
    if "ep2" in out and device == "cpu":
        out["ep2"]["ceiling"] = ep2_ceiling(args.package, args.threads)
        if len(os.sched_getaffinity(0)) >= 2:
            out["ep2"]["side_by_side"] = ep2_side_by_side(args.package, args.threads)
    return out


def ep2_ceiling(package: Path, threads: int, rounds: int = 6, steps: int = 8) -> dict:
    """(f)'s ceiling: median ms of `Engine.step` at 32 rows on `threads` threads and at 16 rows on half of them (each
    its own engine in this process, decoding random 16-token prompts), alternated `rounds` times."""
    import random

    import torch

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine
    from export.serve.request import SamplingParams

    cases = {"32 rows": (32, threads), "16 rows": (16, max(1, threads // 2))}
    engines, ms = {}, {name: [] for name in cases}
    for i, (name, (rows, _)) in enumerate(cases.items()):
        eng = Engine.from_config(ServeConfig(package=package, kv_cache_memory=1))
        rnd = random.Random(i)
        for _ in range(rows):  # enough tokens for every timed step: decode only, all rows all the time
            eng.submit([rnd.randrange(100, 8000) for _ in range(16)],
                       SamplingParams(max_tokens=rounds * (steps + 2) + 8, ignore_eos=True))
        for _ in range(4):
            eng.step()
        engines[name] = eng
    before = torch.get_num_threads()
    try:
        for _ in range(rounds):
            for name, (_, th) in cases.items():
                torch.set_num_threads(th)
                engines[name].step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    engines[name].step()
                ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        torch.set_num_threads(before)
    out = {name: {"threads": th, "step_ms": statistics.median(ms[name]), "runs_ms": ms[name]}
           for name, (_, th) in cases.items()}
    out["ceiling"] = out["32 rows"]["step_ms"] / out["16 rows"]["step_ms"]
    return out


def _engine_rate(package: Path, rows: int, threads: int, cpu: int | None, seconds: float, orders, results) -> None:
    """A child of `ep2_side_by_side`: an engine of `rows` decoding rows on `threads` threads (on core `cpu` alone, if
    given); for each order that arrives, `seconds` of steps, then its tokens/s back."""
    import random

    import torch

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine
    from export.serve.request import SamplingParams

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)  # the parent's own 1-rank group (ep2_ceiling's engines): each child makes its own
    eng = Engine.from_config(ServeConfig(package=package, kv_cache_memory=1))
    torch.set_num_threads(threads)  # after the engine: pipeline.dist.init sets torch's threads to cores / local ranks
    rnd, cfg = random.Random(cpu or 0), eng.cfg
    prompt, new = 16, max(8, min(100, cfg.seq_len - 17))

    def batch() -> int:
        reqs = [eng.submit([rnd.randrange(min(100, cfg.vocab_size - 1), cfg.vocab_size) for _ in range(prompt)],
                           SamplingParams(max_tokens=new, ignore_eos=True)) for _ in range(rows)]
        made = 0
        while not all(r.finished for r in reqs):
            made += eng.step()
        return made

    batch()
    results.put(None)  # ready
    while orders.get():
        t0, made = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            made += batch()
        results.put(made / (time.perf_counter() - t0))


def ep2_side_by_side(package: Path, threads: int, rounds: int = 3, seconds: float = 3.0) -> dict:
    """(f)'s ceiling as two ranks would meet it: two engines of 16 rows at once, each on one thread of its own core
    (no exchange, no step message, no server; they share the caches and the memory), against one engine of 32 rows on
    `threads` threads, each a process, `seconds` of prompt + decode batches, alternated `rounds` times. Medians."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0))[:2]
    setups = {"two 16-row engines": [(16, 1, c) for c in cores], "one 32-row engine": [(32, threads, None)]}
    children, rates = {}, {name: [] for name in setups}
    try:
        for name, specs in setups.items():
            children[name] = []
            for rows, th, cpu in specs:
                orders, results = ctx.Queue(), ctx.Queue()
                proc = ctx.Process(target=_engine_rate, args=(package, rows, th, cpu, seconds, orders, results))
                proc.start()
                children[name].append((proc, orders, results))
        for kids in children.values():
            for _, _, results in kids:
                results.get(timeout=600)  # built and warm
        for _ in range(rounds):
            for name, kids in children.items():
                for _, orders, _ in kids:
                    orders.put(True)
                rates[name].append(sum(results.get(timeout=600) for _, _, results in kids))
    finally:
        for kids in children.values():
            for proc, orders, _ in kids:
                orders.put(False)
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    out = {name: {"tok_s": statistics.median(r), "runs_tok_s": r} for name, r in rates.items()}
    out["cores"] = cores
    out["bound"] = out["two 16-row engines"]["tok_s"] / out["one 32-row engine"]["tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", type=Path, default=ROOT / "runs" / "tiny" / "package")
    p.add_argument("--teacher", type=Path, default=None, help="the teacher's package, for (c)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layouts", nargs="*", default=[], choices=sorted(LAYOUTS),
                   help="(f) also serve 16 and 32 concurrent requests with these multi-rank layouts, interleaved with "
                        "1 rank (the ranks share --threads cores)")
    p.add_argument("--layouts-only", action="store_true", help="run (f) alone (with --layouts)")
    p.add_argument("--layout-requests", type=int, default=4,
                   help="(f): requests a run sends, as a multiple of its concurrency (4: 128 requests at 32 concurrent)")
    p.add_argument("--repeats", type=int, default=5, help="runs of (a), (b), (c) each; the median is reported")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--latency-requests", type=int, default=320, help="(e): requests the 32 clients send in all")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the server and HF run (auto: cuda when there is a GPU); the bound uses its bandwidth")
    args = p.parse_args(argv)
    if not is_package(args.package):
        p.error(f"--package {args.package}: not a package; run README command 1, then `moe-pipeline export runs/tiny`")
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    # the server runs on DeepSpeed's accelerator: on a GPU machine, hiding the GPU is how it runs on the CPU
    server_env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" and torch.cuda.is_available() else None
    n = args.new_tokens
    res: dict = {"new_tokens": n, "threads": args.threads, "package": str(args.package), "device": device}
    if device == "cuda":
        res["device_name"] = torch.cuda.get_device_name()

    if args.layouts_only:
        res["layouts"] = layout_runs(args, server_env, n, device)
        print_layouts(res)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve_bench_layouts.json").write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out / 'serve_bench_layouts.json'}")
        return 0
    hf = load_hf(args.package, device)
    proc, url = start_server(args.package, threads=args.threads, env=server_env)
    try:
        server_run(url, PROMPTS[:2], 4, 2)  # warm-up
        # server and HF alternate, run by run: this machine's speed drifts, and both see the same drift
        runs = {"s1": [], "h1": [], "s16": [], "h16": []}
        for _ in range(args.repeats):
            runs["s1"].append(server_run(url, PROMPTS[:1] * 3, n, 1))
            runs["h1"].append(hf_run(hf, PROMPTS[:1] * 3, n))
        for _ in range(args.repeats):
            runs["s16"].append(server_run(url, PROMPTS[:16], n, 16))
            runs["h16"].append(hf_run(hf, PROMPTS[:16], n))
        lat = server_run(url, [PROMPTS[i % 16] for i in range(args.latency_requests)], 16, 32)
    finally:
        stop_server(proc)
    s1, h1, s16, h16 = (median_run(runs[k]) for k in ("s1", "h1", "s16", "h16"))
    res["one_request"] = {"server_tok_s": s1[1] / s1[0], "hf_tok_s": h1[1] / h1[0]}
    res["sixteen"] = {"server_tok_s": s16[1] / s16[0], "hf_tok_s": h16[1] / h16[0], "failures": s16[3]}
    lats = sorted(lat[2])
    res["latency"] = {"clients": 32, "requests": len(lats), "max_tokens": 16, "failures": lat[3],
                      "p50_s": statistics.median(lats), "p99_s": lats[int(0.99 * (len(lats) - 1))],
                      "tok_s": lat[1] / lat[0]}
    if args.teacher is not None:
        proc, url = start_server(args.teacher, threads=args.threads, env=server_env)
        try:
            server_run(url, PROMPTS[:2], 4, 2)
            t16 = median_run([server_run(url, PROMPTS[:16], n, 16) for _ in range(args.repeats)])
        finally:
            stop_server(proc)
        res["teacher_sixteen_tok_s"] = t16[1] / t16[0]
    if args.layouts:
        res["layouts"] = layout_runs(args, server_env, n, device)
    manifest = read_manifest(args.package)
    elt = 4 if manifest["dtype"] == "float32" else 2
    active_bytes = manifest["params"]["active_per_token"] * elt
    bw = copy_bandwidth(device)
    res["bandwidth"] = {"copy_bytes_per_s": bw, "active_bytes_per_token": active_bytes,
                        "bound_tok_s": bw / 2 / active_bytes}  # reading the weights once per token

    a, b = res["one_request"], res["sixteen"]
    print(f"\n== serve vs HF generate, {args.package} ({manifest['dtype']}) on {device}, {n} new tokens, "
          f"{args.threads} threads ==")
    print(f"(a) 1 request:     server {a['server_tok_s']:8.1f} tok/s   HF {a['hf_tok_s']:8.1f} tok/s   "
          f"ratio {a['server_tok_s'] / a['hf_tok_s']:.2f} (target >= 1.0)")
    print(f"(b) 16 concurrent: server {b['server_tok_s']:8.1f} tok/s   HF {b['hf_tok_s']:8.1f} tok/s   "
          f"ratio {b['server_tok_s'] / b['hf_tok_s']:.2f} (target >= 1.5), failures {b['failures']}")
    if "teacher_sixteen_tok_s" in res:
        print(f"(c) student / teacher at 16 concurrent: {b['server_tok_s'] / res['teacher_sixteen_tok_s']:.2f} "
              f"({b['server_tok_s']:.1f} vs {res['teacher_sixteen_tok_s']:.1f} tok/s)")
    bd = res["bandwidth"]
    print(f"(d) batch-1 decode {a['server_tok_s']:.1f} tok/s vs bandwidth bound {bd['bound_tok_s']:.0f} tok/s "
          f"({active_bytes / 1e6:.1f} MB active per token, copy {bd['copy_bytes_per_s'] / 1e9:.1f} GB/s): "
          f"{100 * a['server_tok_s'] / bd['bound_tok_s']:.0f}% of the bound")
    L = res["latency"]
    print(f"(e) 32 clients, {L['requests']} requests (16 tokens): p50 {L['p50_s'] * 1e3:.0f} ms, "
          f"p99 {L['p99_s'] * 1e3:.0f} ms, "
          f"{L['tok_s']:.0f} tok/s, failures {L['failures']}")
    print_layouts(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_bench.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out / 'serve_bench.json'}")
    return 0


def print_layouts(res: dict) -> None:
    for name, r in res.get("layouts", {}).items():
        for c in LAYOUT_CONCURRENCY:
            one, multi = r["one_rank"][str(c)], r["layout"][str(c)]
            target = " (target >= 1.1)" if name == "ep2" and c == 32 else ""
            print(f"(f) {name:17s} ({' '.join(r['args'])}) at {c:2d} concurrent: {multi['tok_s']:7.1f} tok/s vs 1 rank "
                  f"{one['tok_s']:7.1f} tok/s = {multi['tok_s'] / one['tok_s']:.2f}x{target} (interleaved), failures "
                  f"{multi['failures']} / {one['failures']}; runs paired "
                  f"{' '.join(f'{x:.2f}' for x in r['paired'][str(c)])}")
        if "ceiling" in r:
            c = r["ceiling"]
            a, b = c["32 rows"], c["16 rows"]
            print(f"(f) {name}'s ceiling here: Engine.step of 32 rows on {a['threads']} threads {a['step_ms']:.2f} ms vs "
                  f"16 rows on {b['threads']} {b['step_ms']:.2f} ms = {c['ceiling']:.2f}x at most (in-process, no "
                  f"exchange, no step message)")
        if "side_by_side" in r:
            c = r["side_by_side"]
            print(f"(f) {name}'s ceiling side by side: two engines of 16 rows at once, one a core (cores {c['cores']}), "
                  f"{c['two 16-row engines']['tok_s']:.0f} tok/s vs one of 32 rows "
                  f"{c['one 32-row engine']['tok_s']:.0f} tok/s = {c['bound']:.2f}x at most (no exchange, no step "
                  f"message, no server)")


if __name__ == "__main__":
    sys.exit(main())
