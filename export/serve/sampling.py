"""Sampling on the rank that holds a sequence: every sampled row of a step in one batch, whatever each asks for.

    from export.serve.sampling import Sampler, sample_batch
    samplers = [Sampler.of(new.sampling) for new in step.new]    # a request's settings as its step carries them
    picks = sample_batch(samplers, logits, banned=[None] * len(samplers))   # logits [n, V] -> [{"token": ...}]

As vLLM v1's `Sampler`, in this order: the processors that change the logits (`logit_bias`, the end token before
`min_tokens`, a grammar's allowed tokens, then the penalties: `repetition_penalty` over prompt and output,
`frequency_penalty` and `presence_penalty` over the output), greedy rows' argmax, then temperature, `min_p`,
`top_k`, `top_p`, and one draw. Each step is one tensor op over the rows that use it, none over the rest, and none
a row: no full sort of the vocabulary (top-k by partial selection, top-p by exact rejection from the distribution,
as FlashInfer's sorting-free sampler: draw, accept if the token is inside the nucleus, else draw again above it).

Each draw is the Gumbel-max trick (vLLM's exponential race): the kept token with the largest logit / temperature +
g[t], g a Gumbel number that a counter-based hash makes of the request's seed, the number of tokens sampled before
and the token (`gumbel_noise`): the same seed gives the same tokens in any batch, on any rank, after a preemption,
and a request with no seed gets one drawn at admission (`Request.seed`). A token's draw depends on its own logit
alone, so the head's int8 screen can draw without most logits (export/serve/kernels/heads.py `HeadScreen.sample`).
Every rank samples its own sequences: the sampled tokens travel back to rank 0, not the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from export.serve.request import GREEDY_BELOW


@dataclass
class Sampler:
    """What the rank that holds a sequence needs to sample it: its settings (a step's `Sampling`,
    export/serve/step.py), its seed, the tokens it sampled so far (penalties, the draw's counter), its grammar."""

    settings: object  # export/serve/step.py Sampling
    seed: int = 0
    sampled: int = 0  # tokens sampled so far: the counter of the draw's hash
    counts: dict | None = None  # {token: times sampled} where a penalty needs them
    prompt: torch.Tensor | None = None  # the prompt's distinct tokens (repetition_penalty)
    bias: tuple | None = None  # (token ids, biases) of logit_bias
    matcher: object = None  # the grammar's matcher (export/serve/grammar.py `Matcher`), None without one

    @classmethod
    def of(cls, sampling, vocab: int, grammar=None) -> "Sampler":
        """From a step's `Sampling`; `vocab`: the logits' width; `grammar`: a callable that makes the matcher of
        `sampling.grammar` (export/serve/grammar.py `Grammars.matcher`)."""
        s = sampling
        out = cls(s, seed=(s.seed or 0) & ((1 << 64) - 1))
        if s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0:
            out.counts = {}
        if s.repetition_penalty != 1.0:
            out.prompt = torch.tensor(sorted({t for t in (s.prompt or ()) if 0 <= t < vocab}), dtype=torch.long)
        if s.logit_bias:
            merged: dict[int, float] = {}
            for t, b in s.logit_bias:
                if 0 <= int(t) < vocab:
                    merged[int(t)] = float(b)
            out.bias = (torch.tensor(list(merged), dtype=torch.long),
                        torch.tensor(list(merged.values()), dtype=torch.float32))
        if s.grammar is not None:
            if grammar is None:
                raise ValueError("this rank has no tokenizer to follow a grammar with")
            out.matcher = grammar(s.grammar)
        return out

    @property
    def greedy(self) -> bool:
        return self.settings.temperature < GREEDY_BELOW

    @property
    def processed(self) -> bool:
        """Whether anything changes its logits before the choice (bias, penalties, grammar)."""
        return self.counts is not None or self.bias is not None or self.matcher is not None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else asked: the token is the argmax of the head's own logits (the worker's screen)."""
        return self.greedy and self.settings.logprobs is None and not self.processed

    def edited(self, banned: list[int] | None) -> list[int]:
        """The tokens whose logits its processors change this step (logit_bias, the penalties' tokens, `banned`)."""
        out = list(banned or ())
        if self.bias is not None:
            out += self.bias[0].tolist()
        if self.counts:
            out += list(self.counts)
        if self.prompt is not None:
            out += self.prompt.tolist()
        return out

    def took(self, token: int) -> None:
        """`token` was sampled for it: count it, advance the grammar."""
        self.sampled += 1
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.matcher is not None:
            self.matcher.consume(token)


# -- the draw's random numbers -----------------------------------------------------------------------------------

def _row_keys(seeds: list[int], counters: list[int]) -> np.ndarray:
    """Each row's key, splitmix64 of (seed, counter) [n, 1] uint64, as csrc/draws.h `row_key`."""
    with np.errstate(over="ignore"):
        z = (np.array(seeds, dtype=np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)
             + np.array(counters, dtype=np.uint64)[:, None] * np.uint64(0xD1B54A32D192ED03)
             + np.uint64(0x632BE59BD9B4E019))  # so that (0, 0) is not 0
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(mult)
        return z ^ (z >> np.uint64(31))


def gumbel_noise(seeds: list[int], counters: list[int], V: int) -> torch.Tensor:
    """The draws' Gumbel numbers [n, V] fp32: g[i, t] = -ln(-ln(u)), u = (2 k + 1) / 2^24 with k the top 23 bits of
    murmur3's 32-bit finalizer of (key >> 32) xor (key's low half + t x 0x9E3779B9), key = splitmix64(seeds[i],
    counters[i]). A function of those three alone, so a row's draw does not depend on the other rows of its batch
    (csrc/draws.h `gumbel` is the same, its logarithms polynomial: they agree to ~1e-7)."""
    key = _row_keys(seeds, counters)  # [n, 1]
    with np.errstate(over="ignore"):
        x = (key >> np.uint64(32)).astype(np.uint32) ^ (
            (key & np.uint64(0xFFFFFFFF)).astype(np.uint32) + np.arange(V, dtype=np.uint32)[None] * np.uint32(0x9E3779B9))
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
    u = torch.from_numpy(((x >> np.uint32(9)).astype(np.int64) * 2 + 1).astype(np.float32) * np.float32(2.0 ** -24))
    return -torch.log(-torch.log(u))


def _top_p(a: torch.Tensor, kept: torch.Tensor, g: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """One token per row of scaled logits a [n, V] from its nucleus among the `kept` tokens: the smallest set of the
    largest whose weight exp(a - max) reaches top_p [n] of the kept total, drawn by the Gumbel-max trick with g [n,
    V]. Exact, with no sort: the kept tokens' largest a + g is a draw from them; it is inside the nucleus iff the
    weight above it is below top_p x the total; outside, every token as low is outside too, and the draw is made
    again over the tokens above it alone (csrc/sampling.cpp `choose`)."""
    key = torch.where(kept, a + g, float("-inf"))
    tokens = key.argmax(-1)  # the first largest
    todo = torch.nonzero(top_p < 1.0).flatten()
    if not todo.numel():
        return tokens
    w = torch.where(kept, torch.exp(a - a.amax(-1, keepdim=True)), 0.0).double()
    total = w.sum(-1)
    for _ in range(64):
        at = a[todo].gather(1, tokens[todo, None])  # [m, 1]
        above = a[todo] > at
        out = torch.where(above, w[todo], 0.0).sum(-1) >= top_p[todo].double() * total[todo]
        if not bool(out.any()):
            break
        todo, above = todo[out], above[out]
        redrawn = torch.where(kept[todo] & above, a[todo] + g[todo], float("-inf"))
        found = redrawn.amax(-1) > float("-inf")
        tokens[todo[found]] = redrawn[found].argmax(-1)
        todo = todo[found]
        if not todo.numel():
            break
    return tokens


# -- the batch ----------------------------------------------------------------------------------------------------

def _index(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _distinct(a: np.ndarray) -> np.ndarray:
    """a's distinct values, ascending (by a sort: numpy's hashed `unique` costs ~10x more on these few thousand)."""
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if a.size else a


@dataclass
class Edits:
    """What the processors do to a batch's logits, as a transform of each (row, token) pair they touch: row i's
    tokens are tokens[offsets[i]:offsets[i + 1]] (ascending), each logit v becoming ((v + bias) repetition-penalized
    by rep) - sub: v + bias, then v / rep where positive, else v * rep, then v - sub, in fp32 (a banned token's bias
    -inf). `values` applies it to a batch's logits; csrc/heads.cpp `screened_sample` applies the same ops to the exact
    logits it computes (the same bits)."""

    offsets: torch.Tensor  # [n + 1] int64
    tokens: torch.Tensor  # [E] int64
    bias: np.ndarray  # [E] fp32 (0: none; -inf: banned)
    rep: np.ndarray  # [E] fp32 (1: none)
    sub: np.ndarray  # [E] fp32: frequency_penalty x count + presence_penalty (0: none)

    def values(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited logits [E] fp32 of logits [n, V]."""
        if not self.tokens.numel():
            return torch.empty(0)
        rows = np.repeat(np.arange(self.offsets.numel() - 1), np.diff(self.offsets.numpy()))
        v = logits[torch.from_numpy(rows), self.tokens].float().numpy() + self.bias
        v = np.where(v > 0, v / self.rep, v * self.rep).astype(np.float32)
        return torch.from_numpy(v - self.sub)


def edits_of(samplers: list[Sampler], banned: list[list[int] | None], V: int) -> Edits:
    """The processors' transforms of rows [n] of V logits (`Edits`), in vLLM's order: logit_bias added, the banned
    token -inf, then repetition_penalty over the prompt's and output's tokens (a positive logit divided by it,
    another multiplied), then frequency_penalty x each output token's count and presence_penalty once per output
    token subtracted. Only the (row, token) pairs they touch, never a row of the vocabulary; as flat index arrays (row
    x V + token), in numpy (a few arrays a row with a processor, one op per kind over all of them)."""
    n = len(samplers)
    bias, biases, rep, out, count = [], [], [], [], []
    for i, s in enumerate(samplers):  # rows with a processor only
        base = i * V
        if s.bias is not None:
            bias.append(s.bias[0].numpy() + base)
            biases.append(s.bias[1].numpy())
        if s.counts:
            keys = np.fromiter(s.counts.keys(), np.int64, len(s.counts)) + base
            out.append(keys)
            count.append(np.fromiter(s.counts.values(), np.float32, len(s.counts)))
            if s.prompt is not None:
                rep.append(keys)
        if s.prompt is not None and s.prompt.numel():
            rep.append(s.prompt.numpy() + base)
    ban = np.array([i * V + t for i, ts in enumerate(banned) for t in ts or () if 0 <= t < V], dtype=np.int64)
    cat = lambda parts, dtype=np.int64: np.concatenate(parts) if parts else np.empty(0, dtype)  # noqa: E731
    bias, rep, out = cat(bias), cat(rep), cat(out)  # rep may repeat a token (prompt and output): marked once below
    keys = _distinct(np.concatenate([bias, ban, rep, out]))
    E = keys.size
    add, factor, less = np.zeros(E, np.float32), np.ones(E, np.float32), np.zeros(E, np.float32)
    setting = lambda name: np.array([getattr(s.settings, name) for s in samplers], dtype=np.float32)  # noqa: E731
    if bias.size:  # one bias a token a row (Sampler.of merged them)
        add[np.searchsorted(keys, bias)] = cat(biases, np.float32)
    if ban.size:
        add[np.searchsorted(keys, ban)] = -np.inf
    if rep.size:
        j = np.searchsorted(keys, rep)
        factor[j] = setting("repetition_penalty")[keys[j] // V]
    if out.size:
        j, row = np.searchsorted(keys, out), out // V
        less[j] = setting("frequency_penalty")[row] * cat(count, np.float32) + setting("presence_penalty")[row]
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = torch.from_numpy(np.bincount(keys // V, minlength=n)).cumsum(0)
    return Edits(offsets, torch.from_numpy(keys % V), add, factor, less)


def _edits(samplers: list[Sampler], banned: list[list[int] | None], logits: torch.Tensor):
    """The logits the processors change, as (offsets [n + 1], tokens [E], values [E] fp32): row i's edited tokens are
    tokens[offsets[i]:offsets[i + 1]] (`edits_of`, applied to logits [n, V])."""
    e = edits_of(samplers, banned, logits.shape[1])
    return e.offsets, e.tokens, e.values(logits)


def _allowed(samplers: list[Sampler], V: int) -> torch.Tensor:
    """The grammar rows' allowed tokens as bitmasks [n, ceil(V / 32)] int32 (bit t % 32 of word t // 32; every bit
    set in the other rows), or an empty tensor where no row follows a grammar."""
    ruled = [i for i, s in enumerate(samplers) if s.matcher is not None]
    if not ruled:
        return torch.empty(0, dtype=torch.int32)
    mask = torch.full((len(samplers), (V + 31) // 32), -1, dtype=torch.int32)
    for i in ruled:
        samplers[i].matcher.fill(mask[i])
    return mask


def _unpack(mask: torch.Tensor, V: int) -> torch.Tensor:
    """Bitmasks [n, W] int32 -> allowed [n, V] bool."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :V].astype(bool))


def _scaled_and_cut(x: torch.Tensor, samplers: list[Sampler]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits x [n, V] (sampled rows) times 1 / temperature (in fp32, as csrc/sampling.cpp) and the tokens min_p and
    top_k keep, in vLLM's order: a >= max + ln(min_p), then a >= the k-th largest -> (a, kept [n, V] bool)."""
    inv_t = 1.0 / torch.tensor([s.settings.temperature for s in samplers], dtype=torch.float32)
    a = x.float() * inv_t.to(x.device)[:, None]
    a = a.masked_fill(a.isnan(), float("-inf"))
    cut = torch.full((x.shape[0], 1), float("-inf"), device=x.device)
    min_p = torch.tensor([s.settings.min_p for s in samplers], dtype=torch.float32)
    if bool((min_p > 0).any()):  # tokens less probable than min_p x the most probable one's (vLLM's order: first)
        m = a.amax(-1, keepdim=True)
        at_p = m + torch.log(min_p.clamp(min=1e-38)).to(x.device)[:, None]
        cut = torch.where((min_p > 0).to(x.device)[:, None], at_p, cut)
    top_k = torch.tensor([s.settings.top_k for s in samplers])
    top_k = torch.where((top_k <= 0) | (top_k > x.shape[1]), x.shape[1], top_k)
    if bool((top_k < x.shape[1]).any()):  # the k-th largest logit by partial selection, at the largest k asked
        kth = a.topk(int(top_k[top_k < x.shape[1]].max()), dim=-1, sorted=True).values
        at_k = kth.gather(1, (top_k.clamp(max=kth.shape[1]) - 1).to(x.device)[:, None])
        cut = torch.where((top_k < x.shape[1]).to(x.device)[:, None], torch.maximum(cut, at_k), cut)
    return a, (a >= cut) & (a > float("-inf"))


def _reference(x: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """Tokens [n] of logits x [n, V] in tensor ops: greedy rows' argmax, the others' temperature, min_p, top_k,
    top_p and draw. The spec of csrc/sampling.cpp, and the path where that kernel is not built (another device)."""
    n = x.shape[0]
    tokens = torch.empty(n, dtype=torch.long, device=x.device)
    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy:
        g = _index(greedy)
        tokens[g] = x.index_select(0, g).argmax(-1)
    drawn = [i for i, s in enumerate(samplers) if not s.greedy]
    if drawn:
        d = _index(drawn)
        sub = [samplers[i] for i in drawn]
        a, kept = _scaled_and_cut(x.index_select(0, d), sub)
        noise = gumbel_noise([s.seed for s in sub], [s.sampled for s in sub], x.shape[1]).to(x.device)
        top_p = torch.tensor([s.settings.top_p for s in sub], dtype=torch.float32, device=x.device)
        picked = _top_p(a, kept, noise, top_p)
        none = ~kept.any(-1)  # every token banned: token 0, as the kernel
        tokens[d] = torch.where(none, 0, picked)
    return tokens


def _choose(logits: torch.Tensor, samplers: list[Sampler], edits, allowed: torch.Tensor, fast: bool) -> torch.Tensor:
    """Tokens [n] of logits [n, V] edited by `edits` (`_edits`) and restricted to `allowed` (`_allowed`):
    csrc/sampling.cpp's `sample_rows` on the CPU where the kernel is built, else `_reference` on an fp32 copy."""
    from export.serve import kernels

    n, V = logits.shape
    offsets, tokens, values = edits
    gemv = kernels.kernel() if fast and logits.device.type == "cpu" and logits.dtype in (torch.float32,
                                                                                         torch.bfloat16) else None
    if gemv is None or not hasattr(gemv, "sample_rows"):
        x = logits.float().clone()
        if tokens.numel():
            x[torch.repeat_interleave(torch.arange(n), offsets.diff()), tokens] = values.to(x.device)
        if allowed.numel():
            x.masked_fill_(~_unpack(allowed, V).to(x.device), float("-inf"))
        return _reference(x, samplers)
    setting = lambda name, dtype: torch.tensor([getattr(s.settings, name) for s in samplers], dtype=dtype)  # noqa: E731
    seeds = torch.from_numpy(np.array([s.seed for s in samplers], dtype=np.uint64).view(np.int64))
    return gemv.sample_rows(logits.contiguous(), torch.arange(n), setting("temperature", torch.float32),
                            setting("top_k", torch.long), setting("top_p", torch.float32),
                            setting("min_p", torch.float32), seeds,
                            torch.tensor([s.sampled for s in samplers], dtype=torch.long), offsets, tokens,
                            values.float(), allowed)


def sample_batch(samplers: list[Sampler], logits: torch.Tensor, banned: list[list[int] | None] | None = None,
                 fast: bool = True) -> list[dict]:
    """{"token"} (and {"logprob", "top"} where the request asks for log-probabilities) for each row of logits [n, V]
    (the head's dtype, read as it is), row i sampled as `samplers[i]` says; `banned[i]`: tokens row i may not take
    (the end and stop tokens before min_tokens). Log-probabilities are of the head's own logits, as vLLM's default
    (`raw_logprobs`). `fast` False: the tensor-op reference instead of csrc/sampling.cpp."""
    n, V = logits.shape
    logits = logits.contiguous()
    banned = banned if banned is not None else [None] * n
    edits = _edits(samplers, banned, logits)
    tokens = _choose(logits, samplers, edits, _allowed(samplers, V), fast)
    picked = tokens.tolist()
    out = [{"token": t} for t in picked]
    asked = [i for i, s in enumerate(samplers) if s.settings.logprobs is not None]
    if asked:
        a = _index(asked)
        logp = F.log_softmax(logits.index_select(0, a).float(), dim=-1)
        chosen = logp.gather(1, tokens[a][:, None])[:, 0].tolist()
        k = max(samplers[i].settings.logprobs for i in asked)
        vals, idx = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        vals, idx = vals.tolist(), idx.tolist()
        for j, i in enumerate(asked):
            ki = samplers[i].settings.logprobs
            out[i] = {"token": picked[i], "logprob": chosen[j],
                      "top": [list(pair) for pair in zip(idx[j][:ki], vals[j][:ki])]}
    for s, t in zip(samplers, picked):
        s.took(t)
    return out


def sparse_logits(offsets: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, V: int) -> torch.Tensor:
    """Logits [n, V] fp32 of a screen's candidates (export/serve/kernels/heads.py `HeadScreen.topk`: row i's tokens and
    values at offsets[i]:offsets[i + 1]), every other one -inf."""
    n = offsets.numel() - 1
    out = torch.full((n, V), float("-inf"))
    out[torch.repeat_interleave(torch.arange(n), offsets.diff()), tokens] = values
    return out


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
