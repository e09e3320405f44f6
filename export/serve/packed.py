"""Linear layers with their weights prepacked for oneDNN, for serving on the CPU.

    from export.serve.packed import pack_linears
    pack_linears(model)          # every large enough nn.Linear of a CPU model in eval mode, in place

PyTorch's CPU `F.linear` reads a [out, in] weight at ~20 GB/s on this machine at batch 1 (fp32; a
plain read of the same bytes runs at ~42 GB/s) and is 2-3x slower than it could be at batch 16-512.
oneDNN's linear on a weight reordered once into its blocked layout (`torch.ops.mkldnn.
_reorder_linear_weight`, the prepacking `torch.compile` applies on the CPU when it freezes weights)
reads at ~37-39 GB/s, fp32 and bf16 alike, with the same results to float rounding (bf16: bit for
bit here). Measured by benchmarks/decode_bandwidth.py (batch-1 decode against the read-bandwidth bound).

A `PackedWeight` keeps the packed copy; a small weight (under PLAIN_BELOW elements) also keeps the
plain one, which is faster for a handful of rows (oneDNN's call costs ~20 us). Only fp32 and bf16 on a
CPU with oneDNN are packed; set MOE_PIPELINE_PACKED_LINEARS=0 to leave every layer as it is. A tied
output layer gets its own packed copy (the embedding keeps the plain one).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

PACK_FROM = 1 << 14  # weights with fewer elements are not worth packing
PLAIN_BELOW = 1 << 20  # weights with fewer elements keep the plain copy too, for calls of few rows
FEW_ROWS = 8  # below this many rows a kept plain weight is used
ENV = "MOE_PIPELINE_PACKED_LINEARS"


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` can be packed here (and packing is not switched off)."""
    return (os.environ.get(ENV, "1") != "0" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeight:
    """A [out, in] weight in oneDNN's layout (and, when small, as it was)."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self.plain = w if w.numel() < PLAIN_BELOW else None
        self.shape = w.shape

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.plain is not None and x.numel() // max(1, x.shape[-1]) < FEW_ROWS:
            return F.linear(x, self.plain, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def maybe_packed(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """`weight` packed if it is worth it here, else itself (`linear` takes either)."""
    if weight.numel() >= PACK_FROM and available(weight.dtype, weight.device):
        return PackedWeight(weight)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return weight.linear(x, bias) if isinstance(weight, PackedWeight) else F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """An nn.Linear for inference whose weight is a `PackedWeight` (the bias stays a parameter)."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.packed = PackedWeight(layer.weight)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class FusedQKV:
    """An attention layer's q, k and v projections as one packed [3C', C] weight (its output split in three)."""

    def __init__(self, attn: nn.Module):
        layers = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.weight = PackedWeight(torch.cat([l.weight.detach() for l in layers]))
        biases = [l.bias for l in layers]
        self.bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replace, in place, every plain nn.Linear of `model` (eval, no grad) whose weight is worth packing, an attention
    layer's q, k, v by one fused packed projection; returns how many layers. Left alone: the MoE gates (`wg`: their fp32 weight is read by the router) and layers of other classes
    (DeepSpeed's sliced ones, say)."""
    count = 0
    for module in list(model.modules()):
        projections = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if all(type(l) is nn.Linear for l in projections) and hasattr(module, "qkv") and \
                available(projections[0].weight.dtype, projections[0].weight.device) and \
                projections[0].weight.numel() >= PACK_FROM:
            module.__dict__["fused"] = FusedQKV(module)  # not a submodule: the state dict keeps q, k, v
            for n in ("q_proj", "k_proj", "v_proj"):  # their weights now live in the fused copy only
                setattr(module, n, nn.Identity())
            count += 3
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name != "wg" and child.weight.numel() >= PACK_FROM and \
                    available(child.weight.dtype, child.weight.device):
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
