"""Building models: the one place a GPT is constructed for a layout (DeepSpeed's expert-parallel MoE
or the plain-PyTorch reference, on a device or on the meta device) and filled from a stage directory.

    from pipeline.build import teacher_config, build_model, load_frozen, meta_counts
    cfg = teacher_config(recipe)                      # the recipe's teacher as a ModelConfig
    meta_counts(cfg)                                  # {"total": ..., "active_per_token": ...}, no memory
    teacher = load_frozen("runs/tiny/teacher", ranks) # expert parallel over the ranks, eval mode, no grads
    teacher = load_hf_teacher("/models/OLMoE-1B-7B-0924")  # a Hugging Face checkpoint, its dtype, gates fp32
    model = load_stage_model("runs/tiny/student")     # one rank, every expert local: what export writes

Training builds with `build_model(..., groups=False)` (deepspeed.initialize makes the expert-parallel
groups); everything else that runs DeepSpeed's MoE layers outside `deepspeed.initialize` gets them
made here. Inference layouts (tensor and expert slicing, `deepspeed.init_inference`) build on
`build_model` in export/inference.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pipeline.artifacts import read_model_config
from pipeline.model import GPT, ModelConfig, param_counts
from pipeline.recipe import Recipe


def teacher_config(recipe: Recipe) -> ModelConfig:
    """The teacher's ModelConfig: a Hugging Face teacher's from its config.json (pipeline/hf_import.py), else the
    PR-MoE's with MoE on layers moe_every, 2*moe_every, ... (1-indexed). A student's comes from the teacher's and
    the layers it keeps (distill.student.student_config)."""
    raw = recipe.hf_teacher()
    if raw is not None:
        from pipeline.hf_import import model_config

        return model_config(raw)
    m = recipe.model
    return ModelConfig(vocab_size=recipe.vocab_size(), seq_len=recipe.data.seq_len,
                       layers=m.layers, hidden=m.hidden, heads=m.heads, experts=tuple(m.experts),
                       moe_layers=tuple(range(m.moe_every - 1, m.layers, m.moe_every)),
                       mlp_type=m.mlp_type,
                       top_k=m.top_k, capacity_factor=m.capacity_factor,
                       eval_capacity_factor=m.eval_capacity_factor, min_capacity=m.min_capacity,
                       aux_loss_coef=m.aux_loss_coef, ffn_mult=m.ffn_mult, dropout=m.dropout,
                       tie_embeddings=m.tie_embeddings, init_std=m.init_std)


def meta_model(cfg: ModelConfig) -> GPT:
    """The model of `cfg` on the meta device (shapes and names, no memory): every expert local."""
    with torch.device("meta"):
        return GPT(cfg, moe_impl="reference")


def meta_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total parameters and those active per token, counted from the model code."""
    return param_counts(meta_model(cfg))


def set_groups(model: GPT) -> None:
    """Outside deepspeed.initialize, DeepSpeed's MoE layers need their expert-parallel groups made by hand."""
    for moe in model.moe_layers():
        if moe.impl == "deepspeed":
            moe.moe.set_deepspeed_parallelism()


def expert_parallel_degrees(model: GPT) -> list[int]:
    """Each MoE layer's expert-parallel degree as its process group has it (the ranks its all-to-all spans)."""
    import torch.distributed as td

    return [td.get_world_size(moe.moe.deepspeed_moe.ep_group) if moe.impl == "deepspeed" else 1
            for moe in model.moe_layers()]


def build_model(cfg: ModelConfig, world: int = 1, ep_size: int | None = None, impl: str = "deepspeed",
                meta: bool = False, groups: bool = True) -> GPT:
    """The GPT of `cfg` for `world` ranks: DeepSpeed's MoE layers expert parallel with degree `ep_size`
    (default per layer min(world, experts)), or the reference MoE (`impl="reference"`, one rank).
    `meta`: on the meta device (a rank then materialises only what it holds). `groups`: make DeepSpeed's
    expert-parallel groups now (False when deepspeed.initialize will)."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(cfg, moe_impl=impl, world_size=world, ep_size=ep_size)
    if groups:
        set_groups(model)
    return model


def load_frozen(stage_dir: Path, world: int, ep_size: int | None, device: torch.device,
                dtype: torch.dtype = torch.float32, impl: str = "deepspeed") -> GPT:
    """A finished stage's model, expert parallel over the `world` ranks (each reads only its own experts),
    on `device` in `dtype` (the MoE gates fp32), in eval mode without gradients: the frozen KD teacher, a loaded
    teacher. Built on the meta device and allocated on `device` directly: no initialisation, no full copy on the
    host. A stage recording a Hugging Face checkpoint (source.json) reads it in place. Collective with several
    ranks."""
    from pipeline.weights import load_weights

    model = _allocated(build_model(read_model_config(stage_dir), world, ep_size, impl=impl, meta=True), dtype, device)
    load_weights(model, stage_dir)
    return model.eval().requires_grad_(False)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> GPT:
    """The 1-rank model of `cfg` (every expert local) in `dtype` with fp32 gates, allocated on `device` and not
    initialised: to be filled from a checkpoint (a candidate student cut from its teacher)."""
    return _allocated(build_model(cfg, 1, None, impl="reference", meta=True, groups=False), dtype, device)


def load_stage_model(stage_dir: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> GPT:
    """`load_frozen` on one rank with every expert local (the reference MoE): what export writes out."""
    return load_frozen(stage_dir, 1, None, device, dtype, impl="reference")


def _allocated(model: GPT, dtype: torch.dtype, device: torch.device | str) -> GPT:
    """`model` (on the meta device) in `dtype` with fp32 gates, allocated on `device`, not initialised."""
    cast_keeping_gates(model, dtype)  # on the meta device: free
    model.to_empty(device=device)  # on the host: allocated, not touched; a page is resident once its tensor is read
    if model.cfg.tie_embeddings:  # to_empty made the tied head a tensor of its own
        model.lm_head.weight = model.wte.weight
    return model


def cast_keeping_gates(model: GPT, dtype: torch.dtype) -> GPT:
    """`model` in `dtype` with every MoE gate (`...gate.wg`) in fp32: DeepSpeed's gating computes in fp32,
    and packages store the gates so."""
    model.to(dtype=dtype)
    for name, module in model.named_modules():
        if name.endswith("deepspeed_moe.gate"):
            module.wg.float()
    return model


def load_hf_teacher(src: Path, world: int = 1, ep_size: int | None = None, dtype: torch.dtype | None = None,
                    impl: str | None = None, device: torch.device | str = "cpu") -> GPT:
    """The checkpoint in `src` as our model, expert parallel over `world` ranks (DeepSpeed's MoE; with one rank
    and no `impl`, the reference MoE), in `dtype` (default: the checkpoint's) with the gates in fp32, on `device`,
    eval mode, no gradients. Built on the meta device and allocated empty: nothing is initialised, each rank
    allocates only what it holds and fills it tensor by tensor from the files (no second copy). Collective with
    several ranks."""
    from pipeline.hf_import import CONFIG, checkpoint_dtype, load_hf_weights, model_config, read_hf_config

    raw = read_hf_config(src)
    cfg = model_config(raw, Path(src) / CONFIG)
    impl = impl or ("reference" if world == 1 else "deepspeed")
    model = build_model(cfg, world, ep_size, impl=impl, meta=True, groups=impl == "deepspeed")
    _allocated(model, dtype or checkpoint_dtype(raw), device)
    load_hf_weights(model, src)
    return model.eval().requires_grad_(False)
