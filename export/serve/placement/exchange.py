"""The expert exchange of the data-parallel serving path: each rank's routed tokens travel to the ranks that
hold their experts, every expert runs once over what it received, and the outputs travel back (`Exchange`);
the MoE layer that uses it (`PlacedMoE`), and the model built of those layers (`place_experts`; the served model,
its kernels swapped in: export/serve/served.py `placed_model`).

    from export.serve.placement.exchange import place_experts
    model, exchange = place_experts(cfg, pkg, dist.init(), torch.float32)   # the model and this rank's exchange

On the data-parallel serving path (export/serve/engine.py: no tensor or expert slicing) the MoE
layers run `PlacedMoE`. Each rank routes its own tokens, and the ranks exchange them in an
all-to-all with variable splits (export/serve/transport.py `all_to_all_`, DeepSpeed's comm; no capacity
padding): first one all-gather of every rank's tokens per expert, from which every rank computes
the same send and receive sizes (`algo.route_pairs`: each expert's tokens water-filled over its
holders in the replica table in force), then the tokens go to the ranks holding their experts, each
expert runs once over the tokens of every rank, and the outputs travel back the same way. A rank
with no tokens still joins both exchanges. Without `--placement` the table is the native one.
The tokens each rank's experts receive are its measured load (`LoadMeter`: the balancedness in
/metrics). Outputs do not depend on the table (tests: same logits, same greedy tokens).

Between the ranks of one CPU machine (the shared-memory all-reduce) a decode batch's layer takes a shorter
way, `Exchange.run_gathered`: the step tells every rank how many tokens each rank runs (`begin`), one
all-reduce gathers all of them everywhere, every rank routes them alike, computes its own pairs, and a second
all-reduce sums the pairs (two collectives and three kernel calls, where the general exchange takes three
collectives and the Python between them).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from export.serve import kernels
from export.serve.kernels import linear
from export.serve.placement.algo import balancedness, native_table, route_pairs
from export.serve.placement.residency import ExpertStore, Residency, ResidencyStats
from export.serve.transport import all_to_all_, fast_all_reduce_, gather_rows, shared_memory_reduce
from pipeline.model import GPT, MLP, Gate, ModelConfig, add_shared, mix_residual, mlp_activation, router_logits

if TYPE_CHECKING:
    from export.serve.placement.controller import Directive

# how the expert exchange moves tokens: a variable-split all-to-all (each rank receives only its tokens: the GPU
# path), or two low-latency all-reduces of every rank's routed tokens (DeepSpeed's shared-memory kernel between
# the ranks of one CPU machine, ~100x gloo's latency per call here: benchmarks/moe_exchange_bench.py)
TRANSPORTS = ("all-to-all", "all-reduce")


# -- what the exchange measured ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExchangeStats:
    """One rank's exchange since start: its transport, forwards, the balance of the tokens each rank's experts
    received (per MoE layer, and per forward as vLLM measures it), seconds computing experts and in the
    collectives (transfers and waiting for the other ranks), and the experts it held (`residency`)."""

    transport: str
    forwards: int
    balancedness: tuple[float, ...]
    step_balancedness: float
    expert_s: float
    exchange_s: float
    residency: ResidencyStats
    gathered: int = 0  # MoE layers run by `run_gathered` (the decode batches of ranks on one machine)


class LoadMeter:
    """The tokens each rank's experts received in each MoE layer: the last forward's, and their balance since start
    (token-weighted means, so a forward of many tokens counts for more than one of a few)."""

    def __init__(self, layers: int, ep: int):
        self.ep = ep
        self.last = [[0] * ep for _ in range(layers)]  # the last forward's, per layer
        self.forwards = 0
        # per layer: sum over forwards of tokens x (mean / max tokens per rank), and of tokens
        self.layer_sum, self.layer_weight = [0.0] * layers, [0.0] * layers
        # per forward: summed mean over summed max of the per-rank loads across layers, token-weighted as above
        self.step_sum, self.step_weight = 0.0, 0.0

    def observe(self, layer: int, loads: list[int]) -> None:
        """This forward's tokens per rank in `layer`, as placed (the last layer ends the forward)."""
        self.last[layer] = loads
        self.layer_sum[layer] += sum(loads) * balancedness(loads)
        self.layer_weight[layer] += sum(loads)
        if layer == len(self.last) - 1:
            self.forwards += 1
            total = sum(sum(lo) for lo in self.last)
            peak = sum(max(lo) for lo in self.last)
            if peak:
                self.step_sum += total / self.ep / peak * total
                self.step_weight += total

    def balancedness(self) -> tuple[float, ...]:
        """Per layer: the token-weighted mean over forwards of mean/max tokens per rank (1: even)."""
        return tuple(b / w if w else 1.0 for b, w in zip(self.layer_sum, self.layer_weight))

    def step_balancedness(self) -> float:
        """vLLM's balancedness of the forwards so far: per forward, the summed mean over the summed max across MoE
        layers of the tokens each rank's experts received; a token-weighted mean (1: even)."""
        return self.step_sum / self.step_weight if self.step_weight else 1.0


