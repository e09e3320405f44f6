"""Expert placement policies side by side: balancedness, tokens/s, memory, predictor accuracy, prefetch.

    .venv/bin/python benchmarks/placement_bench.py                 # runs/tiny/package, EP 2, budget 0.25
    .venv/bin/python benchmarks/placement_bench.py --budget 0.5 --requests 96
    .venv/bin/python benchmarks/placement_bench.py --expert-heavy --budget 0.5 --repeats 2 --requests 48  # ~45 min

`--expert-heavy`: instead of --package, a package whose experts dominate the step, made once under `--out`
(benchmarks/common.py `random_package`: hidden 512, 4 layers, MoE layers 2 and 4 with 8 experts each, top-1,
experts 512 -> 8192 -> 512, GPT-2's vocabulary, random weights, bf16: 348 MB of which 268 MB experts) with a
predictor trained on a short trace (32 blocks of 2048 tokens, 40 steps: ~12 minutes here).

One run. The package is copied to `--out`/pkg and its predictor trained there if it has none
(`moe-pipeline predictor train`). Two workloads of token-id prompts (32 tokens each, 32 new tokens,
`--concurrency` at a time) from the held-out split: `heldout` (random passages) and `skewed`
(the passages whose tokens the router sends most to rank 0's experts, picked from router traces
of the whole held-out split). For each workload, `moe-pipeline serve --ep-size 2 --placement P
--replica-budget B` for P in none, reactive, predictive, and from its /metrics and /health:
balancedness per MoE layer (token-weighted mean over forwards of mean/max tokens per rank),
tokens/s (the median of --repeats runs; the three servers take turns run by run), replica memory over the rank's native expert memory,
predictor recall. Then the
predictor's held-out accuracy (from predictor.json: demand error against a frequency baseline,
top-k recall), and prefetching: 1 rank, `--placement predictive --resident-experts F` for F in
1.0, 0.5, 0.25: hit rate and tokens/s. A table on stdout, placement_bench.json and
placement_bench.png under `--out`.

The servers run the data-parallel path (each rank its own sequences, the expert all-to-all), so
balancedness is the measured load: the tokens each rank's experts received. From /health's rank
status: each rank's ms per forward busy (less the exchange's collectives), computing experts, and
in the exchange; the busiest rank's; and the predictor thread's CPU seconds (it shares rank 0's
cores). The tokens/s gain that placement can give at most is bounded by the share of expert time
in the busiest rank's forward: bound = busy / (busy - (its expert time - the ranks' mean)).
And the balancedness a replica table could reach on each workload's own routes (`--ceilings-only`: just these,
no servers), in forwards shaped like the server's: the native table, the best single table for the whole
workload, and an oracle that plans each forward on its actual counts, all within the budget's replica slots.

What it checks (printed as MET or MISSED): on the skewed workload at equal budget, predictive balancedness >= 0.9
and >= reactive's, and predictive >= 1.1x none's tokens/s; the predictor's demand error below the frequency
baseline's; resident 0.5 keeps >= 80% of the all-resident tokens/s.
On the tiny package budget 0.25 is one replica slot a rank, where no table reaches much past 0.9 (the
oracle's ceiling, printed, was 0.912); `--budget 0.5` gives three.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, cli_command, start_server, stop_server  # noqa: E402
from pipeline.artifacts import is_package, read_manifest  # noqa: E402

POLICIES = ("none", "reactive", "predictive")
FRACTIONS = (1.0, 0.5, 0.25)


def run_workloads(urls: dict[str, str], prompts: list[list[int]], new_tokens: int, concurrency: int,
                  repeats: int = 3) -> dict[str, dict]:
    """The workload `repeats` times on each server, the servers taking turns run by run (this machine's speed
    drifts; all of them see the same drift): per server the median tokens/s and its metrics after all runs."""
    import requests

    def one(url, p):
        r = requests.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": new_tokens, "temperature": 0},
                          timeout=600)
        return r.json()["usage"]["completion_tokens"] if r.status_code == 200 else -1

    for url in urls.values():  # warm-up
        requests.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 2, "temperature": 0},
                      timeout=60)
    runs: dict[str, list] = {name: [] for name in urls}
    for _ in range(repeats):
        for name, url in urls.items():
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                made = list(pool.map(lambda p: one(url, p), prompts))
            runs[name].append((time.perf_counter() - t0, made))
    time.sleep(1.2)  # one more health check (once a second) so that rank status is current
    out = {}
    for name, url in urls.items():
        seconds, made = sorted(runs[name], key=lambda r: r[0])[len(runs[name]) // 2]
        metrics = requests.get(f"{url}/metrics", timeout=30).text
        health = requests.get(f"{url}/health", timeout=30).json()
        out[name] = {"seconds": seconds, "tokens": sum(m for m in made if m > 0),
                     "serve_seconds": sum(r[0] for r in runs[name]),  # every run of this server (the counters' span)
                     "failures": sum(m < 0 for r in runs[name] for m in r[1] if m < 0),
                     "tok_s": sum(m for m in made if m > 0) / seconds, "metrics": parse_metrics(metrics),
                     "ranks": health.get("rank_status", [])}
    return out


def serving(pkg: Path, flags: dict[str, list[str]]):
    """Start one server per entry of `flags`; returns ({name: url}, a function that stops them all)."""
    procs, urls = [], {}
    try:
        for name, extra in flags.items():
            proc, url = start_server(pkg, extra)
            procs.append(proc)
            urls[name] = url
    except BaseException:
        for proc in procs:
            stop_server(proc)
        raise
    return urls, lambda: [stop_server(p) for p in procs]


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r'^(moe_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$', line)
        if m:
            out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def layer_values(metrics: dict, name: str) -> list[float]:
    vals = metrics.get(name, {})
    return [vals[k] for k in sorted(vals, key=lambda k: int(re.search(r'layer="(\d+)"', k).group(1)))]


def workloads(pkg: Path, n: int, prompt_len: int, seed: int) -> dict[str, list[list[int]]]:
    """Token-id prompts from the held-out split: random windows, and the windows most routed to rank 0."""
    import numpy as np
    import torch

    from export.inference import load_package
    from export.serve.placement.algo import native_rank
    from export.serve.placement.predictor import record_routes

    from pipeline import data as data_lib
    from pipeline.recipe import validate_stored
    from pipeline.artifacts import cache_root

    manifest = read_manifest(pkg)
    prepared = data_lib.prepare_data(validate_stored(manifest["recipe"]).data, cache_root())
    val = torch.from_numpy(np.asarray(prepared.val).astype("int64"))  # the held-out split, loaded whole
    windows = val[: len(val) // prompt_len * prompt_len].view(-1, prompt_len)
    windows = windows[(windows != prepared.eod_id).all(dim=1)]  # within one document
    model, _ = load_package(pkg)
    routes = record_routes(model, windows, batch=64)  # [W, T, layers]
    share = torch.zeros(len(windows))
    for i, experts in enumerate(model.cfg.experts):
        on0 = torch.tensor([native_rank(e, experts, 2) == 0 for e in range(experts)])
        share += on0[routes[..., i]].float().mean(dim=1)
    g = torch.Generator().manual_seed(seed)
    picks = {"heldout": torch.randperm(len(windows), generator=g)[:n], "skewed": share.argsort(descending=True)[:n]}
    return {**{wl: windows[i].tolist() for wl, i in picks.items()},
            "_share": {"heldout": float(share.mean() / len(model.cfg.experts)),
                       "skewed": float(share.sort(descending=True).values[:n].mean() / len(model.cfg.experts))},
            "_routes": {wl: routes[i] for wl, i in picks.items()}, "_cfg": model.cfg}


def balancedness_ceilings(cfg, routes, concurrency: int, budget: float, ep: int = 2) -> dict:
    """What a replica table could reach on a workload's own routes ([prompts, T, layers], the prompt tokens'
    experts), in forwards shaped like the server's: each group of `concurrency` prompts prefilled in one forward,
    then T one-token-per-prompt forwards (the prompt's own tokens standing in for the generated ones). Balancedness
    as the server's metric: per layer the token-weighted mean over forwards of mean/max per rank, then the mean
    over layers. For the native table (none), the best single table for the workload's whole demand (a reactive
    planner that had seen it all), and an oracle: each forward its own best table, planned on its actual counts
    (no policy can know them in advance). Every table holds at most the budget's replica slots, as the server."""
    import torch

    from export.serve.placement.algo import balancedness, native_table, plan_replicas, rank_loads, replica_slots

    slots = replica_slots(cfg, ep, budget)
    L = len(cfg.experts)

    def counts(tokens):  # tokens [N, layers] -> per layer per expert counts
        return [torch.bincount(tokens[:, i], minlength=n)[:n].tolist() for i, n in enumerate(cfg.experts)]

    forwards = []
    for g in range(0, len(routes), concurrency):
        group = routes[g: g + concurrency]
        forwards.append(counts(group.reshape(-1, L)))
        forwards += [counts(group[:, t]) for t in range(group.shape[1])]
    whole = [[sum(f[i][e] for f in forwards) for e in range(n)] for i, n in enumerate(cfg.experts)]
    tables = {"none": native_table(cfg, ep), "best static": plan_replicas(cfg, ep, whole, slots)}
    out = {}
    for name in (*tables, "oracle"):
        num, den = [0.0] * L, [0.0] * L
        for f in forwards:
            table = tables.get(name) or plan_replicas(cfg, ep, f, slots)
            for i in range(L):
                w = sum(f[i])
                if w:
                    num[i] += w * balancedness(rank_loads(f[i], table[i], ep))
                    den[i] += w
        out[name] = sum(n / d for n, d in zip(num, den)) / L
    return {**out, "slots_per_rank": slots, "forwards": len(forwards)}


