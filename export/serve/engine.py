"""The serving engine behind `moe-pipeline serve`: a package on this rank, continuous batching.

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, SamplingParams
    engine = Engine.from_config(ServeConfig(package="runs/tiny/package"))
    req = engine.submit(engine.encode("And God said"), SamplingParams(max_tokens=16))
    while not req.finished:
        engine.step()
    print(engine.decode(req.generated))

Requests share decode steps: `step()` first prefills the requests that arrived since the last
step (each alone, its whole prompt, into a free row of the `SlotCache`), then runs ONE forward of
one token for every running request, samples each one's next token, and retires the finished
ones (their rows are reused). A request that arrives while others decode joins at the next step;
nobody waits for a batch to drain.

`SlotCache` is a KV cache with one row per running request and a length per row, so rows of
different lengths decode together: keys are written at each row's own position, each query sees
its row's keys up to its own position (an explicit attention mask), and positions are per row.
It implements pipeline/model.py's cache protocol (`Cache`), as the model's own `KVCache` does.

Multi-rank (expert parallel): rank 0 owns the scheduler and sends each forward to the other ranks
before running it (export/serve/ranks.py); they run exactly that forward. Only rank 0 samples.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from export.serve import ranks as rank_msgs
from export.serve.config import ServeConfig
from pipeline.model import GPT, Cache, ModelConfig


# -- the cache ---------------------------------------------------------------------------------------

class SlotCache(Cache):
    """Per-layer K/V buffers [slots, heads, max_len, head_dim] with a length per slot (row).

    Lengths are kept as Python ints (no device sync to read them); a forward over some rows reads
    keys only up to the longest selected row, and a single row needs no mask beyond causality."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int | None = None, device=None, dtype=torch.float32,
                 heads: int | None = None):
        self.max_len = max_len or cfg.seq_len
        # heads: this rank's (a 1/tp slice under tensor slicing)
        shape = (slots, heads or cfg.heads, self.max_len, cfg.hidden // cfg.heads)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.device = device
        self.lens = [0] * slots
        self.free = list(range(slots))
        self.select([])

    def select(self, rows: list[int]) -> "SlotCache":
        """The rows of the next forward, in the order of its batch."""
        self.rows = list(rows)
        self._start = [self.lens[r] for r in self.rows]
        self._rows_t = torch.tensor(self.rows, dtype=torch.long, device=self.device)
        self._span = (self.rows[0], self.rows[0] + len(self.rows)) if self.rows and \
            self.rows == list(range(self.rows[0], self.rows[0] + len(self.rows))) else None
        self._pos: dict[int, torch.Tensor] = {}
        return self

    # pipeline.model.Cache
    @property
    def length(self) -> int:  # for the model's context check: the longest selected row
        return max(self._start, default=0)

    def advance(self, T: int) -> None:  # after a forward of T tokens: every selected row is T longer
        for r in self.rows:
            self.lens[r] += T
        self._start = [self.lens[r] for r in self.rows]
        self._pos = {}

    def positions(self, T: int) -> torch.Tensor:
        if T not in self._pos:
            start = torch.tensor(self._start, dtype=torch.long, device=self.device)
            self._pos[T] = start[:, None] + torch.arange(T, device=self.device)  # [B, T]
        return self._pos[T]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        end = self.length + T  # keys the longest row has after this forward
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {end} needed")
        K, V = self.k[layer], self.v[layer]
        if len(self.rows) == 1:  # one row: plain slices, no gather
            r, p = self.rows[0], self._start[0]
            K[r, :, p:p + T] = k[0]
            V[r, :, p:p + T] = v[0]
            return K[r:r + 1, :, :end], V[r:r + 1, :, :end]
        pos = self.positions(T)  # [B, T]
        rows = self._rows_t[:, None].expand_as(pos)
        # [B, H, T, D] -> written at (row, :, position, :)
        K[rows, :, pos] = k.transpose(1, 2)
        V[rows, :, pos] = v.transpose(1, 2)
        if self._span is not None:  # consecutive rows: a view
            a, b = self._span
            return K[a:b, :, :end], V[a:b, :, :end]
        return K[self._rows_t, :, :end], V[self._rows_t, :, :end]

    def attention_mask(self, T: int) -> torch.Tensor | None:
        """[B, 1, T, keys]: query t of a row sees that row's keys at positions <= its own. None for one
        row: the model's causal masking is then exact."""
        if len(self.rows) == 1:
            return None
        keys = torch.arange(self.length + T, device=self.device)
        return (keys[None, None, :] <= self.positions(T)[:, :, None])[:, None]

    def acquire(self) -> int:
        if not self.free:
            raise RuntimeError("no free slot")
        slot = self.free.pop(0)
        self.lens[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lens[slot] = 0
        self.free.append(slot)


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
    slot: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""  # generated text so far, cut at a stop string when one matched
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    done_at: float | None = None
    generator: torch.Generator | None = None
    on_token: object = None  # callback(request) after every new token (streaming), from the engine's thread
    on_finish: object = None

    def score_rows(self, start: int, logits: torch.Tensor) -> None:
        """echo + logprobs, one chunk of prompt positions at a time: logits [n, V] of positions start.. predict
        prompt tokens start+1..; their log-probabilities and top alternatives are kept, not the logits."""
        if start == 0:
            self.prompt_logprobs, self.prompt_top = [None], [None]
        logp = F.log_softmax(logits, dim=-1)  # [n, V]
        for i in range(logp.shape[0]):
            if start + i + 1 < len(self.prompt):
                self.prompt_logprobs.append(float(logp[i, self.prompt[start + i + 1]]))
                self.prompt_top.append(_top(logp[i], self.params.logprobs))

    def emit(self, logits: torch.Tensor, eos: int | None, decode) -> bool:
        """Sample the next token from the last position's logits [V], then check the stop conditions (the end
        token, a stop string, max_tokens). True if a token was sampled."""
        if len(self.generated) >= self.params.max_tokens:  # max_tokens=0: nothing to sample
            self.finish(self.finish_reason or "length")
            return False
        token = sample(logits, self.params, self.generator)
        logp = F.log_softmax(logits, dim=-1) if self.params.logprobs is not None else None
        self.append(token, logp, eos, decode)
        return True

    def append(self, token: int, logp: torch.Tensor | None, eos: int | None, decode) -> None:
        """Take `token` (its log-probabilities `logp` [V] when asked for): the end token finishes, a stop string
        cuts the text and finishes, max_tokens finishes; otherwise `on_token` hears of it."""
        if logp is not None:
            self.token_logprobs.append(float(logp[token]))
            self.top_logprobs.append(_top(logp, self.params.logprobs))
        self.first_token_at = self.first_token_at or time.perf_counter()
        self.generated.append(token)
        if token == eos:
            self.generated.pop()
            if self.token_logprobs:
                self.token_logprobs.pop()
                self.top_logprobs.pop()
            self.finish("stop")
            return
        self.text = decode(self.generated)
        for s in self.params.stop or ():
            if s and s in self.text:
                self.text = self.text[:self.text.index(s)]
                self.finish("stop")
                return
        if self.on_token is not None:
            self.on_token(self)
        if len(self.generated) >= self.params.max_tokens:
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


def _top(logp: torch.Tensor, k: int) -> dict[int, float]:
    """The k most probable tokens and their log-probabilities."""
    if k <= 0:
        return {}
    vals, idx = logp.topk(k)
    return {int(i): float(v) for i, v in zip(idx, vals)}


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


class ScoringError(RuntimeError):
    """Scoring a prompt's log-probabilities failed after the forward itself completed on every rank."""

    def __init__(self, err: Exception):
        super().__init__(f"{type(err).__name__}: {err}")
        self.__cause__ = err


# -- expert load -------------------------------------------------------------------------------------

class ExpertLoad:
    """Tokens routed to each expert of each MoE layer over every forward so far (prompts included), and the
    load that puts on each rank under the model's layout (an expert held by several ranks with expert
    slicing loads each of them)."""

    def __init__(self, cfg: ModelConfig, world: int, layout=None):
        self.tokens = [torch.zeros(e, dtype=torch.long) for e in cfg.experts]
        self.last: list[list[int]] = []  # the last forward's counts
        self.holders = []  # [layer][expert] -> the ranks that hold it
        for i, experts in enumerate(cfg.experts):
            ep = layout.ep[i] if layout is not None else 1
            local = experts // ep
            self.holders.append([[r for r in range(world) if r % ep == e // local] for e in range(experts)])
        self.world = world

    def add(self, counts: list[torch.Tensor]) -> None:
        self.last = [c.to("cpu", torch.long).tolist() for c in counts]
        for total, c in zip(self.tokens, counts):
            total += c.to("cpu", torch.long)

    def per_rank(self) -> list[list[int]]:
        """For each MoE layer, the tokens routed to the experts each rank holds."""
        out = []
        for counts, holders in zip(self.tokens, self.holders):
            per_rank = [0] * self.world
            for e, ranks in enumerate(holders):
                for r in ranks:
                    per_rank[r] += int(counts[e])
            out.append(per_rank)
        return out


# -- the engine --------------------------------------------------------------------------------------

class Engine:
    """Continuous batching over one model. Not thread safe except `submit` (lock) and `abort`."""

    def __init__(self, model: GPT, tokenizer, max_batch: int = 32, ranks=None):
        self.model, self.tokenizer = model, tokenizer
        self.cfg = model.cfg
        self.ranks = ranks
        self.device = next(model.parameters()).device
        dtype = next(p for n, p in model.named_parameters() if not n.endswith("gate.wg.weight")).dtype
        self.cache = SlotCache(self.cfg, max_batch, device=self.device, dtype=dtype,
                               heads=model.blocks[0].attn.num_heads)
        self.max_batch = max_batch
        self.eos = tokenizer.eos_token_id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.steps = 0
        self.stats = {"forwards": 0, "tokens_in": 0, "tokens_out": 0, "decode_steps": 0, "failed": 0}
        self.on_decode = None  # callback(batch size) after each decode step (the server's metrics)
        self._aborts: set[int] = set()  # ids of requests to end at the next step (their client hung up)
        self.closed: str | None = None  # why the engine stopped (fail_all), refusing new requests
        self.load = ExpertLoad(self.cfg, ranks.world if ranks is not None else 1, getattr(model, "layout", None))
        # expert placement (export/serve/placement.py): this rank's side, and rank 0's policy
        self.placement = getattr(model, "placement", None)
        self.policy = None
        self.rank_status: list[dict] = []  # every rank's last answer to `ping` (rank 0)
        self.rank_status_at: float | None = None

    @classmethod
    def from_config(cls, config: ServeConfig, ranks=None) -> "Engine":
        """The engine for `config` on this rank: the package loaded for its layout (export/inference.py), or with
        `placement` the experts placed by a replica table (export/serve/placement.py) and rank 0's policy.
        Collective with several ranks."""
        from export.inference import load_package
        from export.package import package_dtype, read_tokenizer, verified_package
        from pipeline import dist

        ranks = ranks or dist.init()
        if config.nproc != ranks.world:
            raise ValueError(f"--nproc {config.nproc}: {ranks.world} rank(s) are running; the flags were checked for "
                             f"{config.nproc} (start as many ranks, or drop --nproc)")
        if config.placement is None:
            model, tok = load_package(config.package, ranks, ep_size=config.ep_size, checksums=config.checksums,
                                      dtype=config.dtype, tp_size=config.tp_size)
        else:
            from export.serve.placement import placed_model

            verified = verified_package(config.package, config.checksums)
            model = placed_model(verified.cfg, config.package, ranks, package_dtype(verified.manifest, config.dtype),
                                 config.resident_experts, files=verified.files)
            tok = read_tokenizer(config.package, verified.files)
        engine = cls(model, tok, max_batch=config.max_batch, ranks=ranks)
        if config.placement is not None and ranks.rank == 0:
            engine.policy = make_policy(config, model.cfg, ranks.world)
        return engine

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- scheduling (rank 0) ---------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> Request:
        if not prompt:
            raise ValueError("prompt: empty (give at least one token)")
        if len(prompt) + params.max_tokens > self.cfg.seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.cfg.seq_len}")
        seq = Request(next(self.ids), list(prompt), params, on_token=on_token, on_finish=on_finish)
        if self.policy is not None:
            self.policy.submitted(seq)
        if params.temperature >= GREEDY_BELOW:  # sampled (below it sampling is greedy and draws nothing)
            seq.generator = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                          else int(time.time_ns() % (1 << 62)))
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
        """End `seq` at the next step (from any thread): a waiting one never runs, a running one frees its slot."""
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
        """A request is done (finished, aborted or failed): its slot and the policy's state for it go."""
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req.slot)
        if self.policy is not None:
            self.policy.finished(req)

    def _fail(self, req: Request, err: BaseException) -> None:
        """An error serving one request fails that request alone; the others go on."""
        self.stats["failed"] += 1
        req.text = f"{type(err).__name__}: {err}"
        if not req.finished:
            try:
                req.finish("error")
            except Exception:  # noqa: BLE001 - its own callback failed: nobody left to tell
                pass
        self._retired(req)

    def _forward(self, rows: list[int], tokens: torch.Tensor, reset: list[int] = (), kind: str = "decode",
                 seqs: list[Request] = (), last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (fp32) of `tokens` [B, T] appended to `rows` ([B, 1, V]: the last position's only,
        with `last_only`); every rank runs it. With expert placement, rank 0's policy gives the replica
        table (and the experts to prefetch) for this forward."""
        table = expect = None
        if self.policy is not None:
            table, expect = self.policy.table_for(kind, seqs)
        if self.ranks is not None and self.ranks.world > 1:
            rank_msgs.send(rank_msgs.Forward(rows, tokens.tolist(), list(reset), table, expect, last_only))
        if self.placement is not None:
            self.placement.apply(table, expect)
        scoring_error: list[Exception] = []

        def score(start, rows_logits):  # an error scoring the prompt must not leave the other ranks mid-loop
            if not scoring_error:
                try:
                    seqs[0].score_rows(start, rows_logits)
                except Exception as err:  # noqa: BLE001
                    scoring_error.append(err)

        logits = self._run(rows, tokens, last_only, on_rows=score if kind == "prefill" and not last_only else None)
        if scoring_error:
            raise ScoringError(scoring_error[0])
        if self.policy is not None:
            self.policy.observed(self.load.last, kind, seqs)
        return logits

    SCORE_ROWS = 256  # prompt positions projected to the vocabulary at once when scoring a prompt (echo + logprobs)

    @torch.no_grad()
    def _run(self, rows: list[int], tokens: torch.Tensor, last_only: bool = False, on_rows=None) -> torch.Tensor:
        """Logits [B, 1, V] (fp32) of each row's last position; every rank runs it. A prompt being scored (one row,
        not `last_only`) is projected SCORE_ROWS positions at a time, each chunk handed to `on_rows(start,
        logits [n, V])` on rank 0, so no [T, V] copy is ever whole."""
        self.stats["forwards"] += 1
        out = self.model(tokens.to(self.device), cache=self.cache.select(rows), hidden_only=True)
        self.load.add(out.expert_counts)
        h = out.hidden  # [B, T, C]
        T = h.shape[1]
        if last_only or T == 1:
            logits = self.model.lm_head(h[:, -1:]).float()  # [B, 1, V]
            if on_rows is not None and not last_only:  # a one-token prompt being scored
                on_rows(0, logits[0])
            return logits
        for start in range(0, T, self.SCORE_ROWS):  # the same chunks on every rank (a sliced head is collective)
            logits = self.model.lm_head(h[0, start:start + self.SCORE_ROWS]).float()  # [n, V]
            if on_rows is not None:
                on_rows(start, logits)
        return logits[-1:][None]  # [1, 1, V]: the last chunk's last position

    @property
    def expert_tokens(self) -> list[torch.Tensor]:
        return self.load.tokens

    def rank_expert_tokens(self) -> list[list[int]]:
        return self.load.per_rank()

    def _emit(self, seq: Request, logits: torch.Tensor) -> int:
        """Sample and take one token for `seq`; an error (its tokenizer, its callback) fails `seq` alone."""
        try:
            made = seq.emit(logits, self.eos, self.decode)
        except Exception as err:  # noqa: BLE001
            self._fail(seq, err)
            return 0
        self.stats["tokens_out"] += made
        return int(made)

    def step(self) -> int:
        """Abort what was hung up on, admit and prefill, one decode step for all running requests, retire.
        Returns tokens generated."""
        self._take_aborts()
        with self.lock:
            room = self.max_batch - len(self.running)
            admitted, self.waiting = self.waiting[:room], self.waiting[room:]
        made = 0
        for seq in admitted:
            seq.slot = self.cache.acquire()
            self.running.append(seq)
            scored = seq.params.echo and seq.params.logprobs is not None  # every prompt position's log-probs
            try:
                logits = self._forward([seq.slot], torch.tensor([seq.prompt]), reset=[seq.slot], kind="prefill",
                                       seqs=[seq], last_only=not scored)[0]  # [1, V]
            except ScoringError as err:  # every rank finished the forward: this request alone fails
                self._fail(seq, err.__cause__ or err)
                continue
            except Exception as err:  # noqa: BLE001
                if self.ranks is not None and self.ranks.world > 1:
                    raise  # the other ranks may be inside this forward's collectives: the engine cannot go on
                self._fail(seq, err)
                continue
            self.stats["tokens_in"] += len(seq.prompt)
            made += self._emit(seq, logits[-1])
        live = [s for s in self.running if not s.finished and s not in admitted]
        if live:
            self.stats["decode_steps"] += 1
            if self.on_decode is not None:
                self.on_decode(len(live))
            try:
                logits = self._forward([s.slot for s in live], torch.tensor([[s.generated[-1]] for s in live]),
                                       kind="decode", seqs=live)
            except Exception as err:  # noqa: BLE001 - e.g. an offloaded expert's file changed on disk
                if self.ranks is not None and self.ranks.world > 1:
                    raise  # the other ranks may be inside this forward's collectives: the engine cannot go on
                for seq in live:  # the requests of this forward fail; the others (waiting) go on
                    self._fail(seq, err)
                live = []
            for seq, row in zip(live, logits[:, -1] if live else ()):
                made += self._emit(seq, row)
        for seq in [s for s in self.running if s.finished]:
            self._retired(seq)
        self.steps += 1
        return made

    # -- the other ranks (export/serve/ranks.py) --------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run every forward rank 0 sends, answer its pings, until it says stop."""
        while True:
            msg = rank_msgs.receive()
            if isinstance(msg, rank_msgs.Stop):
                return
            if isinstance(msg, rank_msgs.Ping):  # rank 0 checks that every rank is alive and asks how it is
                self._status()
                continue
            for r in msg.reset:  # a prefill starts its row at length 0
                self.cache.lens[r] = 0
            if self.placement is not None:
                self.placement.apply(msg.table, msg.expect)
            self._run(msg.rows, torch.tensor(msg.tokens), msg.last_only)

    def ping(self) -> None:
        """Rank 0: one round trip with every rank (a dead rank makes it raise within the collective's
        timeout); records each rank's status in `rank_status`."""
        rank_msgs.send(rank_msgs.Ping())
        self.rank_status = [s.to_dict() for s in self._status()]
        self.rank_status_at = time.time()

    def _status(self) -> list[rank_msgs.RankStatus]:
        return rank_msgs.gather_status(self.ranks.rank if self.ranks else 0, self.stats["forwards"], self.placement)

    def stop_followers(self) -> None:
        rank_msgs.send(rank_msgs.Stop())


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