# -- the exchange -------------------------------------------------------------------------------------------

class Seconds:
    """Seconds of device work between two `mark`s, summed per kind. On the CPU the host's clock; on a GPU a pair of
    CUDA events on the current stream, read when the sum is asked for (the host's clock there times the launches,
    not the work, and a sync at every mark would stall the stream)."""

    PENDING = 512  # event pairs kept unread before the finished ones are read

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done: dict[str, float] = {}
        self.pending: list[tuple[str, object, object]] = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, kind: str, start, end) -> None:
        if not self.cuda:
            self.done[kind] = self.done.get(kind, 0.0) + (end - start)
            return
        self.pending.append((kind, start, end))
        if len(self.pending) > self.PENDING:
            self._read(wait=False)

    def add_seconds(self, kind: str, seconds: float) -> None:
        self.done[kind] = self.done.get(kind, 0.0) + seconds

    def total(self, kind: str) -> float:
        self._read(wait=True)
        return self.done.get(kind, 0.0)

    def _read(self, wait: bool) -> None:
        left = []
        for kind, start, end in self.pending:
            if wait or end.query():
                end.synchronize()
                self.add_seconds(kind, start.elapsed_time(end) / 1000)
            else:
                left.append((kind, start, end))
        self.pending = left


class Exchange:
    """One rank's side of every MoE layer's expert exchange, under the replica table in force (`apply` changes it);
    the experts' weights come from its `Residency`."""

    def __init__(self, cfg: ModelConfig, residency: Residency, rank: int, ep: int, transport: str = "all-to-all"):
        if transport not in TRANSPORTS:
            raise ValueError(f"--expert-exchange {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.cfg, self.residency, self.rank, self.ep, self.transport = cfg, residency, rank, ep, transport
        self.table = native_table(cfg, ep)
        self.meter = LoadMeter(len(cfg.experts), ep)
        # seconds this rank computed experts ("expert"), and in the exchange's collectives ("exchange": the transfers,
        # and waiting for the other ranks)
        self.seconds = Seconds(residency.store.device)
        self.tokens: list[int] | None = None  # the forward under way: the real tokens of each rank (`begin`)
        self.gathered = 0  # MoE layers run by run_gathered
        self._owner: dict[int, torch.Tensor] = {}  # layer -> each expert's one holder, under a table without replicas

    def apply(self, directive: Directive | None) -> None:
        """Before a forward: the prefetch under way finishes; then `directive`'s table is in force from this forward
        on (its replicas for this rank loaded, those it no longer gives dropped) and its expected experts are
        prefetched."""
        self.residency.settle()
        if directive is None:
            return
        if directive.table is not None and directive.table != self.table:
            self.table = directive.table
            self._owner = {}
            self.residency.hold(self.table)
        if directive.expect is not None:
            self.residency.prefetch(directive.expect)

    def run(self, layer: int, xs: torch.Tensor, per_expert: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert outputs of this rank's (token, choice) pairs `xs` [pairs, C], grouped by expert (`per_expert`
        each), computed wherever the table sends them; and the tokens per expert over all ranks [E]. Collective
        on several ranks: an all-gather of the counts, then the transport there and back."""
        E, world, me = len(per_expert), self.ep, self.rank
        if world == 1:  # every expert here: nothing to route or send
            self.meter.observe(layer, [len(xs)])
            return self._run_experts(layer, xs, [per_expert]), torch.tensor(per_expert, dtype=torch.long)
        from pipeline import dist

        t0 = self.seconds.mark()
        gather = gather_rows if self.transport == "all-reduce" else dist.gather_numbers
        counts = [[int(c) for c in row] for row in gather(per_expert)]  # [rank][expert]
        self.seconds.add("exchange", t0, self.seconds.mark())
        send = route_pairs(counts, self.table[layer], world)  # [src][dst][expert] pairs
        self.meter.observe(layer, [sum(sum(send[s][h]) for s in range(world)) for h in range(world)])
        total = torch.tensor([sum(col) for col in zip(*counts)], dtype=torch.long)
        order = torch.tensor(send_order(send[me], per_expert), dtype=torch.long, device=xs.device)
        sizes = [[send[s][me][e] for e in range(E)] for s in range(world)]  # [src][expert] pairs received
        if self.transport == "all-reduce":
            return self._by_reduce(layer, xs, order, send, sizes), total
        return self._by_all_to_all(layer, xs, order, send, sizes), total

    def begin(self, tokens: list[int] | None) -> None:
        """Before a forward (None after it): the real tokens each rank runs in it, which every rank knows from the
        step; `gathers` decides the same on every rank from them."""
        self.tokens = tokens

    def gathers(self, xs: torch.Tensor, wg: torch.Tensor, top_k: int) -> bool:
        """Whether `run_gathered` runs this MoE layer: several ranks on one machine (the shared-memory all-reduce),
        the forward's token counts known, and a decode-sized batch over all ranks for the kernels. The same answer on
        every rank."""
        return (self.ep > 1 and self.transport == "all-reduce" and self.tokens is not None
                and kernels.gathered_layer(sum(self.tokens), xs, wg, top_k))

    def run_gathered(self, layer: int, xs: torch.Tensor, wg: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert-parallel MoE layer of a decode-sized batch in two all-reduces and three kernel calls: every
        rank's tokens gathered (one all-reduce of a table where each rank writes its rows: exact), routed on every
        rank alike (`route` is per token), this rank's pairs computed (`expert_pairs`: the experts the table gives
        it; a replicated expert's pairs split between its holders as `route_pairs` water-fills them), every pair's
        output summed over the ranks (the second all-reduce: the others' pairs are zeros), and this rank's tokens'
        choices combined as the 1-rank kernel does. Returns (output [S, C], tokens per expert over all ranks [E])."""

        t0 = self.seconds.mark()
        me, S, C = self.rank, xs.shape[0], xs.shape[1]
        if S != self.tokens[me]:
            raise RuntimeError(f"MoE layer {layer}: {S} tokens on rank {me}, the step says {self.tokens[me]}")
        off = sum(self.tokens[:me])
        every = xs.new_zeros(sum(self.tokens), C)
        every[off:off + S] = xs
        fast_all_reduce_(every)
        t1 = self.seconds.mark()
        mix, experts, counts = kernels.route(every, wg, top_k, renormalize)
        mine, loads = self._my_pairs(layer, experts, counts.tolist())
        pairs = kernels.expert_pairs(every, mine, mix, lambda e: self.residency.weights(layer, e),
                                     self.cfg.activation == "swiglu")
        t2 = self.seconds.mark()
        fast_all_reduce_(pairs)
        t3 = self.seconds.mark()
        out = kernels.combine_pairs(pairs[off:off + S], mix[off:off + S])
        self.meter.observe(layer, loads)
        self.gathered += 1
        t4 = self.seconds.mark()
        for kind, a, b in (("exchange", t0, t1), ("exchange", t2, t3), ("expert", t1, t2), ("expert", t3, t4)):
            self.seconds.add(kind, a, b)
        return out, counts

    def _my_pairs(self, layer: int, experts: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """`experts` [S, k] with -1 where another rank computes the pair, and the pairs each rank computes. An
        expert with one holder: that rank's; a replicated one: its pairs in (token, choice) order, split into runs
        between its holders by `route_pairs` (the same split on every rank)."""
        holders, world = self.table[layer], self.ep
        if all(len(h) == 1 for h in holders):
            if layer not in self._owner:
                self._owner[layer] = torch.tensor([h[0] for h in holders], dtype=torch.long)
            owner = self._owner[layer]
            return torch.where(owner[experts] == self.rank, experts, -1), self._loads(layer, counts)
        send = route_pairs([counts], holders, world)[0]  # [holder][expert] pairs
        loads = [sum(row) for row in send]
        lo = torch.tensor([sum(send[h][e] for h in range(self.rank)) for e in range(len(counts))], dtype=torch.long)
        hi = lo + torch.tensor(send[self.rank], dtype=torch.long)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        first = torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.long)
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(len(flat)) - first[flat[order]]  # each pair's place among its expert's pairs
        keep = (nth >= lo[flat]) & (nth < hi[flat])
        return torch.where(keep, flat, -1).view_as(experts), loads

    def _loads(self, layer: int, counts: list[int]) -> list[int]:
        """The pairs each rank computes in `layer` under the table in force, of `counts` tokens per expert."""
        holders = self.table[layer]
        if all(len(h) == 1 for h in holders):
            loads = [0] * self.ep
            for h, n in zip(holders, counts):
                loads[h[0]] += n
            return loads
        return [sum(row) for row in route_pairs([counts], holders, self.ep)[0]]

    def split_pairs(self, layer: int, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`run_gathered`'s pairs of this rank under the table in force, for export/serve/decode.py's gathered layers:
        `experts` [S, k] with -1 where another rank computes the pair (counts [E]: tokens per expert)."""
        return self._my_pairs(layer, experts, counts.tolist())[0]

    def run_local(self, layer: int, xs: torch.Tensor, wg: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One rank (every expert here), a decode batch: the layer's routing, experts and weighted sum in two kernel
        calls (export/serve/kernels/experts.py `routed_layer`). Returns (output [S, C], tokens per expert [E])."""
        t0 = self.seconds.mark()
        out, counts = kernels.routed_layer(xs, wg, top_k, renormalize, lambda e: self.residency.weights(layer, e),
                                           self.cfg.activation == "swiglu")
        self.meter.observe(layer, [len(xs) * top_k])
        self.seconds.add("expert", t0, self.seconds.mark())
        return out, counts

    def ran_locally(self, layers: int, pairs: int, expert_s: float, experts_run: int) -> None:
        """The books of `layers` MoE layers that ran as `run_local` runs them, outside it (export/serve/decode.py's
        one-call decode step): `pairs` (token, choice) pairs a layer, `expert_s` seconds in all, `experts_run`
        resident experts used in all."""
        for layer in range(layers):
            self.meter.observe(layer, [pairs])
        self.seconds.add_seconds("expert", expert_s)
        self.residency.hits += experts_run

    def ran_gathered(self, counts: list[torch.Tensor], expert_s: float, exchange_s: float, experts_run: int) -> None:
        """The books of the MoE layers that ran as `run_gathered` runs them, outside it (export/serve/decode.py's
        one-call decode step, under the table in force): each layer's tokens per expert over all
        ranks (`counts`, in layer order), seconds computing experts and in the all-reduces, this rank's experts used."""
        for layer, n in enumerate(counts):
            self.meter.observe(layer, self._loads(layer, n.tolist()))
        self.gathered += len(counts)
        self.seconds.add_seconds("expert", expert_s)
        self.seconds.add_seconds("exchange", exchange_s)
        self.residency.hits += experts_run

    @property
    def expert_s(self) -> float:
        return self.seconds.total("expert")

    @property
    def exchange_s(self) -> float:
        return self.seconds.total("exchange")

    def last_loads(self) -> list[list[int]]:
        """The tokens each rank's experts received in each MoE layer of the last forward."""
        return [list(loads) for loads in self.meter.last]

    def stats(self) -> ExchangeStats:
        m = self.meter
        return ExchangeStats(self.transport, m.forwards, m.balancedness(), m.step_balancedness(), self.expert_s,
                             self.exchange_s, self.residency.stats(), self.gathered)

    def _by_all_to_all(self, layer: int, xs: torch.Tensor, order: torch.Tensor, send, sizes) -> torch.Tensor:
        """The exchange as two all-to-alls with variable splits: each rank receives only the pairs sent to it."""

        world, me = self.ep, self.rank
        in_splits = [sum(send[me][h]) for h in range(world)]
        out_splits = [sum(send[s][me]) for s in range(world)]
        got = xs.new_empty(sum(out_splits), xs.shape[1])
        t0 = self.seconds.mark()
        all_to_all_(got, xs[order].contiguous(), out_splits, in_splits)
        t1 = self.seconds.mark()
        done = self._run_experts(layer, got, sizes)
        back = xs.new_empty(len(order), xs.shape[1])
        t2 = self.seconds.mark()
        all_to_all_(back, done, in_splits, out_splits)
        self.seconds.add("exchange", t0, t1)
        self.seconds.add("exchange", t2, self.seconds.mark())
        y = torch.empty_like(xs)
        y[order] = back
        return y

    def _by_reduce(self, layer: int, xs: torch.Tensor, order: torch.Tensor, send, sizes) -> torch.Tensor:
        """The exchange as two all-reduces of one table of every rank's routed tokens: rank s writes its rows (in
        (destination, expert) order) at its offset, the others' rows are zeros, the sum is everybody's rows;
        each rank takes the blocks sent to it, computes, and writes its outputs where those rows were for the
        way back. Exact (x + 0 = x in every dtype)."""

        world, me = self.ep, self.rank
        sent = [sum(sum(send[s][h]) for h in range(world)) for s in range(world)]  # rows each rank sends
        start = [sum(sent[:s]) for s in range(world)]
        mine = [start[s] + sum(sum(send[s][h]) for h in range(me)) for s in range(world)]  # where my blocks lie
        n_in = [sum(send[s][me]) for s in range(world)]
        table = xs.new_zeros(sum(sent), xs.shape[1])
        table[start[me]:start[me] + sent[me]] = xs[order]
        t0 = self.seconds.mark()
        fast_all_reduce_(table)
        t1 = self.seconds.mark()
        got = torch.cat([table[mine[s]:mine[s] + n_in[s]] for s in range(world)])
        done = self._run_experts(layer, got, sizes)
        back = torch.zeros_like(table)
        pos = 0
        for s in range(world):
            back[mine[s]:mine[s] + n_in[s]] = done[pos:pos + n_in[s]]
            pos += n_in[s]
        t2 = self.seconds.mark()
        fast_all_reduce_(back)
        self.seconds.add("exchange", t0, t1)
        self.seconds.add("exchange", t2, self.seconds.mark())
        y = torch.empty_like(xs)
        y[order] = back[start[me]:start[me] + sent[me]]
        return y

    def _run_experts(self, layer: int, got: torch.Tensor, sizes: list[list[int]]) -> torch.Tensor:
        """Each expert once over the tokens it received: `got` holds, for each source rank in order, `sizes[src][e]`
        tokens of each expert e in order; outputs in the same order. On the CPU with few rows an expert (decode
        batches), every expert in one call of the kernel (export/serve/kernels/experts.py `expert_mlps`); else one
        expert at a time, on the few-row kernel or oneDNN."""
        t0 = self.seconds.mark()
        E = len(sizes[0])
        per_expert = [sum(col) for col in zip(*sizes)]
        active = [e for e, n in enumerate(per_expert) if n]  # the experts that received tokens
        offset = [0, *itertools.accumulate(n for row in sizes for n in row)]  # of source s's expert e: s * E + e
        parts = {e: [(offset[s * E + e], sizes[s][e]) for s in range(len(sizes)) if sizes[s][e]] for e in active}
        weights = [self.residency.weights(layer, e) for e in active]
        if active and kernels.grouped_experts(got, [per_expert[e] for e in active]):
            where = None  # the rows in expert order, where they do not lie so already (several source ranks)
            if len(sizes) > 1:
                where = torch.cat([torch.arange(a, a + n, device=got.device) for e in active for a, n in parts[e]])
            rows = got if where is None else got[where]
            y = kernels.expert_mlps(rows, [per_expert[e] for e in active], weights, self.cfg.activation == "swiglu")
            out = y if where is None else torch.empty_like(got).index_copy_(0, where, y)
            self.seconds.add("expert", t0, self.seconds.mark())
            return out
        out = torch.empty_like(got)
        for e, (w1, b1, w2, b2) in zip(active, weights):
            idx = parts[e][0] if len(parts[e]) == 1 else None
            if idx is not None:
                rows = got[idx[0]:idx[0] + idx[1]]
            else:
                at = torch.cat([torch.arange(a, a + n, device=got.device) for a, n in parts[e]])
                rows = got[at]
            y = linear(mlp_activation(linear(rows, w1, b1), self.cfg.activation == "swiglu"), w2, b2)
            if idx is not None:
                out[idx[0]:idx[0] + idx[1]] = y
            else:
                out[at] = y
        self.seconds.add("expert", t0, self.seconds.mark())
        return out


def send_order(mine: list[list[int]], per_expert: list[int]) -> list[int]:
    """The order in which this rank sends its pairs: `mine[dst][e]` of them to each rank, in (destination, expert)
    order, the order the receiver expects. Its pairs are grouped by expert (`per_expert` each); within an expert
    they go to its holders in turn."""
    E = len(per_expert)
    starts = [0, *itertools.accumulate(per_expert)][:E]
    taken = [0] * E
    order = []
    for row in mine:
        for e, k in enumerate(row):
            order += range(starts[e] + taken[e], starts[e] + taken[e] + k)
            taken[e] += k
    return order


# -- the MoE layer ----------------------------------------------------------------------------------------------

class PlacedMoE(nn.Module):
    """An MoE layer whose experts live where the replica table says (module names as DeepSpeed's for the
    gate and the residual part, so `load_weights` fills them; experts come through this rank's `Exchange`)."""

    def __init__(self, cfg: ModelConfig, index: int, num_experts: int, exchange: Exchange):
        super().__init__()
        self.cfg, self.index, self.num_experts = cfg, index, num_experts
        self.impl, self.ep_size = "placed", exchange.ep
        self.exchange = exchange  # not a module: shared by every MoE layer of the model
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

    @property
    def router_weight(self) -> torch.Tensor:
        """The router's fp32 weight [experts, hidden] (stored under DeepSpeed's name, deepspeed_moe.gate.wg)."""
        return self.moe.deepspeed_moe.gate.wg.weight

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] of this rank's rows (B may be 0); `valid` [B, T]: the real tokens (the rest is padding, never
        routed). Collective on several ranks. Returns (output, 0, tokens per expert over all ranks)."""
        cfg, E = self.cfg, self.num_experts
        B, T, C = x.shape
        xs = x.reshape(B * T, C)
        real = valid.reshape(-1).nonzero().squeeze(1) if valid is not None else None
        if real is not None:
            xs = xs[real]
        wg = self.router_weight
        if self.exchange.ep == 1 and kernels.local_layer(xs, wg, cfg.top_k):  # 1 rank, a decode batch: 2 calls
            out, counts = self.exchange.run_local(self.index, xs, wg, cfg.top_k, bool(cfg.renormalize))
        elif self.exchange.gathers(xs, wg, cfg.top_k):  # ranks of one machine, a decode batch: 2 all-reduces
            out, counts = self.exchange.run_gathered(self.index, xs, wg, cfg.top_k, bool(cfg.renormalize))
        else:
            weights, token, choice, per_expert = serving_route(xs, wg, cfg.top_k, E, cfg.renormalize)
            y, counts = self.exchange.run(self.index, xs[token], per_expert)  # [pairs, C]: each pair's expert output
            # back in (token, choice) order, each token's choices weighted and added: a gather, where a scatter-add
            # (index_add_) starts every intra-op thread even for one token, a cost at batch 1 when they sleep
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


# -- the model ------------------------------------------------------------------------------------------------

def place_experts(cfg: ModelConfig, src: Path, ranks, dtype: torch.dtype, resident_fraction: float = 1.0,
                  files: dict | None = None, transport: str = "auto",
                  quantize: str | None = None) -> tuple[GPT, Exchange]:
    """(the model with `PlacedMoE` layers on this rank, its `Exchange`): every rank holds the dense part and the
    gates; experts come through its exchange (its native experts, resident or mapped, plus replicas). Expert parallel
    over all ranks (`serve --placement` needs --ep-size = ranks, no --tp-size: ServeConfig checks the flags).
    `files`: what verification saw of each file (export.package.VerifiedPackage); every read from the package
    compares it with the open file first. `quantize` ("int8", "int4", "w8a8"): the experts quantised as they load
    (CPU only). The served model with its kernels swapped in: export/serve/served.py `placed_model`."""
    from pipeline import dist
    from pipeline.build import cast_keeping_gates, meta_model
    from pipeline.weights import load_weights

    for n in cfg.experts:
        if n % ranks.world:
            raise ValueError(f"--placement on {ranks.world} ranks: every MoE layer's experts {list(cfg.experts)} must "
                             f"divide evenly; choose --nproc accordingly")
    if transport == "auto":
        transport = "all-reduce" if ranks.world > 1 and shared_memory_reduce() else "all-to-all"
    if quantize is not None and dist.device().type != "cpu":
        raise ValueError(f"--quantize {quantize}: the int8 kernels are the CPU's (export/serve/kernels/csrc); on a GPU serve the "
                         f"package's dtype, or its --format hf export in vLLM")
    store = ExpertStore(src, cfg, dtype, files, device=dist.device(), quantize=quantize)
    exchange = Exchange(cfg, Residency(cfg, store, ranks.rank, ranks.world, resident_fraction), ranks.rank,
                        ranks.world, transport)
    model = meta_model(cfg)
    model.to_empty(device="cpu")
    for i, block in enumerate(b for b in model.blocks if b.is_moe):
        block.mlp = PlacedMoE(cfg, i, cfg.experts[i], exchange)
    if cfg.tie_embeddings:  # to_empty made the tied head a separate tensor
        model.lm_head.weight = model.wte.weight
    cast_keeping_gates(model, dtype)
    load_weights(model, src, files=files)
    return model.to(device=dist.device()).eval().requires_grad_(False), exchange
