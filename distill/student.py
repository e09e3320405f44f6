"""The Mixture-of-Students' architecture and its starting weights, taken from the teacher's layers.

A student is the teacher with some blocks removed (paper: 24 -> 21 layers). Which blocks stay is
a recipe setting (`student.layer_selection`); the choice is made separately among MoE layers and
among dense layers, so the student keeps the teacher's MoE/dense mix in depth order:

  * "paper": the top MoE layers (in a pyramid the lowest have the fewest experts) and, of the
    dense layers, the one next to the embeddings plus the top ones. For the paper's teacher this
    drops 1-indexed layers 2, 3, 4 (two 32-expert MoE layers and the dense layer between them);
  * "uniform": evenly spaced within each type (the lowest and the highest of each type stay);
  * "importance": the most important within each type, by `block_importance` (Minitron-style:
    1 - cosine(block input, block output) on calibration batches; a block that barely changes
    its input is the cheapest to drop).

A student MoE layer may also keep fewer experts than its teacher layer (`student.experts` below
the kept layers' counts: expert pruning, a second axis next to depth). Which experts stay is
`student.expert_selection`, scored on calibration batches by `expert_scores`:

  * "frequency": the share of the layer's top-k choices that went to the expert;
  * "saliency": REAP's criterion, the mean over the tokens routed to the expert of its gate
    weight x the norm of its output (an expert no token chose scores 0).

The router keeps its rows of the kept experts and softmaxes over them; the residual MLP is never
pruned. Counts may differ per layer (a pyramid stays a pyramid).

The student then starts from the teacher's weights (the reference implementation started from
random ones): every kept block, the embeddings and the final norm are copied by name (a pruned
layer's kept experts renumbered 0..n-1 in their teacher order).

    teacher_cfg = read_model_config(teacher_dir)
    kept = select_layers(teacher_cfg, layers=21, moe_count=10, method="paper")
    student = GPT(student_config(teacher_cfg, kept))
    init_from_teacher(student, teacher_dir, kept)
    # pruned: experts = {teacher layer: [kept expert ids]} from select_experts(expert_scores(...))
    student = GPT(student_config(teacher_cfg, kept, [len(experts[t]) for t in kept if teacher_cfg.is_moe(t)]))
    init_from_teacher(student, teacher_dir, kept, experts)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline import dist
from pipeline.artifacts import SOURCE, read_model_config
from pipeline.model import GPT, ModelConfig, expert_key, router_logits, split_expert_key
from pipeline.recipe import RecipeError
from pipeline.weights import ep_rank_of as default_ep_rank_of
from pipeline.weights import load_weights, weight_files

METHODS = ("paper", "uniform", "importance")
EXPERT_METHODS = ("frequency", "saliency")


# -- which teacher layers the student keeps -----------------------------------------------------

def select_layers(teacher: ModelConfig, layers: int, moe_count: int, method: str,
                  scores: Sequence[float] | None = None) -> list[int]:
    """The 0-indexed teacher layers the student keeps, sorted by depth.

    Exactly `moe_count` of them are MoE layers and `layers - moe_count` dense ones, each chosen
    among the teacher's layers of that type by `method` ("paper", "uniform" or "importance";
    "importance" needs `scores`, one per teacher layer, higher = more important).
    """
    if method not in METHODS:
        raise RecipeError("student.layer_selection", method, f"one of {', '.join(map(repr, METHODS))}")
    if layers >= teacher.layers:
        raise RecipeError("student.layers", layers, f"must be < teacher layers ({teacher.layers})")
    moe = list(teacher.moe_layers)
    dense = [i for i in range(teacher.layers) if not teacher.is_moe(i)]
    dense_count = layers - moe_count
    if not 0 <= moe_count <= len(moe):
        raise RecipeError("student.layers", layers, f"keeps {moe_count} MoE layers; the teacher has "
                          f"{len(moe)} (0-indexed {moe}), so at most {len(moe)}")
    if not 0 <= dense_count <= len(dense):
        raise RecipeError("student.layers", layers, f"keeps {dense_count} dense layers ({layers} layers, "
                          f"{moe_count} MoE); the teacher has {len(dense)}, so student.layers <= "
                          f"{len(dense) + moe_count}")
    if method == "importance":
        if scores is None or len(scores) != teacher.layers:
            raise ValueError(f"layer_selection 'importance' needs one score per teacher layer "
                             f"({teacher.layers}), got {None if scores is None else len(scores)}")
        kept = _most_important(moe, moe_count, scores) + _most_important(dense, dense_count, scores)
    elif method == "uniform":
        kept = _evenly_spaced(moe, moe_count) + _evenly_spaced(dense, dense_count)
    else:
        kept = _top(moe, moe_count) + _bottom_and_top(dense, dense_count)
    return sorted(kept)


def _top(candidates: list[int], k: int) -> list[int]:
    """The k deepest: in a pyramid the top MoE layers have the most experts, the paper keeps them."""
    return candidates[len(candidates) - k:] if k else []


def _bottom_and_top(candidates: list[int], k: int) -> list[int]:
    """The lowest (next to the embeddings, where the token representation is formed) plus the k-1 deepest."""
    if k == 0:
        return []
    return [candidates[0]] + _top(candidates[1:], k - 1)


def _evenly_spaced(candidates: list[int], k: int) -> list[int]:
    """round(linspace(0, n-1, k)) into the candidates: keeps the lowest and the highest when k >= 2."""
    if k == 0:
        return []
    picks = np.round(np.linspace(0, len(candidates) - 1, k)).astype(int)
    return [candidates[i] for i in picks]


def _most_important(candidates: list[int], k: int, scores: Sequence[float]) -> list[int]:
    """The k highest-scored; on a tie the deeper layer wins (the paper's preference for the top)."""
    ranked = sorted(candidates, key=lambda i: (float(scores[i]), i), reverse=True)
    return ranked[:k]


def student_config(teacher: ModelConfig, kept: Sequence[int], experts: Sequence[int] | None = None) -> ModelConfig:
    """The teacher's config with only the `kept` layers: same width, MoE where the kept layer was MoE, with
    the kept teacher layers' experts or `experts` (one count per student MoE layer, at most its teacher's)."""
    kept = list(kept)
    if kept != sorted(set(kept)) or not all(0 <= i < teacher.layers for i in kept):
        raise ValueError(f"kept layers {kept} must be distinct, sorted teacher layers in 0..{teacher.layers - 1}")
    positions = [s for s, t in enumerate(kept) if teacher.is_moe(t)]
    full = [teacher.experts_at(kept[s]) for s in positions]
    if experts is None:
        experts = full
    experts = list(experts)
    if len(experts) != len(full):
        raise RecipeError("student.experts", experts, f"one entry per student MoE layer ({len(full)})")
    for i, (e, t) in enumerate(zip(experts, full)):
        if not teacher.top_k <= e <= t:
            raise RecipeError(f"student.experts.{i}", e, f"between model.top_k ({teacher.top_k}) and the experts of "
                              f"its teacher layer {kept[positions[i]]} ({t}); fewer prunes experts")
    return dataclasses.replace(teacher, layers=len(kept), moe_layers=tuple(positions), experts=tuple(experts))


# -- which experts a pruned student layer keeps -------------------------------------------------

def _gate_weight(block) -> Tensor:
    return block.mlp.moe.deepspeed_moe.gate.wg.weight  # the same path in both MoE implementations


@torch.no_grad()
def expert_scores(model: GPT, batches: Iterable[dict[str, Tensor]], method: str) -> dict[int, list[float]]:
    """For each MoE block of `model` (0-indexed), one score per expert (global ids) on calibration batches,
    by `method` (see the module docstring). Works at any expert-parallel degree: frequency is counted from
    the router on each rank's own tokens; saliency where each expert computes (after DeepSpeed's
    all-to-all, padding rows left out), with the gate weight recomputed from the token itself. Sums are
    all-reduced, so every rank returns the same scores; the caller guarantees every rank runs the same
    number of forwards (the all-to-alls are collective)."""
    if method not in EXPERT_METHODS:
        raise RecipeError("student.expert_selection", method, f"one of {', '.join(map(repr, EXPERT_METHODS))}")
    device = next(model.parameters()).device
    layers = [i for i, b in enumerate(model.blocks) if b.is_moe]
    k = model.cfg.top_k
    sums = {i: torch.zeros(3, model.blocks[i].mlp.num_experts, dtype=torch.float64, device=device) for i in layers}
    # sums[i][0]: top-k choices per expert; [1]: sum of gate weight x |output|; [2]: tokens the expert computed

    def count_choices(layer: int):
        def record(module, args):
            x = args[0]
            logits = router_logits(x.reshape(-1, x.shape[-1]), _gate_weight(model.blocks[layer]))
            chosen = logits.topk(k, dim=-1).indices.reshape(-1)
            sums[layer][0] += torch.bincount(chosen, minlength=sums[layer].shape[1]).double()
        return record

    def weigh_outputs(layer: int, expert: int):
        def record(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1])
            y = output.reshape(-1, output.shape[-1])
            real = x.abs().amax(dim=-1) > 0  # DeepSpeed pads each expert's slots with zero rows
            x, y = x[real], y[real]
            probs = router_logits(x, _gate_weight(model.blocks[layer])).softmax(dim=-1)
            weight = probs[:, expert]
            if k > 1:  # top-k gates renormalise over the chosen experts (this one among them)
                weight = weight / probs.topk(k, dim=-1).values.sum(dim=-1)
            sums[layer][1, expert] += (weight.double() * y.float().norm(dim=-1).double()).sum()
            sums[layer][2, expert] += real.sum()
        return record

    handles = []
    for i in layers:
        moe = model.blocks[i].mlp
        handles.append(moe.register_forward_pre_hook(count_choices(i)))
        first = default_ep_rank_of(moe) * moe.num_local_experts  # this rank's first global expert id
        for j, expert in enumerate(moe.moe.deepspeed_moe.experts.deepspeed_experts):
            handles.append(expert.register_forward_hook(weigh_outputs(i, first + j)))
    was_training = model.training
    try:
        model.eval()  # no dropout, no token dropping unless the model asks for it at eval
        for batch in batches:
            model(batch["input_ids"].to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not layers:
        return {}
    totals = torch.cat([sums[i].reshape(-1) for i in layers])  # one collective for every layer
    dist.all_reduce_(totals)
    out: dict[int, list[float]] = {}
    start = 0
    for i in layers:
        E = sums[i].shape[1]
        choices, weighted, tokens = totals[start:start + 3 * E].view(3, E)
        start += 3 * E
        if choices.sum() == 0:
            raise ValueError("expert_scores: the calibration batches hold no token")
        score = choices / choices.sum() if method == "frequency" else weighted / tokens.clamp_min(1)
        out[i] = score.tolist()
    return out


def select_experts(scores: Sequence[float], keep: int) -> list[int]:
    """The `keep` highest-scored expert ids, in id order; on a tie the lower id wins."""
    if not 1 <= keep <= len(scores):
        raise ValueError(f"keep {keep} of {len(scores)} experts")
    ranked = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))
    return sorted(ranked[:keep])


