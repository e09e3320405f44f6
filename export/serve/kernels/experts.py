"""An MoE layer's experts in few kernel calls (csrc/moe.cpp): a layer's experts over their rows (`expert_mlps`), a
whole layer on one rank (`routed_layer`), and the expert-parallel layer's routing, pairs and sums (`route`,
`expert_pairs`, `combine_pairs`); each with the test of whether it applies (`grouped_experts`, `local_layer`,
`gathered_layer`). Used by export/serve/placement/exchange.py and export/serve/decode.py.
"""

from __future__ import annotations

import torch

from export.serve.kernels.extension import kernel, kernel_has
from export.serve.kernels.quantized import QuantizedWeight, W8A8Weight
from export.serve.kernels.weights import ServingWeight

GROUPED_MAX_ROWS = 16  # experts' mean rows up to which `expert_mlps` runs a layer's experts (more: oneDNN's GEMM)


def grouped_max_rows(x: torch.Tensor) -> int:
    """Experts' mean rows up to which `expert_mlps` runs a layer's experts over x's rows: any number in bf16, where
    oneDNN's GEMM, an expert at a time, is the slower way on every build: with AVX512_BF16, experts of 16 rows and
    more go to tiles of VDPBF16PS over 16 rows a vector (csrc/tiles.h); with AMX, to AMX tiles; without bf16 products
    (AVX2, AVX-512 without AVX512_BF16), oneDNN's bf16 GEMM widens its operands at a fraction of the fp32 FMA rate
    while the few-row kernels widen each weight vector once for 8 rows (benchmarks/moe_layer_bench.py, 2048 rows); a
    prefill's layer is then one call where oneDNN took two GEMMs and ~10 operators an expert. fp32: GROUPED_MAX_ROWS
    (a decode batch's). W8A8 experts of a prefill go there too (VNNI tiles; one at a time through `w8a8_linear` was
    no faster)."""
    k = kernel()
    if k is not None and x.dtype == torch.bfloat16:
        return 1 << 40
    return GROUPED_MAX_ROWS


def grouped_experts(x: torch.Tensor, counts: list[int]) -> bool:
    """Whether `expert_mlps` runs these experts: the kernel is here, x is on the CPU in its dtype, and the experts
    have few rows each (a decode batch's; a prefill's go one expert at a time to oneDNN's GEMM), or any number in
    bf16 where oneDNN's GEMM is the slower way (AMX; no bf16 products: `grouped_max_rows`)."""
    return kernel_has("expert_mlps", x) and bool(counts) and sum(counts) <= grouped_max_rows(x) * len(counts)


def expert_mlps(x: torch.Tensor, counts: list[int], weights: list[tuple], swiglu: bool) -> torch.Tensor:
    """Every listed expert over its rows in one kernel call: x [rows, C] holds counts[i] rows of expert i in turn;
    weights[i] is its (fc1 weight, fc1 bias, fc2 weight, fc2 bias) (ServingWeight or tensor; biases for all or
    none). Returns [rows, C] in x's order: as fc2(act(fc1(x))) expert by expert, the same roundings."""
    w1, b1, w2, b2, s1, s2 = expert_tensors(weights)
    return kernel().expert_mlps(x.contiguous(), counts, w1, b1, w2, b2, swiglu, s1, s2)


def local_layer(x: torch.Tensor, wg: torch.Tensor, top_k: int) -> bool:
    """Whether `routed_layer` runs an MoE layer over these tokens: the kernel is here, x is on the CPU in its
    dtype, the gate fp32, and the batch a decode batch's (a prefill's tokens go one expert at a time to oneDNN) or
    any batch in bf16 where oneDNN's GEMM is the slower way (`grouped_max_rows`)."""
    return (kernel_has("routed_experts", x) and 0 < x.shape[0] and wg.dtype == torch.float32
            and x.shape[0] * top_k <= grouped_max_rows(x) * wg.shape[0])


