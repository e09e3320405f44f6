"""Expert placement in the serving runtime: physical replicas, placement policies, offload and prefetch.

    moe-pipeline serve runs/tiny/package --ep-size 2 --placement reactive
    moe-pipeline serve runs/tiny/package --ep-size 2 --placement predictive --replica-budget 0.5
    moe-pipeline serve runs/tiny/package --placement predictive --resident-experts 0.5

On the data-parallel serving path (export/serve/engine.py: no tensor or expert slicing) the MoE
layers run `PlacedMoE`. Each rank routes its own tokens, and the ranks exchange them in an
all-to-all with variable splits (`pipeline.dist.all_to_all_`, DeepSpeed's comm; no capacity
padding): first one all-gather of every rank's tokens per expert, from which every rank computes
the same send and receive sizes, then the tokens go to the ranks holding their experts, each
expert runs once over the tokens of every rank, and the outputs travel back the same way. A rank
with no tokens still joins both exchanges. Without `--placement` the table is the native one.

Physical experts. Logical expert e of a layer lives natively on rank e // (experts / ep), as in
DeepSpeed's layout; a *replica table* may add copies on other ranks. The router's choice of a
logical expert is sent to one of its holders: each expert's tokens (of all ranks, in rank order)
are split between its holders so that the tokens per rank even out (water-filling over the
gathered counts, deterministic, identical on every rank), so a replica takes real work off the
busiest rank. The tokens each rank's experts receive are its measured load (`last_loads`: the
balancedness in /metrics). Outputs do not depend on the table (tests: same logits, same greedy tokens).

Policies (decided on rank 0, sent with each forward when they change):
  * `none`: native placement only;
  * `reactive` (EPLB-style, as vLLM's and SGLang's): replicas planned from a sliding window of
    observed per-expert load, re-planned every `replan_every` forwards;
  * `predictive` (MoE-MPMC): replicas planned from the demand the SRU predictor
    (export/serve/predictor.py) expects for the coming forward, prepared by a second thread.
Capacity capping: a rank holds at most `replica_budget` x (its native experts) replicas, over all
layers (every expert has the same size, so this is a memory budget); `plan_replicas` adds, one at
a time, the replica that most lowers a layer's busiest rank, until the budget is spent or no
replica helps. The predictive policy's tables are hedged: a forecast's expected loads are level after
a replica or two, so the slots left go to the most demanded experts, room for the exchange to
water-fill the forward's real counts (`plan_replicas(hedge=True)`).

Offload and prefetch (`--resident-experts F`): a rank keeps only a fraction F of its native experts
resident (tensors in memory); the others stay in the package's safetensors, memory-mapped (on a
GPU machine: host memory), and are loaded when needed. Before each forward the experts the table
expects to be used (predicted or observed demand) are prefetched in a loader thread, ahead of the
layer that needs them; an expert needed and not resident is loaded on demand (a miss). Hits and
misses are counted.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from export.serve.linears import linear, serving_linears, serving_weight
from pipeline.model import (GPT, MLP, Gate, ModelConfig, add_shared, expert_key, mix_residual, router_logits,
                            split_expert_key)

POLICIES = ("none", "reactive", "predictive")
# how the expert exchange moves tokens: a variable-split all-to-all (each rank receives only its tokens: the GPU
# path), or two low-latency all-reduces of every rank's routed tokens (DeepSpeed's shared-memory kernel between
# the ranks of one CPU machine, ~100x gloo's latency per call here: benchmarks/moe_exchange_bench.py)
TRANSPORTS = ("all-to-all", "all-reduce")
EXPERT_PARTS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


# -- tables: which ranks hold which experts -------------------------------------------------------------

def native_rank(expert: int, experts: int, ep: int) -> int:
    return expert // (experts // ep)


def native_table(cfg: ModelConfig, ep: int) -> list[list[list[int]]]:
    """holders[layer][expert] = [its native rank]."""
    return [[[native_rank(e, n, ep)] for e in range(n)] for n in cfg.experts]


def replica_slots(cfg: ModelConfig, ep: int, budget: float) -> int:
    """Replicas one rank may hold: `budget` x its native experts (all layers; every expert is the same size)."""
    return int(math.floor(budget * sum(n // ep for n in cfg.experts) + 1e-9))


def count_replicas(table: list[list[list[int]]], ep: int) -> list[int]:
    """Replicas (non-native copies) each rank holds under `table`."""
    held = [0] * ep
    for layer in table:
        n = len(layer)
        for e, holders in enumerate(layer):
            for r in holders:
                if r != native_rank(e, n, ep):
                    held[r] += 1
    return held


def split_load(demand: list[float], holders: list[list[int]], ep: int, integer: bool = False) -> list[list[tuple[int, float]]]:
    """How each expert's demand is split over its holders so that the busiest rank is as light as it can be:
    single-holder experts first, then the replicated ones, heaviest first, each poured into its least-loaded
    holders (water-filling). `integer`: whole tokens, handed out one at a time. Returns, per expert,
    [(rank, amount)] in holder order. Deterministic: every rank computes the same split."""
    loads = [0.0] * ep
    parts: list[list[tuple[int, float]]] = [[] for _ in demand]
    for e, d in enumerate(demand):
        if len(holders[e]) == 1:
            loads[holders[e][0]] += d
            parts[e] = [(holders[e][0], d)]
    for e in sorted((e for e in range(len(demand)) if len(holders[e]) > 1), key=lambda e: (-demand[e], e)):
        hs = holders[e]
        give = {h: 0.0 for h in hs}
        if integer:
            for _ in range(int(demand[e])):
                h = min(hs, key=lambda h: (loads[h] + give[h], h))
                give[h] += 1
        else:  # continuous water-filling: raise the lowest holders to a common level
            level_of = sorted(hs, key=lambda h: (loads[h], h))
            left, k = demand[e], 1
            while left > 0:
                cur = [loads[h] + give[h] for h in level_of[:k]]
                nxt = loads[level_of[k]] if k < len(level_of) else math.inf
                room = (nxt - max(cur)) * k
                step = min(left, room)
                for h in level_of[:k]:
                    give[h] += step / k
                left -= step
                k += 1
        for h in hs:
            loads[h] += give[h]
        parts[e] = [(h, give[h]) for h in hs]
    return parts


def rank_loads(demand: list[float], holders: list[list[int]], ep: int) -> list[float]:
    loads = [0.0] * ep
    for e, pieces in enumerate(split_load(demand, holders, ep)):
        for r, amount in pieces:
            loads[r] += amount
    return loads


def balancedness(loads: list[float]) -> float:
    """mean / max of the per-rank loads (1: perfectly even; 1/ep: all on one rank)."""
    return (sum(loads) / len(loads) / max(loads)) if loads and max(loads) > 0 else 1.0


def route_pairs(counts: list[list[int]], holders: list[list[int]], ep: int) -> list[list[list[int]]]:
    """send[src][dst][e]: how many of rank src's tokens routed to expert e go to rank dst. `counts[src][e]`: each
    rank's tokens per expert. An expert's tokens of all ranks, in rank order, are cut between its holders in
    holder order by the water-filled split of the total (`split_load`, whole tokens), so every rank computes
    the same sends from the same gathered counts."""
    world, E = len(counts), len(holders)
    send = [[[0] * E for _ in range(ep)] for _ in range(world)]
    demand = [float(sum(col)) for col in zip(*counts)]
    single = all(len(h) == 1 for h in holders)
    parts = [[(holders[e][0], demand[e])] for e in range(E)] if single else split_load(demand, holders, ep, integer=True)
    for e in range(E):
        src, left = 0, counts[0][e] if world else 0
        for dst, amount in parts[e]:
            amount = int(amount)
            while amount:
                while left == 0:
                    src += 1
                    left = counts[src][e]
                k = min(amount, left)
                send[src][dst][e] += k
                amount -= k
                left -= k
    return send


def plan_replicas(cfg: ModelConfig, ep: int, demand: list[list[float]], slots: int,
                  hedge: bool = False) -> list[list[list[int]]]:
    """A replica table for `demand` (per layer, per expert) with at most `slots` replicas per rank.

    Greedy: add the replica (layer, expert, rank) that most lowers its layer's busiest-rank load,
    relative to the layer's total, until no rank has room or no replica lowers any layer's maximum.
    `hedge` (demand that is a forecast): then fill the slots left, most demanded experts first (their
    share of their layer's demand), each onto the rank with room that its layer loads least. The
    expected loads are often level after one replica a layer, yet the forward's real counts are not:
    every extra holder is room for the exchange to water-fill the forecast's error."""
    table = native_table(cfg, ep)
    free = [slots] * ep
    if ep == 1 or slots == 0:
        return table
    while any(free):
        best, best_gain = None, 1e-9
        for i, d in enumerate(demand):
            total = sum(d)
            if total <= 0:
                continue
            current = max(rank_loads(d, table[i], ep))
            loads = rank_loads(d, table[i], ep)
            # only replicas of experts on a busiest rank can help, onto ranks with room
            busiest = {r for r in range(ep) if loads[r] >= current - 1e-9}
            for e in sorted(range(len(d)), key=lambda e: -d[e]):
                if d[e] <= 0 or not busiest & set(table[i][e]):
                    continue
                for r in range(ep):
                    if free[r] == 0 or r in table[i][e]:
                        continue
                    trial = [list(h) for h in table[i]]
                    trial[e].append(r)
                    gain = (current - max(rank_loads(d, trial, ep))) / total
                    if gain > best_gain:
                        best, best_gain = (i, e, r), gain
        if best is None:
            break
        i, e, r = best
        table[i][e].append(r)
        free[r] -= 1
    if hedge:
        totals = [sum(d) for d in demand]  # once a layer, not once an expert
        shares = sorted(((d[e] / totals[i], i, e) for i, d in enumerate(demand) if totals[i] > 0
                         for e in range(len(d)) if d[e] > 0), reverse=True)
        for _, i, e in shares:
            if not any(free):
                break
            room = [r for r in range(ep) if free[r] and r not in table[i][e]]
            if room:
                loads = rank_loads(demand[i], table[i], ep)
                r = min(room, key=lambda r: loads[r])
                table[i][e].append(r)
                free[r] -= 1
    return table


def keep_or_replace(current, new, demand: list[list[float]], ep: int, margin: float = 0.05):
    """`new` if it lowers the busiest rank's expected load by more than `margin` of a layer's demand in
    some layer, else `current`: replicas are copied in when a table changes, so a table that is
    hardly better is not worth the copies (hysteresis)."""
    if current is None or new == current:
        return new
    for i, d in enumerate(demand):
        total = sum(d)
        if total > 0 and (max(rank_loads(d, current[i], ep)) - max(rank_loads(d, new[i], ep))) > margin * total:
            return new
    return current


# -- the expert store: every expert's weights in the package (mapped), resident copies on demand ------------

class ExpertStore:
    """Every expert's tensors in the package (or stage directory), memory-mapped: the host tier. `load`
    copies one expert into resident tensors of `dtype` on `device` (the accelerator's: on a GPU machine, the
    host-to-device copy). The mapping is private copy-on-write, read only here: the files are never changed.

    The files stay open as long as the store. Touching the mapping of a file truncated since it was mapped
    kills the process (SIGBUS), so before each `load` the open files' size and modification time are
    compared with what verification saw (`files`: export/package.py's `VerifiedPackage.files`; without it,
    what the store saw when it opened them): a changed file fails that load with a FileChangedError."""

    def __init__(self, src: Path, cfg: ModelConfig, dtype: torch.dtype, files: dict | None = None,
                 device: torch.device | str = "cpu"):
        import mmap
        import os

        from pipeline.artifacts import FileFacts, check_unchanged, open_regular
        from pipeline.weights import SAFETENSORS_DTYPES, read_header, weight_files

        self.src, self.cfg, self.dtype, self.device = Path(src), cfg, dtype, torch.device(device)
        self.where = weight_files(self.src, files)
        self._files, self._facts, self._maps, self._views = {}, {}, {}, {}
        for f in sorted(set(self.where.values())):
            fh = self._files[f] = open_regular(self.src / f)
            self._facts[f] = files[f] if files is not None else FileFacts.of(os.fstat(fh.fileno()))
            check_unchanged(fh.fileno(), self.src / f, self._facts[f])
            header, start = read_header(fh, self.src / f)
            self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            check_unchanged(fh.fileno(), self.src / f, self._facts[f])  # what was mapped is what was verified
            for key, info in header.items():
                if split_expert_key(key) is not None:
                    begin, end = info["data_offsets"]
                    dt = SAFETENSORS_DTYPES[info["dtype"]]
                    count = (end - begin) // torch.empty((), dtype=dt).element_size()
                    view = torch.frombuffer(self._maps[f], dtype=dt, count=count, offset=start + begin)
                    self._views[key] = view.view(info["shape"])

    def key(self, layer: int, expert: int, part: str) -> str:
        return expert_key(self.cfg.moe_layers[layer], expert, part)

    def load(self, layer: int, expert: int) -> tuple:
        """(fc1 weight, fc1 bias, fc2 weight, fc2 bias) of one expert, resident, in `dtype`; on the CPU the weights
        wrapped for the few-row kernel and oneDNN (export/serve/linears.py: no copy, nothing reordered)."""
        from pipeline.artifacts import FileChangedError, check_unchanged

        parts = EXPERT_PARTS if self.cfg.mlp_bias else EXPERT_PARTS[::2]  # the families' experts have no biases
        keys = [self.key(layer, expert, p) for p in parts]
        for f in dict.fromkeys(self.where[k] for k in keys):  # before touching the mapping
            try:
                check_unchanged(self._files[f].fileno(), self.src / f, self._facts[f])
            except FileChangedError as err:
                raise FileChangedError(f"expert {expert} of MoE layer {layer} not loaded: {err}") from None
        tensors = [self._views[k].to(device=self.device, dtype=self.dtype, copy=True) for k in keys]
        w1, b1, w2, b2 = tensors if self.cfg.mlp_bias else (tensors[0], None, tensors[1], None)
        return serving_weight(w1), b1, serving_weight(w2), b2

    def nbytes(self) -> int:
        """Bytes of one expert in the serving dtype."""
        h, f = self.cfg.hidden, self.cfg.expert_width
        up = 2 * f if self.cfg.activation == "swiglu" else f
        n = up * h + f * h + ((up + h) if self.cfg.mlp_bias else 0)
        return n * torch.finfo(self.dtype).bits // 8


@dataclass
class PlacementStats:
    forwards: int = 0
    # per layer: sum over forwards of tokens x (mean / max tokens per rank), and of tokens: a token-weighted mean
    balancedness_sum: list[float] = field(default_factory=list)
    balancedness_weight: list[float] = field(default_factory=list)
    hits: int = 0  # experts needed by a forward that were resident (or prefetched in time)
    misses: int = 0  # experts needed and loaded on demand
    prefetched: int = 0
    table_changes: int = 0
    # per forward: summed mean over summed max of the per-rank loads across layers (vLLM's balancedness),
    # token-weighted as above
    step_sum: float = 0.0
    step_weight: float = 0.0
    expert_s: float = 0.0  # seconds this rank computed experts
    exchange_s: float = 0.0  # seconds in the exchange's collectives (the transfers, and waiting for the other ranks)


class Placement:
    """One rank's side: the replica table in force, the resident experts, and what it observed."""

    def __init__(self, cfg: ModelConfig, store: ExpertStore, rank: int, world: int, resident_fraction: float = 1.0,
                 transport: str = "all-to-all"):
        if transport not in TRANSPORTS:
            raise ValueError(f"--expert-exchange {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.cfg, self.store, self.rank, self.ep, self.transport = cfg, store, rank, world, transport
        self.table = native_table(cfg, world)
        self.native = [{e for e in range(n) if native_rank(e, n, world) == rank} for n in cfg.experts]
        self.resident_fraction = resident_fraction
        natives = [(i, e) for i, s in enumerate(self.native) for e in sorted(s)]
        # room for native experts in memory: a fraction of them; the least recently used one leaves first
        self.capacity = max(1, round(resident_fraction * len(natives)))
        self.resident: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.cached: OrderedDict[tuple[int, int], None] = OrderedDict()  # resident natives, LRU first
        for key in natives[:self.capacity]:
            self._admit(key, store.load(*key))
        self.stats = PlacementStats(balancedness_sum=[0.0] * len(cfg.experts),
                                    balancedness_weight=[0.0] * len(cfg.experts))
        self.lock = threading.Lock()
        self._prefetch: threading.Thread | None = None
        self._expect: list[set[int]] = [set() for _ in cfg.experts]
        self._loads: list[list[int]] = [[0] * world for _ in cfg.experts]  # the last forward's, per layer

    # -- the table ------------------------------------------------------------------------------------------
    def apply(self, table: list[list[list[int]]] | None, expect: list[list[int]] | None = None) -> None:
        """Use `table` from this forward on (None: keep the current one): load the replicas it gives this
        rank, drop those it no longer does; then prefetch the experts `expect`ed in a loader thread."""
        self._join_prefetch()
        if table is not None and table != self.table:
            self.stats.table_changes += 1
            self.table = table
            for i, layer in enumerate(table):
                for e, holders in enumerate(layer):
                    key = (i, e)
                    if e in self.native[i]:
                        continue
                    if self.rank in holders and key not in self.resident:
                        self.resident[key] = self.store.load(i, e)
                    elif self.rank not in holders and key in self.resident:
                        del self.resident[key]
        if expect is not None and self.resident_fraction < 1.0:
            # `expect`: per layer, the experts expected, most demanded first; prefetch what fits
            ranked = sorted(((j, i, e) for i, es in enumerate(expect) for j, e in enumerate(es) if e in self.native[i]))
            ours = [(i, e) for _, i, e in ranked][:self.capacity]  # each layer's likeliest first, layers interleaved
            wanted = [key for key in ours if key not in self.resident]
            self._expect = [{e for (i, e) in ours if i == layer} for layer in range(len(expect))]
            with self.lock:
                for key in ours:  # expected ones already resident: most recently used, not evicted by the prefetch
                    if key in self.cached:
                        self.cached.move_to_end(key)
            if wanted:
                self._prefetch = threading.Thread(target=self._load_all, args=(wanted,), name="prefetch", daemon=True)
                self._prefetch.start()

    def _load_all(self, keys) -> None:
        for key in keys:
            tensors = self.store.load(*key)
            with self.lock:
                if key not in self.resident:
                    self._admit(key, tensors)
                    self.stats.prefetched += 1

    def _join_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None

    def _admit(self, key, tensors) -> None:
        """A non-pinned native expert becomes resident, evicting the least recently used one if full."""
        self.resident[key] = tensors
        self.cached[key] = None
        self.cached.move_to_end(key)
        while len(self.cached) > self.capacity:
            old, _ = self.cached.popitem(last=False)
            del self.resident[old]

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """Expert tensors for this forward: resident (a hit), being prefetched (wait: a hit if it was
        expected), or loaded now (a miss)."""
        key = (layer, expert)
        with self.lock:
            if key in self.resident:
                self.stats.hits += 1
                if key in self.cached:
                    self.cached.move_to_end(key)
                return self.resident[key]
        if expert in self._expect[layer] and self._prefetch is not None:
            self._join_prefetch()
            with self.lock:
                if key in self.resident:
                    self.stats.hits += 1
                    return self.resident[key]
        tensors = self.store.load(layer, expert)
        with self.lock:
            self.stats.misses += 1
            if expert in self.native[layer]:
                self._admit(key, tensors)
        return tensors

    # -- the expert exchange ------------------------------------------------------------------------------------
    def exchange(self, layer: int, xs: torch.Tensor, per_expert: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert outputs of this rank's (token, choice) pairs `xs` [pairs, C], grouped by expert (`per_expert`
        each), computed wherever the table sends them; and the tokens per expert over all ranks [E]. Collective
        on several ranks: an all-gather of the counts, then an all-to-all there and back."""
        E, world, me = len(per_expert), self.ep, self.rank
        if world == 1:  # every expert here: nothing to route or send
            self._loads[layer] = [len(xs)]
            self.observe(layer, self._loads[layer])
            return self._run_experts(layer, xs, [per_expert]), torch.tensor(per_expert, dtype=torch.long)
        from pipeline import dist

        t0 = time.perf_counter()
        gather = dist.gather_rows if self.transport == "all-reduce" else dist.gather_numbers
        counts = [[int(c) for c in row] for row in gather(per_expert)]  # [rank][expert]
        self.stats.exchange_s += time.perf_counter() - t0
        send = route_pairs(counts, self.table[layer], world)  # [src][dst][expert] pairs
        loads = [sum(sum(send[s][h]) for s in range(world)) for h in range(world)]
        self._loads[layer] = loads
        self.observe(layer, loads)
        total = torch.tensor([sum(col) for col in zip(*counts)], dtype=torch.long)
        # my pairs are grouped by expert; within an expert they go to its holders in order: the send order is
        # (destination, expert), the order the receiver expects
        starts = [0] * E
        for e in range(1, E):
            starts[e] = starts[e - 1] + per_expert[e - 1]
        taken = [0] * E
        pieces = [[] for _ in range(world)]
        for h in range(world):
            for e in range(E):
                k = send[me][h][e]
                if k:
                    pieces[h].append((starts[e] + taken[e], k))
                    taken[e] += k
        order = torch.tensor([i for h in range(world) for a, k in pieces[h] for i in range(a, a + k)],
                             dtype=torch.long, device=xs.device)
        in_splits = [sum(send[me][h]) for h in range(world)]
        out_splits = [sum(send[s][me]) for s in range(world)]
        sizes = [[send[s][me][e] for e in range(E)] for s in range(world)]
        if self.transport == "all-reduce":
            return self._exchange_by_reduce(layer, xs, order, send, sizes), total
        got = xs.new_empty(sum(out_splits), xs.shape[1])
        t0 = time.perf_counter()
        dist.all_to_all_(got, xs[order].contiguous(), out_splits, in_splits)
        t1 = time.perf_counter()
        done = self._run_experts(layer, got, sizes)
        back = xs.new_empty(len(order), xs.shape[1])
        t2 = time.perf_counter()
        dist.all_to_all_(back, done, in_splits, out_splits)
        self.stats.exchange_s += (t1 - t0) + (time.perf_counter() - t2)
        y = torch.empty_like(xs)
        y[order] = back
        return y, total

    def _exchange_by_reduce(self, layer: int, xs: torch.Tensor, order: torch.Tensor, send, sizes) -> torch.Tensor:
        """The exchange as two all-reduces of one table of every rank's routed tokens: rank s writes its rows (in
        (destination, expert) order) at its offset, the others' rows are zeros, the sum is everybody's rows;
        each rank takes the blocks sent to it, computes, and writes its outputs where those rows were for the
        way back. Exact (x + 0 = x in every dtype)."""
        from pipeline import dist

        world, me = self.ep, self.rank
        sent = [sum(sum(send[s][h]) for h in range(world)) for s in range(world)]  # rows each rank sends
        start = [sum(sent[:s]) for s in range(world)]
        mine = [start[s] + sum(sum(send[s][h]) for h in range(me)) for s in range(world)]  # where my blocks lie
        n_in = [sum(send[s][me]) for s in range(world)]
        table = xs.new_zeros(sum(sent), xs.shape[1])
        table[start[me]:start[me] + sent[me]] = xs[order]
        t0 = time.perf_counter()
        dist.fast_all_reduce_(table)
        t1 = time.perf_counter()
        got = torch.cat([table[mine[s]:mine[s] + n_in[s]] for s in range(world)])
        done = self._run_experts(layer, got, sizes)
        back = torch.zeros_like(table)
        pos = 0
        for s in range(world):
            back[mine[s]:mine[s] + n_in[s]] = done[pos:pos + n_in[s]]
            pos += n_in[s]
        t2 = time.perf_counter()
        dist.fast_all_reduce_(back)
        self.stats.exchange_s += (t1 - t0) + (time.perf_counter() - t2)
        y = torch.empty_like(xs)
        y[order] = back[start[me]:start[me] + sent[me]]
        return y

    def _run_experts(self, layer: int, got: torch.Tensor, sizes: list[list[int]]) -> torch.Tensor:
        """Each expert once over the tokens it received: `got` holds, for each source rank in order, `sizes[src][e]`
        tokens of each expert e in order; outputs in the same order."""
        t0 = time.perf_counter()
        E = len(sizes[0])
        offset = [0, *itertools.accumulate(n for row in sizes for n in row)]  # of source s's expert e: s * E + e
        out = torch.empty_like(got)
        for e in [e for e, n in enumerate(map(sum, zip(*sizes))) if n]:  # the experts that received tokens
            parts = [(offset[s * E + e], sizes[s][e]) for s in range(len(sizes)) if sizes[s][e]]
            idx = parts[0] if len(parts) == 1 else None
            if idx is not None:
                rows = got[idx[0]:idx[0] + idx[1]]
            else:
                where = torch.cat([torch.arange(a, a + n, device=got.device) for a, n in parts])
                rows = got[where]
            w1, b1, w2, b2 = self.weights(layer, e)
            h = linear(rows, w1, b1)
            if self.cfg.activation == "swiglu":  # fc1 = [gate; up]
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            y = linear(h, w2, b2)
            if idx is not None:
                out[idx[0]:idx[0] + idx[1]] = y
            else:
                out[where] = y
        self.stats.expert_s += time.perf_counter() - t0
        return out

    def last_loads(self) -> list[list[int]]:
        """The tokens each rank's experts received in each MoE layer of the last forward."""
        return [list(loads) for loads in self._loads]

    # -- accounting -----------------------------------------------------------------------------------------
    def observe(self, layer: int, loads: list[float]) -> None:
        """This forward's tokens per rank in `layer`, as placed."""
        st = self.stats
        st.balancedness_sum[layer] += sum(loads) * balancedness(loads)
        st.balancedness_weight[layer] += sum(loads)
        if layer == len(self.cfg.experts) - 1:
            st.forwards += 1
            total = sum(sum(lo) for lo in self._loads)
            peak = sum(max(lo) for lo in self._loads)
            if peak:
                st.step_sum += total / self.ep / peak * total
                st.step_weight += total

    def step_balancedness(self) -> float:
        """vLLM's balancedness of the forwards so far: per forward, the summed mean over the summed max across MoE
        layers of the tokens each rank's experts received; a token-weighted mean (1: even)."""
        st = self.stats
        return st.step_sum / st.step_weight if st.step_weight else 1.0

    def balancedness(self) -> list[float]:
        """Per layer: the token-weighted mean over forwards of mean/max tokens per rank (1: even)."""
        st = self.stats
        return [b / w if w else 1.0 for b, w in zip(st.balancedness_sum, st.balancedness_weight)]

    def resident_bytes(self) -> dict[str, int]:
        """Expert bytes held now: native resident and replicas; `native_full`: all natives resident."""
        per = self.store.nbytes()
        replicas = sum(1 for (i, e) in self.resident if e not in self.native[i])
        natives = len(self.resident) - replicas
        return {"native": natives * per, "replicas": replicas * per,
                "native_full": sum(len(s) for s in self.native) * per}


# -- the MoE layer ----------------------------------------------------------------------------------------------

class PlacedMoE(nn.Module):
    """An MoE layer whose experts live where the placement says (module names as DeepSpeed's for the
    gate and the residual part, so `load_weights` fills them; experts come from the `Placement`)."""

    def __init__(self, cfg: ModelConfig, index: int, num_experts: int, placement: Placement):
        super().__init__()
        self.cfg, self.index, self.num_experts = cfg, index, num_experts
        self.impl, self.ep_size = "placed", placement.ep
        self.__dict__["placement"] = placement  # not a submodule
        self.moe = nn.Module()
        self.moe.deepspeed_moe = nn.Module()
        self.moe.deepspeed_moe.gate = Gate(cfg.hidden, num_experts)
        if cfg.mlp_type == "residual":
            self.moe.mlp = MLP(cfg)
            self.moe.coefficient = nn.Linear(cfg.hidden, 2)
        if cfg.shared_expert_hidden:  # Qwen2-MoE's shared expert, on every rank (not an expert: data parallel)
            self.shared = MLP(cfg, cfg.shared_expert_hidden)
            self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] of this rank's rows (B may be 0); `valid` [B, T]: the real tokens (the rest is padding, never
        routed). Collective on several ranks. Returns (output, 0, tokens per expert over all ranks)."""
        cfg, E, pl = self.cfg, self.num_experts, self.placement
        B, T, C = x.shape
        xs = x.reshape(B * T, C)
        real = valid.reshape(-1).nonzero().squeeze(1) if valid is not None else None
        if real is not None:
            xs = xs[real]
        weights, token, choice, per_expert = serving_route(xs, self.moe.deepspeed_moe.gate.wg.weight, cfg.top_k, E,
                                                           cfg.renormalizes)
        y, counts = pl.exchange(self.index, xs[token], per_expert)  # [pairs, C]: each (token, choice)'s expert output
        # back in (token, choice) order, each token's choices weighted and added: a gather, where a scatter-add
        # (index_add_) starts every intra-op thread even for one token (~0.2 ms a layer at batch 1 when they sleep)
        k = cfg.top_k
        mine = y.index_select(0, (token * k + choice).argsort()).view(-1, k, C)  # [S, k, C]
        w = weights.to(y.dtype)
        out = mine[:, 0] * w[:, 0, None]
        for c in range(1, k):
            out.addcmul_(mine[:, c], w[:, c, None])
        if real is not None:
            full = x.new_zeros(B * T, C)
            full[real] = out
            out = full
        out = out.view(B, T, C)
        if cfg.mlp_type == "residual":
            out = mix_residual(self.moe, x, out)
        return add_shared(self, x, out), xs.new_zeros((), dtype=torch.float32), counts


def serving_route(xs: torch.Tensor, wg: torch.Tensor, top_k: int, E: int, renormalize: bool | None = None):
    """`pipeline.model.route` + `group_by_expert` as inference needs them, in fewer operations (no balancing loss, no
    capacity: nothing is dropped at inference): (mixing weights [S, k], and the (token, choice) pairs grouped by
    expert, stable, with each expert's count, read to the host in one sync). Tested against route."""
    probs = router_logits(xs, wg).softmax(dim=-1)  # [S, E] fp32
    top_p, top_i = probs.topk(top_k, dim=-1)  # [S, k]
    if renormalize if renormalize is not None else top_k > 1:  # DeepSpeed's rule: for k >= 2
        top_p = top_p / top_p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(top_p.dtype).eps)
    flat = top_i.reshape(-1)  # (token, choice) pairs in row-major order, as keep.nonzero() lists them
    order = flat.argsort(stable=True)
    return top_p, order // top_k, order % top_k, torch.bincount(flat, minlength=E).tolist()