# -- layer importance on calibration data --------------------------------------------------------

@torch.no_grad()
def block_importance(model: GPT, batches: Iterable[dict[str, Tensor]]) -> list[float]:
    """One score per block: 1 - cos(block input, block output), averaged over real tokens.

    Real tokens are those with `loss_mask == 1` (end-of-document positions do not count), over
    all `batches` together (a token-weighted mean, not a mean of batch means). With a process
    group of more than one rank the sums are all-reduced, so every rank returns the same scores;
    every rank passes its own batches, and the caller guarantees they all run the same number of
    forwards (the MoE layers' all-to-alls are collective).
    """
    device = next(model.parameters()).device
    n = len(model.blocks)
    # float64 sums: millions of terms each close to 0 for the blocks that matter least
    distance = torch.zeros(n, dtype=torch.float64, device=device)
    current: dict[str, Tensor] = {}  # the running batch's mask [B, T], read by the hooks

    def hook(layer: int):
        def record(module, args, output):
            x_in, x_out = args[0], output[0]  # [B, T, C] each; a Block returns (x, aux, counts)
            cos = F.cosine_similarity(x_in.float(), x_out.float(), dim=-1)  # [B, T]
            distance[layer] += ((1.0 - cos).double() * current["mask"]).sum()
        return record

    was_training = model.training
    handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(model.blocks)]
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    try:
        model.eval()  # no dropout, no token dropping unless the model asks for it at eval
        for batch in batches:
            current["mask"] = (batch["loss_mask"].to(device) == 1).double()
            tokens += current["mask"].sum()
            model(batch["input_ids"].to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    totals = torch.cat([distance, tokens.view(1)])  # one collective for numerators and count
    dist.all_reduce_(totals)
    if totals[-1] == 0:
        raise ValueError("block_importance: the calibration batches hold no real token (loss_mask == 1)")
    return (totals[:-1] / totals[-1]).tolist()


# -- initialising the student from the teacher ---------------------------------------------------

_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def teacher_name(student_name: str, kept: Sequence[int], experts: dict[int, Sequence[int]] | None = None) -> str:
    """A student parameter's global name -> the teacher's: block s is teacher block kept[s], and in a pruned
    layer (teacher block t in `experts`) expert j is the teacher's expert experts[t][j]."""
    key = split_expert_key(student_name)
    if key is not None and experts and kept[key.block] in experts:
        return expert_key(kept[key.block], experts[kept[key.block]][key.expert], key.suffix)
    return _BLOCK.sub(lambda m: f"blocks.{kept[int(m.group(1))]}.", student_name, count=1)


def init_from_teacher(student: GPT, teacher_dir: Path, kept: Sequence[int],
                      experts: dict[int, Sequence[int]] | None = None, ep_rank_of=default_ep_rank_of) -> None:
    """Copy every student tensor from the teacher's consolidated weights in `teacher_dir`.

    Attention, norms, dense and residual MLPs, coefficients, gates, every expert, embeddings and
    the final norm. Names are global (expert ids over the whole layer), so this works at any
    expert-parallel degree; each rank reads only the experts it holds. `experts` maps a pruned layer's
    teacher block to the teacher expert ids it keeps (select_experts): those experts, and their rows of
    the router, are copied.
    """
    if len(kept) != student.cfg.layers:
        raise ValueError(f"{len(kept)} kept layers for a student of {student.cfg.layers}")
    experts = {int(t): list(ids) for t, ids in (experts or {}).items()}
    counts = _check_expert_counts(student, Path(teacher_dir), kept, experts)
    picked = []
    for s, block in enumerate(student.blocks):
        if block.is_moe and kept[s] in experts:  # the router's rows of the kept experts
            wg = _gate_weight(block)
            wg.pick = (0, experts[kept[s]], counts[kept[s]])
            picked.append(wg)
    try:
        load_weights(student, teacher_dir, ep_rank_of, rename=lambda name: teacher_name(name, kept, experts))
    finally:
        for wg in picked:
            del wg.pick


def _check_expert_counts(student: GPT, teacher_dir: Path, kept: Sequence[int],
                         experts: dict[int, list[int]]) -> dict[int, int]:
    """A student MoE layer has as many experts as its teacher layer, or (pruned) as many as `experts` names
    for it, all distinct teacher experts: the name mapping alone would silently copy a subset. Returns the
    teacher's expert count per MoE block."""
    teacher_experts: dict[int, int] = {}
    if (teacher_dir / SOURCE).is_file():  # weights in another checkpoint (checked against its config when recorded)
        cfg = read_model_config(teacher_dir)
        teacher_experts = dict(zip(cfg.moe_layers, cfg.experts))
    for key in weight_files(teacher_dir) if not teacher_experts else ():
        parts = split_expert_key(key)
        if parts is not None:
            teacher_experts[parts.block] = max(teacher_experts.get(parts.block, 0), parts.expert + 1)
    for s, block in enumerate(student.blocks):
        if not block.is_moe:
            continue
        have, t = block.mlp.num_experts, kept[s]
        if t in experts:
            ids = experts[t]
            if len(ids) != have or len(set(ids)) != have or not all(0 <= e < teacher_experts.get(t, 0) for e in ids):
                raise ValueError(f"student layer {s} has {have} experts; the kept experts of teacher layer {t} "
                                 f"({ids}) must be {have} distinct ids below {teacher_experts.get(t, 0)}")
        elif teacher_experts.get(t, 0) != have:
            raise ValueError(f"student layer {s} has {have} experts, its teacher layer {t} "
                             f"in {teacher_dir} has {teacher_experts.get(t, 0)}: build the student with "
                             f"student_config(teacher config, kept), or name the kept experts")
    return teacher_experts
