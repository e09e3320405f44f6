"""Replica tables and balanced splits: the arithmetic of expert placement, pure Python (no torch).

    from export.serve.placement.algo import native_table, plan_replicas, rank_loads, replica_slots
    table = plan_replicas(cfg, 2, demand, replica_slots(cfg, 2, 0.5))   # demand[layer][expert]: tokens
    rank_loads(demand[0], table[0], 2)                                   # tokens per rank in layer 0

Physical experts. Logical expert e of a layer lives natively on rank e // (experts / ep), as in
DeepSpeed's layout; a *replica table* (`holders[layer][expert]`: the ranks holding it, native rank
first) may add copies on other ranks. The router's choice of a logical expert is sent to one of its
holders: each expert's tokens (of all ranks, in rank order) are split between its holders so that
the tokens per rank even out (water-filling over the gathered counts, deterministic, identical on
every rank), so a replica takes real work off the busiest rank.

Capacity capping: a rank holds at most `replica_budget` x (its native experts) replicas, over all
layers (every expert has the same size, so this is a memory budget); `plan_replicas` adds, one at
a time, the replica that most lowers a layer's busiest rank, until the budget is spent or no
replica helps. A forecast's tables are hedged: its expected loads are level after a replica or two,
so the slots left go to the most demanded experts, room for the exchange to water-fill the
forward's real counts (`plan_replicas(hedge=True)`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.model import ModelConfig

Table = list[list[list[int]]]  # holders[layer][expert]: the ranks that hold it, its native rank first


# -- tables: which ranks hold which experts -------------------------------------------------------------

def native_rank(expert: int, experts: int, ep: int) -> int:
    return expert // (experts // ep)


def native_table(cfg: ModelConfig, ep: int) -> Table:
    """holders[layer][expert] = [its native rank]."""
    return [[[native_rank(e, n, ep)] for e in range(n)] for n in cfg.experts]


def replica_slots(cfg: ModelConfig, ep: int, budget: float) -> int:
    """Replicas one rank may hold: `budget` x its native experts (all layers; every expert is the same size)."""
    return int(math.floor(budget * sum(n // ep for n in cfg.experts) + 1e-9))


def count_replicas(table: Table, ep: int) -> list[int]:
    """Replicas (non-native copies) each rank holds under `table`."""
    held = [0] * ep
    for layer in table:
        n = len(layer)
        for e, holders in enumerate(layer):
            for r in holders:
                if r != native_rank(e, n, ep):
                    held[r] += 1
    return held


# -- splitting an expert's tokens between its holders ------------------------------------------------------

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


# -- planning a table ---------------------------------------------------------------------------------------

def plan_replicas(cfg: ModelConfig, ep: int, demand: list[list[float]], slots: int, hedge: bool = False) -> Table:
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
            loads = rank_loads(d, table[i], ep)
            current = max(loads)
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


def keep_or_replace(current: Table | None, new: Table, demand: list[list[float]], ep: int,
                    margin: float = 0.05) -> Table:
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
