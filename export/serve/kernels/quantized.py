"""Weights held quantised for serving: weight-only int8 (`Int8Weight`), int4 in groups (`Int4Weight`), and int8
weights with int8 inputs (`W8A8Weight`), each run by its kernel (csrc/quantized.cpp) on the CPU and by F.linear on
the weight it stands for elsewhere; and the schemes' choices (`QUANTIZED`, `quantized_weights`, `stored_weight`).

    from export.serve.kernels import Int8Weight
    w = Int8Weight.of(weight)    # [out, in] fp32 or bf16 -> int8 values, one scale per output row
    y = w.linear(x, bias)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from export.serve.kernels.extension import kernel
from pipeline.quantize import INT4_GROUP, dequantized, fits_int4, pack_int4, quantize_int4, quantize_int8, unpack_int4

MORE_INT8 = 4  # the native decoder's code (csrc/decode_model.cpp DecodeLinear, weights.py MORE_ONEDNN's list) for an
# Int8Weight (its int8 weight, and its scales where `packed` goes)
MORE_INT4 = 5  # and an Int4Weight (its packed weight, its group scales)
MORE_W8A8 = 6  # and a W8A8Weight (its tiles, its scales and rows' sums)
DEQUANTIZE_ABOVE = 64  # rows above which a quantised weight is dequantised for one oneDNN GEMM (the kernels: 8 a pass)


class QuantizedWeight:
    """A [out, in] weight held quantised (`Int8Weight`, `Int4Weight`): `q` its values as the kernels read them, `scale`
    its scales. `linear(x, bias)` for x of any rows in fp32 or bf16, as ServingWeight's (on the CPU through the kernel;
    elsewhere, or without it, F.linear on the weight it stands for); `dequantized(dtype)` that weight."""

    KERNEL = ""  # the csrc/quantized.cpp op that runs it
    MORE = -1  # its code for the native decoder's linears (csrc/decode_model.cpp DecodeLinear)

    @staticmethod
    def held_bytes(out: int, inputs: int) -> int:
        """Bytes a weight of [out, inputs] holds in this form: its values and scales."""
        raise NotImplementedError

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q.contiguous(), scale.contiguous()
        self.gemv = kernel()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.gemv is None or not hasattr(self.gemv, self.KERNEL) or x.device.type != "cpu" or rows == 0 \
                or rows > DEQUANTIZE_ABOVE:  # no kernel here, or a prefill's rows: oneDNN on the weight it stands for
            return F.linear(x, self.dequantized(x.dtype).to(x.device), bias)
        y = self._kernel_linear(x.reshape(rows, x.shape[-1]).contiguous(), bias)
        return y.view(*x.shape[:-1], self.q.shape[0])


def _check_int8(name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless q is int8 [out, in] and scale fp32 [out] (one scale per output row)."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError(f"{name}: q int8 [out, in] and scale fp32 [out], not {q.dtype} {tuple(q.shape)} and "
                         f"{scale.dtype} {tuple(scale.shape)}")


class Int8Weight(QuantizedWeight):
    """int8 with one fp32 scale per output row (`quantize_int8`: w ~ scale[:, None] * q), read at 1 byte a weight by
    csrc/quantized.cpp (`int8_linear`; as an expert, `expert_mlps` and the routed layers)."""

    KERNEL, MORE = "int8_linear", MORE_INT8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        _check_int8(type(self).__name__, q, scale)
        super().__init__(q, scale)

    @staticmethod
    def held_bytes(out: int, inputs: int) -> int:
        return out * inputs + 4 * out

    @classmethod
    def of(cls, w: torch.Tensor) -> "Int8Weight":
        return cls(*quantize_int8(w))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(self.q, self.scale).to(dtype)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemv.int8_linear(x, self.q, self.scale, bias)


class Int4Weight(QuantizedWeight):
    """int4, two values a byte, with one fp32 scale per `group` inputs of a row (pipeline/quantize.py `quantize_int4`,
    `pack_int4`), read at half a byte a weight by csrc/quantized.cpp (`int4_linear`; as an expert, `expert_mlps` and the
    routed layers). `of` refuses a row whose inputs are not a multiple of the group (`fits`)."""

    KERNEL, MORE = "int4_linear", MORE_INT4

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, group: int = INT4_GROUP):
        O, half = packed.shape if packed.dim() == 2 else (0, 0)
        if packed.dtype != torch.uint8 or packed.dim() != 2 or scale.dtype != torch.float32 or \
                scale.shape != (O, 2 * half // group) or not self.fits(2 * half, group):
            raise ValueError(f"Int4Weight: packed uint8 [out, in / 2] and scale fp32 [out, in / {group}] with in a "
                             f"multiple of {group}, not {packed.dtype} {tuple(packed.shape)} and {scale.dtype} "
                             f"{tuple(scale.shape)}")
        super().__init__(packed, scale)
        self.group = group

    fits = staticmethod(fits_int4)

    @staticmethod
    def held_bytes(out: int, inputs: int, group: int = INT4_GROUP) -> int:
        return out * inputs // 2 + 4 * out * (inputs // group)

    @classmethod
    def of(cls, w: torch.Tensor, group: int = INT4_GROUP) -> "Int4Weight":
        q, scale = quantize_int4(w, group)
        return cls(pack_int4(q), scale, group)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], 2 * self.q.shape[1]))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(unpack_int4(self.q), self.scale, self.group).to(dtype)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemv.int4_linear(x, self.q, self.scale, bias, self.group)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to int8 steps, one scale a row (s = max |x| / 127, as vLLM's dynamic per-token W8A8 and
    csrc/quantized.cpp `w8a8_linear`), in fp32: s * round(x / s)."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(xf / s).clamp(-127, 127) * s


class W8A8Weight(QuantizedWeight):
    """int8 weights with one fp32 scale per output row (as `Int8Weight`) whose inputs are rounded to int8 too, one
    scale per row of x (vLLM's W8A8 with dynamic per-token activations, compressed-tensors' `int-quantized`): VPDPBUSD
    multiplies 64 byte pairs an instruction, twice VDPBF16PS's, so past a few rows the products cost half as much
    (csrc/quantized.cpp `w8a8_linear`, `expert_mlps`). `q` holds the values in the kernel's tiles (`vnni_pack`), `scale`
    [2, out] the row scales and the rows' sums of q (the kernel's +128 offset of x comes off with them). CPUs whose
    kernel has no AVX512_VNNI (and other devices) compute the same thing with F.linear on x rounded to int8 steps and
    the dequantised weight."""

    KERNEL, MORE = "w8a8_linear", MORE_W8A8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, pack: bool = True):
        _check_int8(type(self).__name__, q, scale)
        self._shape = q.shape
        gemv = kernel()
        if pack and gemv is not None and hasattr(gemv, "vnni_pack") and q.device.type == "cpu":
            super().__init__(gemv.vnni_pack(q.contiguous()), torch.stack([scale, q.sum(1, dtype=torch.int32).float()]))
            self.rows = None
        else:  # no VNNI kernel (or `pack` False: the reference): the plain values, for F.linear
            super().__init__(q, scale)
            self.rows = q

    @classmethod
    def of(cls, w: torch.Tensor) -> "W8A8Weight":
        return cls(*quantize_int8(w))

    @classmethod
    def of_int8(cls, w: "Int8Weight") -> "W8A8Weight":
        return cls(w.q, w.scale)

    @staticmethod
    def held_bytes(out: int, inputs: int) -> int:
        return out * inputs + 8 * out  # the scales and the rows' sums (the tiles' padding left out)

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def values(self) -> torch.Tensor:
        """The int8 values [out, in], unpacked from the tiles where they are packed."""
        if self.rows is not None:
            return self.rows
        O, I = self._shape
        I4 = -(-I // 4) * 4
        tiles = self.q.view(-1, I4 // 4, 64, 4).permute(0, 2, 1, 3).reshape(-1, I4)
        return tiles[:O, :I]

    def scales(self) -> torch.Tensor:
        """The row scales [out]."""
        return self.scale[0] if self.rows is None else self.scale

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(self.values(), self.scales()).to(dtype)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemv.w8a8_linear(x, self.q, self.scale, bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.rows is None and x.device.type == "cpu" and rows > 0 and x.dtype in (torch.float32, torch.bfloat16):
            y = self._kernel_linear(x.reshape(rows, x.shape[-1]).contiguous(), bias)  # any rows: a prefill's too
            return y.view(*x.shape[:-1], self._shape[0])
        return w8a8_reference(x, self.dequantized(torch.float32).to(x.device), bias)


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a W8A8 linear computes, in PyTorch: F.linear in fp32 of x rounded to int8 steps (`int8_activations`) and
    the dequantised `weight`, in x's dtype (the kernel's reference; CPUs without AVX512_VNNI run it)."""
    y = F.linear(int8_activations(x), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


QUANTIZED = {"int8": Int8Weight, "int4": Int4Weight, "w8a8": W8A8Weight}  # serve --quantize: each scheme's class


def stored_weight(values: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """A quantised package's weight (export --quantize: int8 values [out, in], or int4 packed uint8 [out, in / 2]; its
    scales) as the kernels read it, no copy."""
    if values.dtype == torch.uint8:
        return Int4Weight(values, scale, 2 * values.shape[1] // scale.shape[1])
    return Int8Weight(values, scale)


def quantized_kind(scheme: str, inputs: list[int]) -> type[QuantizedWeight]:
    """The form `scheme` gives weights of these input widths, all of one kind (an expert's fc1 and fc2: the expert
    kernels take one kind a layer): int4 where every one's rows fit its groups, else int8 (w8a8: W8A8Weight)."""
    return Int4Weight if scheme == "int4" and all(Int4Weight.fits(i) for i in inputs) else \
        W8A8Weight if scheme == "w8a8" else Int8Weight


def quantized_weights(weights: list[torch.Tensor], scheme: str) -> list[QuantizedWeight]:
    """`weights` in the form `quantized_kind` gives them."""
    kind = quantized_kind(scheme, [w.shape[1] for w in weights])
    return [kind.of(w) for w in weights]


def as_scheme(w: QuantizedWeight, scheme: str) -> QuantizedWeight:
    """A stored weight as `scheme` runs it: an int8 package's Int8Weight as a W8A8Weight under w8a8 (the same values
    and scales), else itself."""
    return W8A8Weight.of_int8(w) if scheme == "w8a8" and type(w) is Int8Weight else w

