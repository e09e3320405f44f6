"""A projection ON PAPER, not a measurement: decode tokens/s per GPU of the 1.3b recipe's student at expert-parallel
degree 8, 16, 64 and 128.

    .venv/bin/python benchmarks/ep_scale_model.py                     # ~1 minute on 2 CPU cores
    .venv/bin/python benchmarks/ep_scale_model.py --batch 64 --context 1024 --hbm-tbps 4.8   # H200's HBM
    .venv/bin/python benchmarks/ep_scale_model.py --efficiency 1.0    # pure roofline: no CPU-measured efficiency

The student is the one `moe-pipeline plan` sizes (recipes/1.3b.yaml, `student:`; distill/student.py): 21 layers,
hidden 2048, 10 MoE layers with [64 x 8, 128 x 2] experts, top-1, residual MLP, tied 50,304-entry head. Its bytes
are counted from the model code (benchmarks/common.active_bytes on the meta device), in bf16.

Inputs. Measured here, on this CPU: the actual modules at the student's hidden size (`--measure-hidden`), batch 1,
fp32: a dense Block (attention with a KV cache of `--context` tokens + MLP) and one expert MLP, each timed, and a
1 GiB read (torch.sum): the share of the read bandwidth each component reaches is its `efficiency`, which the
projection carries to the GPU's HBM (time = bytes / (HBM x efficiency): scaled by bytes to the student's bf16 shapes).
Stated, not measured (STATED below, with where each comes from): HBM bandwidth, bf16 peak, NVLink and InfiniBand
bandwidth, all-to-all latencies, GPUs per node.

Model, per decode step of `--batch` sequences on each GPU (one EP group of EP GPUs, the dense part replicated):
  dense   = max(dense weight bytes / (HBM x eff_dense), 2 x dense params x batch / peak) + KV-cache bytes / (HBM x eff)
  experts = per MoE layer (ep = min(EP, experts), pipeline.model.default_ep_size): the GPU holds experts/EP of the
            layer's experts (a slice of one when EP > experts: expert slicing, export/inference.py), each read once
            if any token reaches it (P = 1 - (1 - 1/E)^(batch x EP x top_k)), bytes / (HBM x eff_expert), or compute
  all-to-all = 2 per MoE layer (dispatch and combine): latency + bytes / link, bytes = batch x top_k x hidden x 2
            (bf16) x the share bound elsewhere; NVLink within a node (EP <= 8), else the slower of the on-node part
            over NVLink and the off-node part over InfiniBand; + one all-reduce of the slices where EP > experts
  step = dense + experts + all-to-all (no overlap assumed); tokens/s per GPU = batch / step.
Then a sensitivity: each assumption x2 and x0.5, the change in tokens/s per GPU; the dominant one is named.
Results: tables on stdout, `ep_scale_model.json` and `ep_scale_model.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, active_bytes, best_bandwidth, best_seconds, read_bandwidth  # noqa: E402

sys.path.insert(1, str(ROOT))

NOTICE = "PROJECTION ON PAPER, NOT A MEASUREMENT: stated GPU/interconnect figures x CPU-measured efficiencies"
# stated assumptions: value, unit, where it comes from (none of them is measured here)
STATED = {
    "hbm_tbps": (3.35, "TB/s", "H100 SXM5 HBM3 (NVIDIA H100 datasheet); H200's HBM3e is 4.8 TB/s (NVIDIA H200 page)"),
    "peak_tflops": (989.0, "TFLOP/s", "H100 SXM5 dense bf16 tensor-core peak (NVIDIA H100 datasheet, no sparsity)"),
    "nvlink_gbps": (450.0, "GB/s", "NVLink 4: 900 GB/s per GPU both directions, 450 each way (NVIDIA H100 datasheet)"),
    "ib_gbps": (50.0, "GB/s", "InfiniBand NDR 400 Gb/s, one ConnectX-7 NIC per GPU (DGX H100 layout)"),
    "latency_intra_us": (10.0, "us", "per all-to-all within a node: assumed (the brief's 10-30 us; NCCL's order)"),
    "latency_inter_us": (25.0, "us", "per all-to-all across nodes: assumed (the brief's 10-30 us; NCCL's order)"),
    "gpus_per_node": (8, "GPUs", "HGX/DGX H100 node"),
}
# what the sensitivity varies: the assumptions (the dominant one is named among these), then the workload
ASSUMED = ("hbm_tbps", "peak_tflops", "nvlink_gbps", "ib_gbps", "latency_intra_us", "latency_inter_us", "eff_dense",
           "eff_expert")
WORKLOAD = ("batch", "context")


def student_config(recipe_path: Path):
    """The recipe's student ModelConfig, as `moe-pipeline plan` builds it (the paper's layer rule)."""
    from distill.student import select_layers, student_config as make
    from pipeline.build import teacher_config
    from pipeline.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    teacher = teacher_config(recipe)
    method = "paper" if recipe.student.layer_selection == "importance" else recipe.student.layer_selection
    kept = select_layers(teacher, recipe.student.layers, recipe.moe_layer_count(recipe.student.layers), method)
    return make(teacher, kept, recipe.student.experts)


def shapes(cfg) -> dict:
    """Bytes (bf16, gates fp32) and parameters a decode step reads: the dense part, one expert, the KV cache."""
    import torch

    act = active_bytes(cfg, torch.bfloat16)
    one_expert = act["experts"] / (len(cfg.experts) * cfg.top_k)
    return {"dense_bytes": act["total"] - act["experts"], "dense_params": (act["total"] - act["experts"]) / 2,
            "expert_bytes": one_expert, "expert_params": one_expert / 2, "hidden": cfg.hidden,
            "kv_bytes_per_token_of_context": cfg.layers * 2 * cfg.hidden * 2, "experts": list(cfg.experts),
            "top_k": cfg.top_k, "layers": cfg.layers}


def measure_cpu(cfg, hidden: int, context: int, repeats: int = 10, buffer_gib: float = 1.0) -> dict:
    """Batch-1 fp32 time of a dense Block (KV cache of `context` tokens) and of one expert MLP at `hidden`, and this
    CPU's read bandwidth (torch.sum); each component's efficiency = its bytes / time / bandwidth (at most 1)."""
    import dataclasses

    import torch

    from pipeline.model import MLP, Block, KVCache

    head_dim = cfg.hidden // cfg.heads
    # narrower: the fields resolved from the width (head_dim, kv_heads, ffn_hidden, expert_hidden) resolved again
    c = dataclasses.replace(cfg, hidden=hidden, heads=max(1, hidden // head_dim), layers=1, moe_layers=(), experts=(),
                            head_dim=None, kv_heads=None, ffn_hidden=None, expert_hidden=None)
    block, expert = Block(c, 0, "reference", 1).eval(), MLP(c).eval()
    cache = KVCache(c, batch=1, max_len=context + 1)
    cache.length = context  # every timed forward writes the same next position

    def best(fn):
        with torch.no_grad():
            return best_seconds(fn, repeats)

    x = torch.randn(1, 1, hidden)
    samples = [read_bandwidth(torch.get_num_threads(), buffer_gib, 3)]  # before and after the timings: the best
    t_block, t_expert = best(lambda: block(x, cache, 0)), best(lambda: expert(x))
    samples.append(read_bandwidth(torch.get_num_threads(), buffer_gib, 3))
    block_bytes = sum(p.numel() * 4 for p in block.parameters()) + 2 * context * hidden * 4
    expert_bytes = sum(p.numel() * 4 for p in expert.parameters())
    bw = best_bandwidth(samples)["ops_bytes_per_s"]["sum_fp32"]
    return {"hidden": hidden, "context": context, "threads": torch.get_num_threads(), "read_bytes_per_s": bw,
            "block_seconds": t_block, "expert_seconds": t_expert, "block_bytes": block_bytes,
            "expert_bytes": expert_bytes, "eff_dense": min(1.0, block_bytes / t_block / bw),
            "eff_expert": min(1.0, expert_bytes / t_expert / bw)}


def all_to_all(nbytes: float, ep: int, a: dict) -> float:
    """Seconds of one all-to-all in which each GPU sends `nbytes` spread evenly over the EP GPUs."""
    node = a["gpus_per_node"]
    if ep <= 1:
        return 0.0
    if ep <= node:
        return a["latency_intra_us"] * 1e-6 + nbytes * (ep - 1) / ep / (a["nvlink_gbps"] * 1e9)
    on, off = nbytes * (node - 1) / ep, nbytes * (ep - node) / ep
    return a["latency_inter_us"] * 1e-6 + max(on / (a["nvlink_gbps"] * 1e9), off / (a["ib_gbps"] * 1e9))


def project(s: dict, ep: int, a: dict) -> dict:
    """One decode step's terms (seconds) on each GPU at expert-parallel degree `ep`, and tokens/s per GPU."""
    hbm, peak, B, k = a["hbm_tbps"] * 1e12, a["peak_tflops"] * 1e12, a["batch"], s["top_k"]
    dense = max(s["dense_bytes"] / (hbm * a["eff_dense"]), 2 * s["dense_params"] * B / peak)
    kv = B * a["context"] * s["kv_bytes_per_token_of_context"] / (hbm * a["eff_dense"])
    experts = comm = slicing = 0.0
    held = 0.0
    for E in s["experts"]:
        share = E / ep  # experts held per GPU (below 1: a slice of one)
        hit = 1 - (1 - 1 / E) ** (B * ep * k)  # the chance a given expert gets a token this step
        nbytes = share * hit * s["expert_bytes"]
        held += share * s["expert_bytes"]
        # compute: the B x top_k tokens this GPU's share of the layer's experts gets (an even spread)
        experts += max(nbytes / (hbm * a["eff_expert"]), 2 * s["expert_params"] * B * k / peak)
        msg = B * k * s["hidden"] * 2  # bf16 activations this GPU sends (and gets back)
        comm += 2 * all_to_all(msg, min(ep, E), a)
        if ep > E:  # expert slicing: the ep/E GPUs holding slices of one expert all-reduce its output
            parts = ep // E
            slicing += a["latency_inter_us"] * 1e-6 + msg * 2 * (parts - 1) / parts / (a["ib_gbps"] * 1e9)
    step = dense + kv + experts + comm + slicing
    terms = {"dense_weights": dense, "kv_cache": kv, "experts": experts, "all_to_all": comm, "slice_allreduce": slicing}
    return {"ep": ep, "gpus": ep, **{f"{t}_us": v * 1e6 for t, v in terms.items()}, "step_us": step * 1e6,
            "tok_s_per_gpu": B / step, "expert_bytes_held_per_gpu": held, "dominant_term": max(terms, key=terms.get)}


