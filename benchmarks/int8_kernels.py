"""int8 weight-only linears against bf16 ones, kernel by kernel, on the weight shapes of the peer benchmark's Qwen3-MoE.

    .venv/bin/python benchmarks/int8_kernels.py                      # 2 threads, 1-16 rows
    .venv/bin/python benchmarks/int8_kernels.py --threads 1 --rows 1 8 --out runs/bench/int8
    .venv/bin/python benchmarks/int8_kernels.py --package .peers/work/checkpoint-*/ours-package   # + batch-1 decode

One run, side by side: for each weight shape (the output layer 50,304 x 1024, the fused q/k/v 1536 x 1024, the
attention output 1024 x 1024, an expert's fused gate/up 1536 x 1024 and down 1024 x 768) and row count,
csrc/quantized.cpp `linear` on a bf16 weight against `int8_linear` on the same weight quantised by export/serve/kernels
`quantize_int8` (one scale per output row), and `int4_linear` on it quantised by pipeline/quantize.py `quantize_int4`
(a scale per 128 inputs of a row, two values a byte), bf16 inputs. Each call reads a weight not in the caches (copies of it
past 256 MB taken in turn), as a decode step reads its layers. More than 8 rows: `linear` 8 rows at a time, as
`ServingWeight` runs a bf16 weight without oneDNN, and `int8_linear` as it is (8 rows a pass). Medians of --repeats
timings of 20 calls. Then one MoE layer's experts (16 of 1024 -> 768 -> 1024, SwiGLU, top-2) through `expert_mlps`
at --tokens tokens, bf16 experts against int8 ones (`Int8Weight`). Prints ms and GB/s of each and the speedup (the
target for a decode step: int8 >= 1.6x bf16, issue 29), with the CPU. With --package: batch-1 greedy decode of that
package served as it is, as it is without the head's int8 screen, and with `serve --quantize int8` and `--quantize
int4`, each also with `--quantize-head`, against the bound of the bytes each reads a token (`decode`; --decode-only:
just that). Writes int8_kernels.json and int8_kernels.png under --out.

    .venv/bin/python benchmarks/int8_kernels.py --package PKG --decode-only --repeats 5   # issue 29's batch-1 table
    W=.peers/work/checkpoint-c512223380; .venv/bin/python benchmarks/int8_kernels.py --package $W/ours-package \
        --decode-only --peer-gguf $W                 # and llama.cpp's BF16, Q8_0, Q4_0 of the same weights beside it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_info, cpu_line  # noqa: E402

VARIANTS = (("package", None, False), ("int8", "int8", False), ("int4", "int4", False),
            ("int8+head", "int8", True), ("int4+head", "int4", True))  # --package: serve --quantize [--quantize-head]
UNSCREENED = "package, no screen"  # --package served with --no-head-screen (`decode`)
# --peer-gguf DIR: the GGUFs of benchmarks/peer_bench.py's work folder, decoded by llama-bench beside ours (`decode`)
PEER_GGUF = {"BF16": "model-bf16.gguf", "Q8_0": "model-q8_0.gguf", "Q4_0": "ours-q4_0.gguf"}
LLAMA_BENCH = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-bench"
SHAPES = {"lm_head": (50304, 1024), "qkv": (1536, 1024), "o_proj": (1024, 1024), "expert gate_up": (1536, 1024),
          "expert down": (1024, 768)}


def timed(fn, repeats: int, inner: int = 20) -> float:
    """Median ms of one call over `repeats` timings of `inner` calls (after 3 unmeasured)."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t0) / inner * 1e3)
    return statistics.median(runs)


