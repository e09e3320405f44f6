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

The student then starts from the teacher's weights (the reference implementation started from
random ones): every kept block, the embeddings and the final norm are copied by name.

    teacher_cfg = read_model_config(teacher_dir)
    kept = select_layers(teacher_cfg, layers=21, moe_count=10, method="paper")
    student = GPT(student_config(teacher_cfg, kept))
    init_from_teacher(student, teacher_dir, kept)
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
from pipeline.model import GPT, ModelConfig, split_expert_key
from pipeline.recipe import RecipeError
from pipeline.weights import ep_rank_of as default_ep_rank_of
from pipeline.weights import load_weights, weight_files

METHODS = ("paper", "uniform", "importance")


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


def student_config(teacher: ModelConfig, kept: Sequence[int]) -> ModelConfig:
    """The teacher's config with only the `kept` layers: same width, MoE where the kept layer was MoE."""
    kept = list(kept)
    if kept != sorted(set(kept)) or not all(0 <= i < teacher.layers for i in kept):
        raise ValueError(f"kept layers {kept} must be distinct, sorted teacher layers in 0..{teacher.layers - 1}")
    positions = [s for s, t in enumerate(kept) if teacher.is_moe(t)]
    return dataclasses.replace(teacher, layers=len(kept), moe_layers=tuple(positions),
                               experts=tuple(teacher.experts_at(kept[s]) for s in positions))


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


def teacher_name(student_name: str, kept: Sequence[int]) -> str:
    """A student parameter's global name -> the teacher's: block s is teacher block kept[s]."""
    return _BLOCK.sub(lambda m: f"blocks.{kept[int(m.group(1))]}.", student_name, count=1)


def init_from_teacher(student: GPT, teacher_dir: Path, kept: Sequence[int],
                      ep_rank_of=default_ep_rank_of) -> None:
    """Copy every student tensor from the teacher's consolidated weights in `teacher_dir`.

    Attention, norms, dense and residual MLPs, coefficients, gates, every expert, embeddings and
    the final norm. Names are global (expert ids over the whole layer), so this works at any
    expert-parallel degree; each rank reads only the experts it holds.
    """
    if len(kept) != student.cfg.layers:
        raise ValueError(f"{len(kept)} kept layers for a student of {student.cfg.layers}")
    _check_expert_counts(student, Path(teacher_dir), kept)
    load_weights(student, teacher_dir, ep_rank_of, rename=lambda name: teacher_name(name, kept))


def _check_expert_counts(student: GPT, teacher_dir: Path, kept: Sequence[int]) -> None:
    """A student MoE layer must have as many experts as its teacher layer: with fewer, the name
    mapping alone would silently copy a subset of the teacher's experts."""
    teacher_experts: dict[int, int] = {}
    for key in weight_files(teacher_dir):
        parts = split_expert_key(key)
        if parts is not None:
            teacher_experts[parts.block] = max(teacher_experts.get(parts.block, 0), parts.expert + 1)
    for s, block in enumerate(student.blocks):
        if block.is_moe and teacher_experts.get(kept[s], 0) != block.mlp.num_experts:
            raise ValueError(f"student layer {s} has {block.mlp.num_experts} experts, its teacher layer {kept[s]} "
                             f"in {teacher_dir} has {teacher_experts.get(kept[s], 0)}: build the student with "
                             f"student_config(teacher config, kept)")
