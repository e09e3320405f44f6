"""How the serving ranks step together: rank 0 plans for all of them, or each data-parallel rank runs its own requests.

    engine = Engine.from_config(config, ranks)   # its coordinator: `engine.coordinator`, chosen by `coordinator_for`
    engine.submit(prompt, params)                # the coordinator decides where it runs
    while engine.has_work():
        engine.step()                            # one step of every rank (rank 0; with OwnRequests, every rank)

An engine (export/serve/engine.py) is one rank's loop: schedule, directive, execute, results, retire. Several ranks
must run the same forwards (each MoE layer's expert exchange joins them all, as do tensor slicing's all-reduces); a
coordinator is how they agree, over the typed messages of export/serve/step.py and export/serve/ranks.py:

  * `RankZero`: rank 0's scheduler plans every rank's rows (it picks a data-parallel rank for each request as it
    admits it: export/serve/scheduler.py). Each step rank 0 sends the `Step` to the others, every rank runs its rows,
    and on the data-parallel path the results come back in one gather. The other ranks `follow`. One rank is this
    with nobody to tell. Tensor or expert slicing and --placement run this way.
  * `OwnRequests` (as vLLM's data-parallel engines for MoE models): every data-parallel rank holds its own requests
    and scheduler. Each step the ranks agree on the forwards in one small gather of `Sync`s (each rank's forwards'
    sizes, its books, its note); a rank stands in for another's rows by their token count, which is all the expert
    exchange needs of them. Behind the server (`front`, rank 0) this coordinator takes every request and gives each
    to the rank with the fewest (`submit`: the one place a rank is chosen on this path), keeps a stand-in of each
    request another rank runs (fed by that rank's results in the next step's gather), and its `Orders` (requests to
    start and abort, a ping) ride in the gather; the other ranks wait for a `Wake`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from export.serve import ranks as rank_msgs
from export.serve import transport
from export.serve.request import Request
from export.serve.scheduler import SCHED_STATS
from export.serve.step import Books, Forward, Order, Orders, Row, RowResult, Step, Sync


class Coordinator:
    """What both ways share: the requests' queues as /metrics reads them, failing every request, pings, the other
    ranks' loop (`follow`)."""

    def __init__(self, engine):
        self.engine = engine  # export/serve/engine.py's Engine of this rank, which holds this coordinator
        self.busy = False  # the ranks are stepping together (OwnRequests behind the server); idle ranks wait

    # -- requests (any thread) -----------------------------------------------------------------------------------

    def submit(self, seq: Request) -> None:
        self.engine.scheduler.add(seq)

    def abort(self, seq: Request) -> None:
        self.engine.scheduler.abort(seq.id)

    def pending(self) -> int:
        """Requests not finished (this rank's, and those it gave other ranks)."""
        return self.engine.scheduler.pending()

    def has_work(self) -> bool:
        """Whether rank 0's loop should step now."""
        return self.pending() > 0

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences over every rank."""
        return len(self.engine.scheduler.running), len(self.engine.scheduler.waiting)

    def kv_usage(self) -> float:
        """The fraction of KV blocks in use over every rank's pool (vLLM's kv_cache_usage_perc)."""
        return self.engine.scheduler.kv_usage()

    def scheduler_stats(self) -> dict[str, int]:
        """The schedulers' counters (prefix-cache queries and hits, preemptions) over every rank."""
        return dict(self.engine.scheduler.stats)

    def fail_all(self, message: str) -> None:
        """Finish every waiting and running sequence with finish_reason 'error'; later submits are refused."""
        self.engine.closed = message
        for seq in self.engine.scheduler.drain() + self._drop_stand_ins():
            if not seq.finished:
                seq.text = message
                seq.end("error")

    def _drop_stand_ins(self) -> list[Request]:
        return []

    def step(self) -> int | None:
        """One step of every rank (rank 0; with OwnRequests, every rank): `RankZero.step`, `OwnRequests.step`."""
        raise NotImplementedError

    # -- the other ranks, pings ---------------------------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run this rank's part of every step rank 0 sends, answer its pings, until it says stop."""
        e = self.engine
        while True:
            msg = rank_msgs.receive()
            if isinstance(msg, rank_msgs.Stop):
                return
            if isinstance(msg, rank_msgs.Ping):  # rank 0 checks that every rank is alive and asks how it is
                e.status()
            elif isinstance(msg, rank_msgs.Wake):
                self._woken()
            else:
                mine = e.worker.execute(msg)
                if e.dp > 1:
                    rank_msgs.gather_results(mine)

    def _woken(self) -> None:
        raise RuntimeError("a Wake reached a rank whose rank 0 plans every step (ranks of different versions?)")

    def ping(self) -> None:
        """Rank 0: one round trip with every rank (a dead rank makes it raise within the collective's timeout);
        records each rank's status in the engine's `rank_status`."""
        rank_msgs.send(rank_msgs.Ping())
        self._pinged()

    def _pinged(self) -> None:
        e = self.engine
        status = e.status()
        if e.worker.rank == 0:
            e.rank_status, e.rank_status_at = [s.to_dict() for s in status], time.time()

    def stop_followers(self) -> None:
        rank_msgs.send(rank_msgs.Stop())


