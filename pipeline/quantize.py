"""Weight-only quantisation schemes: what `serve --quantize int8` runs and `plan --measure` prices.

    from pipeline.quantize import quantize_int8, quantize_int4, pack_int4, fake_quantize_
    q, scale = quantize_int8(w)                  # int8 [out, in], one fp32 scale per output row
    q, scale = quantize_int4(w, group=128)       # int4 values in int8 [out, in], a scale per 128 inputs of a row
    packed = pack_int4(q)                        # two a byte, as csrc/quantized.cpp's int4_linear reads them
    fake_quantize_(model, "int4")                # every quantised weight replaced by what its int4 form stands for

Both are symmetric and round to nearest (the baseline GPTQ is compared with), computed in float64. What is quantised
(`quantised`): every linear layer's weight, the experts' included, but the routers (`wg`), PR-MoE's residual
coefficient, Qwen2-MoE's shared-expert gate and the output layer; embeddings and norms are not linear layers. The
routers decide every token's experts and stay in fp32, as llama.cpp keeps `ffn_gate_inp`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

# the weights' kinds a package holds (pipeline/schemes.py STORED, which tests/test_quantize.py holds this to): this
# file ships alone in every package (moe_quantize.py, torch its only import), so it names them itself
KINDS = ("int8", "int4")

INT4_GROUP = 128
KEEP = ("wg", "coefficient", "shared_gate", "lm_head")  # module names whose weights stay in their dtype


def int8_rows(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a weight in float64 -> (each row's largest |w| (float64), q = round(w / scale) clamped to +-127 (float64,
    integral), scale = largest |w| / 127 (fp32, at least the smallest normal fp32))."""
    top = part.abs().amax(1)
    scale = (top / 127).float().clamp_min(torch.finfo(torch.float32).tiny)
    return top, torch.round(part / scale.double()[:, None]).clamp(-127, 127), scale


