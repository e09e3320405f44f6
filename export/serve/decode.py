"""A decode forward in few calls: one new token a row, on the CPU, through csrc/gemv.cpp's kernels.

    from export.serve.decode import Decoder
    decoder = Decoder.of(model, cache)           # None where it does not apply (CUDA, no kernel, an unknown layer)
    out = decoder(tokens, cache.select(seqs, starts, [1] * len(seqs)))   # as model(tokens, cache=..., hidden_only=True)

pipeline/model.py's `GPT.forward` is the specification: this runs the same layers with the same kernels and
roundings (the hidden states equal to the bit: tests/test_decode.py), without the ~25 tensor operators and the
module calls a layer's attention half took in Python. On a 2-core machine a batch-1 step of the Qwen3-MoE package
of benchmarks/peer_bench.py spent ~4 ms of ~15 there (a torch operator costs ~10 us in Python there, whatever its
size). Per layer: the norm, the q/k/v projection, `qkv_heads` (heads, qk_norm, RoPE), the cache's
`paged_attention`, the out projection, the residual; the MLP half is the block's own module (its MoE layer already
runs in two kernel calls on one rank). Positions come from a RoPE table made once by `rope_tables` itself (the same
values as the per-forward tables).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from export.serve import linears
from pipeline.model import GPT, Output, rope_tables


class Decoder:
    """The decode forward of one served model (see the module)."""

    def __init__(self, model: GPT, kernel, cache=None):
        self.model, self.cfg, self.kernel = model, model.cfg, kernel
        self.dtype = model.wte.weight.dtype
        self.head_dim = self.cfg.head_size
        self._cos = self._sin = None  # the RoPE table: [positions, head_dim] in the model's dtype
        # every layer in one kernel call (csrc/gemv.cpp `DecodeModel`) where it runs them all, up to `native_rows`
        self.native, self.native_rows = _decode_model(model, kernel, cache) if cache is not None else (None, 0)
        self._exchange = next((block.mlp.exchange for block in model.blocks if block.is_moe), None) \
            if self.native is not None else None  # the MoE layers' exchange: its meter and residency counts

    @classmethod
    def of(cls, model: GPT, cache) -> "Decoder | None":
        """A `Decoder` for `model` where every layer is one it runs and `cache` attends on the CPU kernel; else None
        (the model's own forward then runs every decode step)."""
        kernel = linears.kernel()
        if kernel is None or not hasattr(kernel, "qkv_heads") or not getattr(cache, "packs", False):
            return None
        cfg = model.cfg
        if cfg.positions not in ("rope", "learned") or model.wte.weight.device.type != "cpu":
            return None
        for block in model.blocks:
            attn = block.attn
            if not all(_norm_runs(n) for n in (block.ln_1, block.ln_2)):
                return None
            if cfg.qk_norm != "none" and not all(isinstance(n, linears.ServingRMSNorm)
                                                 for n in (attn.q_norm, attn.k_norm)):
                return None
        return cls(model, kernel, cache)

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, head_dim] at positions pos [B], read from the table (grown to the next power of two)."""
        need = int(pos.max()) + 1
        if self._cos is None or self._cos.shape[0] < need:
            n = min(max(1 << (need - 1).bit_length(), 1024), max(self.cfg.seq_len, need))
            self._cos, self._sin = rope_tables(self.cfg, torch.arange(n), self.dtype)
        return self._cos.index_select(0, pos), self._sin.index_select(0, pos)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache) -> Output:
        """tokens [B, 1] (B > 0), `cache` selected with one new token a row -> Output(hidden [B, 1, C], counts)."""
        model, cfg, k = self.model, self.cfg, self.kernel
        B = tokens.shape[0]
        pos = cache.positions(1).view(B)
        x = model.wte(tokens.view(B))  # [B, C]
        cos = sin = None
        if cfg.positions == "learned":
            x = x + model.wpe(pos)
        else:
            cos, sin = self.rope(pos)
        if B <= self.native_rows:
            x, counts = self._native(x, cos, sin, cache)
            cache.advance(1)
            return Output(logits=None, expert_counts=counts, hidden=_norm(model.ln_f, x).view(B, 1, -1))
        D = self.head_dim
        counts = []
        for i, block in enumerate(model.blocks):
            attn = block.attn
            q, kk, v = attn.qkv(_norm(block.ln_1, x))
            qw = kw = None
            if cfg.qk_norm != "none":
                qw, kw = attn.q_norm.weight, attn.k_norm.weight
                eps = attn.q_norm.eps
            q, kk, v = k.qkv_heads(q, kk, v, D, qw, kw, eps if qw is not None else 0.0, cos, sin)
            y = cache.attend(i, q[:, :, None], kk[:, :, None], v[:, :, None])  # [B, H, 1, D]
            if y is None:
                raise RuntimeError("the KV cache's attention kernel declined a decode forward")
            x = x + attn.out_proj(y.view(B, -1))
            h = _norm(block.ln_2, x).view(B, 1, -1)
            if block.is_moe:
                h, _, c = block.mlp(h, None)
                counts.append(c)
            else:
                h = block.mlp(h)
            x = x + h.view(B, -1)
        cache.advance(1)
        return Output(logits=None, expert_counts=counts, hidden=_norm(model.ln_f, x).view(B, 1, -1))

    def _native(self, x, cos, sin, cache) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layers in one `DecodeModel.forward`; the MoE layers' exchange keeps its books as for its own calls."""
        x, counts, expert_s, ran = self.native.forward(x, cos, sin, cache._table, cache._start)
        if counts:
            self._exchange.ran_locally(len(counts), x.shape[0] * self.cfg.top_k, expert_s, ran)
        return x, counts


