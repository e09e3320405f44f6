"""The greedy head's screens against the whole output layer, by row count, on one CPU.

    .venv/bin/python benchmarks/head_screen.py                                        # the peer package's head
    .venv/bin/python benchmarks/head_screen.py --package PKG --rows 1 8 32 --out runs/bench/head_screen

For each row count, in turn and alternated --repeats times (the memory's speed drifts on these machines), the same
hidden states (unit RMS, each row's logits peaked at a random output as a trained model's are not: the random peer
model's flat logits are what the race serves) through: the whole layer as the server runs it unscreened
(`ServingWeight.linear`: the few-row kernel up to 8 rows, oneDNN past them) and `argmax_rows`; the bf16 x int8 screen
(csrc/heads.cpp `screen_argmax`, up to 8 rows); and the int8 x int8 screen (`screen_argmax_vnni`, AVX512_VNNI builds,
up to 64 rows). Checks that both screens give the few-row kernel's tokens, counts each call's candidates, and prints
the CPU, ms (medians) and the speedups; writes head_screen.json and head_screen.png under --out. The head is
--package's `lm_head.weight` (default: benchmarks/peer_bench.py's bf16 package; a random 50,304 x 1024 bf16 one if
there is none, or --random's shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_info, cpu_line  # noqa: E402


def head_weight(package: Path | None, random: list[int] | None = None) -> tuple[torch.Tensor, str]:
    """The bf16 output layer of --package (or of the peer benchmark's package), or a random one of its shape (or of
    `random`'s [out, in])."""
    from safetensors import safe_open

    candidates = [] if random else [package] if package else sorted(
        (ROOT / ".peers" / "work").glob("checkpoint-*/ours-package"))
    for pkg in candidates:
        for f in sorted(Path(pkg).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                if "lm_head.weight" in st.keys():
                    return st.get_tensor("lm_head.weight").to(torch.bfloat16).contiguous(), str(pkg)
    if package:
        raise SystemExit(f"--package {package}: no lm_head.weight in its safetensors files")
    torch.manual_seed(0)
    O, I = random or (50304, 1024)
    return (torch.randn(O, I) * 0.02).to(torch.bfloat16), f"random {O:,} x {I:,}"


def candidates(fn, most: int) -> int:
    """The candidates of a screen call: the smallest `most` it answers with (it declines past it)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi) // 2
        if fn(mid).numel():
            hi = mid
        else:
            lo = mid + 1
    return lo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=Path, default=None)
    p.add_argument("--random", type=int, nargs=2, metavar=("OUT", "IN"), help="a random head of this shape instead")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "head_screen")
    args = p.parse_args(argv)

    from export.serve import kernels
    from export.serve.kernels import HeadScreen, ServingWeight

    k = kernels.kernel()
    if k is None or not hasattr(k, "screen_argmax"):
        raise SystemExit("no GEMV kernel on this machine: nothing to compare")
    cpu = cpu_info()
    print(cpu_line(cpu), flush=True)
    w, source = head_weight(args.package, args.random)
    O, I = w.shape
    served = ServingWeight(w, pack=True)
    screen = HeadScreen(served)
    vnni = screen.vnni
    q = screen.int8.values().contiguous() if vnni else screen.q  # the bf16 x int8 screen's row-major copy
    print(f"head: {source}, {O} x {I} bf16; int8 x int8 screen: {'yes' if vnni else 'no (no AVX512_VNNI build)'}",
          flush=True)
    torch.manual_seed(1)
    results = []
    for M in args.rows:
        x = torch.randn(M, I)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
        x += w[torch.randint(0, O, (M,))].float() * 20  # peaked logits
        x = x.to(torch.bfloat16).contiguous()
        want = kernels.argmax_rows(torch.cat([k.linear(x[i:i + 8], w, None) for i in range(0, M, 8)]))
        ways = {"whole": lambda: kernels.argmax_rows(served.linear(x))}
        if M <= k.MAX_ROWS:
            ways["bf16 x int8"] = lambda: k.screen_argmax(x, w, q, screen.scale, screen.err, O)
        if vnni and M <= k.VNNI_MAX_ROWS:
            ways["int8 x int8"] = lambda: k.screen_argmax_vnni(x, w, screen.int8.q, screen.int8.scale, screen.err,
                                                                screen.err2, screen.top, screen.norm, O)
        row = {"rows": M, "ms": {}, "candidates": {}}
        for name, fn in ways.items():
            if name != "whole":
                got = fn().tolist()
                assert got == want, f"{name} at {M} rows: {got} != {want}"
        times = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        for name in ways:
            row["ms"][name] = 1e3 * statistics.median(times[name])
        if M <= k.MAX_ROWS:
            row["candidates"]["bf16 x int8"] = candidates(
                lambda most: k.screen_argmax(x, w, q, screen.scale, screen.err, most), O)
        if "int8 x int8" in ways:
            row["candidates"]["int8 x int8"] = candidates(lambda most: k.screen_argmax_vnni(
                x, w, screen.int8.q, screen.int8.scale, screen.err, screen.err2, screen.top, screen.norm, most), O)
        results.append(row)
        cells = ", ".join(f"{n} {v:.2f} ms" + (f" ({row['ms']['whole'] / v:.2f}x)" if n != "whole" else "")
                          for n, v in row["ms"].items())
        cands = ", ".join(f"{n} {c / M:.1f}" for n, c in row["candidates"].items())
        print(f"{M:3d} rows: {cells}; candidates a row: {cands or '-'}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_screen.json").write_text(json.dumps({"cpu": cpu, "head": source, "shape": [O, I],
                                                            "results": results}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("whole", "bf16 x int8", "int8 x int8"):
        pts = [(r["rows"], r["ms"][name]) for r in results if name in r["ms"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (greedy decode batch)")
    ax.set_ylabel("ms a call (median)")
    ax.set_title(f"greedy head {O} x {I}: {cpu.get('model', 'CPU')}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "head_screen.png", dpi=120)
    print(f"{args.out / 'head_screen.json'}, {args.out / 'head_screen.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