def placed_model(cfg: ModelConfig, src: Path, ranks, dtype: torch.dtype, resident_fraction: float = 1.0,
                 files: dict | None = None, transport: str = "auto") -> GPT:
    """The model with `PlacedMoE` layers on this rank: every rank holds the dense part and the gates;
    experts come from its `Placement` (its native experts, resident or mapped, plus replicas).
    Expert parallel over all ranks (`serve --placement` needs --ep-size = ranks, no --tp-size:
    ServeConfig checks the flags). `files`: what verification saw of each file (export.package.VerifiedPackage);
    every read from the package compares it with the open file first."""
    from export.inference import Layout
    from pipeline import dist
    from pipeline.build import cast_keeping_gates, meta_model
    from pipeline.weights import load_weights

    for n in cfg.experts:
        if n % ranks.world:
            raise ValueError(f"--placement on {ranks.world} ranks: every MoE layer's experts {list(cfg.experts)} must "
                             f"divide evenly; choose --nproc accordingly")
    if transport == "auto":
        transport = "all-reduce" if ranks.world > 1 and dist.shared_memory_reduce() else "all-to-all"
    placement = Placement(cfg, ExpertStore(src, cfg, dtype, files, device=dist.device()), ranks.rank, ranks.world,
                          resident_fraction,
                          transport)
    model = meta_model(cfg)
    model.to_empty(device="cpu")
    for i, block in enumerate(b for b in model.blocks if b.is_moe):
        block.mlp = PlacedMoE(cfg, i, cfg.experts[i], placement)
    if cfg.tie_embeddings:  # to_empty made the tied head a separate tensor
        model.lm_head.weight = model.wte.weight
    cast_keeping_gates(model, dtype)
    load_weights(model, src, files=files)
    model = model.to(device=dist.device()).eval().requires_grad_(False)
    serving_linears(model)  # on the CPU: the few-row kernel and oneDNN (export/serve/linears.py)
    model.placement = placement
    model.layout = Layout(ranks.world, 1, tuple(ranks.world for _ in cfg.experts), ranks.world)
    return model