def quantize_int8(w: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight as int8 with one scale per output row (w ~ scale[:, None] * q), as csrc/quantized.cpp's
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
    csrc/quantized.cpp's `int4_linear` reads them: each 64 inputs of a row in 32 bytes, byte j holding input j (low
    nibble) and input 32 + j (high nibble), each + 8. -> uint8 [out, in / 2]."""
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
    if scheme not in KINDS:
        raise ValueError(f"quantisation {scheme!r}: one of {', '.join(KINDS)}")
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


# -- a package's quantised weights: which, in what form --------------------------------------------------------------

def values_name(name: str, kind: str) -> str:
    """The stored name of a quantised weight's values: `name` itself (int8 [out, in]) or `name`_packed (int4, uint8
    [out, in / 2] as `pack_int4` lays them out). Its scales are `name`_scale (fp32 [out], or [out, in / group])."""
    return name if kind == "int8" else f"{name}_packed"


def scale_name(name: str) -> str:
    return f"{name}_scale"


def fits_int4(inputs: int, group: int = INT4_GROUP) -> bool:
    """Whether rows of `inputs` take int4 groups of `group` (and the kernels' packing of 64 inputs in 32 bytes)."""
    return group % 64 == 0 and inputs % group == 0 and inputs > 0


def weight_kinds(model: nn.Module, scheme: str, head: bool = False, group: int = INT4_GROUP) -> dict[str, str]:
    """{parameter name ("....weight"): "int8" or "int4"} of every weight a `scheme` package holds quantised, as the
    serving runtime quantises them (export/serve/kernels/quantized.py `quantized_weights`): int4 where its rows fit the
    groups, else int8, and an expert's fc1 and fc2 of one kind (the expert kernels take one kind a layer). The output
    layer only with `head`, and never when it is the (tied) embedding."""
    if scheme not in KINDS:
        raise ValueError(f"--quantize {scheme!r}: one of {', '.join(KINDS)}")
    tied = getattr(getattr(model, "lm_head", None), "weight", None) is getattr(getattr(model, "wte", None), "weight", 0)
    kinds = {}
    for name, module in model.named_modules():
        if name == "lm_head" and (not head or tied):
            continue
        if quantised(name, module) or (name == "lm_head" and isinstance(module, nn.Linear)):
            kinds[f"{name}.weight"] = "int4" if scheme == "int4" and fits_int4(module.in_features, group) else "int8"
    for name in list(kinds):  # an expert: both int4, or both int8
        if ".deepspeed_experts." in name and name.endswith(".fc1.weight"):
            pair = name[:-len("fc1.weight")] + "fc2.weight"
            if kinds.get(pair) != kinds[name]:
                kinds[name] = kinds[pair] = "int8"
    return kinds


def stored_form(w: torch.Tensor, kind: str, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of a weight rounded to nearest, as a package stores them."""
    if kind == "int8":
        return quantize_int8(w)
    q, scale = quantize_int4(w, group)
    return pack_int4(q), scale


def stored_dequantized(values: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """The fp32 weight a package's stored values and scales stand for (int8 [out, in], or int4 packed uint8); an int4
    weight's `group` is its inputs over its scales' columns unless given."""
    q = unpack_int4(values) if values.dtype == torch.uint8 else values
    return dequantized(q, scale, group or (q.shape[1] // scale.shape[1] if scale.dim() == 2 else INT4_GROUP))


class QuantizedLinear(nn.Module):
    """A linear layer whose weight a quantised package stores (export --quantize), as Hugging Face's remote code
    loads it (export/hf/modeling_moe_pipeline.py; this file ships in the package as moe_quantize.py): the stored
    values and scales are buffers under the package's names (`weight` int8, or `weight_packed` uint8, and
    `weight_scale` fp32), and each call computes with the weight they stand for, in the input's dtype."""

    def __init__(self, layer: nn.Linear, kind: str, group: int = INT4_GROUP):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.group = layer.in_features, layer.out_features, kind, group
        O, I = layer.out_features, layer.in_features
        device = layer.weight.device
        if kind == "int8":
            self.register_buffer("weight", torch.zeros(O, I, dtype=torch.int8, device=device))
            self.register_buffer("weight_scale", torch.ones(O, dtype=torch.float32, device=device))
        else:
            self.register_buffer("weight_packed", torch.zeros(O, I // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.ones(O, I // group, dtype=torch.float32, device=device))
        self.bias = layer.bias

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = self.weight if self.kind == "int8" else self.weight_packed
        return stored_dequantized(values, self.weight_scale.float(), self.group).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}" + \
            (f", groups of {self.group}" if self.kind == "int4" else "")


def quantized_modules_(model: nn.Module, scheme: str, head: bool = False, group: int = INT4_GROUP) -> int:
    """Every linear layer a `scheme` package stores quantised (`weight_kinds`) replaced, in place, by a
    `QuantizedLinear` holding its stored form (to be loaded); returns how many."""
    kinds = weight_kinds(model, scheme, head, group)
    modules = dict(model.named_modules())
    for name, kind in kinds.items():
        path = name[:-len(".weight")]
        parent, _, child = path.rpartition(".")
        setattr(modules[parent] if parent else model, child, QuantizedLinear(modules[path], kind, group))
    return len(kinds)


# -- GPTQ ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def gptq(w: torch.Tensor, hessian: torch.Tensor, kind: str, group: int = INT4_GROUP, damp: float = 0.01,
         block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al., 2023) of weights `w` [B, out, in] with their inputs' second moments `hessian` [B, in, in]
    (sum of x x^T over calibration tokens; B weights at once, each its own): columns quantised in order, each one's
    rounding error spread over the columns not yet quantised through the inverse Hessian's Cholesky factor, in blocks
    of `block` columns with lazy updates; `damp` x the mean diagonal added to the diagonal. The grid is the round-to-
    nearest scheme's: int8 one scale per row from the row's largest |w|; int4 one scale per `group` inputs computed
    when the group's first column is reached, from the weights as updated so far (GPTQ's static groups, no act-order).
    Inputs never seen (zero diagonal) get weight 0, as in GPTQ. -> (q int8 [B, out, in] (int4 values -7..7 one a
    byte), scale fp32 [B, out] or [B, out, in / group]). A Hessian that stays singular after damping raises
    torch.linalg.LinAlgError (the caller falls back to round to nearest)."""
    if kind == "int4" and (block % group and group % block):
        raise ValueError(f"gptq: block {block} and group {group} must nest")
    W = w.detach().to(torch.float64).clone()
    H = hessian.detach().to(torch.float64).clone()
    B, O, I = W.shape
    diag = H.diagonal(dim1=1, dim2=2)
    dead = diag == 0
    diag[dead] = 1.0
    W[dead[:, None, :].expand_as(W)] = 0.0
    diag += damp * diag.mean(1, keepdim=True)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # [B, I, I] upper
    Q = torch.zeros_like(W)
    if kind == "int8":
        top = 127
        scale = (W.abs().amax(2) / top).clamp_min(torch.finfo(torch.float32).tiny).float()  # [B, O]
        scales = scale
    else:
        top = 7
        scales = torch.zeros(B, O, -(-I // group), dtype=torch.float32)
    for i1 in range(0, I, block):
        i2 = min(i1 + block, I)
        W1, Err = W[:, :, i1:i2].clone(), torch.zeros(B, O, i2 - i1, dtype=torch.float64)
        Hb = Hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if kind == "int4" and col % group == 0:
                g = col // group
                part = torch.cat([W1[:, :, i:i + group], W[:, :, i2:col + group]], 2)  # the group, as updated so far
                scales[:, :, g] = (part.abs().amax(2) / top).float().clamp_min(torch.finfo(torch.float32).tiny)
            s = (scale if kind == "int8" else scales[:, :, col // group]).double()  # [B, O]
            x = W1[:, :, i]
            q = torch.round(x / s).clamp(-top, top)
            Q[:, :, col] = q
            err = (x - q * s) / Hb[:, i, i][:, None]
            W1[:, :, i:] -= err[:, :, None] * Hb[:, i, i:][:, None, :]
            Err[:, :, i] = err
        W[:, :, i2:] -= Err @ Hinv[:, i1:i2, i2:]
    return Q.to(torch.int8), scales


def rounding_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, hessian: torch.Tensor,
                   group: int = INT4_GROUP) -> torch.Tensor:
    """GPTQ's objective for weights [B, out, in] and their quantised form: tr((W - Wq) H (W - Wq)^T) per weight [B],
    the summed squared error of the outputs over the calibration tokens."""
    d = w.double() - torch.stack([dequantized(q[b], scale[b], group) for b in range(len(q))]).double()
    return torch.einsum("boi,bij,boj->b", d, hessian.double(), d)