class RankZero(Coordinator):
    """Rank 0 plans every rank's rows (one rank; data parallel with --placement; tensor or expert slicing)."""

    def step(self) -> int:
        """Rank 0: schedule every rank's rows; send the step to the others; run this rank's rows; gather the results
        (data parallel); take them. Returns tokens generated."""
        e = self.engine
        plan, step = e.plan()
        e.steps += 1
        if not step.forwards:
            return 0
        e.count(plan, step.forwards)
        if e.world > 1:
            rank_msgs.send(step)
        mine = e.execute(step, plan)
        results = [res for rows in rank_msgs.gather_results(mine) for res in rows] if e.dp > 1 else mine
        return e.take_results(plan, results)


class OwnRequests(Coordinator):
    """Each data-parallel rank its own requests and scheduler; `front`: rank 0 behind the server, taking every request
    and spreading them (see the module's docstring). Without `front` every rank submits its own requests and calls
    `step` until it returns None, which every rank does at the same step."""

    def __init__(self, engine, front: bool = False):
        super().__init__(engine)
        self.front = front
        self.remote: dict[int, tuple[Request, int]] = {}  # front: stand-ins of requests other ranks run
        self._submit: list[Order] = []  # front: what the next step's gather orders
        self._abort: list[int] = []
        self._lock = threading.Lock()
        self._ping_due = False
        self._relay: list[RowResult] | None = None  # a rank following the front: its last step's results
        self.books: list[Books] = []  # every rank's books at the last step's gather

    # -- requests (any thread) -----------------------------------------------------------------------------------

    def submit(self, seq: Request) -> None:
        """Behind the server: the rank with the fewest requests runs it (rank 0 on a tie), another rank's through the
        next step's gather."""
        if self.front:
            with self._lock:
                loads = [self.engine.scheduler.pending()] + [0] * (self.engine.world - 1)
                for _, r in self.remote.values():
                    loads[r] += 1
                rank = loads.index(min(loads))
                if rank:
                    self.remote[seq.id] = (seq, rank)
                    self._submit.append(Order(seq.id, rank, seq.prompt, seq.params))
                    return
        self.engine.scheduler.add(seq)

    def abort(self, seq: Request) -> None:
        with self._lock:
            if seq.id in self.remote:  # another rank runs it: told in the next step's gather
                self._abort.append(seq.id)
                return
        self.engine.scheduler.abort(seq.id)

    def pending(self) -> int:
        if not self.front:
            return self.engine.scheduler.pending()
        with self._lock:
            return self.engine.scheduler.pending() + len(self.remote) + len(self._abort)

    def has_work(self) -> bool:
        return self.busy or self.pending() > 0

    def queue_lengths(self) -> tuple[int, int]:
        """The other ranks' as the last step's gather said (0 once idle), and the requests not yet sent to them as
        waiting."""
        running, waiting = super().queue_lengths()
        for b in self._others():
            running += b.running
            waiting += b.waiting
        return running, waiting + (len(self._submit) if self.front else 0)

    def kv_usage(self) -> float:
        if not self.front or not self.books:
            return super().kv_usage()
        used = sum(pool.used() for pool in self.engine.scheduler.pools) + sum(b.kv_blocks for b in self._others())
        return used / (self.engine.kv.blocks * len(self.books))

    def scheduler_stats(self) -> dict[str, int]:
        stats = super().scheduler_stats()
        for b in self._others():
            for key in SCHED_STATS:
                stats[key] += getattr(b, key)
        return stats

    def _others(self) -> list[Books]:
        """Behind the server, the other ranks' books as of the last step's gather; else none."""
        return [b for r, b in enumerate(self.books) if r != self.engine.worker.rank] if self.front else []

    def _drop_stand_ins(self) -> list[Request]:
        with self._lock:
            stand_ins, self.remote = [seq for seq, _ in self.remote.values()], {}
        return stand_ins

    # -- one step --------------------------------------------------------------------------------------------------

    def step(self) -> int | None:
        """Behind the server (`front`): one step of every rank, waking the others first when they were idle; the
        step's gather takes them the requests `submit` gave them, the aborts and a due ping, and brings their results
        to rank 0's stand-ins (their callbacks: the HTTP answers). Returns the tokens generated on this rank; idle
        again (`busy` False) once a step finds nothing to do. Otherwise collective: every rank calls it until it
        returns None."""
        if not self.front:
            return self._together()
        if not self.busy:
            rank_msgs.send(rank_msgs.Wake())
            self.busy = True
        with self._lock:
            submit, abort, self._submit, self._abort = self._submit, self._abort, [], []
        for rid in abort:  # the stand-in ends now; the rank that runs it forgets it at its next step
            self._forget(rid, "abort")
        orders = Orders(submit, abort, self._ping_due)
        self._ping_due = False
        made = self._together(orders if orders else None)
        if made is None:
            self.busy = False
            return 0
        return made

    def _together(self, orders: Orders | None = None) -> int | None:
        """Schedule this rank's step; agree with the other ranks on the step's forwards in one gather of `Sync`s; run
        as many forwards as the rank with the most has (this rank's rows; another rank's stand in by their token
        count; a rank with none joins with no rows); take this rank's results. None once no rank has a forward, a
        pending request or orders; else the tokens generated on this rank."""
        e = self.engine
        plan, own = e.plan()
        mine = own.forwards
        results = None
        if self._relay is not None:  # a rank following the front: its last step's results go to rank 0
            results, self._relay = self._relay or None, []
        pending = e.scheduler.pending() > 0 or bool(orders and (orders.submit or orders.abort))
        books = Books(len(e.scheduler.running), len(e.scheduler.waiting),
                      sum(pool.used() for pool in e.scheduler.pools), plan.decode_rows,
                      *(e.scheduler.stats[key] for key in SCHED_STATS))
        sync = Sync([sum(len(row.tokens) for row in fwd.rows[0]) for fwd in mine], pending, books, orders, results)
        table = [Sync.from_json(raw) for raw in transport.gather_json(sync.to_json())]
        self.books = [s.books for s in table]
        self._heard(table)
        ping = table[0].orders is not None and table[0].orders.ping
        n = max(len(s.tokens) for s in table)
        e.steps += 1
        if n == 0:
            if ping:
                self._pinged()
            return None if not any(s.pending for s in table) else 0
        me = e.worker.rank
        forwards = []
        for i in range(n):
            rows = [(mine[i].rows[0] if i < len(mine) else []) if r == me else
                    [Row(seq=-1, start=0, tokens=[0] * s.tokens[i])] if i < len(s.tokens) and s.tokens[i] else []
                    for r, s in enumerate(table)]
            forwards.append(Forward(mine[i].kind if i < len(mine) else "decode", rows))
        step = Step(forwards, [dataclasses.replace(new, rank=me) for new in own.new], own.freed, own.ended)
        e.count(plan, mine, sum(b.decode_rows for b in self.books))
        done = e.execute(step, plan)
        if self._relay is not None:
            self._relay = done
        made = e.take_results(plan, done)
        if ping:
            self._pinged()
        return made

    def _heard(self, table: list[Sync]) -> None:
        """Every rank's part of a step's gather: rank 0 applies the others' results to its stand-ins; another rank
        takes the requests and aborts rank 0 ordered for it."""
        e = self.engine
        me = e.worker.rank
        if me == 0:
            for sync in table[1:]:
                for res in sync.results or ():
                    self._take_remote(res)
            return
        orders = table[0].orders
        if orders is None:
            return
        for order in orders.submit:
            if order.rank == me:
                e.scheduler.add(Request(order.seq, order.prompt, order.params))
        for rid in orders.abort:
            e.scheduler.abort(rid)

    def _take_remote(self, res: RowResult) -> None:
        """Another rank's result for one of its requests, on rank 0's stand-in: the same stop conditions and
        detokenization as that rank applied (so both finish it at the same token), and the callbacks."""
        held = self.remote.get(res.seq)
        if held is None or held[0].finished:  # aborted here meanwhile
            return
        seq = held[0]
        if res.error is not None:
            self.engine.fail(seq, res.error, retire=False)
        else:
            self.engine.take_one(seq, res)
        if seq.finished:
            self._forget(seq.id)

    def _forget(self, rid: int, reason: str | None = None) -> None:
        """A stand-in is done (`reason`: finish it so first)."""
        with self._lock:
            held = self.remote.pop(rid, None)
        if held is not None and reason is not None:
            held[0].end(reason)

    # -- the other ranks, pings ---------------------------------------------------------------------------------------

    def follow(self) -> None:
        self._relay = []  # the front leads: this rank's results ride in each step's gather
        super().follow()

    def _woken(self) -> None:
        while self._together() is not None:  # step together until no rank has anything to do
            pass

    def ping(self) -> None:
        """While the ranks step together, in the next step's gather instead of a message of its own."""
        if self.busy:
            self._ping_due = True
            return
        super().ping()


def coordinator_for(engine, own_requests: bool, front: bool = False) -> Coordinator:
    """`OwnRequests` where each data-parallel rank runs its own requests (`front`: this is rank 0 behind the server),
    else `RankZero`."""
    if not own_requests:
        return RankZero(engine)
    return OwnRequests(engine, front=front and engine.worker.rank == 0)
