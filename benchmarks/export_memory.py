"""Package sizes (fp32, bf16) and one rank's memory when loading a package at expert-parallel degree 1 and 2.

    .venv/bin/python benchmarks/export_memory.py                  # ~3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/export_memory.py --tiny-run runs/tiny

1. Sizes: the tiny recipe's student (`--tiny-run`, default runs/tiny, made by README command 1)
   exported at fp32 and bf16 with `moe-pipeline export`.
2. Memory: a package whose experts dominate its size, made by the real pipeline: `moe-pipeline
   teacher recipes/tiny.yaml` with wider, more numerous experts (`--set model.hidden=256
   model.experts=[64,64,128] teacher.train.steps=2 ...`) and `moe-pipeline export --stage teacher`.
   Then `export.inference.load_package` in a fresh process, once alone (EP 1) and once on 2 ranks
   through the DeepSpeed launcher (EP 2, each rank holds half of every layer's experts and reads
   only those tensors), on 2 ranks with the dense part tensor-sliced as well (`--tp-size 2`: each rank reads
   only its slices), and on 4 ranks with experts in pairs of ranks (expert slicing: each rank reads
   half of each of its experts). Each rank first verifies the package once and imports the modules
   tensor slicing uses (a warm-up: building the model on the meta device faults in ~80 MB of torch's
   code pages, and AutoTP imports transformers, once per process, not weights), resets
   its peak (`/proc/self/clear_refs`), loads, and reports the peak resident memory (VmHWM) minus
   its resident memory just before loading, the growth of its anonymous memory, and the bytes of
   the parameters it holds. Target: an EP-2 rank's weight memory at most
   60% of the whole model's (the package's weight bytes).
Results: a table on stdout and `export_memory.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, cli_command  # noqa: E402
from pipeline.artifacts import read_manifest  # noqa: E402
from pipeline.model import split_expert_key  # noqa: E402

BIG = ["model.hidden=256", "model.heads=4", "model.experts=[64,64,128]", "teacher.train.steps=2",
       "teacher.train.warmup_steps=1", "teacher.train.eval_batches=1", "teacher.train.eval_every=2",
       "teacher.train.checkpoint_every=2", "teacher.train.micro_batch_size=2", "teacher.train.global_batch_size=2"]
TARGET = 0.60
# name: (ranks, --ep-size, --tp-size; 0 = default): expert parallel alone, plus tensor slicing of the dense
# part, and expert slicing (4 ranks, experts in pairs of ranks, each expert's FFN cut in two)
LAYOUTS = {"ep1": (1, 0, 0), "ep2": (2, 0, 0), "ep2+tp2": (2, 0, 2), "ep2+slice2": (4, 2, 0)}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(pkg: str, out: str, ep: str = "0", tp: str = "0") -> None:
    """One rank: load the package, report memory (run alone or under the DeepSpeed launcher)."""
    sys.path.insert(0, str(ROOT))
    from export.inference import load_package
    from export.package import verify_package
    from pipeline import dist

    ranks = dist.init()
    dist.barrier()
    cold = _status_kb("VmRSS")
    # warm-up: verification builds the model on the meta device, which faults in ~80 MB of torch's
    # and DeepSpeed's code pages (file-backed, shared, once per process): not weight memory
    verify_package(pkg, checksums=False)
    # and the modules tensor slicing imports (DeepSpeed's AutoTP imports transformers): code, not weights
    import deepspeed.module_inject.auto_tp  # noqa: F401
    import transformers.pytorch_utils  # noqa: F401
    warm = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak) to the current RSS
    before, anon_before = _status_kb("VmRSS"), _status_kb("RssAnon")
    t0 = time.perf_counter()
    model, _ = load_package(pkg, ranks, checksums=False, ep_size=int(ep) or None, tp_size=int(tp) or None)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    after, anon_after = _status_kb("VmRSS"), _status_kb("RssAnon")
    held = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    record = {"rank": ranks.rank, "world": ranks.world, "rss_cold_kb": cold, "rss_after_warmup_kb": warm,
              "rss_before_kb": before, "peak_kb": peak, "rss_after_kb": after,
              "anon_growth_bytes": (anon_after - anon_before) * 1024, "warmup_growth_bytes": (warm - cold) * 1024,
              "weight_peak_bytes": (peak - before) * 1024, "weight_rss_bytes": (after - before) * 1024,
              "param_bytes_held": held, "load_seconds": round(seconds, 2)}
    Path(f"{out}.rank{ranks.rank}.json").write_text(json.dumps(record))
    dist.barrier()


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def _weights_bytes(pkg: Path) -> int:
    manifest = read_manifest(pkg)
    return sum(manifest["files"][f]["size"] for f in manifest["weights"] if f.endswith(".safetensors"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny-run", type=Path, default=ROOT / "runs" / "tiny")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--worker", nargs=4, metavar=("PKG", "OUT", "EP", "TP"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    os.chdir(ROOT)
    work = args.out / "export_memory"
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"sizes": {}, "memory": {}}

    # 1. the tiny student's package sizes
    if (args.tiny_run / "student" / "DONE.json").is_file():
        for dtype in ("fp32", "bf16"):
            pkg = work / f"tiny-student-{dtype}"
            _run([*cli_command(), "export", str(args.tiny_run), "--dtype", dtype, "--out", str(pkg), "--force"])
            manifest = read_manifest(pkg)
            result["sizes"][dtype] = {"weights_bytes": _weights_bytes(pkg),
                                      "package_bytes": sum(f["size"] for f in manifest["files"].values()),
                                      "params": manifest["params"]}
    else:
        print(f"(no finished student in {args.tiny_run}: run README command 1 for the tiny package sizes)")

    # 2. an experts-dominated package, made by the pipeline itself
    run = work / "big_run"
    if not (run / "teacher" / "DONE.json").is_file():
        print("[memory] training 2 steps of an experts-dominated teacher (hidden 256, experts [64, 64, 128]) ...",
              flush=True)
        _run([*cli_command(), "teacher", "recipes/tiny.yaml", "--run-dir", str(run),
              *[x for s in BIG for x in ("--set", s)]])
    pkg = work / "big-package"
    _run([*cli_command(), "export", str(run), "--stage", "teacher", "--out", str(pkg), "--force"])
    manifest = read_manifest(pkg)
    whole = _weights_bytes(pkg)
    from safetensors import safe_open

    expert_bytes = 0  # the package is fp32: 4 bytes per expert parameter
    for f in manifest["weights"]:
        if f.endswith(".safetensors"):
            with safe_open(pkg / f, framework="pt") as sf:
                for k in sf.keys():
                    if split_expert_key(k) is not None:
                        sl = sf.get_slice(k)
                        n = 1
                        for d in sl.get_shape():
                            n *= d
                        expert_bytes += 4 * n
    from pipeline.dist import free_port

    for name, (world, ep, tp) in LAYOUTS.items():
        out = work / name
        for old in work.glob(f"{name}.rank*.json"):
            old.unlink()
        script = [str(Path(__file__).resolve()), "--worker", str(pkg), str(out), str(ep), str(tp)]
        if world == 1:
            _run([sys.executable, *script])
        else:
            _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world), "--master_port",
                  str(free_port()), "--no_local_rank", *script])
        result["memory"][name] = [json.loads((work / f"{name}.rank{r}.json").read_text()) for r in range(world)]
    result["big_package"] = {"path": str(pkg), "weights_bytes": whole, "expert_bytes": expert_bytes,
                             "expert_share": round(expert_bytes / whole, 3), "params": manifest["params"]}

    mb = 1024 ** 2
    print()
    if result["sizes"]:
        print("== tiny student package ==")
        for dtype, s in result["sizes"].items():
            print(f"  {dtype}: weights {s['weights_bytes'] / mb:.2f} MiB, whole package {s['package_bytes'] / mb:.2f} MiB "
                  f"({s['params']['total']:,} parameters)")
        if len(result["sizes"]) == 2:
            print(f"  bf16 / fp32 weights: {result['sizes']['bf16']['weights_bytes'] / result['sizes']['fp32']['weights_bytes']:.3f}")
    print(f"== loading an experts-dominated package ({whole / mb:.1f} MiB of weights, experts "
          f"{100 * expert_bytes / whole:.0f}% of them) ==")
    print(f"{'layout':<10} {'rank':>4} {'params held MiB':>15} {'peak - before MiB':>17} {'/ whole':>8} "
          f"{'anon growth MiB':>15} {'load s':>7} {'warm-up MiB':>11}")
    for key, recs in result["memory"].items():
        for r in recs:
            print(f"{key:<10} {r['rank']:>4} {r['param_bytes_held'] / mb:>15.1f} {r['weight_peak_bytes'] / mb:>17.1f} "
                  f"{r['weight_peak_bytes'] / whole:>8.2f} {r['anon_growth_bytes'] / mb:>15.1f} {r['load_seconds']:>7.2f} "
                  f"{r['warmup_growth_bytes'] / mb:>11.1f}")
    print("(peak - before: VmHWM reset after a warm-up verification, minus VmRSS then; anon growth: RssAnon after "
          "loading minus before; warm-up: what the verification's meta-device model faulted in, once per process)")
    worst = max(r["weight_peak_bytes"] for r in result["memory"]["ep2"]) / whole
    result["ep2_worst_rank_over_whole"] = round(worst, 3)
    result["target"] = TARGET
    print(f"EP-2 rank's weight memory / whole model: {worst:.2f} (target <= {TARGET:.2f}: "
          f"{'ok' if worst <= TARGET else 'MISSED'}); ideal: (non-expert + half the experts) / whole = "
          f"{(whole - expert_bytes / 2) / whole:.2f}")
    (args.out / "export_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'export_memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