def _decode_model(model: GPT, kernel, cache) -> tuple[object | None, int]:
    """csrc/gemv.cpp's `DecodeModel` holding every layer's tensors, and the rows it runs (the kernels' row limits);
    (None, 0) where a layer is not one it runs (a LayerNorm, a shared expert, a residual MoE, experts on other ranks
    or not all resident, weights the kernels do not serve)."""
    from export.serve.placement.exchange import PlacedMoE

    cfg = model.cfg
    if not hasattr(kernel, "DecodeModel") or cfg.mlp_type == "residual":
        return None, 0
    dtype = model.wte.weight.dtype
    rows = linears.grouped_max_rows(model.wte.weight) * min(cfg.experts or [1]) // cfg.top_k

    def served(w) -> bool:
        nonlocal rows
        if not isinstance(w, linears.ServingWeight) or w.gemv is None or w.weight.dtype != dtype:
            return False
        rows = min(rows, w.gemv.AMX_MAX_ROWS if w.amx is not None else w.gemv.MAX_ROWS)
        return True

    native = kernel.DecodeModel(cfg.head_size, *model.blocks[0].attn.qkv.sizes[:2], cfg.top_k,
                                bool(cfg.renormalizes), cfg.activation == "swiglu") \
        if isinstance(getattr(model.blocks[0].attn, "qkv", None), linears.FusedQKV) else None
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        qkv, out = getattr(attn, "qkv", None), getattr(attn, "out_proj", None)
        if not (native is not None and all(isinstance(n, linears.ServingRMSNorm) for n in (block.ln_1, block.ln_2))
                and isinstance(qkv, linears.FusedQKV) and isinstance(out, linears.ServingLinear)
                and served(qkv.weight) and served(out.served)):
            return None, 0
        qk = cfg.qk_norm != "none"
        native.add_attention(block.ln_1.weight, block.ln_1.eps, qkv.weight.weight, qkv.weight.amx, qkv.bias,
                             attn.q_norm.weight if qk else None, attn.k_norm.weight if qk else None,
                             attn.q_norm.eps if qk else 0.0, out.served.weight, out.served.amx, out.bias,
                             block.ln_2.weight, block.ln_2.eps, cache.k[i], cache.v[i])
        if isinstance(mlp, PlacedMoE):
            residency, wg = mlp.exchange.residency, mlp.moe.deepspeed_moe.gate.wg.weight
            if (mlp.exchange.ep != 1 or hasattr(mlp, "shared") or wg.dtype != torch.float32
                    or residency.resident_fraction < 1
                    or any((mlp.index, e) not in residency.resident for e in range(mlp.num_experts))):
                return None, 0
            native.add_experts(wg.contiguous(), *linears._expert_tensors(
                [residency.resident[(mlp.index, e)] for e in range(mlp.num_experts)]))
        elif isinstance(getattr(mlp, "fc1", None), linears.ServingLinear) and \
                isinstance(getattr(mlp, "fc2", None), linears.ServingLinear) and \
                served(mlp.fc1.served) and served(mlp.fc2.served):
            native.add_mlp(mlp.fc1.served.weight, mlp.fc1.served.amx, mlp.fc1.bias,
                           mlp.fc2.served.weight, mlp.fc2.served.amx, mlp.fc2.bias)
        else:
            return None, 0
    return native, rows


def _norm_runs(module: nn.Module) -> bool:
    return isinstance(module, (linears.ServingRMSNorm, nn.LayerNorm))


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm module over x [B, C]: ServingRMSNorm's kernel call directly, LayerNorm as itself."""
    if isinstance(module, linears.ServingRMSNorm) and x.dtype == module.weight.dtype:
        return module.gemv.rms_norm(x, module.weight, module.eps)
    return module(x)
