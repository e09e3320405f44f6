"""One MoE layer as the server runs it, against what this machine can do: time, GB/s of expert weights read, GFLOP/s,
and the fractions of the machine's measured read bandwidth and measured multiply-add peak.

    python benchmarks/moe_layer_bench.py                               # every shape, rows, format, ISA build here
    python benchmarks/moe_layer_bench.py --shapes deep --rows 1 32 --formats bf16 --isa AVX2

The layer is the data-parallel path's `PlacedMoE` on one rank (export/serve/placement/exchange.py: routing, the
experts, the weighted combine), built by `place_experts` from random weights written as a one-layer model, with each
format's weights as `serve --quantize` loads them (bf16; int8 weight-only; w8a8; int4). Shapes: `deep`, the MoE of
the deep peer model (benchmarks/peer_bench.py --model deep: hidden 1024, 64 experts of width 256, top-8, SwiGLU),
and `qwen3-30b`, Qwen3-30B-A3B's own (hidden 2048, 128 experts of width 768, top-8). Rows: tokens in one call (1, 8,
32: decode batches; 128 and 2048: prefill chunks). Routing: the random router's, close to uniform (a trained
router's is more skewed).

Every instruction-set build of the kernels this CPU can run is measured (kernels/extension.py `build`: AVX2, AVX512,
AVX512_BF16, AMX_BF16; the ones the CPU lacks are listed as skipped with the reason), each in a process of its own
whose oneDNN and ATen are limited to that instruction set (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), as on a CPU that
has no more: an AVX2 row on an AVX-512 machine is what an AVX2-only CPU of its bandwidth and clock would run.

Bounds, both measured here first: the read bandwidth (the faster of benchmarks/common.py `read_bandwidth`, best of
three, and our kernel's one-row linear over a 512 MB weight) and the multiply-add
peak (the best GFLOP/s of large torch.mm products in fp32, bf16 and int8 where torch has one). A cell's bandwidth
time is the expert bytes it reads (every expert with a token, once: each format's own bytes and scales) over the
bandwidth; its compute time, the flops (2 x pairs x 3 x hidden x width, plus the router) over the peak of its
arithmetic (bf16 products on a CPU with AVX512_BF16 and AMX; else fp32, as the kernels widen bf16; int8 for w8a8).
Targets (issue "Real MoE shapes at batch and in prefill"): at 1 row at least 85% of the bandwidth on the bytes read;
at 32 rows and more at least 50% of the lower of the two bounds (the bound time over ours). Exits 1 when a cell
misses, with the cells named. Medians of timed calls after a warm-up, with min and max.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_bandwidth, best_seconds, cpu_info, cpu_line, read_bandwidth  # noqa: E402

SHAPES = {
    "deep": dict(hidden=1024, experts=64, width=256, top_k=8),
    "qwen3-30b": dict(hidden=2048, experts=128, width=768, top_k=8),
}
ROWS = (1, 8, 32, 128, 2048)
FORMATS = ("bf16", "int8", "w8a8", "int4")
ISAS = ("AVX2", "AVX512", "AVX512_BF16", "AMX_BF16")  # kernels/extension.py ISA_FLAGS, weakest first
ISA_NEEDS = {"AVX2": {"avx2", "fma"}, "AVX512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
             "AVX512_BF16": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"},
             "AMX_BF16": {"avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}}
COLD_BYTES = 512 << 20  # bf16 expert bytes the layers hold in all: several times any L3 cache
FORMAT_NEEDS = {"w8a8": "AVX512_BF16"}  # the W8A8 expert kernel's VPDPBUSD tiles (AVX512_VNNI; every such CPU has BF16)


def cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def fma_peak(threads: int, isa: str) -> dict:
    """GFLOP/s of large products through torch (oneDNN), best of a few: fp32; bf16 where `isa` multiplies bf16
    (AVX512_BF16, AMX); int8 (torch._int_mm, where this torch has it on the CPU) where it has VPDPBUSD."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    n = 2048
    kinds = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if isa in ("AVX512_BF16", "AMX_BF16") else [])
    for name, dtype in kinds:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out[name] = 2 * n ** 3 / best_seconds(lambda: torch.mm(a, b), 5) / 1e9
    out["bf16"] = out.get("bf16")
    if isa not in ("AVX512_BF16", "AMX_BF16"):
        out["int8"] = None
        return out
    try:
        a8 = torch.randint(-100, 100, (n, n), dtype=torch.int8)
        b8 = torch.randint(-100, 100, (n, n), dtype=torch.int8)
        out["int8"] = 2 * n ** 3 / best_seconds(lambda: torch._int_mm(a8, b8), 5) / 1e9
    except (RuntimeError, AttributeError, NotImplementedError):
        out["int8"] = None
    return out


