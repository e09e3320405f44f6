"""Loading a package (or a stage directory) for inference on this rank, in a multi-rank layout:
expert parallelism, tensor slicing and expert slicing (DeepSpeed-MoE). The one place
`deepspeed.init_inference` enters.

    from export.inference import load_package
    model, tokenizer = load_package("runs/tiny/package")                 # 1 rank: the reference MoE
    model, tokenizer = load_package(pkg, ranks, ep_size=2, tp_size=2)    # under the DeepSpeed launcher

    moe-pipeline serve PKG --nproc 2                  # expert parallel: each rank holds half the experts
    moe-pipeline serve PKG --nproc 2 --tp-size 2      # + the dense part (attention, dense and residual MLPs) sliced
    moe-pipeline serve PKG --nproc 4 --ep-size 2      # more ranks than the expert-parallel degree: expert slicing

Every rank runs the same forwards on the same tokens (`moe-pipeline eval` on several ranks, and the serving
runtime's tensor- and expert-sliced layouts; its data-parallel layout, each rank its own sequences, is
export/serve/placement/exchange.py's; `plan_layout` says which layout a model gets, as the serving engine
shows it). The layouts, as DeepSpeed-MoE's inference system describes them:

  * expert parallelism: a layer's experts are split over `ep` consecutive ranks; DeepSpeed's MoE
    layer sends every token to the rank of its expert (all-to-all) and back;
  * tensor slicing (`tp`): `deepspeed.init_inference(tensor_parallel={"tp_size": tp},
    injection_policy={Block: ("attn.out_proj", "mlp.fc2")})` slices each block's q/k/v and fc1 by
    output and out_proj and fc2 by input, with an all-reduce after the latter (DeepSpeed's AutoTP
    layers). The MoE parts that must stay whole are marked for AutoTP to skip: the gate and the
    experts (expert parallel instead) and the residual mixing coefficient (2 outputs);
  * expert slicing: when a layer has fewer expert-parallel ranks than ranks (world > ep), the
    world/ep ranks that hold the same experts (DeepSpeed's expert-model-parallel group,
    `init_inference(moe=...)` makes it: ranks i, i+ep, i+2ep, ...) each keep a 1/(world/ep) slice of
    every local expert's FFN (fc1 by output, fc2 by input) and all-reduce the partial outputs.
    They receive the same tokens, so the slices add up to the whole expert's output.

A rank reads only its part of the weights: the model is built on the meta device, AutoTP slices
the (still empty) linears, and `pipeline.weights.load_weights` then reads each rank's experts, its
slice of each sliced expert, and its slice of each tensor-sliced linear (a parameter's `shard`).
The model runs in `dtype` with the MoE gates in fp32, as DeepSpeed's gating computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from export.package import package_dtype, read_tokenizer, verified_package
from pipeline.build import build_model, cast_keeping_gates
from pipeline.model import GPT, MLP, Block, ModelConfig, default_ep_size

# the linears whose outputs AutoTP all-reduces (row-parallel); the other linears of a block are column-parallel
ALL_REDUCE_LINEARS = ("attn.out_proj", "mlp.fc2")


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int  # tensor-slicing degree of the dense part: 1 or the world size
    ep: tuple[int, ...]  # expert-parallel degree of each MoE layer
    ep_override: int | None

    def slices(self, layer_index: int) -> int:
        """Ranks that share (and slice) each expert of the `layer_index`-th MoE layer."""
        return self.world // self.ep[layer_index]

    def describe(self) -> str:
        parts = [f"{self.world} rank(s)"]
        if self.world > 1 and self.ep:
            parts.append(f"expert parallel {'/'.join(map(str, self.ep))}")
        if any(self.world > e for e in self.ep):
            parts.append(f"expert slicing {'/'.join(str(self.world // e) for e in self.ep)}")
        if self.tp > 1:
            parts.append(f"tensor slicing {self.tp}")
        return ", ".join(parts)


def plan_layout(cfg: ModelConfig, world: int, ep_size: int | None = None, tp_size: int | None = None) -> Layout:
    """Check that `cfg` can run on `world` ranks with these degrees; a ValueError names the flag and the fix."""
    tp = tp_size or 1
    elsewhere = (f"this {cfg.family} model (SwiGLU experts with fc1 = [gate; up], grouped-query attention) serves "
                 f"expert parallel: --ep-size {world} on {world} rank(s), with --placement if you like; for tensor "
                 "parallelism export it with `moe-pipeline export RUN --format hf` and serve that with vLLM or SGLang")
    if tp > 1 and cfg.family != "pr-moe":
        raise ValueError(f"--tp-size {tp}: tensor slicing is built for the PR-MoE GPT; {elsewhere}")
    if tp not in (1, world):
        raise ValueError(f"--tp-size {tp} with {world} rank(s): DeepSpeed's inference engine slices the dense part "
                         f"over one group of all ranks; use --tp-size {world} (or 1, or --nproc {tp})")
    if tp > 1:
        for what, n in (("model heads", cfg.heads), ("MLP width", cfg.ffn_mult * cfg.hidden)):
            if n % tp:
                raise ValueError(f"--tp-size {tp}: the {what} ({n}) must divide evenly; choose a divisor of {n}")
    eps = []
    for e in cfg.experts:
        try:
            ep = default_ep_size(e, world, ep_size)
        except ValueError:
            raise ValueError(f"--ep-size {ep_size}: must divide every MoE layer's experts {list(cfg.experts)} and "
                             f"the {world} rank(s); choose a common divisor") from None
        slices = world // ep
        if slices > 1 and cfg.family != "pr-moe":
            raise ValueError(f"--ep-size {ep} on {world} ranks would slice each expert {slices} ways, which is built "
                             f"for the PR-MoE GPT's GeLU experts; {elsewhere}")
        if cfg.ffn_mult * cfg.hidden % slices:
            raise ValueError(f"--ep-size {ep}: {slices} ranks would slice each expert's FFN of "
                             f"{cfg.ffn_mult * cfg.hidden}, which they do not divide; choose another --ep-size")
        eps.append(ep)
    return Layout(world, tp, tuple(eps), ep_size)


# -- expert slicing -------------------------------------------------------------------------------------

class SlicedExpert(MLP):
    """One expert's FFN, a 1/`parts` slice of it on this rank: fc1 by output features, fc2 by input
    features; the partial outputs are summed over `group` (the ranks holding the other slices), then
    fc2's bias is added once."""

    def __init__(self, cfg: ModelConfig, index: int, parts: int):
        nn.Module.__init__(self)
        width = cfg.ffn_mult * cfg.hidden // parts
        self.fc1 = nn.Linear(cfg.hidden, width)
        self.fc2 = nn.Linear(width, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)
        self.index, self.parts, self.group = index, parts, None
        # what pipeline.weights.load_weights keeps of the whole tensor: (dim, index, parts)
        whole = cfg.ffn_mult * cfg.hidden
        self.fc1.weight.shard = self.fc1.bias.shard = (0, index * width, whole)
        self.fc2.weight.shard = (1, index * width, whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pipeline import dist

        y = F.linear(F.gelu(self.fc1(x)), self.fc2.weight)
        if self.group is None:
            raise RuntimeError("a sliced expert needs its expert-slicing group (export.inference.parallelize)")
        dist.all_reduce_(y, group=self.group)
        return y + self.fc2.bias


def slice_experts(model: GPT, layout: Layout, rank: int) -> None:
    """Replace each local expert by this rank's slice of it (before loading the weights)."""
    for i, moe in enumerate(model.moe_layers()):
        parts = layout.slices(i)
        if parts == 1:
            continue
        experts = moe.moe.deepspeed_moe.experts.deepspeed_experts
        index = rank // layout.ep[i]  # this rank's place among the ranks i, i+ep, i+2ep, ... holding the same experts
        for j, old in enumerate(experts):
            new = SlicedExpert(moe.cfg, index, parts)
            for p in new.parameters():  # as DeepSpeed marks expert parameters
                p.allreduce, p.group_name = False, getattr(next(old.parameters()), "group_name", None)
            experts[j] = new


# -- DeepSpeed's inference engine -------------------------------------------------------------------------

def tp_targets(model: GPT) -> set[int]:
    """ids of the linears AutoTP will slice: every nn.Linear of a block outside the modules it skips."""
    out = set()
    for block in model.blocks:
        skipped: list[str] = []
        for name, module in block.named_modules():
            if getattr(module, "_is_autoep_layer", False):
                skipped.append(name + ".")
            elif isinstance(module, nn.Linear) and not any((name + ".").startswith(p) for p in skipped):
                out.add(id(module))
    return out


def materialize(model: GPT, skip: set[int] = frozenset()) -> None:
    """Give every meta parameter and buffer real (uninitialised) storage on the CPU, except in the modules of
    `skip` (their weights are still to be sliced); the tied output layer stays the embedding."""
    for module in model.modules():
        if id(module) in skip:
            continue
        if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            module.to_empty(device="cpu", recurse=False)
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight


def materialize_tp_layers(model: GPT) -> None:
    """After AutoTP: storage for this rank's slice of each sliced linear, marked with the slice it holds so
    that `load_weights` reads only that part of the stored tensor."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    for module in model.modules():
        if not isinstance(module, (LinearLayer, LinearAllreduce)):
            continue
        dim = 1 if isinstance(module, LinearAllreduce) else 0  # row-parallel: inputs; column-parallel: outputs
        sizes, index = module._partition_sizes, module.tp_index
        start, whole = sum(sizes[:index]), sum(sizes)
        if module.weight.is_meta:
            module.to_empty(device="cpu", recurse=False)
        module.weight.shard = (dim, start, whole)
        if module.bias is not None and dim == 0:  # a row-parallel bias is whole (added after the all-reduce)
            module.bias.shard = (0, start, whole)


def mark_for_autotp(model: GPT) -> None:
    """AutoTP skips a module flagged `_is_autoep_layer` (DeepSpeed's flag for expert-parallel layers,
    whose experts are not tensor-sliced): the gate and experts, and the residual coefficient."""
    for moe in model.moe_layers():
        moe.moe.deepspeed_moe._is_autoep_layer = True
        if hasattr(moe.moe, "coefficient"):
            moe.moe.coefficient._is_autoep_layer = True


def parallelize(model: GPT, layout: Layout):
    """Wrap a multi-rank model with `deepspeed.init_inference` (expert-parallel groups; tensor slicing with
    tp > 1) and give the sliced experts their groups. Collective. Returns the engine. The model's linears
    to be sliced may still be on the meta device (`materialize_tp_layers` then gives them storage)."""
    import deepspeed

    from pipeline import dist

    dtype = next(p.dtype for n, p in model.named_parameters() if not n.endswith("gate.wg.weight"))
    gates = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("gate.wg.weight")}
    moe_type = "residual" if model.cfg.mlp_type == "residual" else "standard"
    # keep_module_on_host: the sliced layers are still meta here (filled after, slice by slice); the caller
    # moves the loaded model to its device
    kwargs = dict(dtype=dtype, replace_with_kernel_inject=False, keep_module_on_host=True,
                  # slices in whole heads: AutoTP splits dimensions in grains of tp_grain_size (default 64)
                  tensor_parallel={"tp_size": layout.tp, "tp_grain_size": model.cfg.hidden // model.cfg.heads})
    if layout.ep:  # a dense model (no MoE layer) has no expert groups to make
        kwargs["moe"] = {"enabled": True, "ep_size": max(layout.ep), "moe_experts": list(model.cfg.experts),
                         "type": moe_type}
    if layout.tp > 1:
        kwargs["injection_policy"] = {Block: ALL_REDUCE_LINEARS}
    engine = deepspeed.init_inference(model, **kwargs)
    with torch.no_grad():  # init_inference casts the whole module to `dtype`; the gates compute in fp32
        for n, p in engine.module.named_parameters():
            if n in gates:
                p.data = gates[n].to(p.device)
    # the expert-slicing groups: DeepSpeed's expert-model-parallel group for each expert-parallel degree used
    sizes = sorted({e for e in layout.ep if e < layout.world})
    if sizes:
        missing = [e for e in sizes if (engine.expert_mp_group or {}).get(e) is None]
        if missing:  # layers of several degrees: the engine made the group of one (moe.ep_size) only
            engine._create_ep_parallel_group(sizes)
        for i, moe in enumerate(engine.module.moe_layers()):
            for expert in moe.moe.deepspeed_moe.experts.deepspeed_experts:
                if isinstance(expert, SlicedExpert):
                    expert.group = engine.expert_mp_group[layout.ep[i]]
    if layout.tp > 1:
        heads = {b.attn.num_heads for b in engine.module.blocks}
        widths = {b.attn.q_proj.weight.shape[0] for b in engine.module.blocks}
        want = model.cfg.heads // layout.tp
        if heads != {want} or widths != {want * model.cfg.hidden // model.cfg.heads}:
            raise RuntimeError(f"tensor slicing left {heads} heads of width {widths} on rank {deepspeed.comm.get_rank()}, "
                               f"expected {want} heads")
    dist.barrier()
    return engine


# -- a model for inference on this rank ----------------------------------------------------------------

def inference_moe_impl(world: int, ep_size: int | None) -> str:
    """The MoE implementation for inference: DeepSpeed's expert-parallel MoE across ranks; alone, the
    reference MoE (pipeline/model.py), the same math in eval mode (tests/test_model.py) that runs each
    expert on exactly its tokens, where DeepSpeed's dispatch pads every expert to the busiest one's
    load when no token is dropped (on the tiny student at batch 32 that is ~1.6x the expert FLOPs)."""
    return "reference" if world == 1 and (ep_size or 1) == 1 else "deepspeed"


def inference_model(cfg: ModelConfig, src: Path, ranks=None, ep_size: int | None = None,
                    dtype: torch.dtype = torch.float32, tp_size: int | None = None, files: dict | None = None) -> GPT:
    """The model of `cfg` in eval mode on this rank's device, filled from the weights in `src` (a package or a
    stage directory), in `dtype` with the gates in fp32 as DeepSpeed's gating computes. On several ranks:
    expert parallel (each rank reads only its experts), expert slicing when the expert-parallel degree
    is below the world size, tensor slicing of the dense part with `tp_size`, all through
    `deepspeed.init_inference`. Collective with several ranks. `files`: a verified package's
    (export/package.py `VerifiedPackage.files`): a weights file changed since verification is refused."""
    from pipeline import dist
    from pipeline.weights import load_weights

    ranks = ranks or dist.init()
    layout = plan_layout(cfg, ranks.world, ep_size, tp_size)
    impl = inference_moe_impl(ranks.world, ep_size)
    # several ranks: built on the meta device, so that no rank allocates (or initialises) what it will not hold
    model = build_model(cfg, ranks.world, ep_size, impl=impl, meta=ranks.world > 1, groups=impl == "deepspeed")
    if impl == "deepspeed":
        slice_experts(model, layout, ranks.rank)
    cast_keeping_gates(model, dtype)
    if ranks.world > 1:
        mark_for_autotp(model)
        materialize(model, skip=tp_targets(model) if layout.tp > 1 else set())
        # kept outside the module tree (the engine is a Module that holds the model)
        model.__dict__["inference_engine"] = parallelize(model, layout)
        materialize_tp_layers(model)
    tied_head = ranks.world > 1 and cfg.tie_embeddings and model.lm_head.weight is not model.wte.weight
    # init_inference always slices the output layer (DeepSpeed's set_lm_head): a tied one reads its slice of
    # the embedding, which the weights store once
    load_weights(model, src, rename=(lambda n: "wte.weight" if n == "lm_head.weight" else n) if tied_head else None,
                 files=files)
    return model.to(device=dist.device()).eval().requires_grad_(False)


def load_package(pkg: Path, ranks=None, ep_size: int | None = None, checksums: bool = True,
                 dtype: str | None = None, tp_size: int | None = None):
    """(GPT in eval mode on this rank's device, tokenizer) from a verified package. Collective with several ranks.

    Each rank reads only its own experts; the model runs in the package's dtype (or `dtype`:
    fp32|bf16|fp16 or float32|bfloat16|float16), the gates in fp32 as DeepSpeed's gating does. A package
    that fails verification raises a PackageError before any tensor is read; a file that changes after
    verification, a FileChangedError naming it.
    """
    verified = verified_package(pkg, checksums)
    model = inference_model(verified.cfg, pkg, ranks, ep_size, package_dtype(verified.manifest, dtype), tp_size,
                            files=verified.files)
    return model, read_tokenizer(pkg, verified.files)
