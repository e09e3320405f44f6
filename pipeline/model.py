"""The PR-MoE GPT: one model for teacher, student, evaluation and serving.

A GPT-3-style decoder (pre-LayerNorm, learned positions, GeLU MLPs, optionally tied embeddings)
whose MLP is replaced by a Mixture-of-Experts on some layers (the teacher: every other one; a
student keeps the layers it was built from, so its layout is a list). Each MoE layer has
its own expert count (Pyramid: more experts in the top layers) and may be Residual: a fixed dense
MLP plus one routed expert, mixed per token by a learned 2-way softmax (DeepSpeed-MoE, 2022).

The same blocks, switched by `ModelConfig`'s family fields (as litgpt's `Config` expresses model families),
also express the Hugging Face MoE families a teacher can be imported from (pipeline/hf_import.py: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE): RMSNorm, rotary positions (rotate-half, any head width), grouped-query
attention, q/k norms (per head, or over the whole projection), biases on or off, SwiGLU MLPs and experts
(`fc1` holds [gate; up] stacked, as transformers 5 holds `gate_up_proj`), top-k weights renormalised or not,
a shared expert with a sigmoid gate (Qwen2-MoE), dense layers anywhere, untied heads. A field's default is the
PR-MoE GPT's, so a config saved before these fields existed reads as the model it was.

Two interchangeable MoE implementations with the same parameter names:
  * "deepspeed": `deepspeed.moe.layer.MoE`, expert parallel across ranks (training, serving);
  * "reference": plain PyTorch with every expert local, no launcher or process group needed
    (exported packages, tests). `tests/test_model.py` holds them to the same outputs whenever
    no token is dropped (inference, the paper's setting) and for top-2 with dropping; top-1
    dropping differs by design: DeepSpeed picks the dropped tokens at random (random token
    selection), the reference drops the last ones in token order.

This file imports only torch (DeepSpeed lazily), so it can ship inside an exported package.

    python -m pipeline.model      # build a tiny model, print its size, check cache == full forward
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    """Every field is required: the defaults and their reasons live in one place, the recipe schema
    (pipeline/recipe.py, ModelSpec); a saved model carries all of them in its config.json. The optional shape
    fields (head_dim, kv_heads, ffn_hidden, expert_hidden, renormalize) are resolved once, in __post_init__:
    None on the way in, their value from then on. So `dataclasses.replace(cfg, hidden=...)` keeps the old widths:
    a config of another shape sets those it derives from anew (None to derive them again)."""

    vocab_size: int
    seq_len: int  # context length = number of learned positions
    layers: int
    hidden: int
    heads: int
    experts: tuple[int, ...]  # experts per MoE layer, bottom to top
    moe_layers: tuple[int, ...]  # 0-indexed layers whose MLP is an MoE (teacher: 1, 3, 5, ... for MoE every other layer)
    mlp_type: str  # "standard" | "residual"
    top_k: int
    capacity_factor: float
    eval_capacity_factor: float | None  # None: no token dropping outside training
    min_capacity: int
    aux_loss_coef: float
    ffn_mult: int
    dropout: float
    tie_embeddings: bool
    init_std: float
    # -- the family fields (defaults: the PR-MoE GPT) --
    family: str = "pr-moe"  # "pr-moe" | "mixtral" | "qwen2_moe" | "qwen3_moe" | "olmoe": names on import/export
    norm: str = "layernorm"  # "layernorm" (with bias) | "rmsnorm" (computed in fp32, weight only)
    norm_eps: float = 1e-5
    positions: str = "learned"  # "learned" (wpe, seq_len rows) | "rope" (rotate-half, no wpe)
    rope_theta: float = 10000.0
    head_dim: int | None = None  # None: hidden // heads
    kv_heads: int | None = None  # None: heads (grouped-query attention when fewer)
    qk_norm: str = "none"  # "none" | "head" (Qwen3-MoE: RMSNorm(head_dim) per head) | "full" (OLMoE: over q, k)
    qkv_bias: bool = True
    out_bias: bool = True
    activation: str = "gelu"  # "gelu" (fc1 -> GeLU -> fc2) | "swiglu" (fc1 = [gate; up], fc2(silu(gate) * up))
    mlp_bias: bool = True
    ffn_hidden: int | None = None  # dense MLP width (and the residual MLP's); None: ffn_mult * hidden
    expert_hidden: int | None = None  # each expert's width; None: the dense width
    renormalize: bool | None = None  # top-k weights rescaled to sum to 1; None: for k >= 2 (DeepSpeed's rule)
    shared_expert_hidden: int = 0  # Qwen2-MoE's shared expert (width; 0: none), mixed by a sigmoid gate

    def __post_init__(self):
        object.__setattr__(self, "experts", tuple(self.experts))
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        # exceptions, not asserts: a package's config.json is untrusted input, and `python -O` drops asserts
        def need(ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"model config: {why}")

        need(all(v > 0 for v in (self.vocab_size, self.seq_len, self.layers, self.hidden, self.heads)),
             "vocab_size, seq_len, layers, hidden and heads must be positive")
        need(len(self.experts) == len(self.moe_layers), "one experts entry per MoE layer")
        need(list(self.moe_layers) == sorted(set(self.moe_layers)) and all(0 <= i < self.layers for i in self.moe_layers),
             "moe_layers: distinct layer indices below layers, in increasing order")
        need(self.head_dim is not None or self.hidden % self.heads == 0, "hidden must be a multiple of heads")
        need(self.kv_heads is None or 0 < self.kv_heads, "kv_heads must be positive")
        # each optional shape field resolved once, here: a saved config.json carries the resolved values
        for name, value in (("head_dim", self.hidden // self.heads), ("kv_heads", self.heads),
                            ("ffn_hidden", self.ffn_mult * self.hidden), ("renormalize", self.top_k > 1)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.expert_hidden is None:
            object.__setattr__(self, "expert_hidden", self.ffn_hidden)
        need(self.heads % self.kv_heads == 0, "heads must be a multiple of kv_heads")
        need(self.norm in ("layernorm", "rmsnorm"), f"norm {self.norm!r}: layernorm or rmsnorm")
        need(self.positions in ("learned", "rope"), f"positions {self.positions!r}: learned or rope")
        need(self.qk_norm in ("none", "head", "full"), f"qk_norm {self.qk_norm!r}: none, head or full")
        need(self.activation in ("gelu", "swiglu"), f"activation {self.activation!r}: gelu or swiglu")
        need(self.head_dim % 2 == 0 or self.positions != "rope", "rotary positions need an even head_dim")

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def experts_at(self, layer: int) -> int:
        return self.experts[self.moe_layers.index(layer)]

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def default_ep_size(num_experts: int, world_size: int, override: int | None = None) -> int:
    """Expert-parallel degree of one layer: min(world, experts) unless set; must divide both."""
    ep = override if override is not None else min(world_size, num_experts)
    if num_experts % ep or world_size % ep:
        raise ValueError(f"expert-parallel degree {ep} must divide the layer's {num_experts} experts "
                         f"and the world size {world_size}; set distributed.ep_size to a common divisor")
    return ep


# -- attention --------------------------------------------------------------------------------

@runtime_checkable
class Cache(Protocol):
    """What `GPT.forward` needs of a key/value cache (a forward of T new tokens per row):

      * `length`: tokens already cached before this forward (the longest row's), read for the
        context check and by every layer; it does not change during the forward;
      * `update(layer, k, v)`: store the layer's new keys/values [B, H, T, D], return all keys/values
        the new queries attend to [B, H, keys, D];
      * `attend(layer, q, k, v)`: store them and return the attention output [B, H, T, D] itself, where
        the cache has a kernel for this forward (the serving runtime's, for one new token a row on the
        CPU); None (the default): `update`, then scaled_dot_product_attention here;
      * `positions(T)`: [B, T] position ids when rows have their own lengths, else None (every row
        continues at `length`);
      * `attention_mask(T)`: [B, 1, T, keys] bool when rows have their own lengths, else None
        (causal masking after `length` cached tokens is exact);
      * `token_mask(T)`: [B, T] bool, the real tokens of a padded batch (rows of different new-token
        counts, as batched prefill makes), else None: padding is never routed to an expert;
      * `advance(T)`: called once after the last layer: the T new tokens are now cached.

    Implemented by `KVCache` (below: one length for the whole batch), by the serving runtime's
    `PagedCache` (export/serve/kv_cache.py: blocks from a pool, a length per row, rows of different
    lengths decoding together) and by the Hugging Face wrapper's view of HF's own `Cache` (export/hf/). A class that
    subclasses it gets the one-length-per-batch behaviour of the last three."""

    length: int

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        return None

    def positions(self, T: int) -> torch.Tensor | None:
        return None

    def attention_mask(self, T: int) -> torch.Tensor | None:
        return None

    def token_mask(self, T: int) -> torch.Tensor | None:
        return None

    def advance(self, T: int) -> None:
        self.length += T


class KVCache(Cache):
    """Per-layer key/value buffers for incremental decoding: [B, heads, max_len, head_dim]; one length
    for the whole batch."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device=None, dtype=torch.float32):
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.length = 0  # tokens already cached (same for every sequence of the batch)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        end = self.length + T
        if end > self.k[layer].shape[2]:
            raise ValueError(f"KV cache holds {self.k[layer].shape[2]} tokens, {end} needed")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as Llama-style models do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.hidden
    return RMSNorm(dim, cfg.norm_eps) if cfg.norm == "rmsnorm" else nn.LayerNorm(dim, eps=cfg.norm_eps)


def rope_tables(cfg: ModelConfig, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, head_dim] for position ids `pos` [T] or [B, T] (rotate-half layout: the two halves of a
    head share frequencies), in fp32 then cast to the activations' dtype."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv  # [..., T, d/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d]; cos/sin [T, d] or [B, T, d]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # `num_heads`: the name DeepSpeed's tensor slicing (AutoTP) divides by the slice count
        self.num_heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        q_width, kv_width = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        # separate q, k, v projections (not one fused qkv): DeepSpeed's AutoTP can slice them
        self.q_proj = nn.Linear(cfg.hidden, q_width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_width, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_width, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(q_width, cfg.hidden, bias=cfg.out_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            self.q_norm = norm(cfg, q_width if full else cfg.head_dim)
            self.k_norm = norm(cfg, kv_width if full else cfg.head_dim)
        self.dropout = cfg.dropout

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three projections (a finished model's serving may replace this with one fused product)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cache: Cache | None = None, layer: int = 0,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = self.qkv(x)
        if self.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        # [B, T, H*D] -> [B, H, T, D] (this rank's heads under tensor slicing: H = width // D)
        # (head width spelled out, not -1: a rank with no rows this step runs B = 0)
        q, k, v = (y.view(B, T, y.shape[-1] // D, D) for y in (q, k, v))
        if self.qk_norm == "head":  # Qwen3-MoE: per head, one norm shared by the heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        gqa = q.shape[1] != k.shape[1]
        y = cache.attend(layer, q, k, v) if cache is not None else None  # the cache's own kernel, if it has one
        if y is None:
            past, mask = 0, None
            if cache is not None:
                past = cache.length
                k, v = cache.update(layer, k, v)  # [B, H, past+T, C/H]
                mask = cache.attention_mask(T)  # [B, 1, T, keys]: rows with their own lengths (serving), else None
            if mask is not None:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            elif past == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                   dropout_p=self.dropout if self.training else 0.0)
            else:
                # new query i (absolute position past+i) sees keys 0..past+i
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, y.shape[1] * D)  # [B, H, T, D] -> [B, T, H*D] (/tp under tensor slicing)
        return self.out_proj(y)


# -- MLP and Mixture-of-Experts --------------------------------------------------------------

def mlp_activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """fc1's output activated, fc2's input: silu(gate) * up for SwiGLU (fc1 = [gate; up]), else exact GeLU."""
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


class MLP(nn.Module):
    """h -> width -> h: the dense MLP, and every expert. GeLU (8h^2 + 5h parameters at 4x), or SwiGLU with
    fc1 = [gate; up] ([2 x width, h]) and fc2(silu(gate) * up)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.ffn_hidden
        self.swiglu = cfg.activation == "swiglu"
        self.fc1 = nn.Linear(cfg.hidden, 2 * width if self.swiglu else width, bias=cfg.mlp_bias)
        self.fc2 = nn.Linear(width, cfg.hidden, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(mlp_activation(self.fc1(x), self.swiglu)))


class Gate(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)  # DeepSpeed's name; always run in fp32


class _Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, num_experts: int):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(MLP(cfg, cfg.expert_hidden) for _ in range(num_experts))


class Routing(NamedTuple):
    """A router's decision for S tokens choosing k of E experts."""

    weights: torch.Tensor  # [S, k] fp32: each choice's mixing weight (0 where dropped)
    experts: torch.Tensor  # [S, k] long: the chosen experts, best first
    keep: torch.Tensor  # [S, k] bool: the choice fits its expert's capacity
    counts: torch.Tensor  # [E] long: tokens routed to each expert (dropped ones included)
    aux: torch.Tensor  # (): GShard's load-balancing loss


def router_logits(x: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """[S, C] tokens -> [S, E] router logits, in fp32 whatever the model's dtype (as DeepSpeed's gate)."""
    return F.linear(x.float(), wg.float())


def expert_capacity(tokens: int, experts: int, factor: float, top_k: int, min_capacity: int) -> int:
    """Tokens an expert takes before dropping (DeepSpeed's rule): factor x an even share, at least min_capacity."""
    return max(math.ceil(tokens / experts * factor * top_k), min_capacity)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, capacity: int | None = None) -> Routing:
    """Top-k routing from fp32 router logits [S, E]: softmax, the k most probable experts per token,
    choices past an expert's `capacity` dropped in token order (all first choices before second
    ones; None: no dropping), and the kept choices' weights renormalised to sum to 1 if `renormalize`
    (DeepSpeed does so for k >= 2; top-1 keeps the raw probability)."""
    S, E = logits.shape
    probs = logits.softmax(dim=-1)  # [S, E]
    top_p, top_i = probs.topk(top_k, dim=-1)  # [S, k]
    first = F.one_hot(top_i[:, 0], E).float()  # [S, E]
    aux = E * (probs.mean(0) * first.mean(0)).sum()
    counts = F.one_hot(top_i, E).sum(dim=(0, 1))  # [E]
    keep = torch.ones_like(top_p, dtype=torch.bool)  # [S, k]
    if capacity is not None:
        onehot = F.one_hot(top_i.t().reshape(-1), E)  # [k*S, E]: all first choices, then second
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # slot of each (choice, token)
        keep = (position < capacity).view(top_k, S).t()
    weights = top_p * keep
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).eps)
    return Routing(weights, top_i, keep, counts, aux)


def group_by_expert(r: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The kept (token, choice) pairs grouped by expert (stable: token order within an expert), and each
    expert's count, read to the host in one sync so that only the experts that received tokens run."""
    token, choice = r.keep.nonzero(as_tuple=True)
    expert = r.experts[token, choice]
    order = expert.argsort(stable=True)
    return token[order], choice[order], torch.bincount(expert, minlength=num_experts).tolist()


def mix_residual(moe: nn.Module, x: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """PR-MoE's residual MLP: expert(x)*c0 + mlp(x)*c1, (c0, c1) = softmax(coefficient(x)) per token
    (DeepSpeed's use_residual). `moe` holds `mlp` and `coefficient`."""
    coef = moe.coefficient(x).softmax(dim=-1)  # [B, T, 2]: expert weight, dense MLP weight
    return expert_out * coef[..., 0:1] + moe.mlp(x) * coef[..., 1:]


class _ReferenceDispatch(nn.Module):
    """Top-k routing over local experts; module names mirror DeepSpeed's `deepspeed_moe`."""

    def __init__(self, cfg: ModelConfig, num_experts: int):
        super().__init__()
        self.cfg, self.num_experts = cfg, num_experts
        self.gate = Gate(cfg.hidden, num_experts)
        self.experts = _Experts(cfg, num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, E = self.cfg, self.num_experts
        S, C = x.shape  # tokens, hidden
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        capacity = None if factor is None else expert_capacity(S, E, factor, cfg.top_k, cfg.min_capacity)
        r = route(router_logits(x, self.gate.wg.weight), cfg.top_k, cfg.renormalize, capacity)
        out = torch.zeros_like(x)
        token, choice, per_expert = group_by_expert(r, E)
        start = 0
        for e, n in enumerate(per_expert):
            if n:
                t, c = token[start:start + n], choice[start:start + n]
                y = self.experts.deepspeed_experts[e](x[t])
                out.index_add_(0, t, y * r.weights[t, c, None].to(y.dtype))
                start += n
        return out, r.aux, r.counts


_RAW_TOPK_GATE = None


def raw_topk_gate() -> type:
    """DeepSpeed's `TopKGate` whose kept routes weigh their plain softmax probabilities, not rescaled to sum to 1
    (Qwen2-MoE's and OLMoE's norm_topk_prob false; DeepSpeed rescales for every k >= 2). Routing, capacity,
    dropping and the balancing loss stay DeepSpeed's own."""
    global _RAW_TOPK_GATE
    if _RAW_TOPK_GATE is None:
        from deepspeed.moe.sharded_moe import TopKGate

        class RawTopKGate(TopKGate):
            @classmethod
            def like(cls, gate: TopKGate) -> "RawTopKGate":
                """A gate configured as DeepSpeed's `gate`, holding its router (`wg`, its parameter as it is)."""
                with torch.random.fork_rng(devices=[]):  # its own router, replaced below, draws nothing from the RNG
                    raw = cls(gate.wg.in_features, gate.wg.out_features, gate.k, gate.capacity_factor,
                              gate.eval_capacity_factor, gate.min_capacity, gate.noisy_gate_policy, gate.drop_tokens,
                              gate.use_rts, gate.ep_group, gate.top2_2nd_expert_sampling)
                raw.wg = gate.wg
                return raw

            def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
                out = super().forward(input, used_token, sparse_routes, use_tutel)
                if not sparse_routes:
                    raise NotImplementedError("renormalize: false needs DeepSpeed's sparse routes (its MoE layer's)")
                l_aux, capacity, experts, idx, locations, gates, counts = out  # idx [k, S], -1: dropped
                probs = router_logits(input, self.wg.weight).softmax(dim=-1)  # [S, E]
                raw = probs.gather(1, idx.long().clamp_min(0).t()).t() * (idx >= 0)
                return l_aux, capacity, experts, idx, locations, raw.to(gates.dtype), counts

        _RAW_TOPK_GATE = RawTopKGate
    return _RAW_TOPK_GATE


class MoE(nn.Module):
    """One MoE layer. Returns (output, aux loss, tokens per expert)."""

    def __init__(self, cfg: ModelConfig, num_experts: int, impl: str = "reference", ep_size: int = 1):
        super().__init__()
        self.cfg, self.num_experts, self.impl, self.ep_size = cfg, num_experts, impl, ep_size
        residual = cfg.mlp_type == "residual"
        if impl == "deepspeed":
            from deepspeed.moe.layer import MoE as DeepSpeedMoE

            # DeepSpeed names the parts deepspeed_moe.{gate.wg, experts.deepspeed_experts.i}, mlp, coefficient
            self.moe = DeepSpeedMoE(cfg.hidden, MLP(cfg, cfg.expert_hidden), num_experts=num_experts, ep_size=ep_size,
                                    k=cfg.top_k,
                                    capacity_factor=cfg.capacity_factor,
                                    # unused when None: train(False) then turns token dropping off
                                    eval_capacity_factor=cfg.eval_capacity_factor or cfg.capacity_factor,
                                    min_capacity=cfg.min_capacity, use_residual=residual, drop_tokens=True)
            if cfg.top_k > 1 and not cfg.renormalize:  # DeepSpeed's gate always renormalises for k >= 2
                self.moe.deepspeed_moe.gate = raw_topk_gate().like(self.moe.deepspeed_moe.gate)
        elif impl == "reference":
            if ep_size != 1:
                raise ValueError(f"ep_size {ep_size}: the reference MoE holds every expert locally (1)")
            self.moe = nn.Module()
            self.moe.deepspeed_moe = _ReferenceDispatch(cfg, num_experts)
            if residual:
                self.moe.mlp = MLP(cfg)
                self.moe.coefficient = nn.Linear(cfg.hidden, 2)
        else:
            raise ValueError(f"unknown MoE implementation {impl!r}: 'deepspeed' or 'reference'")
        if cfg.shared_expert_hidden:  # Qwen2-MoE: routed(x) + sigmoid(shared_gate(x)) * shared(x)
            self.shared = MLP(cfg, cfg.shared_expert_hidden)
            self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False)
        self.train(True)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def train(self, mode: bool = True):
        super().train(mode)
        if self.impl == "deepspeed":
            gate = self.moe.deepspeed_moe.gate
            drop = mode or self.cfg.eval_capacity_factor is not None
            gate.drop_tokens = drop
            # without dropping, capacity is the busiest expert's load: min_capacity only forbids tiny batches
            gate.min_capacity = self.cfg.min_capacity if drop else 0
            gate.top2_2nd_expert_sampling = mode  # sample the 2nd expert only while training
            # random token selection only while training: evaluation must neither be random nor
            # advance the training RNG (so eval_every cannot change the trained weights)
            gate.use_rts = mode
        return self

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C]; `valid` [B, T] bool: only those tokens are routed (the rest is padding, output 0)."""
        if valid is not None:
            out = torch.zeros_like(x)
            y, aux, counts = self.forward(x[valid][None])  # [1, real tokens, C]
            out[valid] = y[0]
            return out, aux, counts
        if self.impl == "deepspeed":
            out, aux, counts = self.moe(x)
        else:
            B, T, C = x.shape
            out, aux, counts = self.moe.deepspeed_moe(x.reshape(B * T, C))  # [B*T, C]
            out = out.view(B, T, C)
            if self.cfg.mlp_type == "residual":
                out = mix_residual(self.moe, x, out)
        return add_shared(self, x, out), aux, counts


def add_shared(moe: nn.Module, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared expert: routed + sigmoid(shared_gate(x)) * shared(x); `routed` alone without one."""
    shared = getattr(moe, "shared", None)
    if shared is None:
        return routed
    return routed + torch.sigmoid(moe.shared_gate(x)) * shared(x)


# -- block and model ---------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, moe_impl: str, ep_size: int):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = Attention(cfg)
        self.ln_2 = norm(cfg)
        self.is_moe = cfg.is_moe(layer)
        self.mlp = MoE(cfg, cfg.experts_at(layer), moe_impl, ep_size) if self.is_moe else MLP(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cache=None, layer=0, rope=None):
        x = x + self.resid_dropout(self.attn(self.ln_1(x), cache, layer, rope))
        h = self.ln_2(x)
        if self.is_moe:
            h, aux, counts = self.mlp(h, cache.token_mask(h.shape[1]) if cache is not None else None)
        else:
            h, aux, counts = self.mlp(h), None, None
        return x + h, aux, counts


@dataclass
class Output:
    logits: torch.Tensor | None  # [B, T, vocab] (None with hidden_only)
    loss: torch.Tensor | None = None  # lm_loss + aux_loss (training objective)
    lm_loss: torch.Tensor | None = None  # masked mean cross-entropy over real tokens
    aux_loss: torch.Tensor | None = None  # aux_loss_coef * sum of the MoE layers' balancing losses
    expert_counts: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: [experts] tokens routed
    hidden: torch.Tensor | None = None  # [B, T, C] final-norm output (hidden_only): lm_head(hidden) = logits


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_impl: str = "reference", world_size: int = 1,
                 ep_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        if cfg.positions == "learned":
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg, i, moe_impl,
                  default_ep_size(cfg.experts_at(i), world_size, ep_size) if cfg.is_moe(i) else 1)
            for i in range(cfg.layers))
        self.ln_f = norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.blocks if b.is_moe]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, cache: Cache | None = None,
                hidden_only: bool = False) -> Output:
        """hidden_only: skip the vocabulary projection (Output.hidden, no logits), for callers that
        need logits at a few positions only (scoring continuations: `lm_head(hidden[rows, cols])`)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.seq_len:
            raise ValueError(f"{start + T} tokens exceed the model's context of {self.cfg.seq_len}")
        pos = cache.positions(T) if cache is not None else None  # [B, T]: rows with their own lengths
        if pos is None:
            pos = torch.arange(start, start + T, device=input_ids.device)
        x = self.wte(input_ids)  # [B, T, C]
        rope = None
        if self.cfg.positions == "learned":
            x = x + self.wpe(pos)
        else:
            rope = rope_tables(self.cfg, pos, x.dtype)  # cos, sin: computed once, read by every layer
        x = self.drop(x)
        aux_losses, counts = [], []
        for i, block in enumerate(self.blocks):
            x, aux, c = block(x, cache, i, rope)
            if aux is not None:
                aux_losses.append(aux)
                counts.append(c)
        if cache is not None:
            cache.advance(T)
        if hidden_only:
            out = Output(logits=None, expert_counts=counts, hidden=self.ln_f(x))
        else:
            logits = self.lm_head(self.ln_f(x))  # [B, T, vocab]
            out = Output(logits=logits, expert_counts=counts)
        # a dense model (no MoE layer) has no balancing loss; each block's on its own device (blocks placed on
        # several GPUs, as transformers' device_map="auto" splits a package), summed on the last one
        aux = torch.stack([a.float().to(x.device) for a in aux_losses]).sum() if aux_losses else \
            x.new_zeros((), dtype=torch.float32)
        out.aux_loss = self.cfg.aux_loss_coef * aux
        if labels is not None:
            if hidden_only:
                raise ValueError("labels need logits: drop hidden_only")
            out.lm_loss = masked_cross_entropy(logits, labels, loss_mask)
            out.loss = out.lm_loss + out.aux_loss.to(out.lm_loss.device)
        return out


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens the mask keeps (not over B*T)."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")  # [B*T]
    if loss_mask is None:
        return nll.mean()
    mask = loss_mask.flatten().float()
    return (nll * mask).sum() / mask.sum().clamp_min(1.0)


# -- parameter names across expert-parallel layouts --------------------------------------------

_EXPERT_KEY = ".deepspeed_experts."


class ExpertKey(NamedTuple):
    """The parts of an expert parameter's name, e.g.
    'blocks.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight'."""

    prefix: str  # 'blocks.1.mlp.moe.deepspeed_moe.experts'
    block: int  # 1: the model's layer (block) index
    expert: int  # 3: global or local expert id, as the name has it
    suffix: str  # 'fc1.weight'


_BLOCK_OF = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def split_expert_key(name: str) -> ExpertKey | None:
    """An expert parameter's name split into its parts; None for every other parameter."""
    if _EXPERT_KEY not in name:
        return None
    prefix, rest = name.split(_EXPERT_KEY, 1)
    index, suffix = rest.split(".", 1)
    return ExpertKey(prefix, int(_BLOCK_OF.search(prefix + ".").group(1)), int(index), suffix)


