"""The expert load books of a serving rank: tokens routed to each expert of each MoE layer, and what that puts on each rank.

    load = ExpertLoad(cfg, world=2, layout=layout)
    load.add(counts, rank_loads)   # after each forward (export/serve/engine.py)
    load.per_rank()                # /metrics' moe_rank_expert_tokens; `balancedness` of each layer's row

Balancedness, wherever it is reported (/metrics, the exchange's stats, placement_bench), is `algo.balancedness`:
mean over max of the per-rank loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.model import ModelConfig

if TYPE_CHECKING:
    from export.inference import Layout


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer over every forward so far (prompts included), and the
    load that puts on each rank: measured, on the data-parallel path (the tokens each rank's experts received
    in the exchange, replicas included), else from the model's layout (an expert held by several ranks
    with expert slicing loads each of them)."""

    def __init__(self, cfg: ModelConfig, world: int, layout: Layout | None = None):
        self._total = torch.zeros(sum(cfg.experts), dtype=torch.long)  # every layer's, one after another
        self.tokens = list(self._total.split(list(cfg.experts)))  # views of it, one a layer
        self.last: list[list[int]] = []  # the last forward's counts
        self.holders = []  # [layer][expert] -> the ranks that hold it
        for i, experts in enumerate(cfg.experts):
            ep = layout.ep[i] if layout is not None else 1
            local = experts // ep
            self.holders.append([[r for r in range(world) if r % ep == e // local] for e in range(experts)])
        self.world = world
        self.measured: list[list[int]] | None = None  # [layer][rank] tokens received, when measured

    def add(self, counts: list[torch.Tensor], rank_loads: list[list[float]] | None = None) -> None:
        # every layer's counts in one copy from the device (one host sync a forward, not one a layer)
        flat = torch.cat([c.reshape(-1) for c in counts]).to("cpu", torch.long) if counts else \
            torch.zeros(0, dtype=torch.long)
        values, at = flat.tolist(), 0
        self.last = []
        for c in counts:
            self.last.append(values[at:at + c.numel()])
            at += c.numel()
        if flat.numel() == self._total.numel():  # every layer's counts: one add (a decode step's, each step)
            self._total += flat
        else:
            for total, p in zip(self.tokens, flat.split([c.numel() for c in counts])):
                total += p
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
