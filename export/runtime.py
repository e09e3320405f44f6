"""The inference runtime behind `moe-pipeline serve`: a package on this rank, continuous batching.

    from export.runtime import Engine, SamplingParams
    engine = Engine.from_package("runs/tiny/package")
    seq = engine.submit(engine.encode("And God said"), SamplingParams(max_tokens=16))
    while not seq.finished:
        engine.step()
    print(engine.decode(seq.generated))

Sequences share decode steps: `step()` first prefills the sequences that arrived since the last
step (each alone, its whole prompt, into a free row of the `SlotCache`), then runs ONE forward of
one token for every running sequence, samples each sequence's next token, and retires the
finished ones (their rows are reused). A request that arrives while others decode joins at the
next step; nobody waits for a batch to drain.

`SlotCache` is a KV cache with one row per running sequence and a length per row, so rows of
different lengths decode together: keys are written at each row's own position, each query sees
its row's keys up to its own position (an explicit attention mask), and positions are per row.
pipeline/model.py uses it through the same three members as its `KVCache` (`length`, `update`,
and the `positions` / `attention_mask` hooks).

Multi-rank (expert parallel): every rank must run the same forwards (DeepSpeed's all-to-all joins
all ranks in every MoE layer). Rank 0 owns the scheduler; before each forward it broadcasts the
plan (which rows, which input tokens) and the other ranks (`follow()`) run exactly that forward.
Only rank 0 samples.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipeline.model import GPT, ModelConfig


# -- the cache ---------------------------------------------------------------------------------------

class SlotCache:
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

    # the interface pipeline/model.py uses
    @property
    def length(self) -> int:  # for the model's context check: the longest selected row
        return max(self._start, default=0)

    @length.setter
    def length(self, value: int) -> None:  # the model adds T after a forward: advance every selected row
        step = value - self.length
        for r in self.rows:
            self.lens[r] += step
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
class Sequence:
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
    on_token: object = None  # callback(seq) after every new token (streaming), from the engine's thread
    on_finish: object = None


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from fp32 logits [V]: argmax at temperature 0, else top-p nucleus sampling."""
    if params.temperature <= 0:
        return int(logits.argmax())
    probs = F.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


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
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.steps = 0
        self.stats = {"forwards": 0, "tokens_in": 0, "tokens_out": 0, "batch_sizes": []}
        # tokens routed to each expert of each MoE layer, over every forward so far (prompts included)
        self.expert_tokens = [torch.zeros(e, dtype=torch.long) for e in self.cfg.experts]
        self._last_counts: list[list[int]] = []
        # expert placement (export/placement.py): this rank's side, and rank 0's policy
        self.placement = getattr(model, "placement", None)
        self.policy = None
        self.rank_status: list[dict] = []  # every rank's last answer to `ping` (rank 0)
        self.rank_status_at: float | None = None

    @classmethod
    def from_package(cls, pkg, ranks=None, ep_size=None, dtype=None, max_batch: int = 32,
                     checksums: bool = True, tp_size: int | None = None, placement: str | None = None,
                     replica_budget: float = 0.25, resident_experts: float = 1.0) -> "Engine":
        """`placement` (none|reactive|predictive): experts placed by export/placement.py, with replicas up to
        `replica_budget` of a rank's expert memory and `resident_experts` of its experts resident."""
        from export.package import load_package
        from pipeline import dist

        ranks = ranks or dist.init()
        if placement is not None and not replica_budget >= 0:
            raise ValueError(f"--replica-budget {replica_budget}: a fraction >= 0 of a rank's expert memory")
        model, tok = load_package(pkg, ranks, ep_size=ep_size, checksums=checksums, dtype=dtype, tp_size=tp_size,
                                  placed=placement is not None, resident_fraction=resident_experts)
        engine = cls(model, tok, max_batch=max_batch, ranks=ranks)
        if placement is not None and ranks.rank == 0:
            from export.placement import make_policy

            predictor = None
            if placement == "predictive":
                from export.predictor import load_predictor

                predictor = load_predictor(pkg)
            engine.policy = make_policy(placement, model.cfg, ranks.world, replica_budget, predictor)
        return engine

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- scheduling (rank 0) ---------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> Sequence:
        if not prompt:
            raise ValueError("prompt: empty (give at least one token)")
        if len(prompt) + params.max_tokens > self.cfg.seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.cfg.seq_len}")
        seq = Sequence(next(self.ids), list(prompt), params, on_token=on_token, on_finish=on_finish)
        if self.policy is not None:
            self.policy.submitted(seq)
        if params.temperature > 0:
            seq.generator = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                          else int(time.time_ns() % (1 << 62)))
        with self.lock:
            self.waiting.append(seq)
        return seq

    def pending(self) -> int:
        with self.lock:
            return len(self.waiting) + len(self.running)

    def fail_all(self, message: str) -> None:
        """Finish every waiting and running sequence with finish_reason 'error' (the engine cannot go on)."""
        with self.lock:
            seqs, self.waiting = self.waiting + self.running, []
            self.running = []
        for seq in seqs:
            if not seq.finished:
                seq.text = message
                self._finish(seq, "error")

    def abort(self, seq: Sequence) -> None:
        seq.finish_reason = seq.finish_reason or "abort"
        seq.params.max_tokens = len(seq.generated)  # retired at the next step

    def _forward(self, rows: list[int], tokens: torch.Tensor, reset: list[int] = (), kind: str = "decode",
                 seqs: list[Sequence] = (), last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (fp32) of `tokens` [B, T] appended to `rows` ([B, 1, V]: the last position's only,
        with `last_only`); every rank runs it. With expert placement, rank 0's policy gives the replica
        table (and the experts to prefetch) for this forward."""
        from pipeline import dist

        table = expect = None
        if self.policy is not None:
            table, expect = self.policy.table_for(kind, seqs)
        if self.ranks is not None and self.ranks.world > 1:
            dist.broadcast_json(["forward", rows, tokens.tolist(), list(reset), table, expect, last_only])
        if self.placement is not None:
            self.placement.apply(table, expect)
        logits = self._run(rows, tokens, last_only)
        if self.policy is not None:
            self.policy.observed(self._last_counts, kind, seqs)
        return logits

    @torch.no_grad()
    def _run(self, rows: list[int], tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        self.stats["forwards"] += 1
        # last_only (a prefill): project to the vocabulary at the position that is sampled from only
        out = self.model(tokens.to(self.device), cache=self.cache.select(rows), hidden_only=last_only)
        self._last_counts = [c.to("cpu", torch.long).tolist() for c in out.expert_counts]
        for total, counts in zip(self.expert_tokens, out.expert_counts):
            total += counts.to("cpu", torch.long)
        if last_only:
            return self.model.lm_head(out.hidden[:, -1:]).float()
        return out.logits.float()

    def expert_ranks(self) -> list[list[list[int]]]:
        """For each MoE layer and expert, the global ranks that hold it (several with expert slicing)."""
        world = self.ranks.world if self.ranks is not None else 1
        layout = getattr(self.model, "layout", None)
        out = []
        for i, experts in enumerate(self.cfg.experts):
            ep = layout.ep[i] if layout is not None else 1
            local = experts // ep
            out.append([[r for r in range(world) if r % ep == e // local] for e in range(experts)])
        return out

    def rank_expert_tokens(self) -> list[list[int]]:
        """For each MoE layer, the tokens routed to the experts each rank holds (its expert load)."""
        world = self.ranks.world if self.ranks is not None else 1
        out = []
        for counts, holders in zip(self.expert_tokens, self.expert_ranks()):
            per_rank = [0] * world
            for e, ranks in enumerate(holders):
                for r in ranks:
                    per_rank[r] += int(counts[e])
            out.append(per_rank)
        return out

    def step(self) -> int:
        """Admit, prefill, one decode step for all running sequences, retire. Returns tokens generated."""
        with self.lock:
            room = self.max_batch - len(self.running)
            admitted, self.waiting = self.waiting[:room], self.waiting[room:]
        made = 0
        for seq in admitted:
            seq.slot = self.cache.acquire()
            scored = seq.params.echo and seq.params.logprobs is not None  # every prompt position's logits
            logits = self._forward([seq.slot], torch.tensor([seq.prompt]), reset=[seq.slot], kind="prefill",
                                   seqs=[seq], last_only=not scored)[0]  # [T, V] or [1, V]
            self.stats["tokens_in"] += len(seq.prompt)
            if scored:
                self._prompt_logprobs(seq, logits)
            self.running.append(seq)
            self._emit(seq, logits[-1])
            made += 1
        live = [s for s in self.running if not s.finished and s not in admitted]
        if live:
            self.stats["batch_sizes"].append(len(live))
            logits = self._forward([s.slot for s in live], torch.tensor([[s.generated[-1]] for s in live]),
                                   kind="decode", seqs=live)
            for seq, row in zip(live, logits[:, -1]):
                self._emit(seq, row)
                made += 1
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self.cache.release(seq.slot)
        self.steps += 1
        return made

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        logp = F.log_softmax(logits, dim=-1)  # [T, V]: row i predicts prompt token i+1
        seq.prompt_logprobs = [None] + [float(logp[i, t]) for i, t in enumerate(seq.prompt[1:])]
        k = seq.params.logprobs
        seq.prompt_top = [None] + [self._top(logp[i], k) for i in range(len(seq.prompt) - 1)]

    @staticmethod
    def _top(logp: torch.Tensor, k: int) -> dict[int, float]:
        if k <= 0:
            return {}
        vals, idx = logp.topk(k)
        return {int(i): float(v) for i, v in zip(idx, vals)}

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample seq's next token from its last position's logits, then check the stop conditions."""
        if len(seq.generated) >= seq.params.max_tokens:  # aborted
            self._finish(seq, seq.finish_reason or "length")
            return
        token = sample(logits, seq.params, seq.generator)
        if seq.params.logprobs is not None:
            logp = F.log_softmax(logits, dim=-1)
            seq.token_logprobs.append(float(logp[token]))
            seq.top_logprobs.append(self._top(logp, seq.params.logprobs))
        seq.first_token_at = seq.first_token_at or time.perf_counter()
        seq.generated.append(token)
        self.stats["tokens_out"] += 1
        if token == self.eos:
            seq.generated.pop()
            if seq.token_logprobs:
                seq.token_logprobs.pop()
                seq.top_logprobs.pop()
            self._finish(seq, "stop")
            return
        seq.text = self.decode(seq.generated)
        for s in seq.params.stop or ():
            if s and s in seq.text:
                seq.text = seq.text[:seq.text.index(s)]
                self._finish(seq, "stop")
                return
        if seq.on_token is not None:
            seq.on_token(seq)
        if len(seq.generated) >= seq.params.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finished, seq.finish_reason, seq.done_at = True, reason, time.perf_counter()
        if seq.on_finish is not None:
            seq.on_finish(seq)

    # -- other ranks -------------------------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run every forward rank 0 announces, until it says stop."""
        from pipeline import dist

        while True:
            msg = dist.broadcast_json(None)
            if msg[0] == "stop":
                return
            if msg[0] == "ping":  # rank 0 checks that every rank is alive and asks how it is
                self._status()
                continue
            _, rows, tokens, reset, table, expect, last_only = msg
            for r in reset:  # a prefill starts its row at length 0
                self.cache.lens[r] = 0
            if self.placement is not None:
                self.placement.apply(table, expect)
            self._run(rows, torch.tensor(tokens), last_only)

    def ping(self) -> None:
        """Rank 0: one round trip with every rank (a dead rank makes it raise within the collective's
        timeout); records each rank's status in `rank_status`."""
        from pipeline import dist

        if self.ranks is not None and self.ranks.world > 1:
            dist.broadcast_json(["ping"])
        self.rank_status = self._status()
        self.rank_status_at = time.time()

    def _status(self) -> list[dict]:
        """Collective: every rank's (rank, pid, forwards run, resident MiB), gathered as numbers (no pickle)."""
        import os

        import torch.distributed as td

        pl = self.placement
        held = pl.resident_bytes() if pl is not None else {"native": 0, "replicas": 0, "native_full": 0}
        mine = torch.tensor([self.ranks.rank if self.ranks else 0, os.getpid(), self.stats["forwards"], _rss_mib(),
                             pl.stats.hits if pl else 0, pl.stats.misses if pl else 0, held["native"],
                             held["replicas"], held["native_full"]], dtype=torch.float64)
        if self.ranks is not None and self.ranks.world > 1:
            rows = [torch.zeros_like(mine) for _ in range(self.ranks.world)]
            td.all_gather(rows, mine)
        else:
            rows = [mine]
        out = []
        for r in rows:
            status = {"rank": int(r[0]), "pid": int(r[1]), "forwards": int(r[2]), "rss_mib": round(float(r[3]), 1)}
            if pl is not None:
                status.update(expert_hits=int(r[4]), expert_misses=int(r[5]), native_expert_bytes=int(r[6]),
                              replica_bytes=int(r[7]), native_expert_bytes_all_resident=int(r[8]))
            out.append(status)
        return out

    def stop_followers(self) -> None:
        from pipeline import dist

        if self.ranks is not None and self.ranks.world > 1:
            dist.broadcast_json(["stop"])


def _rss_mib() -> float:
    """This process's resident memory (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as fh:
            import os

            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return 0.0


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
    """Submit `prompts` together and step until all are done (offline batch use and tests)."""
    seqs = [engine.submit(p, SamplingParams(**vars(params))) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    return seqs