def kernel_read_rate(threads: int, mib: int = 512, repeats: int = 5) -> float | None:
    """Bytes a second our kernel's one-row linear (the default build's) reads a bf16 weight of `mib` MiB at, best of
    `repeats`: the machine's read bandwidth as the best reader here sees it (torch's sum and mv may read slower)."""
    import torch

    from export.serve.kernels import kernel

    k = kernel()
    if k is None:
        return None
    torch.set_num_threads(threads)
    cols = 4096
    w = torch.randn(mib * (1 << 20) // (2 * cols), cols).bfloat16()
    x = torch.randn(1, cols).bfloat16()
    return w.numel() * 2 / best_seconds(lambda: k.linear(x, w, None), repeats)


def timed(fn, budget_s: float, least: int = 3, most: int = 50) -> list[float]:
    """Seconds of calls of `fn` after one warm-up: at least `least`, then until `budget_s` or `most`."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget_s and len(times) < most):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def layer_dir(shape: str, root: Path) -> tuple[object, Path]:
    """A model of `shape`'s MoE layers (SwiGLU experts, Qwen3's routing; as many as make COLD_BYTES) with random bf16
    weights saved in root/shape: (its ModelConfig, the directory). Reused if there."""
    import torch

    from pipeline.build import cast_keeping_gates, meta_model
    from pipeline.model import ModelConfig
    from pipeline.weights import save_weights

    s = SHAPES[shape]
    heads = s["hidden"] // 128
    # enough layers that their experts far outsize any cache (each call reads another layer's, as a model's step does)
    layers = max(1, -(-COLD_BYTES // (s["experts"] * 3 * s["hidden"] * s["width"] * 2)))
    cfg = ModelConfig(vocab_size=256, seq_len=4096, layers=layers, hidden=s["hidden"], heads=heads,
                      kv_heads=max(1, heads // 4), head_dim=128, experts=(s["experts"],) * layers,
                      moe_layers=tuple(range(layers)), mlp_type="standard", top_k=s["top_k"],
                      capacity_factor=1.0, eval_capacity_factor=None, min_capacity=0, aux_loss_coef=0.0,
                      activation="swiglu", expert_hidden=s["width"], renormalize=True, tie_embeddings=False,
                      dropout=0.0, init_std=0.02, ffn_mult=4, family="qwen3_moe", norm="rmsnorm", norm_eps=1e-6,
                      positions="rope", qk_norm="head", qkv_bias=False, out_bias=False, mlp_bias=False)
    out = root / shape
    if (out / "model.safetensors").is_file() or any(out.glob("*.safetensors")):
        return cfg, out
    out.mkdir(parents=True, exist_ok=True)
    model = cast_keeping_gates(meta_model(cfg), torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    save_weights(model, out)
    return cfg, out


def use_isa(isa: str):
    """The kernels' extension built for `isa`, made the one every weight made from now on uses."""
    from export.serve.kernels import extension

    k = extension.build(isa)
    extension._kernel, extension._kernel_tried = k, True
    return k