def expert_key(block: int, expert: int, suffix: str) -> str:
    """The name of expert `expert`'s parameter `suffix` in block `block` (the inverse of split_expert_key)."""
    return f"blocks.{block}.mlp.moe.deepspeed_moe.experts{_EXPERT_KEY}{expert}.{suffix}"


def global_name(model: GPT, name: str, ep_rank_of) -> str:
    """A parameter's name with its local expert index replaced by the global expert id."""
    key = split_expert_key(name)
    if key is None:
        return name
    moe = model.blocks[key.block].mlp
    return f"{key.prefix}{_EXPERT_KEY}{ep_rank_of(moe) * moe.num_local_experts + key.expert}.{key.suffix}"


def init_weights(model: GPT, seed: int, ep_rank_of=lambda moe: 0) -> None:
    """Initialise every parameter from a generator seeded by (seed, its global name).

    The result does not depend on the expert-parallel layout: expert 5 of layer 3 gets the same
    weights whether it lives on rank 0 of 1 or rank 1 of 2 (the EP-parity tests rely on this),
    and the experts start different from each other (DeepSpeed deep-copies one expert).
    """
    cfg = model.cfg
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or p.is_meta:
            continue
        seen.add(id(p))
        gname = global_name(model, name, ep_rank_of)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))
        if name.endswith("bias"):
            value = torch.zeros(p.shape)
        elif ".ln_" in name or name.startswith("ln_") or name.endswith(("q_norm.weight", "k_norm.weight")):
            value = torch.ones(p.shape)
        else:
            std = cfg.init_std
            if name.endswith(("out_proj.weight", "fc2.weight")):
                std /= math.sqrt(2 * cfg.layers)  # residual-branch outputs, as GPT-2/Megatron scale them
            value = torch.randn(p.shape, generator=g) * std
        with torch.no_grad():
            p.copy_(value.to(p.dtype))


