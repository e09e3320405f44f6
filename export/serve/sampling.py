"""Sampling on the rank that holds a sequence: greedy or top-p, seeded per request; log-probabilities and scores.

    from export.serve.sampling import Sampler, sample
    sampler = Sampler.of(step_sampling)          # a request's settings as its step carries them (export/serve/step.py)
    token = sample(logits, sampler, sampler.generator)

Every rank samples its own sequences (the sampled tokens travel back to rank 0, not the logits), so a
request's generator lives on its rank from admission to its end, over preemptions too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from export.serve.request import GREEDY_BELOW


@dataclass
class Sampler:
    """What the rank that holds a sequence needs to sample it: the request's sampling settings and its generator."""

    temperature: float
    top_p: float
    logprobs: int | None
    generator: torch.Generator | None

    @classmethod
    def of(cls, sampling) -> "Sampler":
        """From a step's `Sampling` (export/serve/step.py): a seed makes the request's own generator."""
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        return cls(sampling.temperature, sampling.top_p, sampling.logprobs, gen)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no log-probabilities asked: the token is the argmax, nothing else (batched by the worker)."""
        return self.temperature < GREEDY_BELOW and self.logprobs is None


def _top(logp: torch.Tensor, k: int) -> list[list]:
    """The k most probable tokens and their log-probabilities, as [[id, logprob]] (JSON-ready)."""
    if k <= 0:
        return []
    vals, idx = logp.topk(k)
    return [list(pair) for pair in zip(idx.tolist(), vals.tolist())]  # one read each from the device, not one a value


def score_positions(logits: torch.Tensor, targets: list[int], k: int) -> list[list]:
    """[[log-probability of targets[i] at position i, its top-k alternatives]] for logits [n, V] (n >= len(targets)),
    read from the device in one copy per kind (not one per position: each is a host sync on a GPU)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    n = len(targets)
    rows = torch.arange(n, device=logp.device)
    chosen = logp[rows, torch.tensor(targets, dtype=torch.long, device=logp.device)].tolist()
    if k <= 0:
        return [[c, []] for c in chosen]
    vals, idx = logp[:n].topk(k, dim=-1)
    return [[c, [list(pair) for pair in zip(i, v)]] for c, i, v in zip(chosen, idx.tolist(), vals.tolist())]


def sample(logits: torch.Tensor, params, generator: torch.Generator | None) -> int:
    """One token from fp32 logits [V] (`params`: temperature, top_p): argmax at temperature 0 (or below
    GREEDY_BELOW), else top-p nucleus sampling."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = F.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sample_row(sampler: Sampler, logits: torch.Tensor, no_token: int | None = None) -> dict:
    """{"token"} (and {"logprob", "top"} when the request asks for log-probabilities) of one row's logits [V];
    `no_token`: a token that may not be sampled (the end token before min_tokens: its logit is -inf)."""
    if no_token is not None and 0 <= no_token < logits.shape[-1]:
        logits = logits.clone()
        logits[no_token] = float("-inf")
    token = sample(logits, sampler, sampler.generator)
    if sampler.logprobs is None:
        return {"token": token}
    logp = F.log_softmax(logits, dim=-1)
    return {"token": token, "logprob": float(logp[token]), "top": _top(logp, sampler.logprobs)}
