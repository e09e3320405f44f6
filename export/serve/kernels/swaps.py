"""A CPU model's modules swapped for serving ones, in place, as gpt-fast swaps its linears: its attention layers
(`FusedAttention`: the model's own Attention with q, k and v as one projection, `FusedQKV`), its linears
(`serving_linears`: `ServingLinear`), its norms (`serving_norms`: `ServingRMSNorm`), and its linears
quantised (`quantize_linears`).

    from export.serve.kernels import serving_linears
    serving_linears(model)       # every large enough nn.Linear of a CPU model in eval mode, in place

The model's output layer also gets a `HeadScreen` (heads.py) where one applies.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from export.serve.kernels.extension import available, kernel
from export.serve.kernels.heads import HeadScreen, QuantizedHeadScreen
from export.serve.kernels.quantized import QuantizedWeight, as_scheme, quantized_weights, stored_weight
from export.serve.kernels.weights import ServingWeight, serves
from pipeline.model import Attention

class ServingLinear(nn.Module):
    """An nn.Linear for inference whose weight is a `ServingWeight` (the bias stays a parameter). `screen`: for the
    output layer, its `HeadScreen` where one applies (else None)."""

    def __init__(self, layer: nn.Linear, screen: bool = False):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.served = ServingWeight(layer.weight, pack=True)
        self.bias = layer.bias
        self.screen = HeadScreen.of(self.served, self.bias) if screen else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.served.linear(x, self.bias)

    def extra_repr(self) -> str:
        how = "GEMV kernel for 1-8 rows, oneDNN" if self.served.gemv is not None else "oneDNN"
        if isinstance(self.served, QuantizedWeight):
            how = f"{type(self.served).__name__} ({self.served.KERNEL})"
        elif self.served.amx is not None:
            how = f"GEMV kernel for 1 row, AMX for 2-{self.served.gemv.AMX_MAX_ROWS}, oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, {how}"


class FusedQKV(nn.Module):
    """An attention layer's q, k and v projections as one [q + k + v, C] weight (a ServingWeight), its output split by
    `sizes` (k and v narrower than q under grouped-query attention): a third of the weight reads' calls."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear):
        super().__init__()
        layers = (q, k, v)
        self.sizes = [l.weight.shape[0] for l in layers]
        self.weight = ServingWeight(torch.cat([l.weight.detach() for l in layers]), pack=True)
        biases = [l.bias for l in layers]
        self.bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.weight.linear(x, self.bias).split(self.sizes, dim=-1)


class FusedAttention(Attention):
    """pipeline/model.py's Attention, its forward and state, with q, k and v as one projection (`qkv_proj`)."""

    @classmethod
    def of(cls, attn: Attention) -> "FusedAttention":
        """`attn` swapped: the same norms, out projection and settings; its q, k and v projections' weights moved into
        one `FusedQKV` (they live in the fused copy only)."""
        fused = cls.__new__(cls)
        fused.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in vars(attn).items()})
        q, k, v = (fused._modules.pop(n) for n in ("q_proj", "k_proj", "v_proj"))
        fused.qkv_proj = FusedQKV(q, k, v)
        return fused

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv_proj(x)

class ServingRMSNorm(nn.Module):
    """pipeline/model.py's RMSNorm in one kernel call (csrc/norms.cpp `rms_norm`: the same roundings) for CPU inputs
    of the weight's dtype; the module's own operators otherwise."""

    def __init__(self, norm: nn.Module, gemv):
        super().__init__()
        self.weight, self.eps, self.gemv = norm.weight, norm.eps, gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pipeline.model import RMSNorm

        if x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return RMSNorm.forward(self, x)
        return self.gemv.rms_norm(x.contiguous(), self.weight, self.eps)


def serving_norms(model: nn.Module) -> int:
    """Replace, in place, every RMSNorm of a CPU model in eval mode by `ServingRMSNorm`; returns how many."""
    from pipeline.model import RMSNorm

    gemv = kernel()
    if gemv is None or not hasattr(gemv, "rms_norm"):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is RMSNorm and available(child.weight.dtype, child.weight.device):
                setattr(module, name, ServingRMSNorm(child, gemv))
                count += 1
    return count


def quantize_linears(model: nn.Module, scheme: str = "int8", head: bool = False,
                     stored: dict[str, QuantizedWeight] | None = None) -> int:
    """After `serving_linears`: every served linear but the output layer (the model's `lm_head`, whose greedy rows the
    screen reads in int8 already; with `head`, it too, and its screen goes: the logits are the quantised layer's,
    its greedy rows read through `QuantizedHeadScreen` where that applies) and
    every fused q/k/v weight as `scheme`'s weight, in place; returns how many. `stored`: {weight name: weight} of a
    quantised package (`stored_weight`), taken as they are; the rest `quantized_weights` (weight-only, round to
    nearest; int8 one scale per output channel, int4 one per 128 inputs of a row). The routers, norms and embeddings
    (a tied head's embedding included) are left as they are."""
    stored = stored or {}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, ServingLinear) and (head or module is not getattr(model, "lm_head", None)) \
                and isinstance(module.served, ServingWeight):
            kept = stored.get(f"{name}.weight")
            module.served = as_scheme(kept, scheme) if kept else quantized_weights([module.served.weight], scheme)[0]
            # the output layer quantised: its greedy rows through its own screen (the logits are its own)
            module.screen = QuantizedHeadScreen.of(module.served, module.bias) \
                if module is getattr(model, "lm_head", None) else None
            count += 1
        qkv = getattr(module, "qkv_proj", None)
        if isinstance(qkv, FusedQKV) and isinstance(qkv.weight, ServingWeight):
            parts = [stored.get(f"{name}.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")]
            if all(parts) and len({type(p) for p in parts}) == 1:  # the package's, rows stacked as the fused weight's
                qkv.weight = as_scheme(stored_weight(torch.cat([p.q for p in parts]),
                                                     torch.cat([p.scale for p in parts])), scheme)
            else:
                (qkv.weight,) = quantized_weights([qkv.weight.weight], scheme)
            count += 1
    return count


def serving_linears(model: nn.Module) -> int:
    """Replace, in place, every plain nn.Linear of `model` (eval, no grad) whose weight this module serves, and an
    attention layer's q, k, v by one fused projection; returns how many layers. Left alone: the MoE gates (`wg`:
    their fp32 weight is read by the router) and layers of other classes (DeepSpeed's sliced ones, say). A tied
    output layer shares the embedding's weight (no copy)."""
    count = 0
    for module in list(model.modules()):  # the attention layers first: their other linears are swapped below
        for name, child in list(module.named_children()):
            projections = [getattr(child, n, None) for n in ("q_proj", "k_proj", "v_proj")]
            if type(child) is Attention and all(type(l) is nn.Linear for l in projections) \
                    and serves(projections[0].weight):
                setattr(module, name, FusedAttention.of(child))
                count += 3
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name != "wg" and serves(child.weight):
                setattr(module, name, ServingLinear(child, screen=name == "lm_head" and module is model))
                count += 1
    return count
