"""The serving engine behind `moe-pipeline serve`: continuous batching, data parallel over the ranks.

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, SamplingParams
    engine = Engine.from_config(ServeConfig(package="runs/tiny/package"))
    req = engine.submit(engine.encode("And God said"), SamplingParams(max_tokens=16))
    while not req.finished:
        engine.step()
    print(engine.decode(req.generated))

Rank 0 schedules (`Engine.step`), every rank computes (`Worker.execute`). A step is at most two
forwards on every rank: first the prefill chunks, then one decode token of every running sequence.

  * Sequences are data parallel: each request is assigned, when a row frees up, to the rank with the
    fewest running tokens, and lives in that rank's `SlotCache` (its own KV-cache rows) until it ends.
    Each forward, every rank runs its own rows; a rank with none this step runs an empty batch, so
    that it still joins the expert all-to-all of every MoE layer (export/serve/placement.py). The
    owner projects its rows to the vocabulary and samples them (sampling parameters and seeded
    generators travel with the admission); the sampled tokens and log-probabilities come back to
    rank 0 in one gather, where the stop conditions, streaming and the HTTP answers are.
  * Batched and chunked prefill: several waiting prompts are prefilled in one forward (a padded
    batch with per-row positions; the padding is never routed to an expert, `Cache.token_mask`),
    and each rank's tokens in a step are bounded by `max_batched_tokens`, decode tokens first: a
    prompt longer than what is left is cut into chunks over several steps, so that it cannot stall
    everybody's decoding (vLLM's chunked prefill). A prompt's last chunk samples its first token.
  * Layouts with tensor slicing or expert slicing (`--tp-size`, `--ep-size` below the rank count)
    are one data-parallel group: every rank runs rank 0's rows (DeepSpeed's inference engine,
    export/inference.py), as before this design.

`SlotCache` is a KV cache with one row per sequence and a length per row, so rows of different
lengths batch together: keys are written at each row's own positions, each query sees its row's
keys up to its own position (an explicit attention mask), positions are per row. It implements
pipeline/model.py's cache protocol (`Cache`), as the model's own `KVCache` does. On the CPU a decode
forward (one new token a row) attends in csrc/gemv.cpp's kernel (`SlotCache.attend`: the rows read
in place, no gather, no mask), a prefill through scaled_dot_product_attention.

A request's text grows by incremental detokenization (`Detokenizer`: tokenizers' DecodeStream, as
vLLM), not by decoding all its tokens again every step.

The ranks' messages (one `Step` broadcast per step, the results gathered back) are in
export/serve/ranks.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from export.serve import linears
from export.serve import ranks as rank_msgs
from export.serve.config import ServeConfig
from pipeline.model import GPT, Cache, ModelConfig


# -- the cache ---------------------------------------------------------------------------------------

class SlotCache(Cache):
    """Per-layer K/V buffers [slots, heads, max_len, head_dim] with a length per slot (row).

    Lengths are Python ints (no device sync to read them). A forward over some rows (`select`) may give
    each row its own count of new tokens (a padded batch: batched prefill); keys are read only up to the
    longest row, and a single row needs no mask beyond causality. Which rows are free is the scheduler's
    business (rank 0), not the cache's."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int | None = None, device=None, dtype=torch.float32,
                 heads: int | None = None):
        self.max_len = max_len or cfg.seq_len
        # heads: this rank's (a 1/tp slice under tensor slicing)
        shape = (slots, heads or cfg.kv_group_heads, self.max_len, cfg.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.device = device
        self.lens = [0] * slots
        self.select([])
        # one new token a row on the CPU: csrc/gemv.cpp's decode attention (stores the token's key and value
        # and attends over the row's keys, heads split between threads): ~10x faster than SDPA's flash kernel
        # in bf16 at a few hundred keys, 2x in fp32
        cpu = torch.device(device if device is not None else "cpu").type == "cpu"
        self._kernel = linears.kernel() if cpu and linears.available(dtype, torch.device("cpu")) else None

    def select(self, rows: list[int], counts: list[int] | None = None) -> "SlotCache":
        """The rows of the next forward, in the order of its batch; `counts`: each row's real new tokens
        (None: all of the forward's T)."""
        self.rows = list(rows)
        self.counts = list(counts) if counts is not None else None
        self._start = [self.lens[r] for r in self.rows]
        self._rows_t = torch.tensor(self.rows, dtype=torch.long, device=self.device)
        self._span = (self.rows[0], self.rows[0] + len(self.rows)) if self.rows and \
            self.rows == list(range(self.rows[0], self.rows[0] + len(self.rows))) else None
        self._pos: dict[int, torch.Tensor] = {}
        self._padded = self.counts is not None and len(set(self.counts)) > 1
        return self

    # pipeline.model.Cache
    @property
    def length(self) -> int:
        """For the model's context check and the keys read: the longest selected row before this forward, or
        with per-row counts, the longest row after it less the forward's T (so length + T is that row's end)."""
        if self._padded:
            return max(s + n for s, n in zip(self._start, self.counts)) - max(self.counts)
        return max(self._start, default=0)

    def advance(self, T: int) -> None:  # after a forward of T tokens: every selected row is its count longer
        for i, r in enumerate(self.rows):
            self.lens[r] += self.counts[i] if self.counts is not None else T
        self._start = [self.lens[r] for r in self.rows]
        self._pos = {}
        self._padded = False
        self.counts = None

    def positions(self, T: int) -> torch.Tensor:
        if T not in self._pos:
            start = torch.tensor(self._start, dtype=torch.long, device=self.device)
            pos = start[:, None] + torch.arange(T, device=self.device)  # [B, T]
            self._pos[T] = pos.clamp_max(self.max_len - 1) if self._padded else pos  # padding stays in range
        return self._pos[T]

    def token_mask(self, T: int) -> torch.Tensor | None:
        if not self._padded:
            return None
        counts = torch.tensor(self.counts, device=self.device)
        return torch.arange(T, device=self.device)[None, :] < counts[:, None]  # [B, T]

    def _room(self, T: int) -> int:
        """The keys the longest row has after a forward of T tokens; refused past the cache's length."""
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {end} needed")
        return end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        end = self._room(T)
        K, V = self.k[layer], self.v[layer]
        if len(self.rows) == 1:  # one row: plain slices, no gather
            r, p = self.rows[0], self._start[0]
            K[r, :, p:p + T] = k[0]
            V[r, :, p:p + T] = v[0]
            return K[r:r + 1, :, :end], V[r:r + 1, :, :end]
        pos = self.positions(T)  # [B, T]
        rows = self._rows_t[:, None].expand_as(pos)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, H, D]
        if self._padded:  # only the real tokens are written: padding must not overwrite a row's keys
            real = self.token_mask(T)
            rows, pos, kt, vt = rows[real], pos[real], kt[real], vt[real]
        # written at (row, :, position, :)
        K[rows, :, pos] = kt
        V[rows, :, pos] = vt
        if self._span is not None:  # consecutive rows: a view
            a, b = self._span
            return K[a:b, :, :end], V[a:b, :, :end]
        return K[self._rows_t, :, :end], V[self._rows_t, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        B, H, T, D = q.shape
        K = self.k[layer]
        if self._kernel is None or T != 1 or self._padded or B == 0 or q.dtype != K.dtype:
            return None
        self._room(T)
        y = self._kernel.decode_attention(q.reshape(B, H, D).contiguous(), k.reshape(B, -1, D).contiguous(),
                                          v.reshape(B, -1, D).contiguous(), K, self.v[layer], self.rows, self._start)
        return y.view(B, H, 1, D)

    def attention_mask(self, T: int) -> torch.Tensor | None:
        """[B, 1, T, keys]: query t of a row sees that row's keys at positions <= its own. None for one
        row: the model's causal masking is then exact."""
        if len(self.rows) == 1:
            return None
        keys = torch.arange(self.length + T, device=self.device)
        return (keys[None, None, :] <= self.positions(T)[:, :, None])[:, None]


# -- requests ----------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # None is taken as []
    logprobs: int | None = None  # top alternatives per token (OpenAI completions' `logprobs`)
    echo: bool = False  # also return the prompt (and its tokens' log-probs with `logprobs`)


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)  # of each generated token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # echo: None for the first token
    prompt_top: list[dict[int, float] | None] = field(default_factory=list)
    slot: int | None = None  # its row in its rank's SlotCache
    rank: int | None = None  # the data-parallel rank that holds its row
    prefilled: int = 0  # prompt tokens already in its row (chunked prefill)
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""  # generated text so far, cut at a stop string when one matched
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    done_at: float | None = None
    generator: torch.Generator | None = None
    stream: object = None  # its Detokenizer's state: a tokenizers DecodeStream and the text it gave so far
    on_token: object = None  # callback(request) after every new token (streaming), from the engine's thread
    on_finish: object = None

    def add_prompt_scores(self, start: int, scores: list) -> None:
        """echo + logprobs, one chunk of prompt positions at a time: `scores` [[log-probability, top alternatives
        as [[id, logprob]]]] of the prompt tokens start+1.. (`score_positions` on the rank that ran them)."""
        if start == 0:
            self.prompt_logprobs, self.prompt_top = [None], [None]
        for lp, top in scores:
            self.prompt_logprobs.append(lp)
            self.prompt_top.append({int(i): v for i, v in top})

    def take(self, token: int, logprob: float | None, top, eos: int | None, decode) -> bool:
        """The token sampled for this request (by the rank that holds its row), unless max_tokens is already
        reached (max_tokens=0: nothing to sample). True if the token was taken."""
        if len(self.generated) >= self.params.max_tokens:
            self.finish(self.finish_reason or "length")
            return False
        self.append(token, logprob, None if top is None else {int(i): v for i, v in top}, eos, decode)
        return True

    def append(self, token: int, logprob: float | None, top: dict[int, float] | None, eos: int | None,
               decode: Detokenizer) -> None:
        """Take `token` (and its log-probability and top alternatives when asked for): the end token finishes, a
        stop string cuts the text and finishes, max_tokens finishes; otherwise `on_token` hears of it."""
        if logprob is not None:
            self.token_logprobs.append(logprob)
            self.top_logprobs.append(top or {})
        self.first_token_at = self.first_token_at or time.perf_counter()
        self.generated.append(token)
        if token == eos:
            self.generated.pop()
            if self.token_logprobs:
                self.token_logprobs.pop()
                self.top_logprobs.pop()
            self.text = decode.final(self)
            self.finish("stop")
            return
        self.text = decode(self)
        for s in self.params.stop or ():
            if s and s in self.text:
                self.text = self.text[:self.text.index(s)]
                self.finish("stop")
                return
        if self.on_token is not None:
            self.on_token(self)
        if len(self.generated) >= self.params.max_tokens:
            self.text = decode.final(self)
            self.finish("length")

    def stable_text(self) -> str:
        """The part of `text` no later token can change: for streaming. Held back: a tail the tokenizer could
        not decode yet ("\ufffd": a multibyte character split over tokens, which byte-level BPE decodes
        later) and a tail that begins a stop string (it is cut if the stop string completes)."""
        text = self.text
        if self.finished:
            return text
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        text = text[:end]
        hold = 0
        for s in self.params.stop or ():
            for k in range(min(len(s) - 1, len(text)), hold, -1):  # the longest tail that is a prefix of s
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason, self.done_at = True, reason, time.perf_counter()
        if self.on_finish is not None:
            self.on_finish(self)


