"""A serving weight (`ServingWeight`): a [out, in] weight and the linear that fits a call's row count, a GEMV kernel
of ours for a few rows (csrc/linears.cpp), oneDNN for more.

    from export.serve.kernels import ServingWeight, linear
    w = ServingWeight(weight, pack=True)
    y = w.linear(x, bias)        # or linear(x, w, bias): a plain tensor, a ServingWeight or a quantised weight

PyTorch's CPU `F.linear` goes to MKL, which on AMD CPUs reads the weight at about half the memory's speed, slower
than oneDNN at 2-512 rows. `torch.ops.mkldnn._linear_pointwise` (oneDNN) runs the dense layers' many rows on a copy
of the weight prepacked into its blocked layout (faster than on the plain weight, the same results): a second copy
of those weights (attention, dense MLPs, lm_head; not the experts, which stay as they are, nothing to reorder when
one loads). For 1-8 rows (batch-1 and small-batch decode) the kernel reads the weight once at the memory's speed,
where oneDNN and MKL do not. On a CPU with AMX (Intel Sapphire Rapids on) the second copy of a bf16 weight is packed
for the kernel's `amx_linear` instead, which streams it once for 2-256 rows (VDPBF16PS and oneDNN's AMX GEMM both
fell well below the memory's speed at 8-32 rows there). benchmarks/decode_bandwidth.py measures batch-1 decode
against the read-bandwidth bound (results: docs/results.md). A weight under 512K elements (the tiny recipe's) goes
to F.linear for more rows: as fast as oneDNN at that size, and oneDNN compiles and keeps a primitive for every row
count it meets (a soak's memory grows); for larger ones oneDNN sees row counts rounded up to 8 sizes per octave
(`bucket`).

fp32 and bf16 on a CPU with oneDNN only. Where oneDNN has no bf16 primitive (CPUs without AVX-512), bf16 rows past
the kernel's go through the kernel eight at a time (F.linear's bf16 fallback there took twice as long: 1.41 s
against 0.69 s for 64 rows of a 50,304 x 512 lm_head, one AVX2 thread).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from export.serve.kernels.extension import available, kernel
from export.serve.kernels.quantized import QuantizedWeight

SERVE_FROM = 1 << 14  # weights with fewer elements stay plain nn.Linear (F.linear's call is cheapest)
# below this, more rows go to F.linear: as fast there, and no primitive cache to grow; at 1 << 19 the peer
# benchmark's Qwen3-MoE experts' down projections (768 x 1024) stay with oneDNN, which runs their prefill faster
# than aten::mm (benchmarks/prefill_bench.py)
ONEDNN_FROM = 1 << 19
PACK_ROWS = 32  # the row count oneDNN's packed weight layout is chosen for (a decode batch's)
# how a ServingWeight runs more rows than the few-row kernel takes (`ServingWeight.more`; csrc/decode_model.cpp
# `DecodeLinear` takes the same codes): oneDNN on its packed copy, the kernel MAX_ROWS rows at a time, F.linear; and an
# nn.Linear left as it is (F.linear at every row count)
MORE_ONEDNN, MORE_CHUNKS, MORE_ATEN, MORE_PLAIN = 0, 1, 2, 3  # (4-6: the quantised weights', quantized.py MORE_INT8)


class ServingWeight:
    """A [out, in] weight (as it was: contiguous, its own dtype) and the linear that fits a call's row count."""

    def __init__(self, weight: torch.Tensor, pack: bool = False):
        self.weight = weight.detach().contiguous()
        self.gemv = kernel()
        # more rows: oneDNN, where it runs this dtype (bf16 needs AVX-512: on an AVX2 CPU it has no bf16 primitive)
        self.onednn = self.weight.numel() >= ONEDNN_FROM and (
            self.weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        # `pack`: a second copy of the weight for more rows, beside the plain one the few-row kernel reads. Dense
        # layers only: an expert stays one copy (residency loads and drops experts as they are). On a CPU with AMX
        # (bf16): packed into AMX tiles for the kernel's `amx_linear`, 2 to AMX_MAX_ROWS rows at the memory's speed
        # (faster there than oneDNN's AMX GEMM); otherwise oneDNN's own blocked copy, faster at 5-257 rows than on
        # the plain one, the same results to the bit
        # past the kernel's rows without oneDNN: bf16 (no bf16 GEMM on this CPU) through the kernel, else F.linear
        self.more = MORE_ONEDNN if self.onednn else MORE_CHUNKS if (
            self.gemv is not None and self.weight.dtype == torch.bfloat16 and self.weight.numel() >= ONEDNN_FROM) \
            else MORE_ATEN
        self.packed, self.amx = self.weight, None
        if pack and self.onednn and amx_packs(self.weight):
            self.amx = self.gemv.amx_pack(self.weight)
        elif pack and self.onednn and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.amx is not None and 1 < rows <= self.gemv.AMX_MAX_ROWS and x.dtype == self.weight.dtype:
            y = self.gemv.amx_linear(x.reshape(rows, x.shape[-1]).contiguous(), self.amx, self.weight.shape[0], bias)
            return y.view(*x.shape[:-1], self.weight.shape[0])
        if self.gemv is not None and 0 < rows <= self.gemv.MAX_ROWS and x.dtype == self.weight.dtype:
            y = self.gemv.linear(x.reshape(rows, x.shape[-1]).contiguous(), self.weight, bias)
            return y.view(*x.shape[:-1], self.weight.shape[0])
        if self.more != MORE_ONEDNN:
            if self.more == MORE_CHUNKS and rows > 0 and x.dtype == self.weight.dtype:  # the kernel, 8 rows at a time
                flat = x.reshape(rows, x.shape[-1]).contiguous()
                n = self.gemv.MAX_ROWS
                y = torch.cat([self.gemv.linear(flat[i:i + n], self.weight, bias) for i in range(0, rows, n)])
                return y.view(*x.shape[:-1], self.weight.shape[0])
            return F.linear(x, self.weight, bias)  # a small weight (and without the kernel, few rows: MKL's GEMV is
            # single-threaded)
        padded = bucket(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        flat = x.new_zeros(padded, x.shape[-1])
        flat[:rows] = x.reshape(rows, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")[:rows]
        return y.view(*x.shape[:-1], self.weight.shape[0])


def amx_packs(weight: torch.Tensor) -> bool:
    """Whether `weight` goes to the kernel's AMX linear for 2 to AMX_MAX_ROWS rows: a bf16 weight of a multiple of
    32 inputs, on a CPU with AMX whose kernel build has it and whose process Linux gave the tile state."""
    k = kernel()
    return (k is not None and hasattr(k, "amx_linear") and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and weight.device.type == "cpu" and k.amx_ready())


def bucket(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per octave (at most 12.5% more rows; up to 8 rows as they are). oneDNN
    keeps a compiled primitive for every shape it meets (up to 1024, each ~0.5-1 MB): a server's row counts (decode
    batches, prefill chunks) are nearly every number up to --max-batched-tokens, and its memory grew by 5-7% over
    a soak; with buckets, ~8 shapes per octave and weight."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def serves(weight: torch.Tensor) -> bool:
    """Whether this module serves `weight` (large enough, and its dtype and device are `available`)."""
    return weight.numel() >= SERVE_FROM and available(weight.dtype, weight.device)


def serving_weight(weight: torch.Tensor) -> torch.Tensor | ServingWeight:
    """`weight` as a `ServingWeight` where this module serves it, else itself (`linear` takes either)."""
    return ServingWeight(weight) if serves(weight) else weight


def linear(x: torch.Tensor, weight: "torch.Tensor | ServingWeight | QuantizedWeight",
           bias: torch.Tensor | None = None) -> torch.Tensor:
    return weight.linear(x, bias) if isinstance(weight, (ServingWeight, QuantizedWeight)) else F.linear(x, weight, bias)

