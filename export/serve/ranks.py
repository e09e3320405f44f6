"""The serving ranks' conversation: rank 0 tells the others what to run, in typed messages.

Every rank must run the same forwards (each MoE layer's expert exchange joins all ranks, as do
tensor slicing's all-reduces). Rank 0 owns the scheduler (export/serve/scheduler.py); each step it
broadcasts the typed `Step` (export/serve/step.py: each forward's rows of every rank) and every rank
runs its own rows of it (`Engine.follow`); on the data-parallel path the results (`RowResult`) come
back to rank 0 in one gather (`gather_results`); export/serve/coordinator.py holds both ends of the conversation. Once a second (busy or idle) rank 0
sends a `Ping`: every rank answers with its `RankStatus` through one all-gather, which also finds a
dead rank within the collective's timeout. `Stop` ends `follow`. With each rank its own requests
(export/serve/coordinator.py `OwnRequests`) rank 0 sends `Wake` when work arrives for idle ranks: every rank then
steps together, each step's orders, results and pings in its one gather (step.py `Sync`), until none has work.

Messages travel as JSON (no pickle), tagged with their kind: `export/serve/transport.py` `broadcast_json` (a named pipe to each
rank of this machine, gloo between machines: a rank waiting for the next message sleeps), `gather_json`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from export.serve import transport
from export.serve.step import RowResult, Step

if TYPE_CHECKING:
    from export.serve.placement.exchange import ExchangeStats


@dataclass(frozen=True)
class Ping:
    """Answer with this rank's status (`gather_status`)."""


@dataclass(frozen=True)
class Wake:
    """Each rank its own requests (coordinator.py `OwnRequests`): step together until no rank has work."""


@dataclass(frozen=True)
class Stop:
    """Leave `follow`: the server is shutting down."""


Message = Step | Ping | Wake | Stop
_KINDS = {cls.__name__.lower(): cls for cls in (Step, Ping, Wake, Stop)}


def encode(message: Message) -> dict:
    """A message as JSON-ready data: its fields and its kind."""
    body = message.to_json() if isinstance(message, Step) else asdict(message)
    return {"kind": type(message).__name__.lower(), **body}


def decode(raw: dict) -> Message:
    """The message `encode` made; an unknown kind or missing field is an error (ranks of different versions)."""
    raw = dict(raw)
    cls = _KINDS[raw.pop("kind")]
    if cls is Step:
        return Step.from_json(raw)
    return cls(**{f.name: raw[f.name] for f in fields(cls)})


def send(message: Message) -> None:
    """Rank 0: `message` to every other rank (a no-op on one rank)."""
    from pipeline import dist

    if dist.world_size() > 1:
        transport.broadcast_json(encode(message))


def receive() -> Message:
    """Ranks > 0: the next message rank 0 sends."""

    return decode(transport.broadcast_json(None))


def gather_results(mine: list[RowResult]) -> list[list[RowResult]]:
    """Collective: every rank's results of a step (export/serve/worker.py `Worker.execute`), in rank order."""

    return [[RowResult.from_json(r) for r in rows] for rows in transport.gather_json([r.to_json() for r in mine])]


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
    # seconds since start: in forwards (model, vocabulary projection, sampling), computing experts, and in the
    # expert exchange's collectives (transfers and waiting for the other ranks); busy = forward - exchange
    forward_s: float = 0.0
    expert_s: float = 0.0
    exchange_s: float = 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def gather_status(rank: int, forwards: int, forward_s: float = 0.0, exchange: ExchangeStats | None = None,
                  placed: bool = False) -> list[RankStatus]:
    """Collective: every rank's status, gathered as numbers (one float64 row per rank, on the accelerator's device:
    `pipeline.dist.gather_numbers`). `exchange`: this rank's expert exchange on the data-parallel path (timings,
    the experts it held); `placed`: rank 0's say, with --placement the experts' fields are reported."""
    from pipeline import dist

    held = exchange.residency if exchange is not None else None
    experts = [held.hits, held.misses, held.native_bytes, held.replica_bytes, held.native_bytes_all_resident] \
        if held is not None else [0] * 5
    timings = [exchange.expert_s, exchange.exchange_s] if exchange is not None else [0.0, 0.0]
    rows = dist.gather_numbers([rank, os.getpid(), forwards, rss_mib(), *experts, forward_s, *timings])
    out = []
    for r in rows:
        extra = {}
        if placed and held is not None:
            extra = dict(expert_hits=int(r[4]), expert_misses=int(r[5]), native_expert_bytes=int(r[6]),
                         replica_bytes=int(r[7]), native_expert_bytes_all_resident=int(r[8]))
        out.append(RankStatus(int(r[0]), int(r[1]), int(r[2]), round(float(r[3]), 1), **extra,
                              forward_s=round(r[9], 4), expert_s=round(r[10], 4), exchange_s=round(r[11], 4)))
    return out


def rss_mib() -> float:
    """This process's resident memory (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return 0.0
