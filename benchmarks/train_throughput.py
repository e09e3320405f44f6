"""Training throughput of the tiny teacher (1 vs 2 ranks) and the cost of one DeepSpeed MoE layer.

    .venv/bin/python benchmarks/train_throughput.py                 # about 2-4 minutes on 2 CPU cores
    .venv/bin/python benchmarks/train_throughput.py --steps 50 --out /tmp/bench

Part 1, end to end: runs `moe-pipeline teacher recipes/tiny.yaml` (our own code path: recipe,
data, DeepSpeed engine, MoE, metrics) for `--steps` optimizer steps, once with `--nproc 1` and
once with `--nproc 2` (expert parallel degree 2 through the DeepSpeed launcher, gloo on CPU),
each into a fresh temporary run directory, and reads `tokens_per_s` from its `metrics.jsonl`.
The first logged window (compilation, allocator and page-cache warm-up) is left out and the rest
averaged. Both runs train the same global batch (16 x 128 tokens per step); the machine's cores
are split between the local ranks (`pipeline.dist.init`), so on 2 cores each of the 2 ranks
runs 1 thread: the 2-rank/1-rank ratio is the parallel efficiency on a fixed core budget, not a
scaling curve (1.0: two 1-thread ranks, paying gloo all-to-all and gradient all-reduce, keep
up with one 2-thread process; the spread column shows how steady the kept windows were).

Part 2, one layer in isolation (in this process, on a 1-rank process group, 2 threads): our
`MoE(cfg, E, impl="deepspeed")` in training mode (top-1, capacity factor 1.0, token dropping on)
against a dense MLP of equal *active* FLOPs, on `--tokens` tokens (default 2048 = one tiny
teacher step), forward (no_grad) and forward+backward (input gradient and aux loss included):

  * standard MoE (one routed expert per token) vs `MLP(cfg)` (ffn_mult 4): with capacity factor
    1.0 the E experts run on E x capacity = S token slots, exactly one expert MLP per token;
  * residual MoE (dense MLP + one routed expert, mixed by a 2-way coefficient) vs an MLP of
    ffn_mult 8, which has the same 16 h^2 multiply-adds per token as the two 4x MLPs.

So "MoE / dense" is the price of DeepSpeed's gating, token dispatch/combine and per-expert
small matmuls (the MoE layer's overhead), at E in {8, 32} and hidden 128 and 512. Timings are
medians over `--repeats` repeats after warm-up; the layers take turns within each repeat, and the
ratio is the median of each repeat's MoE time over the dense time measured next to it, so a slow
moment of a shared machine hits both sides. The dense MLP's achieved GFLOP/s, and a plain 2048^3
fp32 matmul's on 1 and on 2 threads, are printed for comparison with the machine's ceiling
(~150 GFLOP/s fp32 nominal on the 2-core development machine).

Results: a table on stdout, and `train_throughput.json` + `train_throughput.png` under `--out`
(default `benchmarks/results/`). The first run on a machine also tokenizes the bundled corpus
(cached under ~/.cache/moe-pipeline, or $MOE_PIPELINE_CACHE); that time is not in tokens/s.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cli_command, run_logged  # noqa: E402

RECIPE = "recipes/tiny.yaml"


# -- part 1: end-to-end training throughput ------------------------------------------------------

def train_throughput(nproc: int, steps: int, log_every: int, tmp: Path, timeout: float) -> dict:
    """Train the tiny teacher for `steps` steps on `nproc` ranks; tokens/s from metrics.jsonl."""
    run_dir = tmp / f"teacher-{nproc}rank"
    overrides = {
        "teacher.train.steps": steps,
        "teacher.train.warmup_steps": min(5, steps),
        "teacher.train.log_every": log_every,
        "teacher.train.checkpoint_every": 10**9,  # no checkpoint inside the measured windows
        "teacher.train.eval_every": 10**9,        # validation only once, after the last step
        "teacher.train.eval_batches": 1,
    }
    cmd = [*cli_command(), "teacher", RECIPE, "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    log = tmp / f"teacher-{nproc}rank.log"
    print(f"[train] {nproc} rank(s): {steps} steps ...", flush=True)
    wall = run_logged(cmd, log, timeout, append=False)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r["tokens_per_s"] for r in records if r.get("stage") == "teacher" and "tokens_per_s" in r]
    if len(windows) < 2:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has {len(windows)} throughput windows; need >= 2 "
                           f"(steps >= 2 x log_every)")
    measured = windows[1:]  # the first window is warm-up
    return {"nproc": nproc, "steps": steps, "log_every": log_every, "windows_tokens_per_s": windows,
            "tokens_per_s": statistics.fmean(measured),
            "spread": (max(measured) - min(measured)) / statistics.fmean(measured),
            "wall_s": round(wall, 1)}


# -- part 2: one MoE layer against a FLOP-matched dense MLP --------------------------------------

def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_gflops(threads: int, n: int = 2048, repeats: int = 3) -> float:
    """A plain n^3 fp32 matmul: what this machine's BLAS reaches on `threads` threads right now."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        return 2 * n**3 / statistics.median(_time_once(lambda: a @ b) for _ in range(repeats)) / 1e9
    finally:
        torch.set_num_threads(before)