def routed_layer(x: torch.Tensor, wg: torch.Tensor, top_k: int, renormalize: bool, weights_of,
                 swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE layer whose experts are all here, in two kernel calls: the routing (pipeline/model.py `route`, no
    capacity) and every token's experts with their weighted sum. `weights_of(e)`: expert e's (fc1 weight, fc1 bias,
    fc2 weight, fc2 bias). Returns (output [S, C], tokens per expert [E])."""
    x = x.contiguous()
    mix, experts, counts = route(x, wg, top_k, renormalize)
    active = [e for e, n in enumerate(counts.tolist()) if n]
    w1, b1, w2, b2, s1, s2 = expert_tensors([weights_of(e) for e in active])
    return kernel().routed_experts(x, experts, mix, active, w1, b1, w2, b2, swiglu, s1, s2), counts


def gathered_layer(total: int, x: torch.Tensor, wg: torch.Tensor, top_k: int) -> bool:
    """Whether `route`, `expert_pairs` and `combine_pairs` run an expert-parallel MoE layer of `total` tokens over
    every rank (the same answer on every rank: nothing here depends on this rank's own rows): the kernel is here,
    x on the CPU in its dtype, the gate fp32, and a decode-sized batch (GROUPED_MAX_ROWS, with AMX too: a prefill's
    [tokens, k, C] sum over the ranks would outweigh the exchange's)."""
    return (kernel_has("expert_pairs", x) and 0 < total and wg.dtype == torch.float32
            and total * top_k <= GROUPED_MAX_ROWS * wg.shape[0])


def route(x: torch.Tensor, wg: torch.Tensor, top_k: int, renormalize: bool):
    """pipeline/model.py's routing in one kernel call: (weights [S, k] fp32, experts [S, k], tokens per expert [E])."""
    return kernel().route(x.contiguous(), wg.contiguous(), top_k, renormalize)


def expert_pairs(x: torch.Tensor, experts: torch.Tensor, mix: torch.Tensor, weights_of, swiglu: bool) -> torch.Tensor:
    """The outputs [S, k, C] of the (token, choice) pairs `experts` [S, k] names (-1: another rank's pair, left zero),
    each expert once over its tokens; `weights_of(e)`: expert e's (fc1 weight, fc1 bias, fc2 weight, fc2 bias)."""
    active = sorted(set(experts[experts >= 0].tolist()))
    if not active:
        return x.new_zeros(x.shape[0], experts.shape[1], x.shape[1])
    w1, b1, w2, b2, s1, s2 = expert_tensors([weights_of(e) for e in active])
    return kernel().expert_pairs(x.contiguous(), experts.contiguous(), mix.contiguous(), active, w1, b1, w2, b2, swiglu,
                                 s1, s2)


def combine_pairs(y: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Each token's choices [S, k, C] weighted by mix [S, k] and summed, rounded as `routed_layer` rounds."""
    return kernel().combine_pairs(y.contiguous(), mix.contiguous())


def expert_tensors(weights: list[tuple]) -> tuple[list, list, list, list, list, list]:
    """(w1s, b1s, w2s, b2s, s1s, s2s) as the kernel takes them: plain contiguous tensors, empty bias lists for none;
    int8 or int4 experts (`Int8Weight`, `Int4Weight`: every one alike, or none) give their int8 or packed tensors and
    their scales as s1s, s2s (else empty)."""
    kinds = {(type(w[0]), type(w[2])) for w in weights}
    quant = [isinstance(w[0], QuantizedWeight) for w in weights]
    if any(quant) and len(kinds) > 1:
        raise ValueError("an MoE layer's experts are int8 (Int8Weight) or int4 (Int4Weight) all or none, fc1 and fc2 "
                         "alike: quantise every expert the same way")

    if any(isinstance(w[0], W8A8Weight) and w[0].rows is not None for w in weights):
        raise ValueError("W8A8 experts without the kernel's tiles (no AVX512_VNNI build): the expert kernels cannot "
                         "run them")

    def raw(w):
        return w.q if isinstance(w, QuantizedWeight) else w.weight if isinstance(w, ServingWeight) else w.contiguous()

    w1 = [raw(w[0]) for w in weights]
    w2 = [raw(w[2]) for w in weights]
    b1 = [w[1].contiguous() for w in weights] if weights[0][1] is not None else []
    b2 = [w[3].contiguous() for w in weights] if weights[0][3] is not None else []
    s1 = [w[0].scale for w in weights] if all(quant) else []
    s2 = [w[2].scale for w in weights] if all(quant) else []
    return w1, b1, w2, b2, s1, s2