# -- rank 0: the policies --------------------------------------------------------------------------------------

class Policy:
    """Decides the replica table for each forward (rank 0). `table_for` returns (table or None if
    unchanged, the experts expected per layer for prefetching or None)."""

    name = "none"

    def __init__(self, cfg: ModelConfig, ep: int, budget: float):
        self.cfg, self.ep, self.budget = cfg, ep, budget
        self.slots = replica_slots(cfg, ep, budget)
        self.table = native_table(cfg, ep)

    def table_for(self, kind: str, seqs) -> tuple[list | None, list | None]:
        """Before a forward of `kind` ("prefill": chunks of the prompts of `seqs`; "decode": one token of each of
        `seqs`), over every rank's rows."""
        return None, None

    def submitted(self, seq) -> None:
        """A request arrived (called from the HTTP thread)."""

    def observed(self, demand: list[list[int]], kind: str, seqs) -> None:
        """The per-layer, per-expert tokens routed in the forward that just ran."""

    def finished(self, seq) -> None:
        """A request is done (finished, aborted or failed): whatever the policy keeps for it goes."""

    def close(self) -> None:
        pass

    def _set(self, table) -> list | None:
        if table == self.table:
            return None
        self.table = table
        return table


class ReactivePolicy(Policy):
    """EPLB-style: the mean load over the last `window` forwards, re-planned every `replan_every` forwards."""

    name = "reactive"

    def __init__(self, cfg, ep, budget, window: int = 32, replan_every: int = 8):
        super().__init__(cfg, ep, budget)
        self.window: deque = deque(maxlen=window)
        self.replan_every, self.since = replan_every, 0

    def observed(self, demand, kind, seqs):
        self.window.append(demand)

    def table_for(self, kind, seqs):
        self.since += 1
        if self.since < self.replan_every or not self.window:
            return None, self._expected()
        self.since = 0
        mean = [[sum(d[i][e] for d in self.window) / len(self.window) for e in range(n)]
                for i, n in enumerate(self.cfg.experts)]
        table = keep_or_replace(self.table, plan_replicas(self.cfg, self.ep, mean, self.slots), mean, self.ep)
        return self._set(table), self._expected()

    def _expected(self):
        """Experts seen in the window, most used first: those the next forward most likely uses."""
        if not self.window:
            return None
        return [sorted((e for e in range(n) if any(d[i][e] for d in self.window)),
                       key=lambda e: -sum(d[i][e] for d in self.window)) for i, n in enumerate(self.cfg.experts)]
