"""The serving ranks' conversation: rank 0 tells the others what to run, in typed messages.

Every rank must run the same forwards (DeepSpeed's all-to-all, and the placement's all-reduce,
join all ranks in every MoE layer). Rank 0 owns the scheduler (export/serve/engine.py); before each
forward it broadcasts a `Forward` and the other ranks, in `follow`, run exactly that forward. Once a
second (busy or idle) it sends a `Ping`: every rank answers with its `RankStatus` through one
all-gather, which also finds a dead rank within the collective's timeout. `Stop` ends `follow`.

Messages travel as JSON (`pipeline.dist.broadcast_json`: no pickle), tagged with their kind.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Forward:
    """Run one forward: `tokens` [B][T] appended to the cache `rows`, after resetting the rows in `reset`
    (a prefill starts its row at length 0); `table`/`expect`: the replica table and experts to prefetch
    (expert placement; None: unchanged / nothing); `last_only`: project to the vocabulary at the last
    position only."""

    rows: list[int]
    tokens: list[list[int]]
    reset: list[int]
    table: list | None = None
    expect: list | None = None
    last_only: bool = False


@dataclass(frozen=True)
class Ping:
    """Answer with this rank's status (`gather_status`)."""


@dataclass(frozen=True)
class Stop:
    """Leave `follow`: the server is shutting down."""


Message = Forward | Ping | Stop
_KINDS = {cls.__name__.lower(): cls for cls in (Forward, Ping, Stop)}


def encode(message: Message) -> dict:
    """A message as JSON-ready data: its fields and its kind."""
    return {"kind": type(message).__name__.lower(), **asdict(message)}


def decode(raw: dict) -> Message:
    """The message `encode` made; an unknown kind or missing field is an error (ranks of different versions)."""
    raw = dict(raw)
    cls = _KINDS[raw.pop("kind")]
    return cls(**{f.name: raw[f.name] for f in fields(cls)})


def send(message: Message) -> None:
    """Rank 0: `message` to every other rank (a no-op on one rank)."""
    from pipeline import dist

    if dist.world_size() > 1:
        dist.broadcast_json(encode(message))


def receive() -> Message:
    """Ranks > 0: the next message rank 0 sends."""
    from pipeline import dist

    return decode(dist.broadcast_json(None))


# -- status ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankStatus:
    rank: int
    pid: int
    forwards: int  # forwards run since start
    rss_mib: float  # resident memory
    # with expert placement (else None): experts found resident or prefetched / loaded on demand, bytes held
    expert_hits: int | None = None
    expert_misses: int | None = None
    native_expert_bytes: int | None = None
    replica_bytes: int | None = None
    native_expert_bytes_all_resident: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def gather_status(rank: int, forwards: int, placement=None) -> list[RankStatus]:
    """Collective: every rank's status, gathered as numbers (one float64 row per rank, on the accelerator's device:
    `pipeline.dist.gather_numbers`)."""
    from pipeline import dist

    pl = placement
    held = pl.resident_bytes() if pl is not None else {"native": 0, "replicas": 0, "native_full": 0}
    rows = dist.gather_numbers([rank, os.getpid(), forwards, rss_mib(), pl.stats.hits if pl else 0,
                                pl.stats.misses if pl else 0, held["native"], held["replicas"], held["native_full"]])
    out = []
    for r in rows:
        extra = {}
        if pl is not None:
            extra = dict(expert_hits=int(r[4]), expert_misses=int(r[5]), native_expert_bytes=int(r[6]),
                         replica_bytes=int(r[7]), native_expert_bytes_all_resident=int(r[8]))
        out.append(RankStatus(int(r[0]), int(r[1]), int(r[2]), round(float(r[3]), 1), **extra))
    return out


def rss_mib() -> float:
    """This process's resident memory (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return 0.0
