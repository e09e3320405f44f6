"""The scheduler of `moe-pipeline serve` (rank 0): queues, token budgets, data-parallel ranks, KV blocks.

    from export.serve.scheduler import Scheduler
    sched = Scheduler(ranks=2, blocks=512, block_size=16, max_batch=32, max_batched_tokens=2048)
    sched.add(request)                     # any thread
    plan = sched.schedule()                # the next step: plan.step (export/serve/step.py) and its requests
    ... every rank runs plan.step ...
    sched.computed(plan)                   # the step ran: its tokens are in the KV cache
    sched.finish(request)                  # done: its blocks go back (cached for the prefix cache)

No torch and no collectives: what a step runs is decided here, as plain data, and unit-tested
without a model (tests/test_scheduler.py). As in vLLM v1:

  * KV lives in fixed-size blocks, one pool per data-parallel rank (`BlockPool`); a sequence holds a
    block table and gets a block when its tokens cross into one. Requests are admitted by free
    blocks (first come, first served), not by a row count; `max_batch` caps the sequences a rank runs.
  * When a running sequence needs a block and none is free, the most recently admitted sequence of
    its rank that this step has not scheduled yet is preempted (its blocks freed, its computed tokens
    forgotten) and goes back to the front of the queue, to be recomputed later from its prompt and
    the tokens it generated; if there is none, the sequence itself waits that way. A sequence is
    never failed for lack of blocks: the pool always holds one sequence of `max_model_len` alone.
  * Each rank runs at most `max_batched_tokens` tokens a step: decode tokens first, then chunks of
    prompts (a long prompt is cut over several steps: chunked prefill); a prompt's last chunk samples.
  * A new sequence goes to the rank where it adds the least work: the tokens that rank runs, less
    what its prefix cache already holds of this prompt.
  * Prefix caching: a full block is keyed by a hash of its tokens and of every block before it; a new
    sequence starts with the cached blocks of its longest cached prefix (shared, by reference count)
    and computes the rest. Freed blocks stay cached until a new block is needed (least recently used
    first). A prompt whose every block is cached still computes its last token (its logits).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from export.serve.request import Request
from export.serve.step import Forward, NewSeq, Row, Sampling, Step


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_keys(tokens: list[int], block_size: int, keys: list[bytes]) -> list[bytes]:
    """`keys` extended to every full block of `tokens`: key i hashes block i's tokens and key i - 1 (so a key names
    the whole prefix up to its block's end). 16-byte BLAKE2b: a collision would serve another prompt's keys."""
    for i in range(len(keys), len(tokens) // block_size):
        h = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        keys.append(h.digest())
    return keys


class BlockPool:
    """One rank's KV blocks: which are free, which are cached (by key) and who holds them (reference counts)."""

    def __init__(self, blocks: int, block_size: int, caching: bool = True):
        if blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one token, got {blocks} x {block_size}")
        self.blocks, self.block_size, self.caching = blocks, block_size, caching
        self.free: deque[int] = deque(range(blocks))  # holding nothing anyone could reuse: taken first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached and held by nobody, least recently used first
        self.refs = [0] * blocks
        self.key_of: dict[int, bytes] = {}
        self.by_key: dict[bytes, int] = {}

    def available(self) -> int:
        """Blocks a new allocation can take (free, or cached and held by nobody)."""
        return len(self.free) + len(self.evictable)

    def used(self) -> int:
        return self.blocks - self.available()

    def cached(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest prefix of `keys` that is cached."""
        out = []
        for key in keys if self.caching else ():
            block = self.by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Hold cached `blocks` (a prefix hit): they are no longer evictable."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.evictable[b]
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for one holder; free ones first, then the least recently used cached ones (their keys go)."""
        if n > self.available():
            raise RuntimeError(f"KV pool: {n} blocks asked, {self.available()} available")  # the scheduler checks first
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.by_key[self.key_of.pop(b)]
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """One holder lets go of `blocks` (a sequence's table). Its last blocks are evicted first (reversed: vLLM's
        order), so a shared prefix outlives the tails that hang off it."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def register(self, block: int, key: bytes) -> None:
        """`block` is full and holds the tokens `key` names: later prompts may share it. A key already cached in
        another block keeps that one (this block stays private to its holder)."""
        if self.caching and key not in self.by_key and block not in self.key_of:
            self.by_key[key] = block
            self.key_of[block] = key


@dataclass
class Plan:
    """One step as scheduled: the typed `step` the ranks run, and the requests behind its rows."""

    step: Step
    requests: dict[int, Request] = field(default_factory=dict)  # seq id -> request, for every row of the step
    aborted: list[Request] = field(default_factory=list)  # taken out of the queues before this step (to finish)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    decode_rows: int = 0  # sequences that decode a token in this step, over every rank


# the scheduler's counters (`Scheduler.stats`), in this order where the ranks' steps gather them
SCHED_STATS = ("prefix_queries", "prefix_hits", "preemptions")


def sampling_of(req: Request) -> Sampling:
    """What the rank that holds `req` needs to sample it (the prompt only where repetition_penalty reads it)."""
    p = req.params
    return Sampling(p.temperature, p.top_p, p.logprobs, req.seed(), p.top_k, p.min_p, p.presence_penalty,
                    p.frequency_penalty, p.repetition_penalty, p.logit_bias,
                    list(req.prompt) if p.repetition_penalty != 1.0 else None, p.grammar)


class Scheduler:
    """Waiting and running queues, token budgets, the data-parallel rank choice and every rank's KV blocks.

    `ranks`: data-parallel ranks (each its own sequences and pool; 1 when every rank runs the same rows);
    `blocks` per rank of `block_size` tokens; `max_batch`: sequences a rank runs at once; `max_batched_tokens`:
    tokens a rank runs in a step; `max_prefill_seqs`: prompts per prefill forward on a rank (None: all of the
    step's in one); `eos`: the end token (not sampled before a request's min_tokens); `mixed`: the decode tokens
    ride in the (first) prefill forward, one "mixed" forward (the ranks pack rows of different lengths:
    export/serve/kv_cache.py), else a forward of their own after the prefill ones. Thread safe: `add` and `abort`
    from any thread; the rest from the engine's."""

    def __init__(self, ranks: int, blocks: int, block_size: int, max_batch: int, max_batched_tokens: int,
                 max_prefill_seqs: int | None = None, prefix_caching: bool = True, eos: int | None = None,
                 mixed: bool = False):
        if max_batched_tokens < max_batch:
            raise ValueError(f"--max-batched-tokens {max_batched_tokens}: below --max-batch {max_batch}, a step "
                             f"could have no room for a new sequence; give at least {max_batch}")
        self.ranks, self.block_size = ranks, block_size
        self.max_batch, self.max_batched_tokens, self.max_prefill_seqs = max_batch, max_batched_tokens, max_prefill_seqs
        self.eos, self.mixed = eos, mixed
        self.pools = [BlockPool(blocks, block_size, prefix_caching) for _ in range(ranks)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first preempted
        self.tables: dict[int, list[int]] = {}  # seq id -> its blocks, in order
        self.keys: dict[int, list[bytes]] = {}  # seq id -> the keys of its full blocks (prefix caching)
        self.registered: dict[int, int] = {}  # seq id -> its leading blocks already registered in the cache
        self.started: set[int] = set()  # seq ids with a sampler on their rank
        self._freed: list[int] = []  # for the next step: block tables to drop, samplers to drop
        self._ended: list[int] = []
        self._aborts: set[int] = set()
        self.lock = threading.Lock()
        self.stats = dict.fromkeys(SCHED_STATS, 0)  # prefix-cache tokens queried / found cached, preemptions

    # -- queues (any thread) --------------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        with self.lock:
            self.waiting.append(req)

    def abort(self, seq: int) -> None:
        """End request `seq` at the next step: a waiting one never runs, a running one frees its blocks."""
        with self.lock:
            self._aborts.add(seq)

    def drain(self) -> list[Request]:
        """Every waiting and running request, taken out (the engine fails them); blocks are freed."""
        with self.lock:
            out = list(self.waiting) + self.running
            self.waiting.clear()
        for req in out:
            self.finish(req)
        return out

    def pending(self) -> int:
        with self.lock:
            return len(self.waiting) + len(self.running)

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def kv_usage(self) -> float:
        """The fraction of KV blocks in use (held by a sequence) over every rank's pool (vLLM's kv_cache_usage_perc)."""
        return sum(p.used() for p in self.pools) / sum(p.blocks for p in self.pools)

    def finish(self, req: Request) -> None:
        """`req` is done (finished, aborted or failed): its blocks go back to its rank's pool, its rank forgets it."""
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self.keys.pop(req.id, None)
        if req.id in self.started:
            self.started.discard(req.id)
            self._ended.append(req.id)

    def _release(self, req: Request) -> None:
        table = self.tables.pop(req.id, None)
        if table is not None:
            self.pools[req.rank].release(table)
            self._freed.append(req.id)
        self.registered.pop(req.id, None)
        req.num_computed = 0

    def _preempt(self, req: Request, plan: Plan) -> None:
        """Recompute `req` later (vLLM V1): its blocks go, it waits at the front of the queue for its rank."""
        self.running.remove(req)
        self._release(req)
        req.preemptions += 1
        self.stats["preemptions"] += 1
        plan.preempted.append(req)
        with self.lock:
            self.waiting.appendleft(req)

    def _take_aborts(self) -> list[Request]:
        with self.lock:
            ids, self._aborts = self._aborts, set()
            gone = [r for r in self.waiting if r.id in ids]
            for r in gone:
                self.waiting.remove(r)
        gone += [r for r in self.running if r.id in ids]
        for req in gone:
            self.finish(req)
        return gone

    def _keys(self, req: Request) -> list[bytes]:
        return block_keys(req.tokens, self.block_size, self.keys.setdefault(req.id, []))

    def _grow(self, req: Request, n: int) -> list[int] | None:
        """Blocks for `n` more tokens of running `req` (appended to its table), or None when its pool has too few."""
        table = self.tables[req.id]
        need = cdiv(req.num_computed + n, self.block_size) - len(table)
        pool = self.pools[req.rank]
        if need > pool.available():
            return None
        new = pool.allocate(max(need, 0))
        table += new
        return new

    def _row(self, req: Request, n: int, blocks: list[int]) -> Row:
        start = req.num_computed
        tokens = req.tokens_between(start, start + n)
        score, targets = -1, []
        if req.scores_prompt and start < len(req.prompt):
            score, targets = start, req.prompt[start + 1:start + 1 + n]
        return Row(req.id, start, tokens, blocks, sample=start + n == req.num_tokens,
                   banned=req.banned(self.eos), score=score, targets=targets)

    # -- one step ---------------------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """The next step: decode tokens of running sequences, chunks of prompts already started, new sequences."""
        plan = Plan(Step())
        plan.aborted = self._take_aborts()
        R = self.ranks
        budget = [self.max_batched_tokens] * R
        decode: list[list[Row]] = [[] for _ in range(R)]
        prefill: list[list[Row]] = [[] for _ in range(R)]
        done: set[int] = set()  # scheduled this step

        def add(req: Request, rows: list[list[Row]], row: Row) -> None:
            rows[req.rank].append(row)
            budget[req.rank] -= len(row.tokens)
            plan.requests[req.id] = req
            done.add(req.id)

        # 1. one token for each decoding sequence, in admission order; room made by preempting the newest
        for req in list(self.running):
            if req not in self.running or not req.generated or req.num_computed != req.num_tokens - 1:
                continue
            while (blocks := self._grow(req, 1)) is None:
                victim = next((v for v in reversed(self.running) if v.rank == req.rank and v.id not in done
                               and v is not req), None)
                self._preempt(victim or req, plan)
                if victim is None:
                    break
            if blocks is not None:
                add(req, decode, self._row(req, 1, blocks))
        # 2. the next chunk of each prompt already started (or of a preempted sequence being recomputed)
        for req in list(self.running):
            if req.id in done:
                continue
            pool, table = self.pools[req.rank], self.tables[req.id]
            room = len(table) * self.block_size - req.num_computed + pool.available() * self.block_size
            n = min(req.num_tokens - req.num_computed, budget[req.rank], room)
            if n > 0:
                add(req, prefill, self._row(req, n, self._grow(req, n)))
        # 3. new sequences, first come first served, while a rank has a row, tokens and blocks for their first chunk
        counts, loads = [0] * R, [0] * R  # sequences and tokens each rank runs (prompts and generated so far)
        for s in self.running:
            counts[s.rank] += 1
            loads[s.rank] += s.num_tokens
        while True:
            with self.lock:
                req = self.waiting[0] if self.waiting else None
            if req is None or self._sibling_prefilling(req) or not self._admit(req, budget, counts, loads, plan):
                break
            with self.lock:
                self.waiting.popleft()
            # its whole table: the rank's table for it starts empty (prefix-cache hits included)
            add(req, prefill, self._row(req, min(req.num_tokens - req.num_computed, budget[req.rank]),
                                        list(self.tables[req.id])))
        forwards = self._forwards(prefill, decode)
        plan.decode_rows = sum(len(rows) for rows in decode)
        if forwards:  # freed and ended sequences travel with the next step that runs something
            plan.step = Step(forwards, plan.step.new, self._freed, self._ended)
            self._freed, self._ended = [], []
        return plan

    def _sibling_prefilling(self, req: Request) -> bool:
        """Whether a running sequence is computing the first block of `req`'s prompt now (the n choices of one prompt,
        or the same prompt from two clients at once): then `req` waits until that block is in the prefix cache, and
        takes the prompt from it instead of computing it a second time beside its sibling."""
        if not self.pools[0].caching or req.scores_prompt or req.num_tokens <= self.block_size or req.rank is not None:
            return False
        first = self._keys(req)[0]
        return any(self.registered.get(s.id) == 0 and (self.keys.get(s.id) or (None,))[0] == first
                   and s.num_computed < s.num_tokens for s in self.running)

    def _admit(self, req: Request, budget: list[int], counts: list[int], loads: list[int], plan: Plan) -> bool:
        """Start `req` on the rank where it adds the least work (`loads`: tokens each rank runs) and its first chunk's
        blocks fit, below `max_batch` sequences (`counts`); False if none can. Updates `counts` and `loads`."""
        ranks = [req.rank] if req.rank is not None else range(self.ranks)  # a preempted one stays: its sampler
        # full blocks it may take from a prefix cache: never its last token (its logits are needed), never when its
        # prompt is scored position by position
        keys = [] if req.scores_prompt else self._keys(req)[:(req.num_tokens - 1) // self.block_size]
        options = []
        for r in ranks:
            if counts[r] >= self.max_batch or budget[r] <= 0:
                continue
            pool = self.pools[r]
            hit = pool.cached(keys)
            start = len(hit) * self.block_size
            n = min(req.num_tokens - start, budget[r])
            need = cdiv(start + n, self.block_size) - len(hit)
            free = pool.available() - sum(pool.refs[b] == 0 for b in hit)  # taking a hit makes it unavailable
            if need <= free:
                options.append((loads[r] - start, r, hit))
        if not options:
            return False
        _, r, hit = min(options, key=lambda o: o[:2])
        pool = self.pools[r]
        if not req.scores_prompt:
            self.stats["prefix_queries"] += req.num_tokens
            self.stats["prefix_hits"] += len(hit) * self.block_size
        pool.acquire(hit)
        req.rank, req.num_computed = r, len(hit) * self.block_size
        n = min(req.num_tokens - req.num_computed, budget[r])
        self.tables[req.id] = hit + pool.allocate(cdiv(req.num_computed + n, self.block_size) - len(hit))
        self.registered[req.id] = len(hit)
        self.running.append(req)
        counts[r] += 1
        loads[r] += req.num_tokens
        plan.admitted.append(req)
        if req.id not in self.started:
            self.started.add(req.id)
            plan.step.new.append(NewSeq(req.id, r, sampling_of(req)))
        return True

    def _forwards(self, prefill: list[list[Row]], decode: list[list[Row]]) -> list[Forward]:
        """The prefill forwards (at most `max_prefill_seqs` prompts of a rank each; every rank runs as many: one
        with fewer joins with an empty batch), then the decode forward; `mixed`, the decode rows go first in the
        first prefill forward instead."""
        out = []
        if any(prefill):
            n = self.max_prefill_seqs or max(len(rows) for rows in prefill)
            for j in range(max(cdiv(len(rows), n) for rows in prefill)):
                out.append(Forward("prefill", [rows[j * n:(j + 1) * n] for rows in prefill]))
        if any(decode):
            if self.mixed and out:
                out[0] = Forward("mixed", [d + p for d, p in zip(decode, out[0].rows)])
            else:
                out.append(Forward("decode", decode))
        return out

    def computed(self, plan: Plan) -> None:
        """`plan`'s step ran: its rows' tokens are in the KV cache; full blocks are registered in the prefix cache."""
        for fwd in plan.step.forwards:
            for rows in fwd.rows:
                for row in rows:
                    req = plan.requests[row.seq]
                    if req.id not in self.tables:  # failed or aborted meanwhile
                        continue
                    req.num_computed = row.start + len(row.tokens)
                    full = req.num_computed // self.block_size
                    if full > self.registered[req.id]:
                        keys, table, pool = self._keys(req), self.tables[req.id], self.pools[req.rank]
                        for i in range(self.registered[req.id], full):
                            pool.register(table[i], keys[i])
                        self.registered[req.id] = full
