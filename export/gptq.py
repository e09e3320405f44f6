"""Weight quantisation for `moe-pipeline export --quantize`: a model's weights as a package stores them, by GPTQ
calibrated on the run's training split or by round to nearest.

    moe-pipeline export runs/small --quantize int4                        # GPTQ, groups of 128, 128 calibration blocks
    moe-pipeline export runs/small --quantize int8 --quantize-method rtn  # round to nearest, no calibration

    from export.gptq import quantize_model
    stored, report = quantize_model(model, kinds, batches, method="gptq")   # kinds: pipeline.quantize.weight_kinds

GPTQ runs block by block, as GPTQ and llm-compressor's sequential pipeline do: the calibration blocks' hidden states
enter a transformer block, every quantised linear of it records the second moments of its inputs (the Hessian
H = sum x x^T), its weights are quantised (pipeline/quantize.py `gptq`) and replaced by what they stand for, and the
block runs again to give the next block its inputs, so each block is calibrated on the inputs the quantised model
before it produces. The output layer (with `--quantize-head`) is last, on the final norm's output.

Experts: every calibration token goes through every expert of a layer while the routed outputs alone continue (as
llm-compressor calibrates MoE models), so rarely routed experts are calibrated on as many tokens as the busy ones:
fc1 of all the layer's experts shares the layer's input Hessian, fc2 has each expert's own, from its activations on
all tokens. The report counts the tokens the router sent to each expert (an expert no calibration token was routed
to is named: it was quantised from the tokens of others). A weight whose Hessian stays singular after damping, or
that no token reached, falls back to round to nearest, and the report names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from pipeline.model import GPT, _ReferenceDispatch, mlp_activation, rope_tables
from pipeline.quantize import (INT4_GROUP, dequantized, gptq, pack_int4, rounding_error, scale_name, stored_form,
                               values_name)

METHODS = ("gptq", "rtn")


def quantize_model(model: GPT, kinds: dict[str, str], batches: Iterable[torch.Tensor] | None = None,
                   method: str = "gptq", group: int = INT4_GROUP, damp: float = 0.01,
                   progress: Callable[[str], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """({stored name: tensor} of every weight in `kinds` ({parameter name: "int8" | "int4"}), report). `model`: the
    reference-MoE model in fp32, eval mode; with "gptq" its quantised weights are replaced, in place, by what their
    stored form stands for. `batches`: input_ids [B, T] of the calibration blocks (GPTQ only)."""
    if method not in METHODS:
        raise ValueError(f"--quantize-method {method!r}: one of {', '.join(METHODS)}")
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(kinds) - set(params))
    if missing:
        raise ValueError(f"quantize_model: the model has no weight {missing[0]}")
    t0 = time.perf_counter()
    if method == "rtn":
        stored = {}
        for name, kind in kinds.items():
            values, scale = stored_form(params[name].detach(), kind, group)
            stored[values_name(name, kind)], stored[scale_name(name)] = values, scale
        return stored, {"method": "rtn", "seconds": round(time.perf_counter() - t0, 2)}
    ids = [b for b in batches or []]
    if not ids:
        raise ValueError("GPTQ needs calibration blocks (--calibration-blocks at least 1), or --quantize-method rtn")
    run = _Calibration(model, kinds, group, damp)
    with torch.no_grad():
        run.all(ids, progress)
    report = {"method": "gptq", "damp": damp, "calibration_blocks": sum(len(b) for b in ids),
              "calibration_tokens": sum(b.numel() for b in ids), "routed_tokens": run.routed,
              "never_routed": {layer: [e for e, n in enumerate(c) if n == 0] for layer, c in run.routed.items()
                               if any(n == 0 for n in c)},
              "round_to_nearest": run.fallback, "relative_error": run.error,
              "seconds": round(time.perf_counter() - t0, 2)}
    return run.stored, report


class _Calibration:
    """One GPTQ pass over the blocks (see the module docstring)."""

    def __init__(self, model: GPT, kinds: dict[str, str], group: int, damp: float):
        self.model, self.kinds, self.group, self.damp = model, kinds, group, damp
        self.stored: dict[str, torch.Tensor] = {}
        self.fallback: dict[str, str] = {}  # weight -> why it was rounded to nearest
        self.routed: dict[str, list[int]] = {}  # MoE block -> tokens routed to each expert
        self.error: dict[str, float] = {}  # block -> its weights' output error, GPTQ's over round to nearest's
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters(remove_duplicate=False))

    def all(self, ids: list[torch.Tensor], progress) -> None:
        m, cfg = self.model, self.model.cfg
        xs, rope = [], None
        for b in ids:
            x = m.wte(b)
            if cfg.positions == "learned":
                x = x + m.wpe(torch.arange(b.shape[1]))
            else:
                rope = rope_tables(cfg, torch.arange(b.shape[1]), x.dtype)
            xs.append(x)
        for i, block in enumerate(m.blocks):
            prefix = f"blocks.{i}."
            self._quantize(prefix, self._record(prefix, lambda: [block(x, None, i, rope) for x in xs]))
            xs = [block(x, None, i, rope)[0] for x in xs]  # the quantised block's outputs: the next one's inputs
            if progress:
                progress(f"block {i + 1}/{len(m.blocks)}")
        if "lm_head.weight" in self.kinds:
            self._quantize("lm_head.", self._record("lm_head.", lambda: [m.lm_head(m.ln_f(x)) for x in xs]))

    def _record(self, prefix: str, forward) -> dict:
        """Run `forward` with every quantised linear whose weight's name starts with `prefix` and every MoE dispatch
        under it recording its inputs' Hessian: {weight name, or (dispatch, "fc1") / (dispatch, "fc2", expert):
        [H float64, tokens]}."""
        stats: dict = {}
        hooks = []
        for name in self.kinds:
            if name.startswith(prefix) and ".deepspeed_experts." not in name:
                module = self.modules[name[:-len(".weight")]]
                hooks.append(module.register_forward_pre_hook(_accumulating(stats, name)))
        for name, module in self.modules.items():
            if name.startswith(prefix) and isinstance(module, _ReferenceDispatch):
                hooks.append(module.register_forward_pre_hook(_all_experts(stats, name, module)))
                hooks.append(module.register_forward_hook(self._count(name)))
        try:
            forward()
        finally:
            for h in hooks:
                h.remove()
        return stats

    def _count(self, name: str):
        def hook(module, args, out):
            have = self.routed.setdefault(name, [0] * len(out[2]))
            self.routed[name] = [a + b for a, b in zip(have, out[2].tolist())]
        return hook

    def _quantize(self, prefix: str, stats: dict) -> None:
        """Every quantised weight under `prefix` by GPTQ on its Hessian, replaced in the model by what it stands for.
        A layer's experts in two calls: fc1 of all of them as the rows of one weight (one Hessian), fc2 batched."""
        jobs: list[tuple[list[str], torch.Tensor | None]] = []  # (weights of one call, their Hessians [B, I, I])
        for name in self.kinds:
            if name.startswith(prefix) and ".deepspeed_experts." not in name:
                jobs.append(([name], stats[name][0][None] if name in stats else None))
        for d in sorted({k[0] for k in stats if isinstance(k, tuple)}):
            count = len(self.modules[d].experts.deepspeed_experts)
            part = [f"{d}.experts.deepspeed_experts.{e}.fc1.weight" for e in range(count)]
            jobs.append((part, stats[(d, "fc1")][0][None]))  # the rows of all experts' fc1, one call
            part = [f"{d}.experts.deepspeed_experts.{e}.fc2.weight" for e in range(count)]
            jobs.append((part, torch.stack([stats[(d, "fc2", e)][0] for e in range(count)])))
        ours = theirs = 0.0
        for names, H in jobs:
            kind = self.kinds[names[0]]
            W = [self.params[n].detach().double() for n in names]
            rows = len(W) > 1 and H is not None and len(H) == 1  # several weights as the rows of one
            stacked = torch.cat(W)[None] if rows else torch.stack(W)
            try:
                if H is None or not bool((H.diagonal(dim1=1, dim2=2) > 0).any(1).all()):
                    raise torch.linalg.LinAlgError("no calibration token reached it")
                q, scale = gptq(stacked, H, kind, self.group, self.damp)
            except torch.linalg.LinAlgError as err:
                for n in names:
                    self.fallback[n] = str(err).splitlines()[0][:120]
                    self._store(n, kind, *_rtn(self.params[n].detach(), kind, self.group))
                continue
            if rows:
                q, scale = q[0].split([w.shape[0] for w in W]), scale[0].split([w.shape[0] for w in W])
            for b, n in enumerate(names):
                self._store(n, kind, q[b], scale[b])
                h = H[0 if rows else b][None]
                ours += float(rounding_error(W[b][None], q[b][None], scale[b][None], h, self.group))
                near = _rtn(W[b], kind, self.group)
                theirs += float(rounding_error(W[b][None], near[0][None], near[1][None], h, self.group))
        if theirs > 0:
            self.error[prefix.rstrip(".")] = round(ours / theirs, 4)

    def _store(self, name: str, kind: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        p = self.params[name]
        p.data.copy_(dequantized(q, scale, self.group).to(p.dtype))
        self.stored[values_name(name, kind)] = q.contiguous() if kind == "int8" else pack_int4(q)
        self.stored[scale_name(name)] = scale.float().contiguous()


def _accumulating(stats: dict, name: str):
    def hook(module, args):
        _add(stats, name, args[0])
    return hook


def _all_experts(stats: dict, name: str, dispatch: _ReferenceDispatch):
    """All tokens through all experts: fc1's Hessian (the layer's input, shared), each fc2's (its activations)."""
    def hook(module, args):
        x = args[0].detach()
        _add(stats, (name, "fc1"), x)
        for e, expert in enumerate(dispatch.experts.deepspeed_experts):
            _add(stats, (name, "fc2", e), mlp_activation(expert.fc1(x), expert.swiglu))
    return hook


def _add(stats: dict, key, x: torch.Tensor) -> None:
    x = x.detach().reshape(-1, x.shape[-1]).double()
    entry = stats.setdefault(key, [torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64), 0])
    entry[0] += x.T @ x
    entry[1] += x.shape[0]


def _rtn(w: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest as (q int8 values, scale), int4 unpacked."""
    from pipeline.quantize import quantize_int4, quantize_int8

    return quantize_int8(w) if kind == "int8" else quantize_int4(w, group)
