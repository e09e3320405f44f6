"""The output layer's greedy rows without reading all of it: `HeadScreen` (an int8 copy of a fp32 or bf16 head plus
the exact rows its error bound cannot rule out: the same tokens, about half the bytes), `QuantizedHeadScreen` (the
same for a head held quantised), and `argmax_rows`; csrc/heads.cpp.

    from export.serve.kernels import HeadScreen
    screen = HeadScreen.of(served, bias)     # None where it does not apply
    tokens = screen.argmax(x)                # None: the caller runs the whole head

`serve --no-head-screen`: no screens.
"""

from __future__ import annotations


import numpy as np
import torch

import export.serve.kernels.options as options
from export.serve.kernels.extension import kernel, kernel_has
from export.serve.kernels.quantized import Int4Weight, Int8Weight, QuantizedWeight, W8A8Weight
from export.serve.kernels.weights import ServingWeight
from pipeline.quantize import dequantized, int8_rows, unpack_int4



class _Tries:
    """A screen's calls and fallbacks: a row count whose calls keep falling back (candidates past `most`: flat
    logits) stops trying after GIVE_UP of them (more than half of its calls)."""

    GIVE_UP = 8

    def _start(self) -> None:
        self.tried: dict = {}  # row count (or a kind of call and its row count) -> [calls, fallbacks]
        self.calls = self.fallbacks = 0  # screened calls, and those that read the whole layer after all

    def _try(self, n: int) -> bool:
        tried = self.tried.setdefault(n, [0, 0])
        if tried[1] >= self.GIVE_UP and 2 * tried[1] > tried[0]:
            return False
        self.calls += 1
        tried[0] += 1
        return True

    def _result(self, n: int, out: torch.Tensor) -> list[int] | None:
        if out.numel() == 0:
            self.fallbacks += 1
            self.tried[n][1] += 1
            return None
        return out.tolist()