def sensitivity(s: dict, eps: list[int], a: dict) -> dict:
    """Per assumption: the change in tokens/s per GPU at each EP when it is doubled and halved (efficiencies
    capped at 1)."""
    base = {ep: project(s, ep, a)["tok_s_per_gpu"] for ep in eps}
    out = {}
    for key in ASSUMED + WORKLOAD:
        row = {}
        for f in (2.0, 0.5):
            value = a[key] * f
            value = min(1.0, value) if key.startswith("eff_") else (round(value) if key in ("batch", "context")
                                                                      else value)
            b = {**a, key: value}
            row[f"x{f:g}"] = {ep: project(s, ep, b)["tok_s_per_gpu"] / base[ep] - 1 for ep in eps}
        out[key] = row
    dominant = {ep: max(ASSUMED, key=lambda k: max(abs(v[ep]) for v in out[k].values())) for ep in eps}
    return {"change": out, "dominant": dominant}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["projection"]
    terms = ("dense_weights", "kv_cache", "experts", "all_to_all", "slice_allreduce")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
    bottom = [0.0] * len(rows)
    for t in terms:
        vals = [r[f"{t}_us"] for r in rows]
        axes[0].bar([str(r["ep"]) for r in rows], vals, bottom=bottom, label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set(xlabel="expert-parallel degree (GPUs)", ylabel="us per decode step", ylim=(0, 1.3 * max(bottom)))
    axes[0].legend(fontsize=7, ncol=3, loc="upper right")
    axes[1].plot([r["ep"] for r in rows], [r["tok_s_per_gpu"] for r in rows], "o-")
    axes[1].set(xscale="log", xlabel="expert-parallel degree (GPUs)", ylabel="tokens/s per GPU")
    axes[1].set_xticks([r["ep"] for r in rows], [str(r["ep"]) for r in rows])
    fig.suptitle(f"{NOTICE}\n1.3b student, batch {res['assumptions']['batch']} per GPU, context "
                 f"{res['assumptions']['context']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(recipe: Path, out: Path, eps: list[int], batch: int, context: int, measure_hidden: int | None = None,
        efficiency: float | None = None, overrides: dict | None = None, buffer_gib: float = 1.0) -> dict:
    """The projection for `recipe`'s student: measure the CPU efficiencies (unless `efficiency` is given), project
    every EP degree, the sensitivity; JSON and PNG to `out`."""
    cfg = student_config(recipe)
    s = shapes(cfg)
    cpu = measure_cpu(cfg, measure_hidden or cfg.hidden, context, buffer_gib=buffer_gib)
    a = {k: v[0] for k, v in STATED.items()}
    a.update(batch=batch, context=context, eff_dense=efficiency or cpu["eff_dense"],
             eff_expert=efficiency or cpu["eff_expert"], **(overrides or {}))
    res = {"notice": NOTICE, "recipe": str(recipe), "student": s, "cpu_measured": cpu, "assumptions": a,
           "stated_sources": {k: {"value": a[k], "unit": v[1], "source": v[2]} for k, v in STATED.items()},
           "projection": [project(s, ep, a) for ep in eps], "sensitivity": sensitivity(s, eps, a)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ep_scale_model.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    plot(res, out / "ep_scale_model.png")
    return res


def report(res: dict) -> str:
    s, a, c = res["student"], res["assumptions"], res["cpu_measured"]
    lines = [f"== {res['notice']} ==",
             f"student of {res['recipe']}: {s['layers']} layers, hidden {s['hidden']}, experts {s['experts']}; per "
             f"step (bf16) dense {s['dense_bytes'] / 1e9:.2f} GB, one expert {s['expert_bytes'] / 1e6:.1f} MB, KV "
             f"{s['kv_bytes_per_token_of_context'] / 1e3:.0f} kB per sequence per token of context; all-to-all "
             f"{s['hidden'] * 2 * s['top_k']} B per token per MoE layer each way (hidden x 2 bytes x top_k), "
             f"2 per MoE layer",
             f"measured on this CPU (fp32, batch 1, hidden {c['hidden']}, {c['threads']} threads): read "
             f"{c['read_bytes_per_s'] / 1e9:.1f} GB/s; dense block {c['block_seconds'] * 1e3:.2f} ms -> efficiency "
             f"{c['eff_dense']:.0%}, expert {c['expert_seconds'] * 1e3:.2f} ms -> {c['eff_expert']:.0%}",
             f"used: eff_dense {a['eff_dense']:.2f}, eff_expert {a['eff_expert']:.2f}, batch {a['batch']} per GPU, "
             f"context {a['context']}",
             "stated (not measured here):"]
    lines += [f"  {k:17s} {v['value']:>7g} {v['unit']:8s} {v['source']}" for k, v in res["stated_sources"].items()]
    head = ["EP", "dense us", "KV us", "experts us", "a2a us", "slices us", "step us", "tok/s/GPU", "GB held",
            "dominant"]
    lines.append("".join(f"{h:>11s}" for h in head))
    for r in res["projection"]:
        cells = [r["ep"], *(f"{r[f'{t}_us']:.0f}" for t in ("dense_weights", "kv_cache", "experts", "all_to_all",
                                                            "slice_allreduce", "step")),
                 f"{r['tok_s_per_gpu']:.0f}", f"{r['expert_bytes_held_per_gpu'] / 1e9:.1f}", r["dominant_term"]]
        lines.append("".join(f"{str(x):>11s}" for x in cells))
    sens = res["sensitivity"]
    eps = [r["ep"] for r in res["projection"]]
    lines.append("sensitivity: change in tokens/s per GPU, assumption x2 / x0.5, at EP " + ", ".join(map(str, eps)))
    for key, row in sens["change"].items():
        lines.append(f"  {key:17s}" + "".join(f"{row['x2'][ep]:+7.0%}/{row['x0.5'][ep]:+5.0%}" for ep in eps))
    lines.append("dominant assumption (of the stated and measured ones, not batch/context): "
                 + ", ".join(f"EP {ep}: {k}" for ep, k in sens["dominant"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "1.3b.yaml")
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 64, 128], help="expert-parallel degrees (GPUs)")
    p.add_argument("--batch", type=int, default=32, help="decoding sequences per GPU")
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence (KV-cache reads)")
    p.add_argument("--measure-hidden", type=int, default=None,
                   help="hidden size of the CPU timing (default the student's)")
    p.add_argument("--efficiency", type=float, default=None, help="use this share of HBM bandwidth, not the CPU's")
    for key, (value, unit, _) in STATED.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"stated {value} {unit}")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ep_scale_model")
    args = p.parse_args(argv)
    overrides = {k: getattr(args, k) for k in STATED if getattr(args, k) is not None}
    res = run(args.recipe, args.out, args.ep, args.batch, args.context, args.measure_hidden, args.efficiency, overrides)
    print(report(res))
    print(f"wrote {args.out / 'ep_scale_model.json'} and ep_scale_model.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