def expert_bytes(weights: tuple) -> int:
    """Bytes an expert's kernels read: its weights (a quantised one's values and scales; a bf16 one's weight, not
    the packed copy oneDNN reads for many rows) and biases."""
    import torch

    total = 0
    for w in weights:
        if w is None:
            continue
        parts = [w] if isinstance(w, torch.Tensor) else [w.q, w.scale] if hasattr(w, "q") else [w.weight]
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def measure(cfg, src: Path, fmt: str, rows_list, budget_s: float) -> list[dict]:
    """Each row count through the placed MoE layer of `cfg` in format `fmt`, with the kernel in force."""
    import torch

    from export.serve.placement.exchange import place_experts
    from pipeline import dist

    model, exchange = place_experts(cfg, src, dist.init(), torch.bfloat16,
                                    quantize=None if fmt == "bf16" else fmt)
    moes = [b.mlp for b in model.blocks]
    per_expert = expert_bytes(exchange.residency.weights(0, 0))
    gate_bytes = moes[0].router_weight.numel() * 4
    out = []
    g = torch.Generator().manual_seed(1)
    for rows in rows_list:
        # a new input each call, through the next layer: other experts, not in any cache (as in a model's step)
        xs = [torch.randn(1, rows, cfg.hidden, generator=g).bfloat16() for _ in range(max(2, len(moes)) + 1)]
        calls = itertools.count()

        def call():
            i = next(calls)
            return moes[i % len(moes)](xs[i % len(xs)])

        with torch.no_grad():
            active = sum(int((torch.as_tensor(moes[0](x)[2]) > 0).sum()) for x in xs) / len(xs)
            times = timed(call, budget_s)
        pairs = rows * cfg.top_k
        out.append({"rows": rows, "active_experts": active, "bytes": active * per_expert + gate_bytes,
                    "flops": 2 * pairs * 3 * cfg.hidden * cfg.expert_hidden + 2 * rows * cfg.hidden * cfg.experts[0],
                    "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                    "calls": len(times)})
    return out


def peak_for(isa: str, fmt: str, peaks: dict) -> tuple[str, float]:
    """The multiply-add peak a cell's arithmetic runs at: int8 for w8a8, bf16 where the build has bf16 products,
    else fp32 (AVX2 and AVX512 widen bf16 to fp32)."""
    if fmt == "w8a8" and peaks.get("int8"):
        return "int8", peaks["int8"]
    if peaks.get("bf16"):
        return "bf16", max(peaks["bf16"], peaks["fp32"])
    return "fp32", peaks["fp32"]


def verdict(cell: dict) -> str | None:
    """None if the cell meets its target, else why not."""
    if cell["rows"] == 1 and cell["bw_fraction"] < 0.85:
        return f"1 row at {cell['bw_fraction']:.0%} of the bandwidth (target 85%)"
    if cell["rows"] >= 32 and cell["bound_fraction"] < 0.5:
        return f"{cell['rows']} rows at {cell['bound_fraction']:.0%} of the lower bound (target 50%)"
    return None


def draw(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({c["shape"] for c in cells})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for key in sorted({(c["isa"], c["format"]) for c in cells if c["shape"] == shape}):
            pts = sorted((c["rows"], c["bound_fraction"]) for c in cells if (c["shape"], c["isa"], c["format"]) ==
                         (shape, *key))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} ({key[0]})")
        ax.axhline(0.5, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("rows (tokens in one call)")
        ax.set_ylabel("fraction of the lower bound (bound time / ours)")
        ax.set_title(f"MoE layer: {shape}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# each build measured in a process of its own whose oneDNN and ATen are limited to that instruction set, as on a CPU
# that has no more (the GEMMs our kernels leave to oneDNN, a prefill's, run as they would there)
EMULATE = {"AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
           "AVX512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
           "AVX512_BF16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"},
           "AMX_BF16": {"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": "avx512"}}


def worker(args, isa: str, bw: float) -> dict:
    """This process's part: `isa`'s build over every shape, format and row count (run with EMULATE[isa]'s
    environment); its peaks, measured as limited, and its cells."""
    peaks = fma_peak(args.threads, isa)
    print(f"{isa}: multiply-add peak (torch.mm, oneDNN limited to {EMULATE[isa]['ONEDNN_MAX_CPU_ISA']}) " +
          ", ".join(f"{k} {v:.0f} GFLOP/s" if v else f"{k} n/a" for k, v in peaks.items()), flush=True)
    use_isa(isa)
    cells, notes = [], []
    started, done, total = time.perf_counter(), 0, len(args.shapes) * len(args.formats)
    for shape in args.shapes:
        cfg, src = layer_dir(shape, args.work)
        for fmt in args.formats:
            done += 1
            if fmt in FORMAT_NEEDS and ISAS.index(isa) < ISAS.index(FORMAT_NEEDS[fmt]):
                notes.append(f"{shape} {fmt} on {isa}: its kernel needs a {FORMAT_NEEDS[fmt]} build (VPDPBUSD)")
                print(f"skipped {notes[-1]}", flush=True)
                continue
            for r in measure(cfg, src, fmt, args.rows, args.budget):
                t_bw = r["bytes"] / bw
                arith, peak = peak_for(isa, fmt, peaks)
                t_fma = r["flops"] / (peak * 1e9)
                cell = {"shape": shape, "isa": isa, "format": fmt, **r, "gb_per_s": r["bytes"] / r["median_s"] / 1e9,
                        "gflop_per_s": r["flops"] / r["median_s"] / 1e9, "bw_fraction": t_bw / r["median_s"],
                        "fma_fraction": t_fma / r["median_s"], "peak": arith, "peak_gflop_per_s": peak,
                        "bound_fraction": max(t_bw, t_fma) / r["median_s"]}
                cell["miss"] = verdict(cell)
                cells.append(cell)
                print(f"{shape:9s} {isa:11s} {fmt:5s} {r['rows']:5d} rows: {r['median_s'] * 1e3:9.3f} ms "
                      f"[{r['min_s'] * 1e3:.3f}-{r['max_s'] * 1e3:.3f}, {r['calls']}] "
                      f"{cell['gb_per_s']:6.1f} GB/s ({cell['bw_fraction']:4.0%} of bw) "
                      f"{cell['gflop_per_s']:7.1f} GFLOP/s ({cell['fma_fraction']:4.0%} of {arith} peak) "
                      f"bound {cell['bound_fraction']:4.0%}{'  MISS' if cell['miss'] else ''}", flush=True)
            el = time.perf_counter() - started
            print(f"  [{isa}: {done}/{total} shape x format, {el:.0f} s, ETA {el / done * (total - done):.0f} s]",
                  flush=True)
    return {"isa": isa, "peaks": peaks, "cells": cells, "skipped": notes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--isa", nargs="+", default=None, choices=list(ISAS), help="builds to measure (default: every "
                    "one this CPU runs)")
    ap.add_argument("--threads", type=int, default=None, help="default: every core this process may use")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls per cell (at least 3 calls)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "moe_layer_bench",
                    help="the random layers' weights (reused)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/moe_layer_bench"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # ISA BANDWIDTH: one build's process
    args = ap.parse_args()

    import os
    import subprocess

    import torch

    args.threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.worker:
        isa, bw = args.worker.split(":")
        print("RESULT " + json.dumps(worker(args, isa, float(bw))), flush=True)
        return 0

    cpu = cpu_info()
    flags = cpu_flags()
    print(f"CPU: {cpu_line(cpu)}; {args.threads} threads", flush=True)
    samples = [read_bandwidth(args.threads) for _ in range(3)]  # the best of three (a shared machine's slow moments out)
    torch_bw = best_bandwidth(samples)["bytes_per_s"]
    kernel_bw = kernel_read_rate(args.threads)
    bw = max(torch_bw, kernel_bw or 0.0)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s: the faster of torch's sum/mv (best of "
          f"{[round(s['bytes_per_s'] / 1e9, 1) for s in samples]}) and our kernel's one-row linear over 512 MB "
          f"({kernel_bw / 1e9 if kernel_bw else float('nan'):.1f})", flush=True)
    isas, skipped = [], []
    for isa in args.isa or list(ISAS):
        missing = ISA_NEEDS[isa] - flags
        (skipped.append(f"{isa}: this CPU lacks {', '.join(sorted(missing))}") if missing else isas.append(isa))
    for line in skipped:
        print(f"skipped {line}", flush=True)
    for shape in args.shapes:  # written once, before the workers read them
        layer_dir(shape, args.work)

    cells, peaks = [], {}
    for isa in isas:
        cmd = [sys.executable, __file__, "--worker", f"{isa}:{bw}", "--shapes", *args.shapes, "--rows",
               *map(str, args.rows), "--formats", *args.formats, "--threads", str(args.threads), "--budget",
               str(args.budget), "--work", str(args.work)]
        proc = subprocess.Popen(cmd, env={**os.environ, **EMULATE[isa]}, stdout=subprocess.PIPE, text=True)
        result = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0 or result is None:
            print(f"{isa}: its worker failed ({proc.returncode})", flush=True)
            return 2
        cells += result["cells"]
        skipped += result["skipped"]
        peaks[isa] = result["peaks"]

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu, "threads": args.threads, "bandwidth_bytes_per_s": bw,
              "bandwidth_samples": [s["bytes_per_s"] for s in samples], "kernel_read_bytes_per_s": kernel_bw, "peaks_gflop_per_s": peaks,
              "skipped": skipped, "cells": cells, "command": " ".join(sys.argv)}
    (args.out / "moe_layer_bench.json").write_text(json.dumps(result, indent=1))
    lines = [f"CPU: {cpu_line(cpu)}; {args.threads} threads; read bandwidth {bw / 1e9:.1f} GB/s; multiply-add peaks "
             "(GFLOP/s, torch.mm with oneDNN limited to each build's instructions): " +
             "; ".join(f"{isa} " + ", ".join(f"{k} {v:.0f}" for k, v in p.items() if v) for isa, p in peaks.items()),
             "", "| shape | build | format | rows | median ms [min-max] | GB/s | % bw | GFLOP/s | % peak | "
             "% lower bound | |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['shape']} | {c['isa']} | {c['format']} | {c['rows']} | {c['median_s'] * 1e3:.3f} "
                     f"[{c['min_s'] * 1e3:.3f}-{c['max_s'] * 1e3:.3f}] | {c['gb_per_s']:.1f} | "
                     f"{c['bw_fraction']:.0%} | {c['gflop_per_s']:.1f} | {c['fma_fraction']:.0%} ({c['peak']}) | "
                     f"{c['bound_fraction']:.0%} | "
                     f"{'MISS' if c['miss'] else 'met' if c['rows'] == 1 or c['rows'] >= 32 else ''} |")
    lines += [f"skipped: {s}" for s in skipped]
    (args.out / "moe_layer_bench.md").write_text("\n".join(lines) + "\n")
    if cells:
        draw(cells, args.out / "moe_layer_bench.png")
    print("\n".join(lines))
    misses = [f"{c['shape']} {c['isa']} {c['format']} {c['rows']} rows: {c['miss']}" for c in cells if c["miss"]]
    if misses:
        print(f"\n{len(misses)} cell(s) miss their target:\n  " + "\n  ".join(misses))
        return 1
    print("\nevery cell meets its target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
