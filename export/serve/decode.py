"""A decode forward in few calls: one new token a row, on the CPU, through the kernels of export/serve/kernels/csrc; and
a packed forward of few tokens (decode tokens beside prompt chunks) the same way.

    from export.serve.decode import Decoder
    decoder = Decoder.of(model, cache)           # None where it does not apply (CUDA, no kernel, an unknown layer)
    out = decoder(tokens, cache.select(seqs, starts, [1] * len(seqs)))   # as model(tokens, cache=..., hidden_only=True)
    if decoder.packs(counts):                    # rows of any new-token counts, packed: tokens [1, sum(counts)]
        out = decoder.packed(tokens, cache.select(seqs, starts, counts, packed=True))

pipeline/model.py's `GPT.forward` is the specification: this runs the same layers with the same kernels and
roundings (the hidden states equal to the bit: tests/test_decode.py), without the module calls and the ~25 tensor
operators a layer took in Python (on a 2-core machine a torch operator costs ~10 us in Python, whatever its size).
Every layer runs in one call of csrc/decode_model.cpp's `DecodeModel`: the norm (RMSNorm or LayerNorm), the q/k/v
projection, `qkv_heads` (heads, qk_norm, RoPE), the cache's `paged_attention`, the out projection, the residual; then a
dense MLP or a layer's routed experts where every expert is on this rank, else the block's own MLP module, called back
from the kernel (a residual or shared-expert MoE layer, or experts on other ranks, whose exchange joins the other ranks'
collectives as it does in the model's forward). Expert parallelism between the ranks of one machine runs in the
kernel too (`Exchange.run_gathered`'s two all-reduces, called from C++; a replicated expert's pairs split between
its holders by the exchange, called back). The layer-by-layer loop below it runs the same steps in Python
(more rows than the grouped expert kernel takes). Positions come from a RoPE table made once by `rope_tables`
itself (the same values as the per-forward tables).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from export.serve import kernels, transport
from pipeline.model import GPT, Output, rope_tables


class Decoder:
    """The decode forward of one served model (see the module), and the packed forwards of few tokens (`packed`:
    decode tokens and short prompt chunks together, as a serving step mixes them)."""

    # a packed forward's tokens up to which `packed` runs it: a decode step's rows beside prompt chunks, past
    # `native_rows` too (its grouped expert kernel there still beats the model's forward, which sends experts of more
    # rows to oneDNN one at a time; past this many tokens the two are even); with quantised weights up to
    # DEQUANTIZE_ABOVE rows, past which the model's own forward dequantises them for oneDNN (`packs`)
    PACKED_TOKENS = 256

    def __init__(self, model: GPT, kernel, cache=None):
        self.model, self.cfg, self.kernel = model, model.cfg, kernel
        self.dtype = model.wte.weight.dtype
        self.head_dim = self.cfg.head_dim
        self._cos = self._sin = None  # the RoPE table: [positions, head_dim] in the model's dtype
        # every layer in one kernel call (csrc/decode_model.cpp `DecodeModel`) up to `native_rows` rows, where it runs
        # them; `native_experts`: it runs the MoE layers' experts itself ("local": one rank; "gathered": the ranks of
        # one machine, `Exchange.run_gathered`'s way, when every rank's tokens are known; "": it calls the module back)
        self.native, self.native_rows, self.native_experts = _decode_model(model, kernel, cache) \
            if cache is not None else (None, 0, "")
        # int8/int4 weights (a ServingLinear's `served`, the fused q/k/v's `weight`): `packs` stops where the model's
        # own forward dequantises them
        self.quantized = any(isinstance(w, kernels.QuantizedWeight) for m in model.modules()
                             for w in (getattr(m, "served", None), getattr(m, "weight", None)))
        # the MoE layers' exchange: its meter and residency counts, for the MoE layers DecodeModel runs itself
        self._exchange = next((getattr(block.mlp, "exchange", None) for block in model.blocks if block.is_moe), None)
        self._table = None  # "gathered": the replica table whose experts DecodeModel holds (`_hold`)
        self.tables_held = 0  # tables it was given since start

    @classmethod
    def of(cls, model: GPT, cache) -> "Decoder | None":
        """A `Decoder` for `model` where every layer is one it runs and `cache` attends on the CPU kernel; else None
        (the model's own forward then runs every decode step)."""
        kernel = kernels.kernel()
        if kernel is None or not hasattr(kernel, "qkv_heads") or not getattr(cache, "packs", False):
            return None
        cfg = model.cfg
        if cfg.positions not in ("rope", "learned") or model.wte.weight.device.type != "cpu":
            return None
        for block in model.blocks:
            attn = block.attn
            if not all(_norm_runs(n) for n in (block.ln_1, block.ln_2)):
                return None
            if cfg.qk_norm != "none" and not all(isinstance(n, kernels.ServingRMSNorm)
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
        x, cos, sin = self._embed(tokens, cache)
        if B <= self.native_rows:
            x, counts = self._native(x, cos, sin, cache._table, cache._start)
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

    def packs(self, counts: list[int]) -> bool:
        """Whether `packed` runs a forward of rows of these new-token counts in one `DecodeModel` call: up to
        PACKED_TOKENS tokens in all, every row short enough for the cache's attention kernel."""
        most = min(self.PACKED_TOKENS, kernels.DEQUANTIZE_ABOVE if self.quantized else 1 << 30)
        return (self.native is not None and 0 < sum(counts) <= most
                and max(counts) <= kernels.options.current().attention_kernel_rows)

    @torch.no_grad()
    def packed(self, tokens: torch.Tensor, cache) -> Output:
        """A packed forward (tokens [1, N]; `cache` selected packed, the rows' new tokens one after another: decode
        tokens and prompt chunks together) in one `DecodeModel` call -> Output(hidden [1, N, C], counts), as
        model(tokens, cache=..., hidden_only=True) gives it. Each new token attends as a row of its own, its position
        its start, its row's block table, as the model's packed forward has the cache's kernel attend them
        (export/serve/kv_cache.py `_attend_packed`; `packs` first)."""
        x, cos, sin = self._embed(tokens, cache)
        x, counts = self._native(x, cos, sin, cache._kernel_table, cache._kernel_starts)
        cache.advance(1)
        return Output(logits=None, expert_counts=counts, hidden=_norm(self.model.ln_f, x)[None])

    def _embed(self, tokens: torch.Tensor, cache) -> tuple:
        """The new tokens' embeddings x [N, C] (learned positions added) and, with RoPE, cos and sin [N, head_dim] at
        their positions (else None, None): each new token a row, whatever the cache's rows."""
        pos = cache.positions(1).view(-1)
        x = self.model.wte(tokens.view(-1))
        if self.cfg.positions == "learned":
            return x + self.model.wpe(pos), None, None
        return x, *self.rope(pos)

    def _native(self, x, cos, sin, tables, starts) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layers in one `DecodeModel.forward` (x [rows, C], a new token a row; `tables` and `starts` as
        `paged_attention` takes them); the MoE layers' exchange keeps its books as for its own calls."""
        tokens = self._gathered_tokens(x)
        x, counts, expert_s, exchange_s, ran, here, gathered = self.native.forward(x, cos, sin, tables, starts, tokens)
        if here:
            self._exchange.ran_locally(here, x.shape[0] * self.cfg.top_k, expert_s, ran)
        if gathered:
            self._exchange.ran_gathered(counts, expert_s, exchange_s, ran)
        return x, counts

    def _gathered_tokens(self, x: torch.Tensor) -> list[int]:
        """Every rank's tokens in this forward where DecodeModel runs the MoE layers as `Exchange.run_gathered` would
        (the same answer on every rank: `Exchange.gathers`, for the layer of fewest experts, under the table it
        holds); else [] (each MoE layer's module is called back, and decides for itself)."""
        ex = self._exchange
        # Exchange.apply replaces the table only when it changes: identity is enough
        if self.native_experts != "gathered" or (ex.table is not self._table and not self._hold(ex.table)):
            return []
        wg = self.model.blocks[self._fewest].mlp.router_weight
        return list(ex.tokens) if ex.gathers(x, wg, self.cfg.top_k) else []

    def _hold(self, table) -> bool:
        """Give DecodeModel's gathered layers the experts `table` has this rank compute (natives and replicas, as
        the exchange's residency holds them) and, for a layer with replicas, the split of their pairs between their
        holders (`Exchange.split_pairs`); False (and nothing changed) while one of them is not resident."""
        ex = self._exchange
        layers = [(i, block.mlp) for i, block in enumerate(self.model.blocks) if block.is_moe]
        held = {i: [e for e, holders in enumerate(table[moe.index]) if ex.rank in holders] for i, moe in layers}
        if any((moe.index, e) not in ex.residency.resident for i, moe in layers for e in held[i]):
            return False
        for i, moe in layers:
            single = all(len(holders) == 1 for holders in table[moe.index])
            weights = [ex.residency.resident[(moe.index, e)] for e in held[i]]
            self.native.hold(i, held[i], *(kernels.expert_tensors(weights) if weights else ([],) * 6),
                             None if single else functools.partial(ex.split_pairs, moe.index))
        self._table = table
        self.tables_held += 1
        return True

    @functools.cached_property
    def _fewest(self) -> int:
        """The block of the MoE layer with the fewest experts."""
        moe = [i for i, block in enumerate(self.model.blocks) if block.is_moe]
        return min(moe, key=lambda i: self.model.blocks[i].mlp.num_experts)


# -- the served model as DecodeModel takes it: a typed spec of every layer -----------------------------------------

@dataclass(frozen=True)
class NormSpec:
    """A norm as DecodeModel runs it: RMSNorm (`bias` None) or LayerNorm."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    layer_norm: bool

    def args(self) -> tuple:
        return self.weight, self.bias, self.eps, self.layer_norm


@dataclass(frozen=True)
class LinearSpec:
    """A linear as csrc/decode_model.cpp's `DecodeLinear` takes it: the weight the few-row kernel reads (a quantised
    weight's values), its AMX tiles, what runs more rows (oneDNN's packed copy, or a quantised weight's scales) and
    the code for how (kernels' MORE_*), its bias."""

    weight: torch.Tensor
    amx: object
    more_weight: object
    more: int
    bias: torch.Tensor | None

    def args(self) -> tuple:
        return self.weight, self.amx, self.more_weight, self.more, self.bias


@dataclass(frozen=True)
class AttentionSpec:
    """A block's attention half: its norm, the fused q/k/v projection, the q/k norms (None without qk_norm), the out
    projection, the MLP half's norm, and the layer's KV pools."""

    ln_1: NormSpec
    qkv: LinearSpec
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    out: LinearSpec
    ln_2: NormSpec
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass(frozen=True)
class MLPSpec:
    """A block's MLP half: a dense MLP (`fcs`), this rank's routed experts ("experts": every expert resident here),
    the experts of one machine's ranks ("gathered": this rank's, through Exchange.run_gathered), or the block's own
    module called back ("module"); an MoE layer's residual MLP and shared expert, each (fc1, fc2, gate) or None."""

    kind: Literal["mlp", "experts", "gathered", "module"]
    fcs: tuple[LinearSpec, LinearSpec] | None = None
    router: torch.Tensor | None = None
    experts: tuple | None = None  # "experts": kernels.expert_tensors of every expert, in order
    rank: int = 0  # "gathered": this rank
    module: Callable | None = None  # "gathered", "module": h [B, C] -> (output [B, C], tokens per expert or None)
    residual: tuple[LinearSpec, LinearSpec, LinearSpec] | None = None
    shared: tuple[LinearSpec, LinearSpec, LinearSpec] | None = None


@dataclass(frozen=True)
class DecodeSpec:
    """Every layer of a served model as DecodeModel runs it, the rows it runs (the grouped expert kernel's limit where
    it runs the experts; any number otherwise) and how it runs the MoE layers' experts ("local", "gathered", "")."""

    head_dim: int
    q_size: int
    kv_size: int
    top_k: int
    renormalize: bool
    swiglu: bool
    layers: list[tuple[AttentionSpec, MLPSpec]]
    rows: int
    native_experts: str


def decode_spec(model: GPT, cache) -> DecodeSpec | None:
    """The served model's layers as `DecodeModel` takes them, or None where an attention half is not one it runs
    (projections not served by export/serve/kernels, a norm on other weights' dtype). The MLP half of a layer is a
    dense MLP, or the experts of an MoE layer (with its residual MLP or shared expert) when it runs every MoE layer
    that way (one rank, every expert resident: "local"; or the ranks of one machine in the shared-memory all-reduce,
    this rank's experts resident: "gathered", with the module kept for the forwards it does not gather); else the
    block's own module, called back (its exchange's collectives and books as that module keeps them)."""
    from export.serve.placement.exchange import PlacedMoE

    cfg = model.cfg
    if not isinstance(model.blocks[0].attn, kernels.FusedAttention):
        return None
    dtype = model.wte.weight.dtype

    def norm(module: nn.Module) -> NormSpec | None:
        if isinstance(module, kernels.ServingRMSNorm) and module.weight.dtype == dtype:
            return NormSpec(module.weight, None, module.eps, False)
        if type(module) is nn.LayerNorm and module.weight is not None and module.weight.dtype == dtype:
            return NormSpec(module.weight, module.bias, module.eps, True)
        return None

    def served(w, bias) -> LinearSpec | None:  # a ServingWeight as its `linear` runs it; a QuantizedWeight: its kernel
        if isinstance(w, kernels.QuantizedWeight) and w.gemv is not None and hasattr(w.gemv, w.KERNEL):
            return LinearSpec(w.q, None, w.scale, w.MORE, bias)
        if not isinstance(w, kernels.ServingWeight) or w.gemv is None or w.weight.dtype != dtype:
            return None
        return LinearSpec(w.weight, w.amx, w.packed, w.more, bias)

    def lin(module) -> LinearSpec | None:  # a served linear, or an nn.Linear left as it is (F.linear at every row count)
        if isinstance(module, kernels.ServingLinear):
            return served(module.served, module.bias)
        if type(module) is nn.Linear and module.weight.dtype == dtype:
            return LinearSpec(module.weight, None, module.weight, kernels.MORE_PLAIN, module.bias)
        return None

    def fcs_of(module) -> tuple[LinearSpec, LinearSpec] | None:  # an MLP's (fc1, fc2)
        fcs = tuple(lin(getattr(module, n, None)) for n in ("fc1", "fc2"))
        return fcs if all(fc is not None for fc in fcs) else None

    def extras(moe) -> list | None:  # an MoE layer's residual MLP and shared expert, each (fc1, fc2, gate) or None
        out = [None, None]
        if cfg.mlp_type == "residual":
            fcs, coef = fcs_of(moe.moe.mlp), lin(moe.moe.coefficient)
            if fcs is None or coef is None:
                return None
            out[0] = (*fcs, coef)
        if hasattr(moe, "shared"):
            fcs, gate = fcs_of(moe.shared), lin(moe.shared_gate)
            if fcs is None or gate is None:
                return None
            out[1] = (*fcs, gate)
        return out

    def experts_held(moe, ep: int) -> bool:  # an MoE layer on `ep` ranks whose experts here are all resident
        if not isinstance(moe, PlacedMoE) or extras(moe) is None or moe.exchange.ep != ep:
            return False
        ex, residency = moe.exchange, moe.exchange.residency
        mine = [e for e, holders in enumerate(ex.table[moe.index]) if ex.rank in holders]
        return (moe.router_weight.dtype == torch.float32 and residency.resident_fraction >= 1
                and all((moe.index, e) in residency.resident for e in mine))

    def gathered(moe) -> bool:  # ranks of one machine in the shared-memory all-reduce: Exchange.run_gathered's layer
        ex = getattr(moe, "exchange", None)
        return (ex is not None and ex.ep > 1 and ex.transport == "all-reduce" and experts_held(moe, ex.ep)
                and transport.shared_memory_reduce(dtype))

    moe_layers = [block.mlp for block in model.blocks if block.is_moe]
    native_experts = ""
    if moe_layers and all(experts_held(moe, 1) for moe in moe_layers):
        native_experts = "local"
    elif moe_layers and all(gathered(moe) for moe in moe_layers):
        native_experts = "gathered"
    layers = []
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        out = attn.out_proj
        parts = (norm(block.ln_1), served(attn.qkv_proj.weight, attn.qkv_proj.bias) if type(attn) is
                 kernels.FusedAttention else None,
                 served(out.served, out.bias) if isinstance(out, kernels.ServingLinear) else None, norm(block.ln_2))
        if any(p is None for p in parts):
            return None
        qk = cfg.qk_norm != "none"
        attention = AttentionSpec(parts[0], parts[1], attn.q_norm.weight if qk else None,
                                  attn.k_norm.weight if qk else None, attn.q_norm.eps if qk else 0.0, parts[2],
                                  parts[3], cache.k[i], cache.v[i])
        if block.is_moe and native_experts:
            residual, shared = extras(mlp)
            ex, router = mlp.exchange, mlp.router_weight.contiguous()
            if native_experts == "local":
                half = MLPSpec("experts", router=router, residual=residual, shared=shared,
                               experts=kernels.expert_tensors([ex.residency.resident[(mlp.index, e)]
                                                               for e in range(mlp.num_experts)]))
            else:  # its experts: Decoder._hold, under the table in force
                half = MLPSpec("gathered", router=router, rank=ex.rank, module=_module_half(block), residual=residual,
                               shared=shared)
        elif not block.is_moe and (fcs := fcs_of(mlp)) is not None:
            half = MLPSpec("mlp", fcs=fcs)
        else:
            half = MLPSpec("module", module=_module_half(block))
        layers.append((attention, half))
    rows = kernels.grouped_max_rows(model.wte.weight) * min(cfg.experts) // cfg.top_k \
        if native_experts == "local" else 1 << 30
    q_size, kv_size = model.blocks[0].attn.qkv_proj.sizes[:2]
    return DecodeSpec(cfg.head_dim, q_size, kv_size, cfg.top_k, bool(cfg.renormalize), cfg.activation == "swiglu",
                      layers, rows, native_experts)


def decode_model(kernel, spec: DecodeSpec):
    """csrc/decode_model.cpp's `DecodeModel` holding every layer of `spec`."""
    native = kernel.DecodeModel(spec.head_dim, spec.q_size, spec.kv_size, spec.top_k, spec.renormalize, spec.swiglu)
    for a, m in spec.layers:
        native.add_attention(a.ln_1.args(), a.qkv.args(), a.q_norm, a.k_norm, a.qk_eps, a.out.args(), a.ln_2.args(),
                             a.k_cache, a.v_cache)
        if m.kind == "experts":
            native.add_experts(m.router, *m.experts)
        elif m.kind == "gathered":
            native.add_gathered(m.router, m.rank, m.module)
        elif m.kind == "mlp":
            native.add_mlp(*(fc.args() for fc in m.fcs))
        else:
            native.add_module(m.module)
        if m.residual is not None:
            native.add_residual(*(fc.args() for fc in m.residual))
        if m.shared is not None:
            native.add_shared(*(fc.args() for fc in m.shared))
    return native


def _decode_model(model: GPT, kernel, cache) -> tuple[object | None, int, str]:
    """(`DecodeModel` of the served model, the rows it runs, how it runs the experts); (None, 0, "") where it does
    not run the model (`decode_spec`), or the kernel has no DecodeModel."""
    spec = decode_spec(model, cache) if hasattr(kernel, "DecodeModel") else None
    if spec is None:
        return None, 0, ""
    return decode_model(kernel, spec), spec.rows, spec.native_experts


def _module_half(block: nn.Module):
    """A block's MLP half as DecodeModel calls it back: h [B, C] -> (output [B, C], tokens per expert or None), as the
    layer loop of `Decoder.__call__` runs it."""
    mlp = block.mlp
    if block.is_moe:
        def half(h: torch.Tensor):
            out, _, counts = mlp(h.view(h.shape[0], 1, -1), None)
            return out.view(h.shape[0], -1), counts
    else:
        def half(h: torch.Tensor):
            return mlp(h.view(h.shape[0], 1, -1)).view(h.shape[0], -1), None
    return half


def _norm_runs(module: nn.Module) -> bool:
    return isinstance(module, (kernels.ServingRMSNorm, nn.LayerNorm))


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm module over x [B, C]: ServingRMSNorm's kernel call directly, LayerNorm as itself."""
    if isinstance(module, kernels.ServingRMSNorm) and x.dtype == module.weight.dtype:
        return module.gemv.rms_norm(x, module.weight, module.eps)
    return module(x)
