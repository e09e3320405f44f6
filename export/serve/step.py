"""The typed step: what rank 0's scheduler decides for one step, and what each rank gives back.

    from export.serve.step import Forward, Row, Step
    step = Step(forwards=[Forward("decode", rows=[[Row(seq=7, start=12, tokens=[318], blocks=[], sample=True)]])])
    Step.from_json(step.to_json()) == step                               # how it crosses the ranks

In the spirit of vLLM v1's `SchedulerOutput` / `ModelRunnerOutput`. A step is a few forwards that every
rank runs (an expert all-to-all in each MoE layer joins all ranks); each `Forward` holds, per
data-parallel rank, the `Row`s that rank runs: a sequence's new tokens, the position they start at,
the KV blocks appended to its block table, whether to sample its next token or score its prompt.
The placement directive (export/serve/placement/controller.py `Directive`) rides along opaquely. A `RowResult` comes back
from the rank that holds the row.

Where each data-parallel rank schedules its own requests (export/serve/coordinator.py `OwnRequests`), no `Step` crosses
the ranks: each step every rank gives one `Sync` to a small gather (its forwards' sizes, its `Books`, and rank 0's
`Orders` to the others or another rank's results for rank 0's stand-ins of its requests).

Everything here is plain data: no torch, JSON both ways (`export/serve/transport.py` `broadcast_json`, `gather_json`; no pickle
between processes), each type with one `to_json` / `from_json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from export.serve.request import SamplingParams


_NAMES: dict[type, tuple[str, ...]] = {}  # each class's field names, looked up once (`fields` costs ~2 us a call)


def _row(obj) -> list:
    names = _NAMES.get(type(obj))
    if names is None:
        names = _NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return [getattr(obj, n) for n in names]


@dataclass(frozen=True)
class Sampling:
    """How the rank that holds a sequence samples it (export/serve/sampling.py `Sampler`)."""

    temperature: float
    top_p: float = 1.0
    logprobs: int | None = None  # top alternatives per token to return; None: no log-probabilities
    seed: int | None = None  # the seed of the request's draws (export/serve/sampling.py `gumbel_noise`); None: greedy
    top_k: int = 0  # 0 (or -1): every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list | None = None  # [[token, bias]]
    prompt: list[int] | None = None  # the prompt's tokens, sent only where repetition_penalty needs them
    grammar: str | None = None  # a grammar its tokens must follow (export/serve/grammar.py), llguidance's JSON


@dataclass(frozen=True)
class NewSeq:
    """A sequence that starts on a data-parallel rank: its sampler is made there and lives until it ends."""

    seq: int
    rank: int
    sampling: Sampling

    def to_json(self) -> list:
        return [self.seq, self.rank, _row(self.sampling)]

    @classmethod
    def from_json(cls, raw: list) -> "NewSeq":
        return cls(raw[0], raw[1], Sampling(*raw[2]))


@dataclass(frozen=True)
class Row:
    """One sequence's part of one forward on its rank."""

    seq: int
    start: int  # its tokens already in the KV cache: the new ones take positions start, start + 1, ...
    tokens: list[int]  # the new tokens
    blocks: list[int] = field(default_factory=list)  # KV blocks appended to its block table before this forward
    sample: bool = False  # sample its next token from the last new token's logits
    banned: list[int] | None = None  # tokens that may not be sampled (the end and stop tokens before min_tokens)
    score: int = -1  # >= 0: return the log-probabilities of `targets` at every new position (echo + logprobs)
    targets: list[int] = field(default_factory=list)  # the prompt tokens after these (score >= 0)

    def to_json(self) -> list:
        return _row(self)

    @classmethod
    def from_json(cls, raw: list) -> "Row":
        return cls(*raw)


@dataclass(frozen=True)
class Forward:
    """One forward on every rank: `rows[r]` are data-parallel rank r's rows (one list when every rank runs the
    same rows: tensor or expert slicing). `kind`: prompt chunks, one token of each decoding sequence, or both
    ("mixed": the decode rows first). `placement`: the expert placement directive, carried opaquely."""

    kind: Literal["prefill", "decode", "mixed"]
    rows: list[list[Row]]
    placement: dict | None = None

    def to_json(self) -> list:
        return [self.kind, [[r.to_json() for r in rows] for rows in self.rows], self.placement]

    @classmethod
    def from_json(cls, raw: list) -> "Forward":
        return cls(raw[0], [[Row.from_json(r) for r in rows] for rows in raw[1]], raw[2])