class Detokenizer:
    """A request's text after each new token, equal to `tokenizer.decode(generated)`. Decoding every token again
    at each step costs O(length): ~340 us at 2,000 tokens with GPT-2's tokenizer, every step, for every running
    request. With a fast tokenizer, tokenizers' `DecodeStream` decodes only the tokens since the last whole
    character instead (~1 us; what vLLM does): a character split over tokens appears once whole. At the end
    (`final`) the whole text is decoded once, so a request's final text is exactly the tokenizer's decode. A
    tokenizer that cleans up spaces after decoding (transformers' clean_up_tokenization_spaces), which a stream
    cannot know, is decoded whole every time."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.tokenizer, self.backend = tokenizer, backend if backend is not None and not cleans else None

    def __call__(self, req: Request) -> str:
        if self.backend is None:
            return self.tokenizer.decode(req.generated)
        if req.stream is None:
            from tokenizers.decoders import DecodeStream

            req.stream = [DecodeStream(skip_special_tokens=False), ""]
        chunk = req.stream[0].step(self.backend, req.generated[-1])
        if chunk:
            req.stream[1] += chunk
        return req.stream[1]

    def final(self, req: Request) -> str:
        return self.tokenizer.decode(req.generated)


def _top(logp: torch.Tensor, k: int) -> list[list]:
    """The k most probable tokens and their log-probabilities, as [[id, logprob]] (JSON-ready)."""
    if k <= 0:
        return []
    vals, idx = logp.topk(k)
    return [[int(i), float(v)] for i, v in zip(idx, vals)]


def score_positions(logits: torch.Tensor, targets: list[int], k: int) -> list[list]:
    """[[log-probability of targets[i] at position i, its top-k alternatives]] for logits [n, V] (n >= len(targets))."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return [[float(logp[i, t]), _top(logp[i], k)] for i, t in enumerate(targets)]


