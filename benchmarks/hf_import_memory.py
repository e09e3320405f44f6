"""Importing a Hugging Face MoE checkpoint as a teacher: time and memory (checked: peak RSS growth <= 1.2x the
model's bytes at 1 rank, <= 0.7x per rank at EP 2).

    .venv/bin/python benchmarks/hf_import_memory.py                        # a ~4.7 GB Mixtral-layout checkpoint
    .venv/bin/python benchmarks/hf_import_memory.py --family qwen3_moe --gb 6

A checkpoint of random bf16 weights in the family's real layout, written by our own export
(`export.native.write_native`: config.json, the Hub's tensor names, shards of `--shard-mb` (1 GiB) with
model.safetensors.index.json), is written once under `--work`: Mixtral's
shape at hidden 2048 (16 heads, 4 kv heads, 8 experts of width 5632, top-2, vocab 32000), as many layers as
reach `--gb`. Then, each in a fresh process (`pipeline.build.load_hf_teacher`: built on the meta device,
materialised empty, filled tensor by tensor):
  * 1 rank (the reference MoE);
  * EP 2: two ranks through the DeepSpeed launcher (gloo), each reading only its half of every layer's experts;
  * for comparison, transformers' own `AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16)`.
Each reports (peak RSS during the load - RSS just before it) / the model's bytes in the checkpoint (VmHWM reset
through /proc/self/clear_refs right before the load) and its wall seconds. A table on stdout,
hf_import_memory.json and hf_import_memory.png under `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env

sys.path.insert(1, str(ROOT))

TARGETS = {"1 rank": 1.2, "EP 2": 0.7}


def family_config(family: str, gb: float, hidden: int = 2048):
    """Our ModelConfig of `family` at `hidden` (experts as wide as at 2048, scaled) with as many layers as make
    `gb` GB of bf16 weights."""
    from pipeline.build import meta_model
    from pipeline.hf_import import model_config
    from pipeline.model import param_counts

    base = {"model_type": family, "hidden_size": hidden, "num_attention_heads": 16, "num_key_value_heads": 4,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts_per_tok": 2,
            "tie_word_embeddings": False}
    if family == "mixtral":
        base.update(intermediate_size=hidden * 11 // 4, num_local_experts=8)
    elif family == "olmoe":
        base.update(intermediate_size=hidden // 2, num_experts=64, num_experts_per_tok=8)
    else:
        base.update(intermediate_size=hidden * 11 // 4, moe_intermediate_size=hidden * 11 // 16, num_experts=32,
                    num_experts_per_tok=4, shared_expert_intermediate_size=hidden * 11 // 8 if family == "qwen2_moe" else 0)
        if family == "qwen3_moe":
            base.update(head_dim=128, norm_topk_prob=True)
    one, two = (param_counts(meta_model(model_config({**base, "num_hidden_layers": n})))["total"] for n in (1, 2))
    per_layer, fixed = two - one, 2 * one - two  # a layer's parameters; the embedding, the head, the final norm
    layers = max(1, math.ceil((gb * 1e9 / 2 - fixed) / per_layer))
    return model_config({**base, "num_hidden_layers": layers})


def write_checkpoint(cfg, out: Path, shard_bytes: int = 1 << 30) -> int:
    """Random bf16 weights of `cfg` written by our own Hugging Face-family export (`export.native.write_native`: the
    Hub's names, config.json, shards of at most `shard_bytes` with model.safetensors.index.json); returns the
    weights' bytes. Written once: a finished one (its DONE file) is reused."""
    import torch

    from export.native import write_native
    from pipeline.build import meta_model
    from pipeline.weights import unique_params

    if (out / "DONE").is_file():
        return int((out / "DONE").read_text())
    model = meta_model(cfg).to(torch.bfloat16).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in unique_params(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    total = sum(p.numel() * p.element_size() for _, p in unique_params(model))
    print(f"[hf-import-memory] writing {total / 1e9:.2f} GB of random bf16 weights to {out} ...", flush=True)
    write_native(model, out, dtype=torch.bfloat16, force=True, max_shard_bytes=shard_bytes)
    del model
    (out / "DONE").write_text(str(total))
    return total


CHILD = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[3])

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

mode, src, out = sys.argv[1], sys.argv[2], sys.argv[4]
import torch
rank, world = 0, 1
if mode == "ep2":
    from pipeline import dist
    ranks = dist.init()
    rank, world = ranks.rank, ranks.world
if mode == "transformers":
    from transformers import AutoModelForCausalLM
else:
    from pipeline.build import load_hf_teacher
    import pipeline.hf_import, pipeline.weights  # what it imports on first use: not counted as the load's memory
torch.set_num_threads(1)
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
t0 = time.perf_counter()
if mode == "transformers":
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
else:
    model = load_hf_teacher(src, world=world)
seconds = time.perf_counter() - t0
peak = status("VmHWM")
resident = sum(p.numel() * p.element_size() for p in model.parameters())
with open(f"{out}.{rank}.json", "w") as fh:
    json.dump({"rank": rank, "before": before, "peak": peak, "seconds": seconds, "param_bytes": resident}, fh)
'''


def measure(mode: str, src: Path, work: Path) -> list[dict]:
    """Run one import in fresh process(es); each rank's numbers."""
    script = work / "child.py"
    script.write_text(CHILD)
    out = work / f"result-{mode}"
    for old in work.glob(f"result-{mode}.*.json"):
        old.unlink()
    env = {**child_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if mode == "ep2":
        from pipeline.dist import free_port

        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
               str(free_port()), "--no_local_rank", str(script), mode, str(src), str(ROOT), str(out)]
    else:
        cmd = [sys.executable, str(script), mode, str(src), str(ROOT), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} import failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(work.glob(f"result-{mode}.*.json"))]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for name, r in res["runs"].items():
        for rank in r["ranks"]:
            labels.append(f"{name}\nrank {rank['rank']}" if len(r["ranks"]) > 1 else name)
            values.append(rank["ratio"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, values, color=["#4c72b0" if "transformers" not in lb else "#999999" for lb in labels])
    for name, t in TARGETS.items():
        ax.axhline(t, ls="--", lw=1, color="#c44e52" if name == "1 rank" else "#dd8452", label=f"target {name} <= {t}")
    ax.set_ylabel("(peak RSS - RSS before) / model bytes")
    ax.set_title(f"importing a {res['gb']:.1f} GB {res['family']} checkpoint (bf16, {res['shards']} shards)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"], default="mixtral")
    p.add_argument("--gb", type=float, default=4.5, help="checkpoint size to reach (GB of bf16 weights), >= 4")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (smaller: a quick check of the script)")
    p.add_argument("--work", type=Path, default=Path("/tmp/moe-hf-import-memory"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hf_import_memory")
    p.add_argument("--skip-transformers", action="store_true", help="leave out transformers' own load")
    p.add_argument("--shard-mb", type=int, default=1024, help="the checkpoint's shard size, MiB (default 1024)")
    args = p.parse_args(argv)
    os.chdir(ROOT)
    cfg = family_config(args.family, args.gb, args.hidden)
    src = args.work / (f"{args.family}-h{args.hidden}-{cfg.layers}layers"
                       + ("" if args.shard_mb == 1024 else f"-shards{args.shard_mb}mb"))
    nbytes = write_checkpoint(cfg, src, args.shard_mb << 20)
    shards = len(list(src.glob("*.safetensors")))
    res = {"family": args.family, "layers": cfg.layers, "gb": nbytes / 1e9, "model_bytes": nbytes, "shards": shards,
           "runs": {}}
    modes = {"1 rank": "one", "EP 2": "ep2"}
    if not args.skip_transformers:
        modes["transformers from_pretrained"] = "transformers"
    for name, mode in modes.items():
        t0 = time.time()
        ranks = measure(mode, src, args.work)
        for r in ranks:
            r["ratio"] = (r["peak"] - r["before"]) / nbytes
        res["runs"][name] = {"ranks": ranks, "wall_s": time.time() - t0}
        print(f"[hf-import-memory] {name}: " + ", ".join(f"rank {r['rank']} {r['ratio']:.3f}x in {r['seconds']:.1f}s"
                                                         for r in ranks), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_import_memory.json").write_text(json.dumps(res, indent=1))
    plot(res, args.out / "hf_import_memory.png")
    print(f"\n== importing a {nbytes / 1e9:.2f} GB {args.family} checkpoint ({cfg.layers} layers, bf16, {shards} shards) ==")
    print(f"{'':32s} {'rank':>4s} {'peak - before GB':>17s} {'/ model bytes':>14s} {'seconds':>8s} {'target':>8s}")
    for name, r in res["runs"].items():
        for rank in r["ranks"]:
            target = TARGETS.get(name)
            verdict = "" if target is None else (f"<= {target} " + ("MET" if rank["ratio"] <= target else "MISSED"))
            print(f"{name:32s} {rank['rank']:4d} {(rank['peak'] - rank['before']) / 1e9:17.2f} {rank['ratio']:14.3f} "
                  f"{rank['seconds']:8.1f} {verdict:>8s}")
    print(f"wrote {args.out / 'hf_import_memory.json'} and hf_import_memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