@dataclass(frozen=True)
class Step:
    """One scheduler step. Before the forwards, each rank drops the block tables of `freed` (finished or
    preempted: a preempted sequence is recomputed later from position 0, or from a prefix-cache hit), the
    samplers of `ended` (finished), and makes the samplers of `new`."""

    forwards: list[Forward] = field(default_factory=list)
    new: list[NewSeq] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"forwards": [f.to_json() for f in self.forwards], "new": [n.to_json() for n in self.new],
                "freed": list(self.freed), "ended": list(self.ended)}

    @classmethod
    def from_json(cls, raw: dict) -> "Step":
        return cls([Forward.from_json(f) for f in raw["forwards"]], [NewSeq.from_json(n) for n in raw["new"]],
                   list(raw["freed"]), list(raw["ended"]))


@dataclass(frozen=True)
class RowResult:
    """What the rank that ran a row returns: its sampled token (with log-probabilities when asked), its prompt
    scores (`score_start`: the prompt index they begin after), or the error that failed this sequence alone."""

    seq: int
    token: int | None = None
    logprob: float | None = None
    top: list | None = None  # [[token, logprob]]
    score_start: int | None = None
    scores: list | None = None  # [[logprob, [[token, logprob]]]] of the prompt tokens score_start + 1, ...
    error: str | None = None

    def to_json(self) -> list:
        return _row(self)

    @classmethod
    def from_json(cls, raw: list) -> "RowResult":
        return cls(*raw)


# -- each rank its own requests: what a step's gather carries ---------------------------------------------------------

@dataclass(frozen=True)
class Order:
    """A request rank 0 took and gives another rank to run (`rank`): its id, prompt and sampling parameters."""

    seq: int
    rank: int
    prompt: list[int]
    params: SamplingParams

    def to_json(self) -> list:
        return [self.seq, self.rank, self.prompt, asdict(self.params)]

    @classmethod
    def from_json(cls, raw: list) -> "Order":
        return cls(raw[0], raw[1], raw[2], SamplingParams(**raw[3]))


@dataclass(frozen=True)
class Orders:
    """What rank 0 (taking every request behind the server) tells the other ranks in a step's gather: requests to
    start, requests to abort (ids), and a ping (every rank answers with its status after the step)."""

    submit: list[Order] = field(default_factory=list)
    abort: list[int] = field(default_factory=list)
    ping: bool = False

    def __bool__(self) -> bool:
        return bool(self.submit or self.abort or self.ping)

    def to_json(self) -> list:
        return [[o.to_json() for o in self.submit], list(self.abort), self.ping]

    @classmethod
    def from_json(cls, raw: list) -> "Orders":
        return cls([Order.from_json(o) for o in raw[0]], list(raw[1]), bool(raw[2]))


@dataclass(frozen=True)
class Books:
    """One rank's books at a step: sequences running and waiting, KV blocks in use, the step's decode rows, and the
    scheduler's counters (export/serve/scheduler.py `SCHED_STATS`)."""

    running: int = 0
    waiting: int = 0
    kv_blocks: int = 0
    decode_rows: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0

    def to_json(self) -> list:
        return _row(self)

    @classmethod
    def from_json(cls, raw: list) -> "Books":
        return cls(*raw)


@dataclass(frozen=True)
class Sync:
    """A rank's part of a step's gather: the tokens of each of its forwards (the other ranks stand in for its rows by
    these counts), whether it has requests pending, its books, and its note: rank 0's `orders` for the others, or
    another rank's `results` of its last step for rank 0's stand-ins of its requests (rank 0 behind the server)."""

    tokens: list[int]
    pending: bool
    books: Books
    orders: Orders | None = None
    results: list[RowResult] | None = None

    def to_json(self) -> list:
        return [self.tokens, self.pending, self.books.to_json(), self.orders.to_json() if self.orders else None,
                [r.to_json() for r in self.results] if self.results is not None else None]

    @classmethod
    def from_json(cls, raw: list) -> "Sync":
        return cls(list(raw[0]), bool(raw[1]), Books.from_json(raw[2]),
                   Orders.from_json(raw[3]) if raw[3] is not None else None,
                   [RowResult.from_json(r) for r in raw[4]] if raw[4] is not None else None)