# below this temperature sampling is greedy: logits / 1e-38 overflow to inf, and far above that the
# distribution is already one-hot in fp32
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from fp32 logits [V]: argmax at temperature 0 (or below GREEDY_BELOW), else top-p nucleus sampling."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = F.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


# -- expert load -------------------------------------------------------------------------------------

class ExpertLoad:
    """Tokens routed to each expert of each MoE layer over every forward so far (prompts included), and the
    load that puts on each rank: measured, on the data-parallel path (the tokens each rank's experts received
    in the all-to-all, replicas included), else from the model's layout (an expert held by several ranks
    with expert slicing loads each of them)."""

    def __init__(self, cfg: ModelConfig, world: int, layout=None):
        self.tokens = [torch.zeros(e, dtype=torch.long) for e in cfg.experts]
        self.last: list[list[int]] = []  # the last forward's counts
        self.holders = []  # [layer][expert] -> the ranks that hold it
        for i, experts in enumerate(cfg.experts):
            ep = layout.ep[i] if layout is not None else 1
            local = experts // ep
            self.holders.append([[r for r in range(world) if r % ep == e // local] for e in range(experts)])
        self.world = world
        self.measured: list[list[int]] | None = None  # [layer][rank] tokens received, when measured

    def add(self, counts: list[torch.Tensor], rank_loads: list[list[float]] | None = None) -> None:
        self.last = [c.to("cpu", torch.long).tolist() for c in counts]
        for total, c in zip(self.tokens, counts):
            total += c.to("cpu", torch.long)
        if rank_loads is not None:
            if self.measured is None:
                self.measured = [[0] * self.world for _ in rank_loads]
            for total, loads in zip(self.measured, rank_loads):
                for r, n in enumerate(loads):
                    total[r] += int(n)

    def per_rank(self) -> list[list[int]]:
        """For each MoE layer, the tokens routed to the experts each rank holds."""
        if self.measured is not None:
            return [list(m) for m in self.measured]
        out = []
        for counts, holders in zip(self.tokens, self.holders):
            per_rank = [0] * self.world
            for e, ranks in enumerate(holders):
                for r in ranks:
                    per_rank[r] += int(counts[e])
            out.append(per_rank)
        return out


# -- every rank: run this rank's rows of a step ------------------------------------------------------------

@dataclass
class RowState:
    """What the rank that holds a row needs to sample it: the request's sampling settings and its generator."""

    temperature: float
    top_p: float
    logprobs: int | None
    generator: torch.Generator | None

    @classmethod
    def of(cls, params: dict) -> "RowState":
        seed = params.get("seed")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return cls(params["temperature"], params["top_p"], params.get("logprobs"), gen)


class Worker:
    """One rank's rows: its `SlotCache`, the sampling state of each row, and the forwards of each step."""

    SCORE_ROWS = 256  # prompt positions projected to the vocabulary at once when scoring a prompt (echo + logprobs)

    def __init__(self, model: GPT, slots: int, rank: int, world: int, single: bool):
        self.model, self.rank, self.world = model, rank, world
        self.single = single  # one process: an error in a forward fails its requests, nothing else waits on it
        self.device = next(model.parameters()).device
        dtype = next(p for n, p in model.named_parameters() if not n.endswith("gate.wg.weight")).dtype
        self.cache = SlotCache(model.cfg, slots, device=self.device, dtype=dtype,
                               # this rank's key/value heads (its query heads' share under tensor slicing)
                               heads=model.blocks[0].attn.num_heads * model.cfg.kv_group_heads // model.cfg.heads)
        self.rows: dict[int, RowState] = {}
        self.forwards = 0
        self.forward_s = 0.0  # seconds in forwards since start (model, projection, sampling)
        self.placement = getattr(model, "placement", None)  # the data-parallel path's experts and exchange
        self.counts: list = []  # per forward of the last step: (expert counts, per-rank loads or None)

    def execute(self, step: rank_msgs.Step) -> list[dict]:
        """Run `step`'s forwards with this rank's rows (maybe none: it still joins every collective) and return
        one result per row that was to be sampled or scored: {"row", "token", "logprob", "top", "scores",
        "start"} or {"row", "error"}."""
        for dp, row, params in step.admit:
            if dp == self.rank:
                self.cache.lens[row] = 0
                self.rows[row] = RowState.of(params)
        results: list[dict] = []
        self.counts = []
        for phase in step.phases:
            items = [it for it in phase["rows"] if it[0] == self.rank]
            if self.placement is not None:
                self.placement.apply(phase.get("table"), phase.get("expect"))
            t0 = time.perf_counter()
            try:
                results += self._phase(items)
            except Exception as err:  # noqa: BLE001
                if not self.single:
                    raise  # the other ranks may be inside this forward's collectives: the engine cannot go on
                results += [{"row": it[1], "error": f"{type(err).__name__}: {err}"} for it in items]
            self.forward_s += time.perf_counter() - t0
        return results

    @torch.no_grad()
    def _phase(self, items: list) -> list[dict]:
        """One forward over `items` [[rank, row, tokens, sample, score start (-1: no scoring), targets]]."""
        self.forwards += 1
        T = max((len(it[2]) for it in items), default=1)
        counts = [len(it[2]) for it in items]
        tokens = torch.zeros(len(items), T, dtype=torch.long)
        for b, it in enumerate(items):
            tokens[b, :len(it[2])] = torch.tensor(it[2])
        out = self.model(tokens.to(self.device), cache=self.cache.select([it[1] for it in items], counts),
                         hidden_only=True)
        loads = self.placement.last_loads() if self.placement is not None else None
        self.counts.append((out.expert_counts, loads))
        h = out.hidden  # [B, T, C]
        results = []
        for b, it in enumerate(items):  # prompts being scored: every position, SCORE_ROWS at a time
            row, n, start, targets = it[1], counts[b], it[4], it[5]
            if start < 0:
                continue
            res = {"row": row, "start": start, "scores": []}
            for lo in range(0, n, self.SCORE_ROWS):  # the same chunks on every rank (a sliced head is collective)
                logits = self._project(h[b, lo:lo + self.SCORE_ROWS])  # [n, V]
                if "error" in res:
                    continue
                try:
                    res["scores"] += score_positions(logits, targets[lo:lo + self.SCORE_ROWS],
                                                     self.rows[row].logprobs or 0)
                except Exception as err:  # noqa: BLE001 - this request alone fails
                    res = {"row": row, "error": f"{type(err).__name__}: {err}"}
            results.append(res)
        sampled = [b for b, it in enumerate(items) if it[3]]
        if sampled:
            last = h[sampled, [counts[b] - 1 for b in sampled]]  # [n, C]: each row's last real position
            logits = self._project(last)  # [n, V]
            scored = {r["row"]: r for r in results}
            for j, b in enumerate(sampled):
                row = items[b][1]
                res = scored.get(row)
                if res is None:
                    res = {"row": row}
                    results.append(res)
                if "error" in res:
                    continue
                try:
                    res.update(self._sample(self.rows[row], logits[j]))
                except Exception as err:  # noqa: BLE001 - this request alone fails
                    res.clear()
                    res.update(row=row, error=f"{type(err).__name__}: {err}")
        return results

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, V] of hidden states [n, C] (as [1, n, C]: DeepSpeed's sliced output layer takes 3-D input)."""
        return self.model.lm_head(h[None])[0].float()

    def _sample(self, state: RowState, logits: torch.Tensor) -> dict:
        token = sample(logits, state, state.generator)
        if state.logprobs is None:
            return {"token": token}
        logp = F.log_softmax(logits, dim=-1)
        return {"token": token, "logprob": float(logp[token]), "top": _top(logp, state.logprobs)}


# -- rank 0: the scheduler -------------------------------------------------------------------------------------

class Engine:
    """Continuous batching over data-parallel ranks (rank 0 schedules). Not thread safe except `submit`
    (lock) and `abort`.

    `max_batch`: sequences each rank holds; `max_batched_tokens`: tokens each rank runs in one step
    (decode tokens first, then prefill chunks); at least `max_batch`, so that a free row can always
    start. `max_prefill_seqs`: prompts per prefill forward on a rank (None: every chunk of the step in one
    forward; 1: each prompt its own forward, as before batched prefill)."""

    def __init__(self, model: GPT, tokenizer, max_batch: int = 32, ranks=None, max_batched_tokens: int = 2048,
                 data_parallel: bool | None = None, placed: bool = False, max_prefill_seqs: int | None = None):
        if max_batched_tokens < max_batch:
            raise ValueError(f"--max-batched-tokens {max_batched_tokens}: below --max-batch {max_batch}, a step "
                             f"could have no room for a new sequence; give at least {max_batch}")
        self.model, self.tokenizer = model, tokenizer
        self.detokenize = Detokenizer(tokenizer)
        self.cfg = model.cfg
        self.ranks = ranks
        world = ranks.world if ranks is not None else 1
        rank = ranks.rank if ranks is not None else 0
        # the data-parallel path: each rank its own rows (the placed model's expert all-to-all); else one group
        if data_parallel is None:
            data_parallel = getattr(model, "placement", None) is not None
        self.dp = world if data_parallel else 1
        self.world = world
        self.worker = Worker(model, max_batch, rank if self.dp > 1 else 0, self.dp, single=world == 1)
        self.device = self.worker.device
        self.max_batch, self.max_batched_tokens = max_batch, max_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs  # prompts per prefill forward on a rank (None: all of the step's)
        self.eos = tokenizer.eos_token_id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free = [list(range(max_batch)) for _ in range(self.dp)]  # free rows of each rank's cache
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.steps = 0
        self.stats = {"forwards": 0, "tokens_in": 0, "tokens_out": 0, "decode_steps": 0, "prefill_forwards": 0,
                      "failed": 0}
        self.on_decode = None  # callback(batch size) after each decode step (the server's metrics)
        self._aborts: set[int] = set()  # ids of requests to end at the next step (their client hung up)
        self.closed: str | None = None  # why the engine stopped (fail_all), refusing new requests
        self.load = ExpertLoad(self.cfg, world, getattr(model, "layout", None))
        # expert placement (export/serve/placement.py): this rank's side (with --placement), and rank 0's policy
        self.placement = model.placement if placed else None
        self.policy = None
        self.rank_status: list[dict] = []  # every rank's last answer to `ping` (rank 0)
        self.rank_status_at: float | None = None

    @classmethod
    def from_config(cls, config: ServeConfig, ranks=None) -> "Engine":
        """The engine for `config` on this rank. Data parallel (`data_parallel_layout`): the experts placed by a
        replica table (export/serve/placement.py; the native one without --placement) and exchanged in an
        all-to-all, with rank 0's policy; else the package loaded for its tensor- or expert-sliced layout
        through DeepSpeed's inference engine (export/inference.py). Collective with several ranks."""
        from export.inference import load_package
        from export.package import package_dtype, read_tokenizer, verified_package
        from pipeline import dist

        ranks = ranks or dist.init()
        if config.nproc != ranks.world:
            raise ValueError(f"--nproc {config.nproc}: {ranks.world} rank(s) are running; the flags were checked for "
                             f"{config.nproc} (start as many ranks, or drop --nproc)")
        verified = verified_package(config.package, config.checksums)
        dp = data_parallel_layout(verified.cfg, config, ranks.world)
        if not dp:
            model, tok = load_package(config.package, ranks, ep_size=config.ep_size, checksums=config.checksums,
                                      dtype=config.dtype, tp_size=config.tp_size)
        else:
            from export.serve.placement import placed_model

            model = placed_model(verified.cfg, config.package, ranks, package_dtype(verified.manifest, config.dtype),
                                 config.resident_experts, files=verified.files, transport=config.expert_exchange)
            tok = read_tokenizer(config.package, verified.files)
        engine = cls(model, tok, max_batch=config.max_batch, ranks=ranks, max_batched_tokens=config.max_batched_tokens,
                     data_parallel=dp, placed=config.placement is not None, max_prefill_seqs=config.max_prefill_seqs)
        if config.placement is not None and ranks.rank == 0:
            engine.policy = make_policy(config, model.cfg, ranks.world)
        return engine

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- requests (any thread) ---------------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> Request:
        if not prompt:
            raise ValueError("prompt: empty (give at least one token)")
        if len(prompt) + params.max_tokens > self.cfg.seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.cfg.seq_len}")
        seq = Request(next(self.ids), list(prompt), params, on_token=on_token, on_finish=on_finish)
        if self.policy is not None:
            self.policy.submitted(seq)
        with self.lock:
            if self.closed is not None:  # after fail_all: nobody would ever finish it
                raise RuntimeError(f"the engine stopped: {self.closed}")
            self.waiting.append(seq)
        return seq

    def pending(self) -> int:
        with self.lock:
            return len(self.waiting) + len(self.running)

    def fail_all(self, message: str) -> None:
        """Finish every waiting and running sequence with finish_reason 'error' (the engine cannot go on); later
        submits are refused."""
        with self.lock:
            self.closed = message
            seqs, self.waiting = self.waiting + self.running, []
            self.running = []
        for seq in seqs:
            if not seq.finished:
                seq.text = message
                try:
                    seq.finish("error")
                except Exception:  # noqa: BLE001 - its client's event loop is gone
                    pass

    def abort(self, seq: Request) -> None:
        """End `seq` at the next step (from any thread): a waiting one never runs, a running one frees its row."""
        with self.lock:
            self._aborts.add(seq.id)

    def _take_aborts(self) -> None:
        with self.lock:
            ids, self._aborts = self._aborts, set()
            gone = [r for r in self.waiting if r.id in ids]
            self.waiting = [r for r in self.waiting if r.id not in ids]
        gone += [r for r in self.running if r.id in ids and not r.finished]
        for req in gone:
            try:
                req.finish("abort")
            except Exception:  # noqa: BLE001 - its client's event loop is gone: nobody left to tell
                pass
            self._retired(req)

    def _retired(self, req: Request) -> None:
        """A request is done (finished, aborted or failed): its row and the policy's state for it go."""
        if req in self.running:
            self.running.remove(req)
            self.free[req.rank].append(req.slot)
        if self.policy is not None:
            self.policy.finished(req)

    def _fail(self, req: Request, err: BaseException | str) -> None:
        """An error serving one request fails that request alone; the others go on."""
        self.stats["failed"] += 1
        req.text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        if not req.finished:
            try:
                req.finish("error")
            except Exception:  # noqa: BLE001 - its own callback failed: nobody left to tell
                pass
        self._retired(req)

    # -- one step ------------------------------------------------------------------------------------------------

    def _schedule(self) -> tuple[list, list, list]:
        """(admitted, prefill items, decode items) of the next step; each item (request, tokens, sample, score)."""
        decode = [s for s in self.running if not s.finished and s.prefilled == len(s.prompt)]
        budget = [self.max_batched_tokens] * self.dp
        for s in decode:
            budget[s.rank] -= 1
        prefill = []

        def chunk(seq):
            n = min(len(seq.prompt) - seq.prefilled, budget[seq.rank])
            if n <= 0:
                return
            budget[seq.rank] -= n
            lo, hi = seq.prefilled, seq.prefilled + n
            scored = seq.params.echo and seq.params.logprobs is not None  # every prompt position's log-probs
            prefill.append((seq, seq.prompt[lo:hi], hi == len(seq.prompt), lo if scored else -1))
            seq.prefilled = hi

        for seq in self.running:  # prompts already started go on first, in arrival order
            if not seq.finished and seq.prefilled < len(seq.prompt):
                chunk(seq)
        admitted = []
        loads = [0] * self.dp  # tokens each rank runs (prompts and generated so far)
        for s in self.running:
            loads[s.rank] += len(s.prompt) + len(s.generated)
        with self.lock:
            while self.waiting:
                # the rank with a free row and room this step that runs the fewest tokens
                open_ranks = [r for r in range(self.dp) if self.free[r] and budget[r] > 0]
                if not open_ranks:
                    break
                rank = min(open_ranks, key=lambda r: (loads[r], r))
                seq = self.waiting.pop(0)
                seq.rank, seq.slot = rank, self.free[rank].pop(0)
                loads[rank] += len(seq.prompt)
                self.running.append(seq)
                admitted.append(seq)
                chunk(seq)
        return admitted, prefill, [(s, [s.generated[-1]], True, -1) for s in decode]

    def _prefill_groups(self, prefill: list) -> list[list]:
        """The prefill forwards of a step: all chunks in one, or with `max_prefill_seqs` N, at most N of each rank's
        in each forward (every rank runs as many forwards: a rank with fewer joins with an empty batch)."""
        if not prefill:
            return []
        n = self.max_prefill_seqs or len(prefill)
        per_rank = [[it for it in prefill if it[0].rank == r] for r in range(self.dp)]
        count = max((len(items) + n - 1) // n for items in per_rank)
        return [[it for items in per_rank for it in items[j * n:(j + 1) * n]] for j in range(count)]

    def _admission(self, seq: Request) -> list:
        p = seq.params
        seed = None
        if p.temperature >= GREEDY_BELOW:  # sampled (below it sampling is greedy and draws nothing)
            seed = p.seed if p.seed is not None else int(time.time_ns() % (1 << 62))
        return [seq.rank, seq.slot, {"temperature": p.temperature, "top_p": p.top_p, "logprobs": p.logprobs,
                                     "seed": seed}]

    def step(self) -> int:
        """Abort what was hung up on; admit; one prefill forward (chunks of waiting prompts, batched) and one
        decode forward (every running request) on every rank; take the sampled tokens; retire. Returns tokens
        generated."""
        self._take_aborts()
        admitted, prefill, decode = self._schedule()
        phases, kinds = [], []
        for kind, items in (*(("prefill", group) for group in self._prefill_groups(prefill)), ("decode", decode)):
            if not items:
                continue
            table = expect = None
            if self.policy is not None:
                table, expect = self.policy.table_for(kind, [it[0] for it in items])
            phases.append({"kind": kind, "table": table, "expect": expect,
                           "rows": [[s.rank, s.slot, toks, sample_it, score,
                                     s.prompt[score + 1:score + 1 + len(toks)] if score >= 0 else []]
                                    for s, toks, sample_it, score in items]})
            kinds.append((kind, items))
        if not phases:
            self.steps += 1
            return 0
        if decode:
            self.stats["decode_steps"] += 1
            if self.on_decode is not None:
                self.on_decode(len(decode))
        self.stats["prefill_forwards"] += sum(kind == "prefill" for kind, _ in kinds)
        msg = rank_msgs.Step([self._admission(s) for s in admitted], phases)
        if self.world > 1:
            rank_msgs.send(msg)
        mine = self.worker.execute(msg)
        self.stats["forwards"] += len(phases)
        results = rank_msgs.gather_results(mine) if self.dp > 1 else [mine]
        for (kind, items), (counts, loads) in zip(kinds, self.worker.counts):
            self.load.add(counts, loads)
            if self.policy is not None:
                self.policy.observed(self.load.last, kind, [it[0] for it in items])
        made = self._take_results(prefill + decode, results)
        for seq in [s for s in self.running if s.finished]:
            self._retired(seq)
        self.steps += 1
        return made

    def _take_results(self, items: list, results: list[list[dict]]) -> int:
        """Apply every rank's results to the requests of `items`: prompt scores, sampled tokens, errors."""
        by_row = {(s.rank, s.slot): s for s, *_ in items}
        made = 0
        for rank, rows in enumerate(results):
            for res in rows:
                seq = by_row.get((rank, res["row"]))
                if seq is None or seq.finished:
                    continue
                if "error" in res:
                    self._fail(seq, res["error"])
                    continue
                try:
                    if "scores" in res:
                        seq.add_prompt_scores(res["start"], res["scores"])
                    if "token" in res:
                        if seq.prefilled == len(seq.prompt) and not seq.generated:
                            self.stats["tokens_in"] += len(seq.prompt)
                        took = seq.take(res["token"], res.get("logprob"), res.get("top"), self.eos, self.detokenize)
                        made += took
                        self.stats["tokens_out"] += took
                except Exception as err:  # noqa: BLE001 - its tokenizer, its callback: this request alone fails
                    self._fail(seq, err)
        return made

    @property
    def expert_tokens(self) -> list[torch.Tensor]:
        return self.load.tokens

    def rank_expert_tokens(self) -> list[list[int]]:
        return self.load.per_rank()

    # -- the other ranks (export/serve/ranks.py) --------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run this rank's part of every step rank 0 sends, answer its pings, until it says stop."""
        while True:
            msg = rank_msgs.receive()
            if isinstance(msg, rank_msgs.Stop):
                return
            if isinstance(msg, rank_msgs.Ping):  # rank 0 checks that every rank is alive and asks how it is
                self._status()
                continue
            mine = self.worker.execute(msg)
            if self.dp > 1:
                rank_msgs.gather_results(mine)

    def ping(self) -> None:
        """Rank 0: one round trip with every rank (a dead rank makes it raise within the collective's
        timeout); records each rank's status in `rank_status`."""
        rank_msgs.send(rank_msgs.Ping())
        self.rank_status = [s.to_dict() for s in self._status()]
        self.rank_status_at = time.time()

    def _status(self) -> list[rank_msgs.RankStatus]:
        return rank_msgs.gather_status(self.ranks.rank if self.ranks else 0, self.worker.forwards, self.placement,
                                       self.worker.forward_s, self.worker.placement)

    def stop_followers(self) -> None:
        rank_msgs.send(rank_msgs.Stop())


def data_parallel_layout(cfg: ModelConfig, config: ServeConfig, world: int) -> bool:
    """Whether `config` on `world` ranks serves data parallel (each rank its own sequences, an expert all-to-all
    in every MoE layer): no tensor slicing, and every MoE layer's experts split over all the ranks (no expert
    slicing). Otherwise one group runs rank 0's rows on every rank (DeepSpeed's inference engine)."""
    if (config.tp_size or 1) > 1 or (config.ep_size or world) != world:
        return False
    return all(n % world == 0 for n in cfg.experts)


def make_policy(config: ServeConfig, cfg: ModelConfig, ep: int):
    """Rank 0's placement policy for `config.placement` (export/serve/placement.py, predictor.py)."""
    from export.serve.placement import Policy, ReactivePolicy

    if config.placement == "none":
        return Policy(cfg, ep, config.replica_budget)
    if config.placement == "reactive":
        return ReactivePolicy(cfg, ep, config.replica_budget)
    from export.serve.predictor import PredictivePolicy, load_predictor

    return PredictivePolicy(cfg, ep, config.replica_budget, load_predictor(config.package))


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """Submit `prompts` together and step until all are done (offline batch use and tests)."""
    seqs = [engine.submit(p, SamplingParams(**vars(params))) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    return seqs