def param_counts(model: GPT) -> dict[str, int]:
    """Total parameters and those active per token (one routed expert each for top-1, k for top-k).

    Works on the meta device; expert parameters are counted globally (num_experts x one expert)
    whatever the expert-parallel layout.
    """
    total = active = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = split_expert_key(name)
        if key is None:
            total += p.numel()
            active += p.numel()
            continue
        moe = model.blocks[key.block].mlp
        if key.expert == 0:  # count one expert's shape once per layer, scaled to all experts
            total += p.numel() * moe.num_experts
            active += p.numel() * moe.cfg.top_k
    return {"total": total, "active_per_token": active}


if __name__ == "__main__":
    cfg = ModelConfig(vocab_size=512, seq_len=64, layers=4, hidden=64, heads=4, experts=(2, 4), moe_layers=(1, 3),
                      mlp_type="residual", top_k=1, capacity_factor=1.0, eval_capacity_factor=None, min_capacity=4,
                      aux_loss_coef=0.01, ffn_mult=4, dropout=0.0, tie_embeddings=True, init_std=0.02)
    model = GPT(cfg).eval()
    init_weights(model, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    full = model(ids).logits
    cache = KVCache(cfg, batch=2, max_len=16)
    steps = [model(ids[:, :8], cache=cache).logits] + [model(ids[:, t:t + 1], cache=cache).logits for t in range(8, 16)]
    print(param_counts(model), "cache vs full max diff:", (torch.cat(steps, 1) - full).abs().max().item())
