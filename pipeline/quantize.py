"""Weight-only quantisation schemes: what `serve --quantize int8` runs and `plan --measure` prices.

    from pipeline.quantize import quantize_int8, quantize_int4, pack_int4, fake_quantize_
    q, scale = quantize_int8(w)                  # int8 [out, in], one fp32 scale per output row
    q, scale = quantize_int4(w, group=128)       # int4 values in int8 [out, in], a scale per 128 inputs of a row
    packed = pack_int4(q)                        # two a byte, as csrc/gemv.cpp's int4_linear reads them
    fake_quantize_(model, "int4")                # every quantised weight replaced by what its int4 form stands for

Both are symmetric and round to nearest (the baseline GPTQ is compared with), computed in float64. What is quantised
(`quantised`): every linear layer's weight, the experts' included, but the routers (`wg`), PR-MoE's residual
coefficient, Qwen2-MoE's shared-expert gate and the output layer; embeddings and norms are not linear layers. The
routers decide every token's experts and stay in fp32, as llama.cpp keeps `ffn_gate_inp`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

SCHEMES = ("int8", "int4")
INT4_GROUP = 128
KEEP = ("wg", "coefficient", "shared_gate", "lm_head")  # module names whose weights stay in their dtype


def int8_rows(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a weight in float64 -> (each row's largest |w| (float64), q = round(w / scale) clamped to +-127 (float64,
    integral), scale = largest |w| / 127 (fp32, at least the smallest normal fp32))."""
    top = part.abs().amax(1)
    scale = (top / 127).float().clamp_min(torch.finfo(torch.float32).tiny)
    return top, torch.round(part / scale.double()[:, None]).clamp(-127, 127), scale


def quantize_int8(w: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight as int8 with one scale per output row (w ~ scale[:, None] * q), as csrc/gemv.cpp's
    `int8_linear` reads it: (q int8 [out, in], scale fp32 [out]). `chunk` rows at a time. A row of zeros gets zeros
    and the smallest normal scale."""
    O, I = w.shape
    q, scale = torch.empty(O, I, dtype=torch.int8), torch.empty(O, dtype=torch.float32)
    for lo in range(0, O, chunk):
        _, q_part, scale[lo:lo + chunk] = int8_rows(w[lo:lo + chunk].detach().double().cpu())
        q[lo:lo + chunk] = q_part.to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight as int4 values (-7..7, held one a byte here) with one fp32 scale per `group` inputs of a row
    (w[o, g*group:(g+1)*group] ~ scale[o, g] * q; the last group shorter when `in` is not a multiple): (q int8
    [out, in], scale fp32 [out, ceil(in / group)])."""
    O, I = w.shape
    G = -(-I // group)
    padded = torch.zeros(O, G * group, dtype=torch.float64)
    padded[:, :I] = w.detach().double().cpu()
    parts = padded.view(O, G, group)
    scale = (parts.abs().amax(2) / 7).float().clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(parts / scale.double()[:, :, None]).clamp(-7, 7).view(O, G * group)[:, :I]
    return q.to(torch.int8).contiguous(), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (-8..7, one a byte: `quantize_int4`'s q [out, in], `in` a multiple of 64) two a byte, as
    csrc/gemv.cpp's `int4_linear` reads them: each 64 inputs of a row in 32 bytes, byte j holding input j (low nibble)
    and input 32 + j (high nibble), each + 8. -> uint8 [out, in / 2]."""
    O, I = q.shape
    if I % 64:
        raise ValueError(f"pack_int4: rows of {I} inputs; the packing takes a multiple of 64")
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(O, I // 64, 2, 32)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(O, I // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 [out, in / 2] -> int4 values in int8 [out, in]."""
    O, half = packed.shape
    p = packed.view(O, half // 32, 1, 32)
    return (torch.cat([p & 0x0F, p >> 4], dim=2).to(torch.int16) - 8).to(torch.int8).reshape(O, half * 2)


def dequantized(q: torch.Tensor, scale: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """The float32 weight int8 or int4 values and their scales stand for: one scale a row ([out]), or one a `group`
    inputs of a row ([out, groups])."""
    if scale.dim() == 1:
        return q.float() * scale[:, None]
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :q.shape[1]]


def quantised(name: str, module: nn.Module) -> bool:
    """Whether `name`'s module (a model's named_modules entry) has its weight quantised."""
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in KEEP


@torch.no_grad()
def fake_quantize_(model: nn.Module, scheme: str) -> dict:
    """Every quantised linear weight of `model` replaced, in place, by the weight its `scheme` form stands for, in the
    weight's own dtype and device: the model computes what the quantised one would, up to the kernels' sums.
    Returns {"tensors": how many, "weights": their elements, "bytes": what they hold quantised (values and scales)}."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantisation {scheme!r}: one of {', '.join(SCHEMES)}")
    tensors = weights = nbytes = 0
    seen = set()
    for name, module in model.named_modules():
        if not quantised(name, module) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        w = module.weight
        q, scale = quantize_int8(w) if scheme == "int8" else quantize_int4(w)
        w.copy_(dequantized(q, scale).to(w.dtype))
        tensors, weights = tensors + 1, weights + w.numel()
        nbytes += w.numel() * (1 if scheme == "int8" else 0.5) + scale.numel() * 4
    return {"tensors": tensors, "weights": weights, "bytes": int(nbytes)}
