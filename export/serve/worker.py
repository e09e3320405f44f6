"""One serving rank's side of every step: its KV cache, its sequences' samplers, its forwards.

    from export.serve.worker import Worker
    worker = Worker(model, blocks=512, block_size=16, rank=0, single=True)
    results = worker.execute(step)        # a typed Step (export/serve/step.py) -> [RowResult] of this rank's rows

Every rank runs every forward of a step, with its own rows (maybe none: it still joins each MoE layer's
expert exchange, under the placement directive the forward carries). The rank that holds a sequence
projects its rows to the vocabulary and samples them, so only sampled tokens (and log-probabilities
when asked for) travel back to rank 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
import time

import torch

from export.serve.decode import Decoder
from export.serve.kv_cache import PagedCache, served_kv
from export.serve.placement.controller import Directive
from export.serve.placement.exchange import Exchange
from export.serve.grammar import Grammars
from export.serve.sampling import Sampler, edits_of, sample_batch, score_positions, sparse_logits
from export.serve.step import Row, RowResult, Step
from pipeline.model import GPT


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


@dataclass
class Refused:
    """A sequence whose sampler could not be made on this rank (its grammar, say): its rows fail with `error`."""

    error: str


def _rows(idx: list[int]) -> torch.Tensor:
    return torch.tensor(idx, dtype=torch.long)


class Worker:
    """One rank's rows: its `PagedCache`, the sampler of each of its sequences, and the forwards of each step.
    `rank`: this rank's index among the data-parallel ranks (0 when every rank runs the same rows); `single`: one
    process, so an error in a forward fails its rows alone (with several ranks the others may be inside that
    forward's collectives: it is raised). `exchange`: the data-parallel path's expert exchange
    (export/serve/placement/exchange.py), which applies each forward's placement directive."""

    TOPK_SCREEN = 256  # top_k up to which a sampled row's logits come from the head's screen (`HeadScreen.topk`)
    SCORE_ROWS = 256  # prompt positions projected to the vocabulary at once when scoring a prompt (echo + logprobs)

    def __init__(self, model: GPT, blocks: int, block_size: int, rank: int, single: bool,
                 exchange: Exchange | None = None, tokenizer=None):
        self.model, self.rank, self.single, self.exchange = model, rank, single, exchange
        self.vocab = model.cfg.vocab_size
        self.grammars = Grammars(tokenizer, self.vocab) if tokenizer is not None else None  # structured output
        heads, dtype, self.device = served_kv(model)
        self.cache = PagedCache(model.cfg, blocks, block_size, heads, device=self.device, dtype=dtype)
        self.decoder = Decoder.of(model, self.cache)  # decode forwards in few kernel calls (CPU), else None
        self.samplers: dict[int, Sampler | Refused] = {}
        self.forwards = 0
        self.forward_s = 0.0  # seconds in forwards since start (model, projection, sampling)
        self.counts: list = []  # per forward of the last step: (expert counts, per-rank loads or None)

    def execute(self, step: Step) -> list[RowResult]:
        """Run `step`'s forwards with this rank's rows; one result per row that was sampled or scored."""
        for seq in step.freed:
            self.cache.drop(seq)
        for seq in step.ended:
            self.samplers.pop(seq, None)
        for new in step.new:
            if new.rank == self.rank:
                try:
                    self.samplers[new.seq] = Sampler.of(new.sampling, self.vocab,
                                                        self.grammars.matcher if self.grammars else None)
                except Exception as err:  # noqa: BLE001 - this request alone fails
                    self.samplers[new.seq] = Refused(_error(err))
        results: list[RowResult] = []
        self.counts = []
        for fwd in step.forwards:
            rows = fwd.rows[self.rank]
            for row in rows:
                self.cache.extend(row.seq, row.blocks)
            if self.exchange is not None:
                self.exchange.apply(Directive.from_json(fwd.placement) if fwd.placement is not None else None)
                self.exchange.begin([sum(len(row.tokens) for row in rows) for rows in fwd.rows])
            t0 = time.perf_counter()
            try:
                results += self._forward(rows)
            except Exception as err:  # noqa: BLE001
                if not self.single:
                    raise  # the other ranks may be inside this forward's collectives: the engine cannot go on
                results += [RowResult(row.seq, error=_error(err)) for row in rows]
            finally:
                if self.exchange is not None:
                    self.exchange.begin(None)
            self.forward_s += time.perf_counter() - t0
        return results

    @torch.no_grad()
    def _forward(self, rows: list[Row]) -> list[RowResult]:
        self.forwards += 1
        counts = [len(row.tokens) for row in rows]
        T = max(counts, default=1)
        # rows of different lengths (prompt chunks, with or without decode tokens): packed one after another where
        # the cache can (no padding), else a padded batch; few tokens in all (a decode step's rows and short prompts):
        # packed, in one decoder call
        native = T > 1 and self.decoder is not None and self.decoder.packs(counts)
        packed = (len(set(counts)) > 1 or native) and self.cache.packs
        if packed:
            tokens = torch.tensor([t for row in rows for t in row.tokens], dtype=torch.long)[None]  # [1, N]
        elif min(counts, default=T) == T:  # rows of one length (a decode step's): one tensor, not one a row
            tokens = torch.tensor([row.tokens for row in rows], dtype=torch.long).view(len(rows), T)
        else:
            tokens = torch.zeros(len(rows), T, dtype=torch.long)
            for b, row in enumerate(rows):
                tokens[b, :counts[b]] = torch.tensor(row.tokens)
        cache = self.cache.select([r.seq for r in rows], [r.start for r in rows], counts, packed=packed)
        if T == 1 and rows and self.decoder is not None:  # every row one decode token
            out = self.decoder(tokens, cache)
        elif native:
            out = self.decoder.packed(tokens, cache)
        else:
            out = self.model(tokens.to(self.device), cache=cache, hidden_only=True)
        loads = self.exchange.last_loads() if self.exchange is not None else None
        self.counts.append((out.expert_counts, loads))
        offsets = list(itertools.accumulate(counts, initial=0))
        flat = out.hidden[0] if packed else None  # [N, C] packed, else [B, T, C]
        results: dict[int, RowResult] = {}
        for b, row in enumerate(rows):  # prompts being scored: every position, SCORE_ROWS at a time
            if row.score >= 0:
                results[b] = self._score(row, flat[offsets[b]:offsets[b + 1]] if packed else out.hidden[b, :counts[b]])
        sampled = [b for b, row in enumerate(rows) if row.sample]
        if sampled:
            if T == 1 and len(sampled) == len(rows):  # a decode step's rows: each row's one position
                last = out.hidden[:, 0]
            elif packed:  # [n, C]: each row's last position
                last = flat.index_select(0, torch.tensor([offsets[b + 1] - 1 for b in sampled], device=flat.device))
            else:
                last = out.hidden[sampled, [counts[b] - 1 for b in sampled]]  # [n, C]: each row's last real position
            picks = self._sample([rows[b] for b in sampled], last, [b in results for b in sampled])
            for b, pick in zip(sampled, picks):  # a row that failed in scoring keeps that error
                res = results.get(b, RowResult(rows[b].seq))
                if res.error is None:
                    results[b] = dataclasses.replace(res, **pick)
        return [results[b] for b in sorted(results)]

    def _sample(self, rows: list[Row], last: torch.Tensor, scored: list[bool]) -> list[dict]:
        """The next token of each row from its last position's hidden state, last [n, C]: {"token"} (with
        "logprob" and "top" where asked), or {"error"} for a row that fails alone. Plain greedy rows (no
        log-probabilities, nothing that changes their logits, no banned token, not scored) take the argmax through the
        head's screen where it has one (export/serve/kernels/heads.py `HeadScreen`, reading half the head's bytes); rows
        that keep their top_k largest logits (top_k up to TOPK_SCREEN; greedy rows with processors, k = 1) take
        their candidates' exact logits from it too (`HeadScreen.topk`); other sampled rows (no grammar, no
        log-probabilities) are drawn from it where its bounds decide (`HeadScreen.sample`); every other row is
        projected through the head; each group sampled in one batch (export/serve/sampling.py), so sampled rows do not make greedy ones
        read the whole head."""
        samplers = [self.samplers.get(row.seq) for row in rows]
        out: list[dict | None] = [None] * len(rows)
        for j, s in enumerate(samplers):
            if isinstance(s, Refused):
                out[j] = {"error": s.error}
        plain = [j for j, (row, s) in enumerate(zip(rows, samplers)) if isinstance(s, Sampler) and s.plain_greedy
                 and row.banned is None and not scored[j]]
        screen = getattr(self.model.lm_head, "screen", None)
        if plain and screen is not None:
            tokens = screen.argmax(last if len(plain) == len(rows) else last.index_select(0, _rows(plain)))
            for j, t in zip(plain, tokens or ()):
                out[j] = {"token": t}
                samplers[j].took(t)
        # rows that keep their top_k largest logits (and greedy ones with processors: k = 1): the screen's candidates
        # for them, computed exactly, and every other logit -inf (export/serve/kernels/heads.py `HeadScreen.topk`)
        few = [j for j, (row, s) in enumerate(zip(rows, samplers)) if out[j] is None and isinstance(s, Sampler)
               and s.settings.logprobs is None and s.matcher is None and not scored[j]
               and (s.greedy or 0 < s.settings.top_k <= self.TOPK_SCREEN)]
        if few and screen is not None and hasattr(screen, "topk"):
            got = screen.topk(last if len(few) == len(rows) else last.index_select(0, _rows(few)),
                              [1 if samplers[j].greedy else samplers[j].settings.top_k for j in few],
                              [samplers[j].edited(rows[j].banned) for j in few])
            if got is not None:
                self._pick(few, sparse_logits(*got, screen.served.weight.shape[0]), samplers, rows, out)
        # other sampled rows (temperature, min_p, top_p, the processors; no grammar): drawn from the screen where its
        # bounds decide (export/serve/kernels/heads.py `HeadScreen.sample`), the rest through the whole head
        free = [j for j, (row, s) in enumerate(zip(rows, samplers)) if out[j] is None and isinstance(s, Sampler)
                and not s.greedy and s.matcher is None and s.settings.logprobs is None and not scored[j]
                and not 0 < s.settings.top_k < self.vocab]
        if free and screen is not None and hasattr(screen, "sample"):
            sub = [samplers[j] for j in free]
            got = screen.sample(last if len(free) == len(rows) else last.index_select(0, _rows(free)),
                                [s.settings.temperature for s in sub], [s.settings.top_p for s in sub],
                                [s.settings.min_p for s in sub], [s.seed for s in sub], [s.sampled for s in sub],
                                edits_of(sub, [rows[j].banned for j in free], self.vocab))
            for j, t in zip(free, got or ()):
                if t >= 0:
                    out[j] = {"token": t}
                    samplers[j].took(t)
        rest = [j for j in range(len(rows)) if out[j] is None]
        if rest:
            raw = self._project(last if len(rest) == len(rows) else last.index_select(0, _rows(rest)), fp32=False)
            self._pick(rest, raw, samplers, rows, out)
        for j, s in enumerate(samplers):  # a grammar that refused the token (or could not say what may come next)
            matcher = getattr(s, "matcher", None)
            if matcher is not None and matcher.error is not None:
                out[j] = {"error": f"the request's grammar: {matcher.error}"}
        return out

    @staticmethod
    def _pick(js: list[int], logits: torch.Tensor, samplers: list, rows: list[Row], out: list) -> None:
        """Rows js sampled from their logits [len(js), V] in one batch into out; where that fails, row by row, a row
        that fails alone getting {"error"}."""
        try:
            picks = sample_batch([samplers[j] for j in js], logits, [rows[j].banned for j in js])
        except Exception:  # noqa: BLE001 - find the rows that fail, and sample the others
            picks = []
            for i, j in enumerate(js):
                try:
                    picks += sample_batch([samplers[j]], logits[i:i + 1], [rows[j].banned])
                except Exception as err:  # noqa: BLE001 - this request alone fails
                    picks.append({"error": _error(err)})
        for j, pick in zip(js, picks):
            out[j] = pick

    def _score(self, row: Row, h: torch.Tensor) -> RowResult:
        """The log-probabilities of the row's prompt targets at each of its positions (h [n, C])."""
        scores, error = [], None
        for lo in range(0, h.shape[0], self.SCORE_ROWS):  # the same chunks on every rank (a sliced head is collective)
            logits = self._project(h[lo:lo + self.SCORE_ROWS])  # [n, V]
            if error is None:
                try:
                    scores += score_positions(logits, row.targets[lo:lo + self.SCORE_ROWS],
                                              self.samplers[row.seq].settings.logprobs or 0)
                except Exception as err:  # noqa: BLE001 - this request alone fails
                    error = _error(err)
        if error is not None:
            return RowResult(row.seq, error=error)
        return RowResult(row.seq, score_start=row.start, scores=scores)

    def _project(self, h: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits [n, V] of hidden states [n, C] (as [1, n, C]: DeepSpeed's sliced output layer takes 3-D input), in
        fp32 or, `fp32` False, in the head's own dtype."""
        logits = self.model.lm_head(h[None])[0]
        return logits.float() if fp32 else logits
