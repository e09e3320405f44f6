"""One MoE layer's forward at 2 ranks in the data-parallel serving mode: DeepSpeed's capacity-padded exchange
against our variable-split one, timed side by side.

    .venv/bin/python benchmarks/moe_exchange_bench.py                      # tiny shapes and hidden 512, 8 experts
    .venv/bin/python benchmarks/moe_exchange_bench.py --tokens 1 8 32 --repeats 10 --shapes tiny-e8

Run plainly, it relaunches itself on 2 ranks through the DeepSpeed launcher (the same as
`.venv/bin/python -m deepspeed.launcher.runner --num_gpus 2 --master_port P --no_local_rank
benchmarks/moe_exchange_bench.py ...`). Each rank holds different tokens and half of the layer's experts
(expert e on rank e // (experts / 2), DeepSpeed's layout), and calls the layer on its own tokens:

  * A, `pipeline.model.MoE(impl="deepspeed", ep_size=2)` in eval mode with no token dropping
    (eval_capacity_factor null, as recipes/tiny.yaml): DeepSpeed's gate all-reduces the busiest expert's load
    (MAX over the ranks) and pads every expert to it, so each rank sends a [experts, capacity, C] tensor in an
    all-to-all, every expert runs over 2 x capacity rows (padding included), and the outputs come back the same way;
  * B, `export.serve.placement.exchange.PlacedMoE` with a native table: an all-gather of the per-expert counts, then
    an all-to-all with variable splits (`export/serve/transport.py` `all_to_all_`) of exactly the routed tokens, each expert once
    over what it received, and back.

Both get the same weights (gate, experts, the residual MLP and its coefficient when the config is residual; the
experts reach B through an ExpertStore over a safetensors file written here), and their outputs are checked
against each other and against the plain-PyTorch reference layer (max abs difference < --tol, fp32) before any
timing. Shapes: the tiny recipe's MoE layer (hidden, mlp_type, top_k from recipes/tiny.yaml) with 4 experts (its
lower MoE layers) and 8 (its top one), and `h512-e8` (hidden 512, 8 experts). Tokens per rank in --tokens
(decode-like 1 to prefill-like 2048), random normal inputs (`--skew`: plus that many times a fixed direction,
so the router prefers some experts, as trained routers do). Timing: one thread per rank, warm-up, then
--repeats calls of each implementation (more for short calls: --min-seconds), taking turns (A B, then B A), a
barrier before each call; a call's time is the slower rank's; the median over repeats is reported, the best
repeat, and the median of the repeats' paired A/B ratios. Bytes: what each rank hands to the all-to-alls (both
ways), counted by wrapping deepspeed.comm.all_to_all_single for one untimed call, and the part of it that leaves
the rank (a rank's own slice is a local copy).

Writes moe_exchange.json (settings, every row, the raw per-call times) and moe_exchange.png under --out
(default benchmarks/results/moe_exchange), and prints the table. Measured on the CPU (gloo); this machine's
speed drifts with other jobs, hence the interleaving and the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env  # noqa: E402

sys.path.insert(0, str(ROOT))

TOKENS = (1, 8, 32, 256, 2048)
SHAPES = {"tiny-e4": (None, 4), "tiny-e8": (None, 8), "h512-e8": (512, 8)}  # name: (hidden or the recipe's, experts)
RANKS = 2


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe_exchange")
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "tiny.yaml",
                    help="hidden, mlp_type, top_k, ffn_mult of its model (default: the tiny recipe)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="tokens per rank")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each implementation, at least")
    ap.add_argument("--min-seconds", type=float, default=2.0, help="more repeats for short calls, up to this many "
                    "seconds per implementation and point (200 calls at most); 0: exactly --repeats")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skew", type=float, default=0.0, help="add this times a fixed unit-variance direction to every "
                    "token: the router then favours some experts (0: random tokens, near-even loads)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs difference allowed between A, B and the reference")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def relaunch(argv: list[str]) -> int:
    """This script on RANKS ranks through the DeepSpeed launcher, one thread each, on the CPU."""
    from pipeline.dist import free_port

    env = child_env()
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 ranks share 2 cores with whatever else runs: no spinning
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(RANKS), "--master_port",
           str(free_port()), "--no_local_rank", str(Path(__file__).resolve()), *argv]
    print(f"launching {RANKS} ranks: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


# -- the two layers, with the same weights ---------------------------------------------------------------------

def layer_config(recipe_path: Path, hidden: int | None, experts: int):
    """A one-layer ModelConfig whose only layer is an MoE of `experts` (the recipe's model otherwise)."""
    from pipeline.build import teacher_config
    from pipeline.recipe import load_recipe

    cfg = teacher_config(load_recipe(recipe_path))
    # another width: the fields resolved from it (head_dim, kv_heads, ffn_hidden, expert_hidden) resolved again
    width = {} if hidden in (None, cfg.hidden) else dict(hidden=hidden, head_dim=None, kv_heads=None, ffn_hidden=None,
                                                         expert_hidden=None)
    return dataclasses.replace(cfg, layers=1, moe_layers=(0,), experts=(experts,), **width)


def build_layers(cfg, rank: int, seed: int, store_dir: Path):
    """(reference, A, B) in eval mode: the plain-PyTorch layer with every expert, DeepSpeed's over 2 ranks (this
    rank's half of the experts), PlacedMoE with a native table; every weight taken from the reference."""
    import torch
    from safetensors.torch import save_file

    from export.serve.placement.exchange import Exchange, PlacedMoE
    from export.serve.placement.residency import ExpertStore, Residency
    from pipeline.artifacts import WEIGHTS
    from pipeline.model import MoE, expert_key, split_expert_key

    E = cfg.experts[0]
    torch.manual_seed(seed)  # the same draws on both ranks
    ref = MoE(cfg, E, impl="reference").eval().requires_grad_(False)
    weights = ref.state_dict()  # moe.deepspeed_moe.{gate.wg, experts.deepspeed_experts.e.*}, moe.{mlp, coefficient}.*

    ds = MoE(cfg, E, impl="deepspeed", ep_size=RANKS)
    ds.moe.set_deepspeed_parallelism()  # the expert-parallel group, as pipeline.build.set_groups makes it
    local = ds.num_local_experts
    mine = {}
    for name in ds.state_dict():
        key = split_expert_key("blocks.0.mlp." + name)  # the names of a block's MoE, as the model's
        own = f"deepspeed_experts.{key.expert}." if key else ""
        mine[name] = weights[name.replace(own, f"deepspeed_experts.{rank * local + key.expert}.") if key else name]
    ds.load_state_dict(mine, strict=True)
    ds = ds.eval().requires_grad_(False)

    # B's experts come from a package-like safetensors file, as the serving runtime maps them
    store_dir.mkdir(parents=True, exist_ok=True)
    experts = {}
    for name, t in weights.items():
        key = split_expert_key("blocks.0.mlp." + name)
        if key is not None:
            experts[expert_key(cfg.moe_layers[0], key.expert, key.suffix)] = t.contiguous()
    save_file(experts, str(store_dir / WEIGHTS))
    residency = Residency(cfg, ExpertStore(store_dir, cfg, torch.float32), rank, RANKS)
    placed = PlacedMoE(cfg, 0, E, Exchange(cfg, residency, rank, RANKS))
    placed.load_state_dict({k: v for k, v in weights.items() if ".experts." not in k}, strict=True)
    placed = placed.eval().requires_grad_(False)
    return ref, ds, placed


# -- measuring ---------------------------------------------------------------------------------------------------

class ExchangeCounter:
    """Wraps deepspeed.comm.all_to_all_single (both implementations' exchanges go through it) while active: the
    bytes this rank hands to each call and the part of them bound for other ranks."""

    def __init__(self, rank: int):
        import deepspeed.comm as dc

        self.dc, self.rank, self.calls = dc, rank, []
        self._orig = dc.all_to_all_single

    def __enter__(self):
        def counted(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
            splits = input_split_sizes or [tensor.shape[0] // RANKS] * RANKS
            self.calls.append({"shape": list(tensor.shape), "bytes": tensor.shape[0] * row,
                               "off_rank": (tensor.shape[0] - splits[self.rank]) * row})
            return self._orig(output, tensor, output_split_sizes=output_split_sizes,
                              input_split_sizes=input_split_sizes, group=group, **kw)

        self.dc.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        self.dc.all_to_all_single = self._orig


def tokens_for(rank: int, T: int, C: int, seed: int, skew: float):
    """[1, T, C]: this rank's own tokens (different on each rank), optionally pulled towards a shared direction."""
    import torch

    x = torch.randn(1, T, C, generator=torch.Generator().manual_seed(seed * 7919 + rank * 104729 + T))
    if skew:
        u = torch.randn(C, generator=torch.Generator().manual_seed(seed + 1))
        x = x + skew * u / u.std()
    return x


def measure(cfg, name: str, layers, rank: int, args) -> list[dict]:
    """Every --tokens size: check the outputs, count the bytes, time both. Rows (rank 0's view of both ranks)."""
    import torch

    from pipeline import dist

    ref, ds, placed = layers
    impls = {"A": lambda x: ds(x)[0], "B": lambda x: placed(x)[0]}
    rows = []
    for T in args.tokens:
        x = tokens_for(rank, T, cfg.hidden, args.seed, args.skew)
        with torch.no_grad():
            want = ref(x)[0]
            bytes_of = {}
            for key, f in impls.items():
                with ExchangeCounter(rank) as counter:
                    got = f(x)
                err = (got - want).abs().max().item()
                if err > args.tol:
                    raise SystemExit(f"{name}, {T} tokens per rank: {key} differs from the reference by {err:.2e} "
                                     f"(> --tol {args.tol}) on rank {rank}")
                bytes_of[key] = counter.calls
            diff = (impls["A"](x) - impls["B"](x)).abs().max().item()
            if diff > args.tol:
                raise SystemExit(f"{name}, {T} tokens per rank: A and B differ by {diff:.2e} on rank {rank}")
            # routing, for the capacity A pads to: this rank's tokens per expert
            from pipeline.model import route, router_logits

            r = route(router_logits(x.reshape(T, -1), ref.moe.deepspeed_moe.gate.wg.weight), cfg.top_k, cfg.top_k > 1)
            per_expert = r.counts.tolist()
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                for f in impls.values():
                    dist.barrier()
                    f(x)
            # at least --repeats, more for short calls (up to --min-seconds per implementation, 200 at most): the
            # same count on both ranks, from the slower rank's warm-up
            per_call = max(max(dist.gather_numbers([(time.perf_counter() - t0) / max(1, 2 * args.warmup)])))
            repeats = max(args.repeats, min(200, int(args.min_seconds / per_call)))
            times = {"A": [], "B": []}
            for i in range(repeats):
                for key in ("AB" if i % 2 == 0 else "BA"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    impls[key](x)
                    times[key].append(time.perf_counter() - t0)
        # a call's time: the slower rank's
        slowest = {k: [max(col) for col in zip(*dist.gather_numbers(v))] for k, v in times.items()}
        sent = {k: dist.gather_numbers([sum(c["bytes"] for c in calls), sum(c["off_rank"] for c in calls)])
                for k, calls in bytes_of.items()}
        loads = dist.gather_numbers(per_expert)  # [rank][expert]
        errs = dist.gather_numbers([diff])
        total = [sum(col) for col in zip(*loads)]
        a_ms, b_ms = (statistics.median(slowest[k]) * 1e3 for k in "AB")
        a_best, b_best = (min(slowest[k]) * 1e3 for k in "AB")
        capacity = bytes_of["A"][0]["shape"][1] if bytes_of["A"] else 0
        row = {"shape": name, "hidden": cfg.hidden, "experts": cfg.experts[0], "top_k": cfg.top_k,
               "mlp_type": cfg.mlp_type, "tokens_per_rank": T, "A_ms": a_ms, "B_ms": b_ms,
               "A_ms_best": a_best, "B_ms_best": b_best,
               "speed_B_over_A": a_ms / b_ms,
               "A_bytes_per_rank": [s[0] for s in sent["A"]], "A_off_rank_bytes": [s[1] for s in sent["A"]],
               "B_bytes_per_rank": [s[0] for s in sent["B"]], "B_off_rank_bytes": [s[1] for s in sent["B"]],
               "A_capacity": capacity, "A_padded_rows_per_rank": capacity * cfg.experts[0],
               "routed_pairs_per_rank": [sum(lo) for lo in loads], "tokens_per_expert": total,
               # paired by repeat (A and B ran back to back): robust to this machine's drift
               "B_faster_in": sum(b < a for a, b in zip(slowest["A"], slowest["B"])), "repeats": repeats,
               "paired_speed_B_over_A": statistics.median(a / b for a, b in zip(slowest["A"], slowest["B"])),
               "max_abs_diff_A_B": max(e[0] for e in errs),
               "A_ms_all": slowest["A"], "B_ms_all": slowest["B"]}
        row["A_ms_all"] = [t * 1e3 for t in row["A_ms_all"]]
        row["B_ms_all"] = [t * 1e3 for t in row["B_ms_all"]]
        rows.append(row)
        if rank == 0:
            print(f"[{name}] {T:5d} tokens/rank: A {a_ms:8.3f} ms  B {b_ms:8.3f} ms  (capacity {capacity}, "
                  f"|A-B| {row['max_abs_diff_A_B']:.1e})", flush=True)
    return rows


# -- reporting -----------------------------------------------------------------------------------------------------

def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def table(rows: list[dict]) -> str:
    head = (f"{'shape':8} {'tok/rank':>8} {'A ms':>8} {'B ms':>8} {'B/A':>6}  {'A best':>8} {'B best':>8} {'B/A':>6}  "
            f"{'paired':>6}  {'A cap':>5}  {'A sends':>9} {'B sends':>9}  {'A off':>9} {'B off':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['shape']:8} {r['tokens_per_rank']:8d} {r['A_ms']:8.2f} {r['B_ms']:8.2f} "
                     f"{r['speed_B_over_A']:5.2f}x  {r['A_ms_best']:8.2f} {r['B_ms_best']:8.2f} "
                     f"{r['A_ms_best'] / r['B_ms_best']:5.2f}x  {r['paired_speed_B_over_A']:5.2f}x  "
                     f"{r['A_capacity']:5d}  {human(max(r['A_bytes_per_rank'])):>9} "
                     f"{human(max(r['B_bytes_per_rank'])):>9}  "
                     f"{human(max(r['A_off_rank_bytes'])):>9} {human(max(r['B_off_rank_bytes'])):>9}")
    lines.append("B/A = A ms / B ms: >1, B (the variable-split exchange) is faster. ms: the median over repeats\n"
                 "of the slower rank's call; best: the fastest repeat (a call when neither rank is descheduled);\n"
                 "paired: the median over repeats of A/B, each repeat's A and B run back to back (robust to drift).\n"
                 "A cap: the capacity DeepSpeed pads every expert to. sends: bytes a rank hands to the two\n"
                 "all-to-alls (there and back; the busier rank). off: the part of them that leaves the rank.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.6 * len(shapes), 7), squeeze=False)
    for j, s in enumerate(shapes):
        rs = [r for r in rows if r["shape"] == s]
        T = [r["tokens_per_rank"] for r in rs]
        ax = axes[0][j]
        ax.plot(T, [r["A_ms"] for r in rs], "o-", label="A: DeepSpeed MoE (capacity-padded)")
        ax.plot(T, [r["B_ms"] for r in rs], "s-", label="B: PlacedMoE (variable splits)")
        ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="ms per layer forward (median)",
               title=f"{s}: hidden {rs[0]['hidden']}, {rs[0]['experts']} experts, top-{rs[0]['top_k']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][j]
        ax.plot(T, [max(r["A_off_rank_bytes"]) for r in rs], "o-", label="A off-rank bytes")
        ax.plot(T, [max(r["B_off_rank_bytes"]) for r in rs], "s-", label="B off-rank bytes")
        ax.set(xscale="log", xlabel="tokens per rank", ylabel="bytes to the other rank per forward (both ways)")
        ax.set_yscale("symlog", linthresh=256)  # B sends nothing when every token stays on its rank
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("One MoE layer at 2 ranks, data-parallel serving (each rank its own tokens), CPU, 1 thread/rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    from pipeline import dist

    if not dist.under_launcher():
        return relaunch(argv)
    args = parse(argv)
    import torch

    ranks = dist.init()
    if ranks.world != RANKS:
        raise SystemExit(f"moe_exchange_bench needs {RANKS} ranks, got {ranks.world}")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix=f"moe-exchange-r{ranks.rank}-"))
    rows = []
    try:
        for name in args.shapes:
            hidden, experts = SHAPES[name]
            cfg = layer_config(args.recipe, hidden, experts)
            layers = build_layers(cfg, ranks.rank, args.seed, work / name)
            rows += measure(cfg, name, layers, ranks.rank, args)
            del layers
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if ranks.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {"ranks": RANKS, "threads_per_rank": 1, "repeats": args.repeats, "min_seconds": args.min_seconds,
                    "warmup": args.warmup, "skew": args.skew, "seed": args.seed, "recipe": str(args.recipe),
                    "tol": args.tol,
                    "device": "cpu (gloo)", "torch": torch.__version__,
                    "deepspeed": __import__("deepspeed").__version__, "cpus": os.cpu_count(),
                    "load_average": os.getloadavg()}
        (args.out / "moe_exchange.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
        plot(rows, args.out / "moe_exchange.png")
        print(table(rows))
        print(f"wrote {args.out / 'moe_exchange.json'} and {args.out / 'moe_exchange.png'}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
