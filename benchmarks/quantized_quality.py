"""What quantising a trained student costs: `export --quantize` packages of one run against its bf16 package.

    .venv/bin/python benchmarks/quantized_quality.py runs/small                       # held-out loss and routing
    .venv/bin/python benchmarks/quantized_quality.py runs/small --tasks               # + the bundled zero-shot tasks
    .venv/bin/python benchmarks/quantized_quality.py runs/tiny --methods gptq --out runs/bench/quality

One run, side by side: the run's student exported as our package in bf16, and with `--quantize int8` and `int4` by
each of `--methods` (GPTQ calibrated on `--calibration-blocks` blocks of the training split; round to nearest), all
in bf16 otherwise. Each package is loaded as `moe-pipeline eval` and `serve` on a sliced layout load it (its weights
dequantised: export/inference.py `load_package`) and scored on the whole held-out split: the mean loss per token
(nats) and its change against bf16 (targets, issue 29: int8 within +0.5%, int4 within +3%), and the top-1 routing
agreement with bf16 (every MoE layer's first choice of every held-out token: targets >= 98% int8, >= 95% int4).
The w8a8 rows score the int8 packages as `serve --quantize w8a8` computes: each quantised linear's input rounded to
int8 too, one scale a row (vLLM's dynamic per-token W8A8), in fp32 against the dequantised weights.
With --tasks, `moe-pipeline eval` runs the bundled zero-shot tasks on every package (lm-eval's scores). Prints a
table with the CPU, writes quantized_quality.json and quantized_quality.png under --out (default RUN/quality).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_info, cpu_line  # noqa: E402

sys.path.insert(0, str(ROOT))


def export(run: Path, out: Path, scheme: str | None, method: str, blocks: int) -> Path:
    from export.package import Quantize, export_package

    q = Quantize(scheme, method=method, calibration_blocks=blocks) if scheme else None
    return export_package(run / "student", out, dtype="bf16", force=True, quantize=q, progress=True)


def score(pkg: Path, val, micro: int, w8a8: bool = False) -> tuple[float, "torch.Tensor"]:
    """(held-out loss of the whole split, every router's first choice of every held-out token). `w8a8`: an int8
    package scored as `serve --quantize w8a8` computes, each quantised linear's input rounded to int8, one scale a row."""
    import torch

    from distill.measure import top1_routes
    from export.inference import load_package
    from pipeline.dist import Ranks
    from pipeline.train import evaluate

    model, _ = load_package(pkg)
    if w8a8:
        int8_inputs_(model)
    one = Ranks(rank=0, world=1, local_rank=0, local_world=1)
    with top1_routes() as routes, torch.no_grad():
        loss = evaluate(model, val, None, micro, one)
    return loss, torch.cat(routes)


def int8_inputs_(model) -> int:
    """Every linear layer an int8 package stores quantised (`weight_kinds`) computes, from here on, what a W8A8 linear
    computes on its dequantised weight (export/serve/kernels/quantized.py `w8a8_reference`: its input rounded to int8
    steps, one scale a row, F.linear in fp32); returns how many."""
    import functools

    from export.serve.kernels import w8a8_reference
    from pipeline.quantize import weight_kinds

    modules = dict(model.named_modules())
    names = weight_kinds(model, "int8")
    for name in names:
        module = modules[name[:-len(".weight")]]
        module.forward = functools.partial(lambda m, x: w8a8_reference(x, m.weight, m.bias), module)
    return len(names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a run directory with a finished student stage")
    p.add_argument("--methods", nargs="+", default=["gptq", "rtn"], choices=["gptq", "rtn"])
    p.add_argument("--calibration-blocks", type=int, default=128)
    p.add_argument("--tasks", action="store_true", help="also the bundled zero-shot tasks (moe-pipeline eval)")
    p.add_argument("--limit", type=float, default=None, help="with --tasks: documents per task")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from pipeline import data as data_lib
    from pipeline.artifacts import RECIPE_FILE, cache_root, read_model_config
    from pipeline.recipe import load_stored_recipe

    out = args.out or args.run / "quality"
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    print(f"[quality] {cpu_line(cpu)}; {torch.get_num_threads()} threads", flush=True)
    recipe = load_stored_recipe(args.run / RECIPE_FILE)
    cfg = read_model_config(args.run / "student")
    prepared = data_lib.prepare_data(recipe.data, cache_root())
    val = data_lib.PackedTokens(prepared.val, cfg.seq_len, prepared.eod_id, name="val")
    variants = [("bf16", None, "-")] + [(f"{s} {m}", s, m) for s in ("int8", "int4", "w8a8") for m in args.methods]
    rows, base_routes, packages = [], None, {}
    for name, scheme, method in variants:
        t0 = time.perf_counter()
        stored = "int8" if scheme == "w8a8" else scheme  # w8a8: the int8 package, its linears' inputs rounded too
        if (stored, method) not in packages:
            packages[stored, method] = export(args.run, out / ("bf16" if stored is None else f"{stored}-{method}"),
                                              stored, method, args.calibration_blocks)
        pkg = packages[stored, method]
        seconds = time.perf_counter() - t0
        loss, routes = score(pkg, val, recipe.student.train.micro_batch_size, w8a8=scheme == "w8a8")
        if base_routes is None:
            base_routes = routes
        manifest = json.loads((pkg / "manifest.json").read_text())
        size = sum(f["size"] for n, f in manifest["files"].items() if n.endswith(".safetensors"))
        rows.append({"name": name, "scheme": scheme or "bf16", "method": method, "package": str(pkg),
                     "weights_bytes": size, "val_loss": loss, "export_seconds": round(seconds, 1),
                     "top1_routing_agreement": float((routes == base_routes).double().mean()),
                     "gptq_relative_error": (manifest.get("quantization") or {}).get("relative_error")})
        print(f"[quality] {name}: held-out loss {loss:.5f}, {size / 1e6:.2f} MB, export {seconds:.1f} s", flush=True)
    base = rows[0]["val_loss"]
    for r in rows:
        r["loss_vs_bf16_pct"] = 100 * (r["val_loss"] / base - 1)
    if args.tasks:
        # the w8a8 rows' packages are the int8 ones: `eval` runs a package as stored (no task scores for them)
        cmd = [sys.executable, "-m", "cli", "eval", *[r["package"] for r in rows if r["scheme"] != "w8a8"],
               "--out", str(out / "eval")]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        results = json.loads((out / "eval" / "results.json").read_text())
        for r in rows:
            if r["scheme"] == "w8a8":
                continue
            entry = next((v for k, v in results.items() if not k.startswith("_")
                          and Path(v.get("model", {}).get("path", "")).resolve() == Path(r["package"]).resolve()), None)
            r["tasks"] = {t: {m: v for m, v in ms.items() if isinstance(v, (int, float)) and "stderr" not in m}
                          for t, ms in (entry or {}).get("results", {}).items()}
    print(f"\n{'variant':12} {'MB':>8} {'held-out loss':>14} {'vs bf16':>9} {'top-1 routes':>13}")
    for r in rows:
        print(f"{r['name']:12} {r['weights_bytes'] / 1e6:8.2f} {r['val_loss']:14.5f} {r['loss_vs_bf16_pct']:+8.3f}% "
              f"{100 * r['top1_routing_agreement']:12.2f}%")
    if args.tasks:
        tasks = sorted({t for r in rows for t in r.get("tasks", {})})
        print(f"\n{'variant':12} " + " ".join(f"{t[:18]:>18}" for t in tasks)
              + "   (acc_norm, else acc, else bits per byte, else perplexity)")
        for r in rows:
            cells = []
            for t in tasks:
                ms = r.get("tasks", {}).get(t, {})
                key = next((m for m in ("acc_norm,none", "acc,none", "bits_per_byte,none", "perplexity,none")
                            if m in ms), None)
                cells.append(f"{ms[key]:18.4f}" if key else f"{'-':>18}")
            print(f"{r['name']:12} " + " ".join(cells))
    result = {"cpu": cpu, "run": str(args.run.resolve()), "held_out_tokens": val.num_blocks * cfg.seq_len,
              "calibration_blocks": args.calibration_blocks, "rows": rows}
    (out / "quantized_quality.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out / "quantized_quality.png", cpu_line(cpu))
    print(f"[quality] wrote {out / 'quantized_quality.json'} and {out / 'quantized_quality.png'}")
    return 0


def plot(rows: list[dict], path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["name"] for r in rows]
    a.bar(names, [r["loss_vs_bf16_pct"] for r in rows], color="tab:blue")
    a.axhline(0.5, color="tab:orange", ls="--", label="int8 target +0.5%")
    a.axhline(3.0, color="tab:red", ls="--", label="int4 target +3%")
    a.set_ylabel("held-out loss vs bf16 (%)")
    a.legend(fontsize=8)
    b.bar(names, [100 * r["top1_routing_agreement"] for r in rows], color="tab:green")
    b.axhline(98, color="tab:orange", ls="--", label="int8 target 98%")
    b.axhline(95, color="tab:red", ls="--", label="int4 target 95%")
    b.set_ylim(90, 100.5)
    b.set_ylabel("top-1 routing agreement with bf16 (%)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"quantised students: {cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