def layer_overhead(hiddens: list[int], experts: list[int], tokens: int, warmup: int, repeats: int) -> list[dict]:
    import torch

    from pipeline import dist
    from pipeline.model import MLP, ModelConfig, MoE

    dist.init()  # DeepSpeed's MoE needs a process group for its (here 1-rank) expert-parallel group
    torch.set_num_threads(2)
    torch.manual_seed(0)
    seq = 128
    assert tokens % seq == 0, "--tokens must be a multiple of 128 (the tiny recipe's seq_len)"
    rows = []
    for h in hiddens:
        def cfg(ffn_mult=4, mlp_type="standard", e=8):
            return ModelConfig(vocab_size=256, seq_len=seq, layers=2, hidden=h, heads=4, experts=(e,), moe_layers=(1,),
                               mlp_type=mlp_type, top_k=1, capacity_factor=1.0, eval_capacity_factor=None,
                               min_capacity=4, aux_loss_coef=0.01, ffn_mult=ffn_mult, dropout=0.0,
                               tie_embeddings=True, init_std=0.02)

        layers: dict[str, torch.nn.Module] = {"dense x4": MLP(cfg(4)), "dense x8": MLP(cfg(8))}
        for mlp_type in ("standard", "residual"):
            for e in experts:
                moe = MoE(cfg(mlp_type=mlp_type, e=e), e, impl="deepspeed").train()
                moe.moe.set_deepspeed_parallelism()
                layers[f"{mlp_type} E={e}"] = moe
        x = torch.randn(tokens // seq, seq, h)

        def fwd(layer):
            with torch.no_grad():
                layer(x)

        def fwd_bwd(layer):
            xi = x.detach().requires_grad_(True)
            out = layer(xi)
            loss = out[0].sum() + out[1] if isinstance(out, tuple) else out.sum()
            loss.backward()
            layer.zero_grad(set_to_none=True)

        times: dict[tuple[str, str], list[float]] = {}
        for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            for layer in layers.values():
                for _ in range(warmup):
                    fn(layer)
            for _ in range(repeats):  # interleaved, so a noisy moment hits every layer alike
                for name, layer in layers.items():
                    times.setdefault((name, mode), []).append(_time_once(lambda: fn(layer)))
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}

        def paired_ratio(name, base, mode):  # each repeat's MoE call against the dense call next to it
            return statistics.median(a / b for a, b in zip(times[name, mode], times[base, mode]))

        for mode in ("fwd", "fwd+bwd"):
            for name in layers:
                if name.startswith("dense"):
                    continue
                base = "dense x4" if name.startswith("standard") else "dense x8"
                rows.append({"hidden": h, "layer": name, "baseline": base, "mode": mode, "tokens": tokens,
                             "moe_ms": round(ms[name, mode], 3), "dense_ms": round(ms[base, mode], 3),
                             "ratio": round(paired_ratio(name, base, mode), 3)})
            for base, mult in (("dense x4", 4), ("dense x8", 8)):
                flops = 4 * tokens * mult * h * h * (3 if mode == "fwd+bwd" else 1)
                rows.append({"hidden": h, "layer": base, "mode": mode, "tokens": tokens,
                             "dense_ms": round(ms[base, mode], 3), "gflops": round(flops / ms[base, mode] / 1e6, 1)})
        print(f"[layer] hidden {h} done", flush=True)
    return rows


# -- report ---------------------------------------------------------------------------------------