def share(seconds, total: float) -> str:
    """`seconds` as a share of `total` (the predictor's cost next to the serving time), '-' when not measured."""
    return "-" if not seconds else f"{100 * seconds / total:.0f}%"


def rank_times(ranks: list[dict]) -> dict:
    """Per rank, ms per forward since the server started: busy (in forwards, less the time in the expert exchange's
    collectives, which includes waiting for the other rank), computing experts; and the busiest rank's."""
    busy = [1e3 * (st["forward_s"] - st["exchange_s"]) / max(1, st["forwards"]) for st in ranks]
    expert = [1e3 * st["expert_s"] / max(1, st["forwards"]) for st in ranks]
    exchange = [1e3 * st["exchange_s"] / max(1, st["forwards"]) for st in ranks]
    top = max(range(len(busy)), key=busy.__getitem__) if busy else None
    return {"rank_busy_ms": busy, "rank_expert_ms": expert, "rank_exchange_ms": exchange,
            "busiest_rank_ms": busy[top] if busy else None,
            "expert_fraction": expert[top] / busy[top] if busy and busy[top] else None}


HEAVY = ["model.hidden=512", "model.heads=8", "model.experts=[8, 8]", "model.ffn_mult=16", "model.mlp_type=standard",
         "model.top_k=1"]


