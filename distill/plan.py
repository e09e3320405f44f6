"""`moe-pipeline plan`: sizes of the recipe's teacher and student, counted from the model code.

Both models are built on the meta device (no memory), so the paper's 31B-parameter teacher plans
in a second on a laptop. Memory per rank is an estimate for training: weights, gradients and Adam
state for the recipe's precision and ZeRO stage, with experts split by expert parallelism and
their optimizer state by ZeRO over the expert-data-parallel group (activations not included).
A Hugging Face teacher is imported, not trained: its memory is its weights alone, in the student's
precision (the frozen KD teacher).

    moe-pipeline plan recipes/1.3b.yaml --world-size 128 --json
"""

from __future__ import annotations

from distill.student import select_layers, student_config
from pipeline.build import meta_counts, meta_model, teacher_config
from pipeline.model import ModelConfig, default_ep_size, split_expert_key
from pipeline.recipe import Recipe, TrainSpec


def _bytes_per_param(train: TrainSpec) -> dict[str, int]:
    if train.precision == "fp32":
        return {"weights": 4, "gradients": 4, "optimizer": 8}  # Adam m, v
    return {"weights": 2, "gradients": 2, "optimizer": 12}  # fp32 master copy + Adam m, v


def memory_per_rank(cfg: ModelConfig, ep: list[int], train: TrainSpec, world: int,
                    frozen: bool = False) -> dict[str, int]:
    """Bytes of training state on one rank, split into weights, gradients and optimizer state.

    The rank holds E/ep experts of each MoE layer, replicated over the world/ep ranks of its
    expert-data-parallel group (ZeRO partitions their gradients/optimizer state over that group);
    everything else is replicated over all ranks. `frozen`: weights only (no gradients, no optimizer).
    """
    per = _bytes_per_param(train)
    if frozen:
        per = {"weights": per["weights"], "gradients": 0, "optimizer": 0}
    local_cfg = ModelConfig(**{**cfg.to_dict(), "experts": tuple(e // d for e, d in zip(cfg.experts, ep))})
    local = meta_model(local_cfg)
    moe_index = {i: n for n, i in enumerate(i for i in range(cfg.layers) if cfg.is_moe(i))}
    out = {"weights": 0, "gradients": 0, "optimizer": 0}
    for name, p in local.named_parameters():
        key = split_expert_key(name)
        dp = world if key is None else world // ep[moe_index[key.block]]
        n = p.numel()
        out["weights"] += n * per["weights"]
        out["gradients"] += n * per["gradients"] // (dp if train.zero_stage >= 2 else 1)
        out["optimizer"] += n * per["optimizer"] // (dp if train.zero_stage >= 1 else 1)
    out["total"] = sum(out.values())
    return out


def describe(cfg: ModelConfig, train: TrainSpec, world: int, ep_override: int | None, frozen: bool = False,
             seq_len: int | None = None) -> dict:
    """`seq_len`: the training sequence length (default: the model's context)."""
    ep = [default_ep_size(e, world, ep_override) for e in cfg.experts]
    counts = meta_counts(cfg)
    mem = memory_per_rank(cfg, ep, train, world, frozen)
    return {
        "params_total": counts["total"],
        "params_active_per_token": counts["active_per_token"],
        "layers": cfg.layers,
        "experts": list(cfg.experts),
        "ep_size": ep,
        "memory_per_rank_bytes": mem["total"],
        "memory_per_rank_breakdown": {k: v for k, v in mem.items() if k != "total"},
        "tokens_per_step": train.global_batch_size * (seq_len or cfg.seq_len),
        "total_steps": 0 if frozen else train.steps,
    }


def plan(recipe: Recipe, world: int) -> dict:
    """Teacher and student sizes. The student is the one `student.layer_selection` builds (with
    `student.experts`, pruned); `importance` depends on calibration data, so it is planned with the paper's
    rule (same counts per layer type)."""
    ep = recipe.distributed.ep_size
    teacher = teacher_config(recipe)
    method = "paper" if recipe.student.layer_selection == "importance" else recipe.student.layer_selection
    kept = select_layers(teacher, recipe.student.layers, recipe.moe_layer_count(recipe.student.layers), method)
    trained = recipe.teacher.trained()  # else loaded and frozen: weights in the student's precision
    student = describe(student_config(teacher, kept, recipe.student.experts), recipe.student.train, world, ep,
                       seq_len=recipe.data.seq_len)
    # distillation holds the frozen teacher (weights only, the student's precision) on the same ranks
    frozen = memory_per_rank(teacher, [default_ep_size(e, world, ep) for e in teacher.experts], recipe.student.train,
                             world, frozen=True)
    student["memory_per_rank_with_teacher_bytes"] = student["memory_per_rank_bytes"] + frozen["total"]
    return {
        "teacher": describe(teacher, recipe.teacher.train if trained else recipe.student.train, world, ep,
                            not trained, recipe.data.seq_len),
        "student": student,
    }


def format_plan(result: dict, world: int) -> str:
    lines = [f"world size {world}"]
    for role, d in result.items():
        lines.append(f"{role}: {d['params_total'] / 1e9:.2f}B parameters ({d['params_active_per_token'] / 1e9:.2f}B "
                     f"active per token), {d['layers']} layers, experts {d['experts']}, ep {d['ep_size']}")
        lines.append(f"  memory per rank {d['memory_per_rank_bytes'] / 2**30:.1f} GiB "
                     + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in d["memory_per_rank_breakdown"].items())
                     + f"; {d['tokens_per_step']:,} tokens a step x {d['total_steps']:,} steps")
        if "memory_per_rank_with_teacher_bytes" in d:
            lines.append(f"  with the frozen KD teacher on the same ranks: "
                         f"{d['memory_per_rank_with_teacher_bytes'] / 2**30:.1f} GiB per rank")
    return "\n".join(lines)