def print_report(train: list[dict], layers: list[dict], peak: dict | None) -> None:
    print()
    if train:
        print("== tiny teacher training (recipes/tiny.yaml, 16 x 128 tokens/step, fp32, gloo/CPU) ==")
        print(f"{'ranks':>5} {'threads/rank':>12} {'tokens/s':>9} {'spread':>7}  windows (first = warm-up, excluded)")
        for t in train:
            threads = max(1, (os.cpu_count() or 1) // t["nproc"])
            windows = ", ".join(f"{w:.0f}" for w in t["windows_tokens_per_s"])
            print(f"{t['nproc']:>5} {threads:>12} {t['tokens_per_s']:>9.0f} {100 * t['spread']:>6.0f}%  [{windows}]")
        if len(train) == 2:
            ratio = train[1]["tokens_per_s"] / train[0]["tokens_per_s"]
            print(f"2-rank / 1-rank tokens/s = {ratio:.2f}  (same {os.cpu_count()} cores split between the ranks: "
                  f"parallel efficiency on a fixed core budget, ideal 1.00)")
        print()
    if layers:
        tokens = layers[0]["tokens"]
        print(f"== one MoE layer vs a dense MLP of equal active FLOPs ({tokens} tokens, top-1, capacity 1.0, "
              "training mode, 2 threads, median ms; "
              "ratio = median of paired MoE/dense repeats) ==")
        print(f"{'hidden':>6} {'MoE layer':<14} {'baseline':<9} {'fwd MoE':>8} {'dense':>7} {'ratio':>6}   "
              f"{'f+b MoE':>8} {'dense':>7} {'ratio':>6}")
        by = {(r["hidden"], r["layer"], r["mode"]): r for r in layers}
        for (h, name, mode), r in by.items():
            if mode != "fwd" or "baseline" not in r:
                continue
            b = by[h, name, "fwd+bwd"]
            print(f"{h:>6} {name:<14} {r['baseline']:<9} {r['moe_ms']:>8.2f} {r['dense_ms']:>7.2f} {r['ratio']:>5.2f}x   "
                  f"{b['moe_ms']:>8.2f} {b['dense_ms']:>7.2f} {b['ratio']:>5.2f}x")
        print("dense MLP achieved GFLOP/s (fwd / fwd+bwd):  " + "   ".join(
            f"h{h} {name}: {by[h, name, 'fwd']['gflops']:.0f} / {by[h, name, 'fwd+bwd']['gflops']:.0f}"
            for (h, name, mode) in by if mode == "fwd" and name.startswith("dense")))
        print(f"plain 2048^3 fp32 matmul: {peak[1]:.0f} GFLOP/s on 1 thread, {peak[2]:.0f} on 2 "
              "(nominal ceiling of the 2-core dev machine ~150 GFLOP/s fp32)")


def save(out: Path, result: dict) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "train_throughput.json", out / "train_throughput.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, layers = result["train"], [r for r in result["layers"] if "ratio" in r]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80, gridspec_kw={"width_ratios": [1, 3]})
    ax = axes[0]
    if train:
        ax.bar([f"{t['nproc']} rank" for t in train], [t["tokens_per_s"] for t in train], color=["C0", "C1"][:len(train)])
        for i, t in enumerate(train):
            ax.text(i, t["tokens_per_s"], f"{t['tokens_per_s']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_title("tiny teacher, tokens/s", fontsize=9)
    ax.tick_params(labelsize=8)
    ax = axes[1]
    if layers:
        labels = list(dict.fromkeys((r["hidden"], r["layer"]) for r in layers))  # hidden, standard/residual, E
        idx = {k: i for i, k in enumerate(labels)}
        for j, mode in enumerate(("fwd", "fwd+bwd")):
            rs = [r for r in layers if r["mode"] == mode]
            ax.bar([idx[r["hidden"], r["layer"]] + (j - 0.5) * 0.4 for r in rs], [r["ratio"] for r in rs], width=0.4,
                   label=mode)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(labels)), [f"h{h}\n{n[:3]} {n.split()[-1]}" for h, n in labels], fontsize=7)
        ax.legend(fontsize=8)
    ax.set_title("MoE time / FLOP-matched dense MLP time", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return json_path, png_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where JSON and PNG go")
    p.add_argument("--steps", type=int, default=30, help="teacher training steps per run")
    p.add_argument("--log-every", type=int, default=10, help="steps per throughput window")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per MoE layer call (multiple of 128)")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per layer and mode")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per layer and mode (median)")
    p.add_argument("--skip-train", action="store_true", help="only the layer benchmark")
    p.add_argument("--skip-layer", action="store_true", help="only the training runs")
    args = p.parse_args(argv)
    if args.steps < 2 * args.log_every:
        p.error("--steps must be at least 2 x --log-every (the first window is warm-up)")
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()

    train = []
    if not args.skip_train:  # first: the layer benchmark's process group would leak into the children
        tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
        try:
            for nproc in (1, 2):
                train.append(train_throughput(nproc, args.steps, args.log_every, tmp, timeout=300))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    layers, peak = [], None
    if not args.skip_layer:
        layers = layer_overhead(args.hidden, args.experts, args.tokens, args.warmup, args.repeats)
        peak = {t: round(matmul_gflops(t), 1) for t in (1, 2)}

    import torch

    total = time.perf_counter() - t0
    result = {
        "meta": {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                 "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "deepspeed": __import__("deepspeed").__version__, "recipe": RECIPE, "args": {
                     k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "total_seconds": round(total, 1)},
        "train": train,
        "train_ratio_2_over_1": (train[1]["tokens_per_s"] / train[0]["tokens_per_s"]) if len(train) == 2 else None,
        "matmul_2048_gflops_by_threads": peak,
        "layers": layers,
    }
    print_report(train, layers, peak)
    json_path, png_path = save(args.out, result)
    print(f"\nwrote {json_path} and {png_path}; total {total:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
