"""`moe-pipeline plan RECIPE --measure`: how much each way of compressing the teacher costs, before any training.

    moe-pipeline plan recipes/tiny.yaml --measure                 # the run's finished teacher (runs/tiny/teacher)
    moe-pipeline plan recipes/tiny.yaml --measure --json --blocks 128 --run-dir runs/other

Candidate students are cut from the trained teacher (`teacher.load` if the recipe sets it, else the run's
finished teacher stage) exactly as the student stage starts them (`distill.student.init_from_teacher`), and
every one is scored on the same held-out blocks, untrained:

  * depth: each layer-selection rule (`paper`, `uniform`, `importance`) at each depth from the teacher's
    minus one down to half of it, the MoE layers counted as the recipe counts them (`model.moe_every`);
  * experts: each pruning rule (`frequency`, `saliency`) keeping 75% and 50% of every MoE layer's experts
    at the teacher's depth (at least `model.top_k`, a multiple of `distributed.ep_size` if it is set);
  * the teacher itself, the 100% row;
  * weight-only quantisation (pipeline/quantize.py: int8 per output channel, int4 in groups of 128, symmetric,
    round to nearest; routers and the output layer kept): the teacher and the recipe's own student (cut as the
    distill stage cuts it, untrained), each as it is, int8 and int4, with the bytes of their weights (`quantized`).

Importance and expert scores come from `student.calibration_batches` micro-batches of the training split,
the held-out blocks from the validation split. Printed as a table (or one JSON object with `--json`) with
total and active parameters, and drawn as a PNG (held-out loss against active and against total
parameters) into `--out` (default RUN/plan/): the table a user picks `student.layers`, `student.experts`
and the selection rules from. The models run on one process (every expert local), on the accelerator
if there is one, one at a time, in the recipe's precision (bf16 for a bf16 or fp16 recipe: the 1.3b teacher is
63 GB so, 126 GB in fp32), built on the meta device and allocated there directly; a model larger than the
device's free memory is refused before anything is allocated, naming both sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from distill.stage import calibration_batches, choose_layers, kept_experts
from distill.student import (METHODS, EXPERT_METHODS, block_importance, expert_scores, init_from_teacher,
                             select_experts, select_layers, student_config)
from pipeline import data as data_lib
from pipeline.artifacts import atomic_write_text, cache_root, read_model_config
from pipeline.build import empty_model, load_frozen, meta_counts
from pipeline.dist import Ranks, device
from pipeline.model import ModelConfig
from pipeline.quantize import INT4_GROUP, fake_quantize_
from pipeline.schemes import STORED
from pipeline.recipe import Recipe, RecipeError
from pipeline.train import evaluate

FRACTIONS = (0.75, 0.5)
DTYPE_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclasses.dataclass
class Candidate:
    kind: str  # "teacher", "depth" or "experts"
    rule: str  # "-", a layer-selection rule or an expert-pruning rule
    kept: list[int]  # teacher layers kept
    experts: list[int]  # experts per student MoE layer
    kept_experts: dict[int, list[int]]  # pruned teacher layer -> the expert ids it keeps

    @property
    def name(self) -> str:
        if self.kind == "teacher":
            return "teacher"
        if self.kind == "depth":
            return f"{len(self.kept)} layers ({self.rule})"
        return f"experts {self.experts} ({self.rule})"


def _pruned_counts(teacher: ModelConfig, fraction: float, ep: int | None) -> list[int]:
    counts = []
    for e in teacher.experts:
        keep = max(teacher.top_k, round(fraction * e))
        if ep:
            keep = max(ep, keep // ep * ep)
        counts.append(min(keep, e))
    return counts


def candidates(recipe: Recipe, teacher: ModelConfig, importance: list[float],
               scores: dict[str, dict[int, list[float]]]) -> list[Candidate]:
    """Every candidate the module docstring lists, in table order (invalid shapes skipped)."""
    out = [Candidate("teacher", "-", list(range(teacher.layers)), list(teacher.experts), {})]
    for layers in range(teacher.layers - 1, math.ceil(teacher.layers / 2) - 1, -1):
        moe_count = recipe.moe_layer_count(layers)
        if moe_count < 1:
            continue
        for rule in METHODS:
            try:
                kept = select_layers(teacher, layers, moe_count, rule, importance if rule == "importance" else None)
            except RecipeError:  # more dense layers than the teacher has, at this depth
                continue
            out.append(Candidate("depth", rule, kept, list(student_config(teacher, kept).experts), {}))
    moe = list(teacher.moe_layers)
    for rule in EXPERT_METHODS:
        for fraction in FRACTIONS:
            counts = _pruned_counts(teacher, fraction, recipe.distributed.ep_size)
            if counts == list(teacher.experts):
                continue
            kept_experts = {t: select_experts(scores[rule][t], n) for t, n, e in zip(moe, counts, teacher.experts)
                            if n < e}
            out.append(Candidate("experts", rule, list(range(teacher.layers)), counts, kept_experts))
    return out


def teacher_dir_of(recipe: Recipe, run_dir: Path) -> Path:
    if recipe.teacher.load:
        return Path(recipe.teacher.load)
    stage = Path(run_dir) / "teacher"
    if not (stage / "DONE.json").is_file():
        raise RecipeError("teacher.load", None, f"a trained teacher to cut candidates from: set teacher.load, or "
                          f"run `moe-pipeline teacher` first ({stage}/DONE.json is missing)")
    return stage


def free_bytes(on: torch.device) -> int:
    """Memory free for one model on `on`: the GPU's free memory, or the host's available memory."""
    if on.type == "cuda":
        return torch.cuda.mem_get_info(on)[0]
    import psutil

    return psutil.virtual_memory().available


def check_fits(cfg: ModelConfig, dtype: torch.dtype, on: torch.device, teacher_dir: Path | str = "") -> None:
    """Refuse a teacher whose weights alone exceed 90% of the memory free on `on` (its candidates are no larger)."""
    need = meta_counts(cfg)["total"] * torch.finfo(dtype).bits // 8
    free = free_bytes(on)
    if need > 0.9 * free:
        raise RecipeError("--measure", str(teacher_dir), f"plan --measure holds the whole teacher on one device: "
                          f"{need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, with {free / 2**30:.1f} "
                          f"GiB free on {on}; run it where the teacher fits (a larger GPU, or the host's memory "
                          f"with CUDA_VISIBLE_DEVICES=''), or choose the student with `moe-pipeline plan` alone")


def measure(recipe: Recipe, teacher_dir: Path, blocks: int = 64, progress: bool = True) -> dict:
    """The held-out loss of every candidate (see the module docstring), with their sizes."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    on = device()
    teacher_cfg = read_model_config(teacher_dir)
    prepared = data_lib.prepare_data(recipe.data, cache_root())
    train = data_lib.PackedTokens(prepared.train, teacher_cfg.seq_len, prepared.eod_id)
    val = data_lib.PackedTokens(prepared.val, teacher_cfg.seq_len, prepared.eod_id, name="val")
    micro = recipe.student.train.micro_batch_size
    one = Ranks(rank=0, world=1, local_rank=0, local_world=1)

    dtype = torch.float32 if recipe.student.train.precision == "fp32" else torch.bfloat16
    check_fits(teacher_cfg, dtype, on, teacher_dir)
    teacher = load_frozen(teacher_dir, 1, None, on, dtype, impl="reference")
    importance = block_importance(teacher, calibration_batches(recipe, train, one))  # the student stage's, rank 0
    scores = {rule: expert_scores(teacher, calibration_batches(recipe, train, one), rule) for rule in EXPERT_METHODS}
    chosen = choose_layers(recipe, teacher, train, one)  # the student the distill stage would start from
    del teacher
    batches = max(1, min(blocks, val.num_blocks) // micro)
    rows = []
    for c in tqdm(candidates(recipe, teacher_cfg, importance, scores), desc="scoring candidates", unit="model",
                  disable=not progress):
        cfg = student_config(teacher_cfg, c.kept, c.experts) if c.kind != "teacher" else teacher_cfg
        if c.kind == "teacher":
            model = load_frozen(teacher_dir, 1, None, on, dtype, impl="reference")
        else:
            model = empty_model(cfg, dtype, on)
            init_from_teacher(model, teacher_dir, c.kept, c.kept_experts)
        loss = evaluate(model.requires_grad_(False), val, batches, micro, one)
        counts = meta_counts(cfg)
        rows.append({"name": c.name, "kind": c.kind, "rule": c.rule, "layers": cfg.layers,
                     "kept_teacher_layers": c.kept, "experts": list(cfg.experts),
                     "kept_experts": {str(t): ids for t, ids in c.kept_experts.items()},
                     "params_total": counts["total"], "params_active_per_token": counts["active_per_token"],
                     "val_loss": round(loss, 5)})
        del model
    # the cost of weight-only quantisation (pipeline/quantize.py), for the teacher and the recipe's student (cut,
    # untrained): each as it is and with every quantised weight replaced by its int8 or int4 form
    quantized = []
    student_cfg = student_config(teacher_cfg, chosen["kept_teacher_layers"], chosen["experts"])
    for target in tqdm(("teacher", "student"), desc="scoring quantised", unit="model", disable=not progress):
        cfg = teacher_cfg if target == "teacher" else student_cfg
        for scheme in (None, *STORED):
            if target == "teacher":
                model = load_frozen(teacher_dir, 1, None, on, dtype, impl="reference")
            else:
                model = empty_model(cfg, dtype, on)
                init_from_teacher(model, teacher_dir, chosen["kept_teacher_layers"], kept_experts(chosen))
            held = fake_quantize_(model, scheme) if scheme else None
            with top1_routes() as routes:
                loss = evaluate(model.requires_grad_(False), val, batches, micro, one)
            routes = torch.cat(routes) if routes else torch.zeros(0, dtype=torch.long)
            counts = meta_counts(cfg)
            size = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
            if held:  # the quantised weights' bytes instead of their dtype's
                size += held["bytes"] - held["weights"] * torch.finfo(dtype).bits // 8
            quantized.append({"name": f"{target} {scheme or DTYPE_LABEL[dtype]}", "target": target,
                              "scheme": scheme or DTYPE_LABEL[dtype], "layers": cfg.layers,
                              "params_total": counts["total"], "params_active_per_token": counts["active_per_token"],
                              "weight_bytes": int(size), "val_loss": round(loss, 5), "_routes": routes})
            del model
    base = rows[0]["val_loss"]
    for r in rows + quantized:
        r["loss_vs_teacher"] = round(r["val_loss"] - base, 5)
        r["retention"] = round(base / r["val_loss"], 5)  # the teacher's loss over the candidate's: 1 = no cost
    for r in quantized:  # against the same model unquantised
        plain = next(x for x in quantized if x["target"] == r["target"])
        r["loss_vs_unquantized"] = round(r["val_loss"] - plain["val_loss"], 5)
        r["loss_vs_unquantized_pct"] = round(100 * (r["val_loss"] / plain["val_loss"] - 1), 3)
        same = (r["_routes"] == plain["_routes"]).double().mean().item() if len(plain["_routes"]) else 1.0
        r["top1_routing_agreement"] = round(same, 5)  # every MoE layer's tokens: the same first expert chosen
    for r in quantized:
        del r["_routes"]
    return {"teacher": str(Path(teacher_dir).resolve()), "held_out_tokens": batches * micro * teacher_cfg.seq_len,
            "calibration_batches": recipe.student.calibration_batches, "block_importance": importance,
            "expert_scores": {rule: {str(t): s for t, s in by_layer.items()} for rule, by_layer in scores.items()},
            "candidates": rows, "quantized": quantized, "int4_group": INT4_GROUP,
            "seconds": round(time.perf_counter() - t0, 1)}


@contextlib.contextmanager
def top1_routes():
    """While inside: every router's first choice of each token, in call order (pipeline/model.py `router_logits`, which
    every MoE layer's routing calls), appended to the list it yields."""
    import pipeline.model as model_lib

    seen, original = [], model_lib.router_logits

    def recording(x, wg):
        logits = original(x, wg)
        seen.append(logits.argmax(-1).flatten().cpu())
        return logits

    model_lib.router_logits = recording
    try:
        yield seen
    finally:
        model_lib.router_logits = original


def format_table(result: dict) -> str:
    lines = [f"candidates cut from {result['teacher']}, untrained, on {result['held_out_tokens']:,} held-out tokens",
             f"{'candidate':<34}{'layers':>7}{'total':>12}{'active':>12}{'held-out':>10}{'vs teacher':>12}{'retention':>10}"]
    for r in result["candidates"]:
        lines.append(f"{r['name'][:33]:<34}{r['layers']:>7}{r['params_total'] / 1e6:>11.2f}M"
                     f"{r['params_active_per_token'] / 1e6:>11.2f}M{r['val_loss']:>10.4f}{r['loss_vs_teacher']:>+12.4f}"
                     f"{r['retention']:>10.3f}")
    if result.get("quantized"):
        lines.append(f"weight-only quantisation (symmetric, round to nearest; int4 in groups of {result['int4_group']}; "
                     f"routers and the output layer kept)")
        lines.append(f"{'model':<34}{'weights':>12}{'held-out':>10}{'vs unquantised':>20}{'top-1 routes':>14}")
        for r in result["quantized"]:
            lines.append(f"{r['name'][:33]:<34}{r['weight_bytes'] / 2 ** 20:>10.2f}MB{r['val_loss']:>10.4f}"
                         f"{r['loss_vs_unquantized']:>+11.4f} ({r['loss_vs_unquantized_pct']:+.2f}%)"
                         f"{100 * r['top1_routing_agreement']:>13.2f}%")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Held-out loss against active and against total parameters, one marker per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quantized = result.get("quantized") or []
    fig, axes = plt.subplots(1, 3 if quantized else 2, figsize=(13.5 if quantized else 9, 3.6), dpi=90)
    styles = {"teacher": ("*", "k"), "paper": ("o", "C0"), "uniform": ("s", "C1"), "importance": ("^", "C2"),
              "frequency": ("D", "C3"), "saliency": ("v", "C4")}
    for ax, key, label in ((axes[0], "params_active_per_token", "active parameters per token (M)"),
                           (axes[1], "params_total", "total parameters (M)")):
        for rule, (marker, color) in styles.items():
            rows = [r for r in result["candidates"] if (r["rule"] if r["kind"] != "teacher" else "teacher") == rule]
            if rows:
                ax.scatter([r[key] / 1e6 for r in rows], [r["val_loss"] for r in rows], marker=marker, color=color,
                           s=60 if rule == "teacher" else 25, label=rule)
        ax.set(xlabel=label, ylabel="held-out loss (nats/token), untrained")
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    if quantized:  # the teacher and the recipe's student, as they are and quantised, against their weights' bytes
        ax = axes[2]
        for target, marker in (("teacher", "*"), ("student", "o")):
            rows = [r for r in quantized if r["target"] == target]
            ax.plot([r["weight_bytes"] / 2 ** 20 for r in rows], [r["val_loss"] for r in rows], marker=marker,
                    label=target)
            for r in rows:
                ax.annotate(r["scheme"], (r["weight_bytes"] / 2 ** 20, r["val_loss"]), fontsize=7)
        ax.set(xlabel="weights (MB)", ylabel="held-out loss (nats/token), untrained")
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    fig.suptitle("compression candidates before training", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def run(recipe: Recipe, run_dir: Path, out_dir: Path, blocks: int, as_json: bool) -> dict:
    """Measure, write measure.json and measure.png into `out_dir`, print the table (or the JSON)."""
    result = measure(recipe, teacher_dir_of(recipe, run_dir), blocks, progress=not as_json)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "measure.json", json.dumps(result, indent=1))
    result["plot"] = str(plot(result, out_dir / "measure.png"))
    print(json.dumps(result) if as_json else format_table(result) + f"\n-> {out_dir}/measure.json, measure.png "
          f"({result['seconds']:.0f}s)")
    return result