def expert_heavy_package(out: Path) -> Path:
    """`--expert-heavy`'s package (made once, reused) with its predictor."""
    from common import random_package

    if not (out / "predictor.json").is_file():
        random_package(out, layers=4, overrides=HEAVY)
        subprocess.run([*cli_command(), "predictor", "train", str(out), "--train-blocks", "32", "--val-blocks", "8",
                        "--steps", "40"], cwd=ROOT, env=child_env(), check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", type=Path, default=ROOT / "runs" / "tiny" / "package")
    p.add_argument("--budget", type=float, default=0.25, help="--replica-budget for every policy")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs of each workload per server; the median tokens/s")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "placement")
    p.add_argument("--expert-heavy", action="store_true",
                   help="a random package whose experts dominate the step, made under --out, instead of --package")
    p.add_argument("--ceilings-only", action="store_true",
                   help="only the balancedness a table could reach on the workloads' routes (no servers)")
    args = p.parse_args(argv)
    if args.expert_heavy:
        args.package = expert_heavy_package(args.out / "expert-heavy")
    if not is_package(args.package):
        p.error(f"--package {args.package}: not a package; run README command 1 first")
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    args.out.mkdir(parents=True, exist_ok=True)
    pkg = args.out / "pkg"
    if not (pkg / "predictor.json").is_file():
        shutil.rmtree(pkg, ignore_errors=True)
        shutil.copytree(args.package, pkg)
    if not (pkg / "predictor.json").is_file():  # the package's own predictor, else one trained here
        subprocess.run([*cli_command(), "predictor", "train", str(pkg)], cwd=ROOT, env=child_env(), check=True)
    predictor = json.loads((pkg / "predictor.json").read_text())["held_out"]
    loads = workloads(pkg, args.requests, args.prompt_len, args.seed)
    routes, cfg = loads.pop("_routes"), loads.pop("_cfg")
    res: dict = {"package": str(args.package), "budget": args.budget, "requests": args.requests,
                 "concurrency": args.concurrency, "new_tokens": args.new_tokens, "rank0_share": loads.pop("_share"),
                 "predictor": predictor, "placement": {}, "prefetch": {},
                 "ceilings": {wl: balancedness_ceilings(cfg, r, args.concurrency, args.budget) for wl, r in routes.items()}}
    if args.ceilings_only:
        report_ceilings(res)
        return 0
    for wl, prompts in loads.items():
        urls, stop = serving(pkg, {policy: ["--ep-size", "2", "--placement", policy, "--replica-budget", str(args.budget)]
                                   for policy in POLICIES})
        try:
            results = run_workloads(urls, prompts, args.new_tokens, args.concurrency, args.repeats)
        finally:
            stop()
        for policy, r in results.items():
            bal = layer_values(r["metrics"], "moe_placement_balancedness")
            native = [st.get("native_expert_bytes_all_resident", 0) for st in r["ranks"]]
            replicas = [st.get("replica_bytes", 0) for st in r["ranks"]]
            res["placement"].setdefault(wl, {})[policy] = {
                **rank_times(r["ranks"]), "step_balancedness": r["metrics"].get("moe_step_balancedness", {}).get(""),
                "predictor_cpu_s": r["metrics"].get("moe_predictor_cpu_seconds", {}).get(""),
                "predictor_wait_s": r["metrics"].get("moe_predictor_wait_seconds", {}).get(""),
                "table_changes": r["metrics"].get("moe_placement_table_changes", {}).get(""),
                "serve_seconds": r["serve_seconds"],
                "balancedness": bal, "mean_balancedness": sum(bal) / len(bal) if bal else None,
                "tok_s": r["tok_s"], "failures": r["failures"],
                "replica_memory": max(rp / nb for rp, nb in zip(replicas, native)) if native and min(native) else 0.0,
                "replicas": layer_values(r["metrics"], "moe_placement_replicas"),
                "recall": layer_values(r["metrics"], "moe_predictor_recall")}
            print(f"[placement] {wl:8s} {policy:10s} balancedness {bal} tok/s {r['tok_s']:.1f}", flush=True)
    urls, stop = serving(pkg, {str(f): ["--placement", "predictive", "--resident-experts", str(f)] for f in FRACTIONS})
    try:
        results = run_workloads(urls, loads["heldout"], args.new_tokens, args.concurrency, args.repeats)
    finally:
        stop()
    for fraction, r in results.items():
        hit = r["metrics"].get("moe_expert_prefetch_hit_rate", {}).get('{rank="0"}')
        res["prefetch"][fraction] = {"tok_s": r["tok_s"], "hit_rate": hit, "failures": r["failures"]}
        print(f"[placement] resident {fraction}: tok/s {r['tok_s']:.1f} hit rate {hit}", flush=True)
    report(res, args.out)
    return 0


def report_ceilings(res: dict) -> None:
    for wl, c in res["ceilings"].items():
        print(f"ceiling on {wl:8s} routes ({c['forwards']} forwards, {c['slots_per_rank']} replica slots a rank): "
              f"none {c['none']:.3f}, best static table {c['best static']:.3f}, oracle (each forward's own best "
              f"table) {c['oracle']:.3f}")


def report(res: dict, out: Path) -> None:
    B = res["budget"]
    print(f"\n== expert placement, EP 2, replica budget {B}, {res['requests']} requests x {res['new_tokens']} tokens, "
          f"{res['concurrency']} concurrent ==")
    print(f"routes to rank 0's experts: heldout {res['rank0_share']['heldout']:.2f}, skewed "
          f"{res['rank0_share']['skewed']:.2f} (prompt tokens)")
    print(f"{'workload':9s} {'policy':11s} {'balancedness/layer':>22s} {'mean':>6s} {'tok/s':>8s} {'replica mem':>12s} "
          f"{'recall':>14s}")
    for wl, rows in res["placement"].items():
        for policy, r in rows.items():
            bal = "/".join(f"{b:.3f}" for b in r["balancedness"])
            rec = "/".join(f"{x:.2f}" for x in r["recall"]) or "-"
            print(f"{wl:9s} {policy:11s} {bal:>22s} {r['mean_balancedness']:6.3f} {r['tok_s']:8.1f} "
                  f"{r['replica_memory']:12.3f} {rec:>14s}")
    print(f"\n{'workload':9s} {'policy':11s} {'busiest ms/fwd':>14s} {'busy ms/fwd per rank':>22s} "
          f"{'experts ms/fwd':>16s} {'exchange ms/fwd':>16s} {'step bal.':>9s} {'predictor cpu s':>15s} "
          f"{'waited for it':>13s} {'tables':>6s}")
    for wl, rows in res["placement"].items():
        for policy, r in rows.items():
            pc = r.get("predictor_cpu_s")
            print(f"{wl:9s} {policy:11s} {r['busiest_rank_ms']:14.2f} "
                  f"{'/'.join(f'{x:.2f}' for x in r['rank_busy_ms']):>22s} "
                  f"{'/'.join(f'{x:.2f}' for x in r['rank_expert_ms']):>16s} "
                  f"{'/'.join(f'{x:.2f}' for x in r['rank_exchange_ms']):>16s} "
                  f"{r['step_balancedness'] or 0:9.3f} {'-' if pc is None else f'{pc:.1f}':>15s} "
                  f"{share(r.get('predictor_wait_s'), r['serve_seconds']):>13s} {int(r.get('table_changes') or 0):6d}")
    report_ceilings(res)
    sk = res["placement"]["skewed"]
    pb, rb = sk["predictive"]["mean_balancedness"], sk["reactive"]["mean_balancedness"]
    oracle = res["ceilings"]["skewed"]["oracle"]
    print(f"target: skewed predictive balancedness {pb:.3f} >= 0.9 and >= reactive {rb:.3f}: "
          f"{'MET' if pb >= 0.9 and pb >= rb - 1e-9 else 'MISSED'} ({pb / oracle:.0%} of the oracle's {oracle:.3f})")
    gain = sk["predictive"]["tok_s"] / sk["none"]["tok_s"]
    # the most placement can give: the busiest rank's expert time brought down to the ranks' mean, nothing else
    none = sk["none"]
    mean_expert = sum(none["rank_expert_ms"]) / len(none["rank_expert_ms"])
    top = none["rank_busy_ms"].index(none["busiest_rank_ms"])
    bound = none["busiest_rank_ms"] / (none["busiest_rank_ms"] - (none["rank_expert_ms"][top] - mean_expert))
    res["skewed_gain"], res["skewed_gain_bound"] = gain, bound
    print(f"target: skewed predictive tok/s {gain:.2f}x none's (>= 1.1); bound from none's measured expert share "
          f"{none['expert_fraction']:.2f} of the busiest rank's forward and its imbalance: {bound:.2f}x "
          f"({'MET' if gain >= 1.1 else 'MISSED'}; {gain / bound:.0%} of the bound)")
    P = res["predictor"]
    print(f"predictor (held-out, {P['batch_tokens']}-token steps): demand error {P['demand_error']:.3f} vs frequency "
          f"baseline {P['frequency_demand_error']:.3f} ({'MET' if P['demand_error'] < P['frequency_demand_error'] else 'MISSED'}); "
          f"top-k recall {P['topk_recall']:.3f}; per layer top-1 "
          + ", ".join(f"{x['top1_accuracy']:.3f} (commonest {x['frequency_top1_accuracy']:.3f})" for x in P["layers"]))
    base = res["prefetch"]["1.0"]["tok_s"]
    for f, r in res["prefetch"].items():
        print(f"resident {f:>4s}: {r['tok_s']:8.1f} tok/s = {r['tok_s'] / base:.2f}x all-resident, hit rate "
              f"{r['hit_rate'] if r['hit_rate'] is None else round(r['hit_rate'], 3)}")
    half = res["prefetch"]["0.5"]["tok_s"] / base
    print(f"target: resident 0.5 keeps {half:.2f} of all-resident tok/s (>= 0.80): {'MET' if half >= 0.8 else 'MISSED'}")
    (out / "placement_bench.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out / "placement_bench.png")
    print(f"wrote {out / 'placement_bench.json'} and {out / 'placement_bench.png'}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    wls = list(res["placement"])
    for j, policy in enumerate(POLICIES):
        vals = [res["placement"][wl][policy]["mean_balancedness"] for wl in wls]
        ax.bar([i + 0.27 * (j - 1) for i in range(len(wls))], vals, width=0.27, label=policy)
    ax.axhline(0.85, color="gray", ls="--", lw=1)
    ax.set_xticks(range(len(wls)), wls)
    ax.set_ylim(0.4, 1.02)
    ax.set_title(f"balancedness (mean/max tokens per rank), budget {res['budget']}")
    ax.legend(loc="lower right")
    ax = axes[1]
    for j, policy in enumerate(POLICIES):
        vals = [res["placement"][wl][policy]["tok_s"] for wl in wls]
        ax.bar([i + 0.27 * (j - 1) for i in range(len(wls))], vals, width=0.27, label=policy)
    ax.set_xticks(range(len(wls)), wls)
    ax.set_title("tokens/s, EP 2")
    ax = axes[2]
    fr = list(res["prefetch"])
    ax.bar(fr, [res["prefetch"][f]["tok_s"] for f in fr], color="tab:green")
    for i, f in enumerate(fr):
        h = res["prefetch"][f]["hit_rate"]
        ax.text(i, res["prefetch"][f]["tok_s"], f"hit {h:.2f}" if h is not None else "", ha="center", va="bottom")
    ax.set_xlabel("resident expert fraction")
    ax.set_title("predictive prefetch, 1 rank: tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