class HeadScreen(_Tries):
    """The greedy rows' argmax of an output layer, read from an int8 copy of its weight (half of bf16's bytes, a
    quarter of fp32's) and exact (csrc/heads.cpp `screen_argmax`, `screen_argmax_vnni`): the same token as the
    argmax_rows of the layer's logits as the few-row kernel writes them (passes of up to MAX_ROWS rows), to the bit,
    for ~half the layer's reading and, past a few rows, for fewer instructions. A batch-1 decode step of the peer
    benchmark's Qwen3-MoE reads 162 MB, 103 MB of it the bf16 output layer (50,304 x 1024).

    Each output row o is stored as q[o] = round(w[o] / scale[o]) (int8, scale = max |w[o]| / 127) and err[o], a
    bound, per unit of |x|'s L1 norm, on |exact sum - scale[o] * (q[o] . x)|: the row's largest quantisation error
    max |w[o] - scale[o] q[o]| (measured in float64, where it is exact), plus both sums' fp32 roundings (I
    additions of terms at most (max |w[o]| + scale[o]) |x_i| each: 2 I 2^-24 per unit, doubled). The kernel then
    recomputes, as the few-row kernel does, every row whose interval can reach the best one's (a handful on a trained
    model: its logits are peaked). With AVX512_VNNI (the AVX512_BF16 and AMX builds) the rows of x are rounded to
    int8 too (one scale a row) and multiplied by VPDPBUSD, 1 to VNNI_MAX_ROWS (64) rows a call: err2, top and norm
    bound what that rounding adds (`screen_argmax_vnni`), and q is kept only as a `W8A8Weight` (`int8`): it reads
    about half the bytes of the whole layer and runs faster at 8-32 rows (benchmarks/head_screen.py). Past 8 rows the tokens are the few-row
    kernel's (8 rows a pass), where the unscreened layer runs oneDNN's GEMM: both are fp32 sums of the same bf16
    products rounded once; near-ties can differ between the two.

    `topk` does the same for rows that sample among their top_k largest logits (and greedy rows whose logits a
    processor edits, k = 1): every token that can be among them, computed exactly, the rest -inf (the same
    distribution, for the screen's bytes and one row of the layer a candidate: on a trained model's peaked logits a
    few dozen; the peer benchmark's random model's flat ones give ~1,000 for top_k 40, past TOPK_MOST at 32 rows).

    `sample` draws sampled rows (temperature, min_p, top_p) the same way: the draw is the Gumbel-max trick
    (csrc/draws.h), a token's chance of being drawn depends on its own logit, and the screen's bounds rule out all but
    a few tokens; top_p's nucleus is decided from the bounds' sums where they allow (peaked logits), else that row
    takes the whole head (flat logits: most of the peer benchmark's random model's rows at top_p 0.95; a few percent
    of a trained model's, whose logits are peaked).

    Not for: a bias, a weight that is not finite, rows the head would send to AMX (`amx_linear`'s other sums), rows
    that ask for log-probabilities. A row count whose calls keep falling back (candidates past `most`:
    flat logits) stops trying after GIVE_UP of them. `--no-head-screen`: none."""

    CHUNK = 4096  # output rows quantised at a time (a float64 copy of this many rows at most)
    MOST = 1 / 16  # candidates (all rows of a call) past this share of the outputs: the whole layer instead
    # the same with VNNI on a bf16 layer, where each row's own candidates are re-checked (one row of w each, not the
    # union for every row): the peer benchmark's random Qwen3-MoE gives 2,100-2,900 candidates for 32 rows (its
    # logits are flat; 1/16 of its outputs is 3,144), re-checked in ~0.3 ms where a fallback costs the whole layer
    MOST_PER_ROW = 1 / 4
    TOPK_MOST = 512  # `topk`: candidates a row may have at least, however many rows (the peer model's top_k 40: ~100)
    SAMPLE_ROWS = 32  # `sample`: rows a call at most (it keeps 17 bytes a row a token: 27 MB at 32 x 50,304)

    def __init__(self, served: ServingWeight):
        w = served.weight
        O, I = w.shape
        self.served, self.gemv = served, served.gemv
        self.q = torch.empty(O, I, dtype=torch.int8)
        self.scale = torch.empty(O, dtype=torch.float32)
        self.err = torch.empty(O, dtype=torch.float32)
        # the int8 x int8 screen's other bounds (`screen_argmax_vnni`): the weights' error per unit of |x|_2, and
        # each row's scale * max |q| and scale * |q|_2 (the inputs' rounding's weight, per unit of |e|_1, |e|_2)
        self.vnni = hasattr(self.gemv, "screen_argmax_vnni")
        self.err2, self.top, self.norm = (torch.empty(O, dtype=torch.float32) for _ in range(3))
        rounding = 4 * I * 2.0 ** -24
        self.finite = True  # every weight finite (a NaN or inf one makes its row's largest |w| so): else unusable
        up = torch.tensor(float("inf"))
        for lo in range(0, O, self.CHUNK):
            part = w[lo:lo + self.CHUNK].double()
            top, q, scale = int8_rows(part)
            self.finite = self.finite and bool(torch.isfinite(top).all())
            d = part - scale.double()[:, None] * q
            bound = (d.abs().amax(1) + rounding * (top + scale.double())) * (1 + 1e-6)
            self.q[lo:lo + self.CHUNK] = q.to(torch.int8)
            self.scale[lo:lo + self.CHUNK] = scale
            self.err[lo:lo + self.CHUNK] = torch.nextafter(bound.float(), up)
            if self.vnni:
                # |sum x d| <= |x|_2 |d|_2, and the sums' roundings sum |x_i| (|w_i| + scale) <= |x|_2 |(|w| + s)|_2
                err2 = (d.norm(dim=1) + rounding * (part.abs() + scale.double()[:, None]).norm(dim=1)) * (1 + 1e-6)
                self.err2[lo:lo + self.CHUNK] = torch.nextafter(err2.float(), up)
                s64 = scale.double()
                self.top[lo:lo + self.CHUNK] = torch.nextafter((s64 * q.abs().amax(1) * (1 + 1e-6)).float(), up)
                self.norm[lo:lo + self.CHUNK] = torch.nextafter((s64 * q.norm(dim=1) * (1 + 1e-6)).float(), up)
        if self.vnni:  # the int8 copy as a W8A8 weight holds it (the kernel's tiles, scales and rows' sums) only
            self.int8 = W8A8Weight(self.q, self.scale)
            del self.q
        self.rows = self.gemv.VNNI_MAX_ROWS if self.vnni else self.gemv.MAX_ROWS  # most rows a call screens
        self.most = max(1, int(O * (self.MOST_PER_ROW if self.vnni and w.dtype == torch.bfloat16 else self.MOST)))
        self._start()

    @classmethod
    def of(cls, served: ServingWeight, bias: torch.Tensor | None) -> "HeadScreen | None":
        w = served.weight
        if (not options.current().head_screen or bias is not None or served.gemv is None
                or not hasattr(served.gemv, "screen_argmax") or w.device.type != "cpu"
                or w.dtype not in (torch.float32, torch.bfloat16)):
            return None
        screen = cls(served)
        return screen if screen.finite else None

    def _fits(self, x: torch.Tensor) -> bool:
        """Whether the screen takes these rows: 1 to `rows` of them in the head's dtype, one alone where the head
        would send more to AMX."""
        n = x.shape[0]
        return 0 < n <= self.rows and x.dtype == self.served.weight.dtype and (self.served.amx is None or n == 1)

    def argmax(self, x: torch.Tensor) -> list[int] | None:
        """Each row's token of hidden states x [n, C] (the head's dtype), as argmax_rows(head(x)); None where the
        screen does not apply (then the caller runs the whole head)."""
        n = x.shape[0]
        if not self._fits(x) or not self._try(n):
            return None  # this many rows' candidates keep passing `most` (flat logits): the whole layer at once
        if self.vnni:
            out = self.gemv.screen_argmax_vnni(x.contiguous(), self.served.weight, self.int8.q, self.int8.scale,
                                               self.err, self.err2, self.top, self.norm, self.most)
        else:
            out = self.gemv.screen_argmax(x.contiguous(), self.served.weight, self.q, self.scale, self.err, self.most)
        return self._result(n, out)

    def sample(self, x: torch.Tensor, temperature: list[float], top_p: list[float], min_p: list[float],
               seeds: list[int], counters: list[int], edits=None) -> list[int] | None:
        """Each sampled row's token of hidden states x [n, C] (the head's dtype): the one export/serve/sampling.py
        `sample_batch` draws from the whole head's logits with these settings (temperature, top_p, min_p; no top_k,
        no grammar, no log-probabilities), draw numbers (seeds, counters: uint64 and the tokens sampled before) and
        processors (`edits`: export/serve/sampling.py `Edits`, or None), from the int8 copy and the few exact logits
        its bounds need (csrc/heads.cpp `screened_sample`), or -1 for a row they cannot decide (top_p on flat logits:
        the caller runs the whole head for it). None where the screen does not apply."""
        n = x.shape[0]
        if not self._fits(x) or n > self.SAMPLE_ROWS or not hasattr(self.gemv, "screen_sample"):
            return None
        # rows under top_p may keep needing the whole head (a model's flat logits, whatever the row count): then they
        # are not tried again, for any row count; the others still are
        key = ("sample", min(top_p) < 1)
        if not self._try(key):
            return None
        f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        settings = (f32(temperature), f32(top_p), f32(min_p),
                    torch.from_numpy(np.array(seeds, dtype=np.uint64).view(np.int64)),
                    torch.tensor(counters, dtype=torch.long))
        if edits is None:
            processors = (torch.zeros(n + 1, dtype=torch.long), torch.empty(0, dtype=torch.long),
                          *(torch.empty(0) for _ in range(3)))
        else:
            processors = (edits.offsets, edits.tokens, *(torch.from_numpy(a) for a in (edits.bias, edits.rep,
                                                                                        edits.sub)))
        most = max(self.TOPK_MOST, self.most // n)
        if self.vnni:
            out = self.gemv.screen_sample_vnni(x.contiguous(), self.served.weight, self.int8.q, self.int8.scale,
                                               self.err, self.err2, self.top, self.norm, most, *settings, *processors)
        else:
            out = self.gemv.screen_sample(x.contiguous(), self.served.weight, self.q, self.scale, self.err, most,
                                          *settings, *processors)
        tokens = out.tolist()
        if not tokens or 2 * sum(t < 0 for t in tokens) > n:  # most rows undecided: a fallback
            self.fallbacks += 1
            self.tried[key][1] += 1
        return tokens or None

    def topk(self, x: torch.Tensor, ks: list[int], edited: list[list[int]]):
        """The logits of the rows of hidden states x [n, C] that sample among their ks[i] largest (top_k; 1 for a
        greedy row whose logits a processor edits), every token that can be among those after the processors
        (`edited[i]`: the tokens they touch, always computed), as the whole head writes them, the rest left out:
        (offsets [n + 1], tokens, logits fp32), row i's at offsets[i]:offsets[i + 1]. Sampling from these with every
        other logit -inf is sampling from the head's own (csrc/heads.cpp `screened_topk`). None where the screen does
        not apply (flat logits: candidates past `most` a row; then the caller runs the whole head)."""
        n = x.shape[0]
        if not self._fits(x) or not self._try(-n):  # the row counts' tries kept apart from argmax's
            return None
        ks_t = torch.tensor(ks, dtype=torch.long)
        O = self.served.weight.shape[0]
        distinct = [sorted({t for t in e if 0 <= t < O}) for e in edited]
        offsets = torch.zeros(n + 1, dtype=torch.long)
        offsets[1:] = torch.tensor([len(e) for e in distinct], dtype=torch.long).cumsum(0)
        tokens = torch.tensor([t for e in distinct for t in e], dtype=torch.long)
        most = max(self.TOPK_MOST, self.most // n)  # a row's candidates, each one row of the layer read again
        if self.vnni:
            out = self.gemv.screen_topk_vnni(x.contiguous(), self.served.weight, self.int8.q, self.int8.scale,
                                             self.err, self.err2, self.top, self.norm, most, ks_t, offsets, tokens)
        else:
            out = self.gemv.screen_topk(x.contiguous(), self.served.weight, self.q, self.scale, self.err, most, ks_t,
                                        offsets, tokens)
        if not out:
            self.fallbacks += 1
            self.tried[-n][1] += 1
            return None
        return tuple(out)


class QuantizedHeadScreen(_Tries):
    """HeadScreen for an output layer held quantised (`--quantize-head`): each greedy row's token as argmax_rows of the
    layer's own logits (`int4_linear`, `int8_linear`), to the bit, through csrc/heads.cpp `screen_argmax_i4` or
    `screen_argmax_i8`: x rounded to int8 and the stored weights read as they are by VPDPBUSD (64 products an
    instruction, where the layers' one-row passes do 32 by VDPBF16PS after widening each weight to bf16: compute-bound
    there; 1 to 64 rows, 8 a pass over the weight), then the candidates its bound cannot rule out computed again by
    the layer's kernel. Per output row it holds the dequantised row's largest |w| (`top`), its L2 norm and the fp32
    roundings' bound (`round`: both sides' sums, per unit of |x|_1 + |e|_1). Not for: a bias, int4 groups that are
    not a multiple of 128, CPUs without AVX512_VNNI (the kernel has neither op), `--no-head-screen`."""

    CHUNK, MOST_PER_ROW = HeadScreen.CHUNK, HeadScreen.MOST_PER_ROW  # 1 to 64 rows: candidates as the VNNI screen's

    def __init__(self, weight: "Int4Weight | Int8Weight"):
        O, I = weight.shape
        self.weight, self.gemv = weight, weight.gemv
        self.int4 = isinstance(weight, Int4Weight)
        self.top, self.norm, self.round = (torch.empty(O, dtype=torch.float32) for _ in range(3))
        # both sides' fp32 roundings: the layer's sums of I products (and int4's G groups); int4's screen adds its G
        # group terms, its offset and 16 lanes, each term at most (7 + 8 + 8) max scale |x_i| or |s xq_i| (s |xq|_1 <=
        # |x|_1 + |e|_1); int8's sums are exact integers, then two products (and one conversion past 2^24)
        group = weight.group if self.int4 else I
        rounding = 2 * (23 if self.int4 else 128) * (I + I // group + 32) * 2.0 ** -24
        up = torch.tensor(float("inf"))
        self.finite = bool(torch.isfinite(weight.scale).all())
        self.rowsum = None if self.int4 else weight.q.sum(1, dtype=torch.int32)
        for lo in range(0, O, self.CHUNK):
            scale = weight.scale[lo:lo + self.CHUNK]
            if self.int4:
                w = dequantized(unpack_int4(weight.q[lo:lo + self.CHUNK]), scale, weight.group).double()
            else:
                w = dequantized(weight.q[lo:lo + self.CHUNK], scale).double()  # q * scale is exact in fp32
            self.top[lo:lo + self.CHUNK] = torch.nextafter((w.abs().amax(1) * (1 + 1e-6)).float(), up)
            self.norm[lo:lo + self.CHUNK] = torch.nextafter((w.norm(dim=1) * (1 + 1e-6)).float(), up)
            biggest = scale.double().abs().reshape(scale.shape[0], -1).amax(1)
            self.round[lo:lo + self.CHUNK] = torch.nextafter((biggest * rounding * (1 + 1e-6)).float(), up)
        self.most = max(1, int(O * self.MOST_PER_ROW))
        self.rows = self.gemv.VNNI_MAX_ROWS  # most rows a call screens (MAX_ROWS a pass over the weight)
        self._start()

    @classmethod
    def of(cls, weight: "QuantizedWeight", bias: torch.Tensor | None) -> "QuantizedHeadScreen | None":
        op = "screen_argmax_i4" if isinstance(weight, Int4Weight) else "screen_argmax_i8"
        if (not options.current().head_screen or bias is not None or type(weight) not in (Int4Weight, Int8Weight)
                or not hasattr(weight.gemv, op) or (op == "screen_argmax_i4" and weight.group % 128)
                or weight.q.device.type != "cpu"):
            return None
        screen = cls(weight)
        return screen if screen.finite else None

    def _fits(self, x: torch.Tensor) -> bool:
        """Whether the screen takes these rows: 1 to `rows` of them in the head's dtype, one alone where the head
        would send more to AMX."""
        n = x.shape[0]
        return 0 < n <= self.rows and x.dtype == self.served.weight.dtype and (self.served.amx is None or n == 1)

    def argmax(self, x: torch.Tensor) -> list[int] | None:
        """Each row's token of hidden states x [n, C] (fp32 or bf16), as argmax_rows(the layer(x)); None where the
        screen does not apply (then the caller runs the whole layer)."""
        n = x.shape[0]
        if not 0 < n <= self.rows or x.dtype not in (torch.float32, torch.bfloat16) or not self._try(n):
            return None
        w = self.weight
        if self.int4:
            out = self.gemv.screen_argmax_i4(x.contiguous(), w.q, w.scale, self.top, self.norm, self.round, w.group,
                                             self.most)
        else:
            out = self.gemv.screen_argmax_i8(x.contiguous(), w.q, w.scale, self.rowsum, self.top, self.norm,
                                             self.round, self.most)
        return self._result(n, out)



def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of logits [n, V] (torch.argmax's answer), in one parallel kernel call on the CPU."""
    if kernel_has("argmax_rows", x):
        return kernel().argmax_rows(x.contiguous()).tolist()
    return x.argmax(dim=-1).tolist()