def run(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int, cold_bytes: float) -> list[dict]:
    import torch

    from export.serve.kernels import kernel
    from pipeline.quantize import quantize_int8
    from pipeline.quantize import INT4_GROUP, pack_int4, quantize_int4

    gemv = kernel()
    if gemv is None or not hasattr(gemv, "int8_linear"):
        raise SystemExit("the GEMV kernel did not build on this machine")
    torch.manual_seed(0)
    out = []
    for name, (O, I) in shapes.items():
        n = max(1, int(cold_bytes // (O * I * 2)))  # copies: each call reads one the last n - 1 calls did not
        bf16 = [(torch.randn(O, I) * 0.02).bfloat16() for _ in range(n)]
        int8 = [quantize_int8(w) for w in bf16]
        int4 = [(pack_int4(q), scale) for q, scale in (quantize_int4(w, INT4_GROUP) for w in bf16)] \
            if I % INT4_GROUP == 0 else None
        turn = iter(range(1 << 62))
        for M in rows:
            x = torch.randn(M, I).bfloat16()

            def plain():
                w = bf16[next(turn) % n]
                return [gemv.linear(x[i:i + 8].contiguous(), w, None) for i in range(0, M, 8)]

            def quantised():
                q, scale = int8[next(turn) % n]
                return gemv.int8_linear(x, q, scale, None)

            def quarter():
                q, scale = int4[next(turn) % n]
                return gemv.int4_linear(x, q, scale, None, INT4_GROUP)

            a, b = timed(plain, repeats), timed(quantised, repeats)
            c = timed(quarter, repeats) if int4 is not None else None
            out.append({"weight": name, "shape": [O, I], "rows": M, "bf16_ms": a, "int8_ms": b,
                        "bf16_gb_s": O * I * 2 / a / 1e6, "int8_gb_s": O * I / b / 1e6, "speedup": a / b,
                        "int4_ms": c, "int4_gb_s": O * I / 2 / c / 1e6 if c else None,
                        "int4_speedup": a / c if c else None})
    return out


def run_experts(experts: int, top_k: int, hidden: int, width: int, tokens: list[int], repeats: int,
                cold_bytes: float) -> list[dict]:
    """One MoE layer's experts (SwiGLU, `experts` of hidden -> width -> hidden) through `expert_mlps`, bf16 against
    int8, for each token count routed top-k (the tokens spread evenly; the experts with none are left out, as the
    routed layers do); cold weights as `run`."""
    import torch

    from export.serve.kernels import Int8Weight, expert_mlps

    torch.manual_seed(0)
    one = 3 * hidden * width * 2  # an expert's bf16 bytes
    n = max(1, int(cold_bytes // (experts * one)))
    layers = []
    for _ in range(n):
        plain = [((torch.randn(2 * width, hidden) * 0.02).bfloat16(), None, (torch.randn(hidden, width) * 0.02).bfloat16(),
                  None) for _ in range(experts)]
        layers.append((plain, [(Int8Weight.of(w1.float()), None, Int8Weight.of(w2.float()), None)
                               for w1, _, w2, _ in plain]))
    turn = iter(range(1 << 62))
    out = []
    for S in tokens:
        pairs = S * top_k
        counts = [pairs // experts + (e < pairs % experts) for e in range(experts)]
        counts = [c for c in counts if c]
        x = torch.randn(sum(counts), hidden).bfloat16()
        def some(kind: int):  # the next copy's next len(counts) experts: a few experts a call stay cold too
            i = next(turn)
            held = layers[i % n][kind]
            return [held[(i * len(counts) + j) % experts] for j in range(len(counts))]

        a = timed(lambda: expert_mlps(x, counts, some(0), True), repeats)
        b = timed(lambda: expert_mlps(x, counts, some(1), True), repeats)
        read = len(counts) * one
        out.append({"weight": f"{experts} experts, top-{top_k}", "tokens": S, "experts_run": len(counts),
                    "bf16_ms": a, "int8_ms": b, "bf16_gb_s": read / a / 1e6, "int8_gb_s": read / 2 / b / 1e6,
                    "speedup": a / b})
    return out


def read_bytes(engine, quantize: str | None, head: bool) -> float:
    """Bytes of weights one greedy batch-1 step of `engine` reads (common.active_bytes' categories): the linears
    (attention, dense and residual MLPs, top_k experts) at 1 byte a weight in int8 and 0.5 + 4 / 128 in int4 (its
    group scales; int8's row scales left out, under 0.5%), the output layer in the package's dtype, or at 1 byte a
    weight read through its int8 screen (`HeadScreen`; the few exact rows it re-reads left out), or as quantised with
    --quantize-head; the rest (norms, gates, an embedding row) as stored."""
    from common import active_bytes

    dtype = engine.model.wte.weight.dtype
    act = active_bytes(engine.model.cfg, dtype)
    per_weight = {None: dtype.itemsize, "int8": 1.0, "w8a8": 1.0, "int4": 0.5 + 4 / 128}[quantize]
    linear = sum(act[c] for c in ("attention", "dense_mlp", "residual_mlp", "experts"))
    lm_head = act["lm_head"] / dtype.itemsize * (per_weight if head else 1.0 if getattr(
        engine.model.lm_head, "screen", None) is not None else dtype.itemsize)
    return act["total"] - act["lm_head"] - linear + linear / dtype.itemsize * per_weight + lm_head


def llama_bench(binary: Path, gguf: Path, threads: int, new_tokens: int) -> float:
    """llama.cpp's own batch-1 decode tokens/s of `gguf` (llama-bench: `new_tokens` generated, no prompt, one run)."""
    import subprocess

    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=600)
    (row,) = json.loads(out.stdout)
    return float(row["avg_ts"])


def decode(pkg: Path, threads: int, new_tokens: int, repeats: int, bandwidth_gib: float = 1.0,
           peer: dict[str, Path] | None = None, peer_binary: Path | None = None) -> dict:
    """Batch-1 greedy decode of `pkg` served as it is (its greedy head read through the int8 screen), as it is with
    the screen off (--no-head-screen: every weight read in the package's dtype, the baseline the issue's
    "int8 halves bf16's bytes" assumes), with `--quantize int8` and `--quantize int4`, each also with
    `--quantize-head`, and with `--quantize w8a8` where the kernel has it; the engines in this process, their runs
    alternated `repeats` times (this VM's memory speed drifts within minutes), the read bandwidth
    (common.read_bandwidth, a `bandwidth_gib` buffer) sampled before each round and after the last: tokens/s of each
    (decode steps only, as benchmarks/decode_bandwidth.py times them), medians, the paired ratios against both baselines, the bytes a step reads (`read_bytes`) and the bound they give
    at the best bandwidth sample, and how many tokens agree with the package's. `peer`: {"BF16": gguf, "Q8_0": gguf,
    ...} of the same weights, each decoded by llama.cpp's llama-bench (`peer_binary`) in every round after ours: the
    anchor's own quantised-to-BF16 ratios on this machine at the same moments."""
    import torch

    from common import best_bandwidth, read_bandwidth
    from decode_bandwidth import decode_run
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine
    from export.serve.kernels import kernel

    engines, read = {}, {}
    w8a8 = (("w8a8", "w8a8", False),) if hasattr(kernel(), "w8a8_linear") else ()  # AVX512_VNNI builds
    for name, quantize, head in VARIANTS[:1] + ((UNSCREENED, None, False),) + VARIANTS[1:] + w8a8:
        engines[name] = Engine.from_config(ServeConfig(package=pkg, max_batch=1, quantize=quantize,
                                                       quantize_head=head, head_screen=name != UNSCREENED))
        engines[name].eos = None
        read[name] = read_bytes(engines[name], quantize, head)
    torch.set_num_threads(threads)  # after dist.init, which sizes the pool for the local ranks
    prompt = list(range(1000, 1016))
    runs = {name: [] for name in engines}
    for name, engine in engines.items():
        decode_run(engine, prompt, 8)  # warm-up
    samples, peer_runs = [], {}
    for _ in range(repeats):
        samples.append(read_bandwidth(threads, bandwidth_gib, 2))
        for name, engine in engines.items():
            runs[name].append(decode_run(engine, prompt, new_tokens))
        for name, gguf in (peer or {}).items():
            peer_runs.setdefault(name, []).append(llama_bench(peer_binary, gguf, threads, new_tokens))
    samples.append(read_bandwidth(threads, bandwidth_gib, 2))
    bandwidth = best_bandwidth(samples)["bytes_per_s"]
    a, plain = runs["package"], runs[UNSCREENED]
    tok_s = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    return {"package": str(pkg), "dtype": str(engines["package"].model.wte.weight.dtype).removeprefix("torch."),
            "new_tokens": new_tokens, "tok_s": tok_s,
            "runs_tok_s": {k: [r["tok_s"] for r in v] for k, v in runs.items()},
            "paired": {k: statistics.median(y["tok_s"] / x["tok_s"] for x, y in zip(a, runs[k])) for k in runs if k != "package"},
            "paired_unscreened": {k: statistics.median(y["tok_s"] / x["tok_s"] for x, y in zip(plain, runs[k]))
                                  for k in runs if k != UNSCREENED},
            "read_bytes": read, "bandwidth_bytes_per_s": bandwidth,
            "bound_tok_s": {k: bandwidth / read[k] for k in runs},
            "of_bound": {k: tok_s[k] / (bandwidth / read[k]) for k in runs},
            "same_tokens": {k: sum(x == y for x, y in zip(a[0]["tokens"], runs[k][0]["tokens"])) for k in runs
                            if k != "package"},
            "tokens": len(a[0]["tokens"]),
            "peer": {"tok_s": {k: statistics.median(v) for k, v in peer_runs.items()}, "runs_tok_s": peer_runs,
                     "paired": {k: statistics.median(y / x for x, y in zip(peer_runs["BF16"], v)) for k, v in
                                peer_runs.items() if k != "BF16"} if "BF16" in peer_runs else {}} if peer else None}


def decode_table(served: dict) -> str:
    """`decode`'s results, a variant a line: tok/s, MB a token, its bound and the share reached, the paired ratios."""
    lines = [f"{'batch-1 decode':22s} {'tok/s':>7s} {'MB/token':>8s} {'bound':>7s} {'of bound':>8s} "
             f"{'/ package':>9s} {'/ no screen':>11s} {'same tokens':>11s}"]
    for k, t in served["tok_s"].items():
        lines.append(f"{k:22s} {t:7.1f} {served['read_bytes'][k] / 1e6:8.1f} {served['bound_tok_s'][k]:7.1f} "
                     f"{served['of_bound'][k]:8.0%} {served['paired'].get(k, 1.0):8.2f}x "
                     f"{served['paired_unscreened'].get(k, 1.0):10.2f}x "
                     f"{served['same_tokens'].get(k, served['tokens']):5d} of {served['tokens']}")
    peer = served.get("peer")
    for k, t in (peer["tok_s"] if peer else {}).items():
        lines.append(f"{'llama.cpp ' + k:22s} {t:7.1f} {'':8s} {'':7s} {'':8s} {'':9s} "
                     f"{peer['paired'].get(k, 1.0):10.2f}x  (its own / BF16)")
    return "\n".join(lines) + f"\n(read bandwidth, best sample: {served['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; " \
        "ratios: medians of each round's paired ratio)"


def table(results: list[dict]) -> str:
    lines = [f"{'weight':16s} {'rows':>4s} {'bf16 ms':>8s} {'GB/s':>6s} {'int8 ms':>8s} {'GB/s':>6s} {'int8 / bf16':>11s} "
             f"{'int4 ms':>8s} {'GB/s':>6s} {'int4 / bf16':>11s}"]
    for r in results:
        four = f"{r['int4_ms']:8.3f} {r['int4_gb_s']:6.1f} {r['int4_speedup']:10.2f}x" if r.get("int4_ms") else \
            f"{'-':>8s} {'-':>6s} {'-':>11s}"
        lines.append(f"{r['weight']:16s} {r['rows']:4d} {r['bf16_ms']:8.3f} {r['bf16_gb_s']:6.1f} {r['int8_ms']:8.3f} "
                     f"{r['int8_gb_s']:6.1f} {r['speedup']:10.2f}x {four}")
    return "\n".join(lines)


def experts_table(results: list[dict]) -> str:
    lines = [f"{'MoE layer':22s} {'tokens':>6s} {'experts':>7s} {'bf16 ms':>8s} {'GB/s':>6s} {'int8 ms':>8s} {'GB/s':>6s} "
             f"{'int8 / bf16':>11s}"]
    for r in results:
        lines.append(f"{r['weight']:22s} {r['tokens']:6d} {r['experts_run']:7d} {r['bf16_ms']:8.3f} {r['bf16_gb_s']:6.1f} "
                     f"{r['int8_ms']:8.3f} {r['int8_gb_s']:6.1f} {r['speedup']:10.2f}x")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, name in enumerate(dict.fromkeys(r["weight"] for r in results)):
        rs = [r for r in results if r["weight"] == name]
        ax.plot([r["rows"] for r in rs], [r["speedup"] for r in rs], marker="o", color=f"C{k}", label=f"{name} int8")
        if all(r.get("int4_speedup") for r in rs):
            ax.plot([r["rows"] for r in rs], [r["int4_speedup"] for r in rs], marker="s", ls="--", color=f"C{k}",
                    label=f"{name} int4")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens in the call)")
    ax.set_ylabel("speedup over bf16 (time)")
    ax.set_title("int8_linear and int4_linear (groups of 128) vs bf16 linear, cold weights")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(served: dict, path: Path) -> None:
    """`decode`'s tokens/s of each variant beside the bound of the bytes it reads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(served["tok_s"])
    peer = (served.get("peer") or {}).get("tok_s", {})
    fig, ax = plt.subplots(figsize=(9, 4))
    at = range(len(names))
    ax.bar([i - 0.2 for i in at], [served["tok_s"][k] for k in names], 0.4, label="ours, measured (median)")
    ax.bar([i + 0.2 for i in at], [served["bound_tok_s"][k] for k in names], 0.4, label="bytes-per-token bound",
           color="lightgrey")
    there = range(len(names), len(names) + len(peer))
    if peer:
        ax.bar(list(there), list(peer.values()), 0.4, color="C1", label="llama.cpp (llama-bench, median)")
    ax.set_xticks([*at, *there], names + [f"llama.cpp {k}" for k in peer], rotation=20, fontsize=8)
    ax.set_ylabel("batch-1 decode tokens/s")
    ax.set_title(f"{Path(served['package']).name}: batch-1 greedy decode, {served['dtype']} package")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32], help="tokens of the MoE layer timed")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cold-mb", type=float, default=256.0, help="weight copies taken in turn, in MB of bf16")
    p.add_argument("--package", type=Path, default=None,
                   help="also: batch-1 decode of this package served as it is and with --quantize int8")
    p.add_argument("--new-tokens", type=int, default=128, help="with --package: tokens a decode run")
    p.add_argument("--decode-only", action="store_true", help="with --package: only its decode, no kernel timings")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="with --package: the read-bandwidth buffer, GiB")
    p.add_argument("--peer-gguf", type=Path, default=None,
                   help="with --package: peer_bench's folder of the same weights' GGUFs, decoded by llama-bench too")
    p.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH, help="llama.cpp's llama-bench (with --peer-gguf)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "int8_kernels")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(f"[int8] {cpu_line(cpu)}; {torch.get_num_threads()} threads", flush=True)
    if args.decode_only and args.package is None:
        p.error("--decode-only needs --package")
    results = [] if args.decode_only else run(SHAPES, args.rows, args.repeats, args.cold_mb * 1e6)
    experts = [] if args.decode_only else run_experts(16, 2, 1024, 768, args.tokens, args.repeats, args.cold_mb * 1e6)
    if results:
        print(table(results))
        print(experts_table(experts))
    served = None
    if args.package is not None:
        peer = {k: args.peer_gguf / f for k, f in PEER_GGUF.items()} if args.peer_gguf else None
        if peer and not all(f.is_file() for f in peer.values()) or peer and not args.llama_bench.is_file():
            p.error(f"--peer-gguf: {args.peer_gguf} needs {', '.join(PEER_GGUF.values())} (benchmarks/peer_bench.py "
                    f"--quantize int8 and int4 write them) and {args.llama_bench} (scripts/peers_setup.sh)")
        served = decode(args.package, torch.get_num_threads(), args.new_tokens, args.repeats, args.bandwidth_gib,
                        peer, args.llama_bench)
        print(decode_table(served))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_kernels.json").write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(),
                                                            "results": results, "experts": experts,
                                                            "decode": served}, indent=1))
    if results:
        plot(results, args.out / "int8_kernels.png")
    if served is not None:
        plot_decode(served, args.out / "int8_decode.png")
    print(f"[int8] wrote {args.out / 'int8_kernels.json'}" + (" and int8_kernels.png" if results else "") +
          (" and int8_decode.png" if served else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
