"""Rank 0's placement decisions: which replica table each forward runs under, and which experts to prefetch.

    moe-pipeline serve runs/tiny/package --ep-size 2 --placement reactive
    moe-pipeline serve runs/tiny/package --ep-size 2 --placement predictive --replica-budget 0.5

    controller = make_controller(config, cfg, ep=2)        # config.placement: none, reactive or predictive
    directive = controller.before_forward("decode", requests)   # a Directive, or None: nothing changes

The engine (export/serve/engine.py) tells its controller what happens: a request arrived (`on_submit`,
from the HTTP thread), a forward is about to run (`before_forward`: its `Directive`, sent to every rank
with the forward, export/serve/step.py), a forward ran with these tokens per expert (`after_forward`),
a request is done (`on_finish`). `stats` is what /metrics and the server print read. Policies:
  * `none` (`Controller`): native placement only;
  * `reactive` (EPLB-style, as vLLM's and SGLang's): replicas planned from a sliding window of
    observed per-expert load, re-planned every `replan_every` forwards;
  * `predictive` (MoE-MPMC): replicas planned from the demand the SRU predictor (predictor.py)
    expects for the coming forward, prepared by a second thread.
A new policy is a subclass here, one entry in `make_controller`, and its name in ServeConfig.placement.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from export.serve.config import ServeConfig
from export.serve.placement.algo import (Table, count_replicas, keep_or_replace, native_table, plan_replicas,
                                         replica_slots)
from pipeline.model import ModelConfig


@dataclass(frozen=True)
class Directive:
    """What every rank applies before a forward (export/serve/placement/exchange.py `Exchange.apply`): the replica
    table from this forward on (None: the one in force stays) and, per MoE layer, the experts expected, most
    demanded first, for prefetching (None: no forecast). Travels as JSON in `step.Forward.placement`."""

    table: Table | None = None
    expect: list[list[int]] | None = None

    def to_json(self) -> dict:
        return {"table": self.table, "expect": self.expect}

    @classmethod
    def from_json(cls, raw: dict) -> "Directive":
        return cls(raw["table"], raw["expect"])


@dataclass(frozen=True)
class ControllerStats:
    """A controller since start: its policy, the replicas a rank may hold, the replicas per MoE layer in the table
    in force, how many tables it swapped in; the predictive policy's recall of the experts used (per layer), decode
    steps whose table came late, its thread's CPU seconds and the seconds the scheduler waited for it (None where
    a policy has no such thing)."""

    name: str
    slots: int
    replicas: tuple[int, ...]
    table_changes: int
    recall: tuple[float, ...] | None = None
    late_steps: int | None = None
    cpu_s: float | None = None
    waited_s: float | None = None


class Controller:
    """The `none` policy, and the interface of every policy: the native table, never changed, no forecast."""

    name = "none"

    def __init__(self, cfg: ModelConfig, ep: int, budget: float):
        self.cfg, self.ep, self.budget = cfg, ep, budget
        self.slots = replica_slots(cfg, ep, budget)
        self.table = native_table(cfg, ep)
        self.table_changes = 0

    def on_submit(self, request) -> None:
        """A request arrived (called from the HTTP thread)."""

    def before_forward(self, kind: str, requests) -> Directive | None:
        """Before a forward of `kind` ("prefill": chunks of the prompts of `requests`; "decode": one token of each of
        `requests`), over every rank's rows."""
        return None

    def after_forward(self, counts: list[list[int]], kind: str, requests) -> None:
        """The per-layer, per-expert tokens routed in the forward that just ran."""

    def on_finish(self, request) -> None:
        """A request is done (finished, aborted or failed): whatever the policy keeps for it goes."""

    def stats(self) -> ControllerStats:
        return ControllerStats(self.name, self.slots, self._replicas(), self.table_changes)

    def close(self) -> None:
        """Stop what the policy runs besides the engine (nothing here)."""

    def _directive(self, table: Table | None, expect: list[list[int]] | None) -> Directive | None:
        """The directive for a planned `table` (sent only if it differs from the one in force) and `expect`."""
        if table is not None and table != self.table:
            self.table = table
            self.table_changes += 1
        else:
            table = None
        return Directive(table, expect) if table is not None or expect is not None else None

    def _replicas(self) -> tuple[int, ...]:
        return tuple(sum(count_replicas([layer], self.ep)) for layer in self.table)


class ReactiveController(Controller):
    """EPLB-style: the mean load over the last `window` forwards, re-planned every `replan_every` forwards."""

    name = "reactive"

    def __init__(self, cfg: ModelConfig, ep: int, budget: float, window: int = 32, replan_every: int = 8):
        super().__init__(cfg, ep, budget)
        self.window: deque = deque(maxlen=window)
        self.replan_every, self.since = replan_every, 0

    def after_forward(self, counts, kind, requests) -> None:
        self.window.append(counts)

    def before_forward(self, kind, requests) -> Directive | None:
        self.since += 1
        if self.since < self.replan_every or not self.window:
            return self._directive(None, self._expected())
        self.since = 0
        mean = [[sum(d[i][e] for d in self.window) / len(self.window) for e in range(n)]
                for i, n in enumerate(self.cfg.experts)]
        table = keep_or_replace(self.table, plan_replicas(self.cfg, self.ep, mean, self.slots), mean, self.ep)
        return self._directive(table, self._expected())

    def _expected(self) -> list[list[int]] | None:
        """Experts seen in the window, most used first: those the next forward most likely uses."""
        if not self.window:
            return None
        return [sorted((e for e in range(n) if any(d[i][e] for d in self.window)),
                       key=lambda e: -sum(d[i][e] for d in self.window)) for i, n in enumerate(self.cfg.experts)]


class PredictiveController(Controller):
    """Replica tables from predicted demand (MoE-MPMC's producer/consumer). A table-building thread consumes the
    runtime's events (a prompt arrived; a decode step started with these tokens) and produces, for each prompt,
    its prefill's table and, after each decode step's tokens, the next step's table. While the runtime computes
    a decode step, the thread feeds the SRU predictor (predictor.py) that step's tokens and sums the running
    sequences' distributions into the next step's per-expert demand; a prompt is read whole when its request
    arrives, which predicts its prefill's demand before it runs."""

    name = "predictive"

    def __init__(self, cfg: ModelConfig, ep: int, budget: float, predictor, wait_s: float = 0.2):
        super().__init__(cfg, ep, budget)
        self.model, self.info = predictor
        self.wait_s = wait_s
        self.jobs: queue.Queue = queue.Queue()
        # sequence id -> SRU state [layers, 1, dim] (after a prompt: (state, its last token, not yet read))
        self.state: dict[int, object] = {}
        self.decoding: set[int] = set()  # sequences in the last decode step
        self.prefill: dict[int, tuple] = {}  # sequence id -> (table, expected, demand) of its prompt
        self.started: set[int] = set()  # sequences whose prefill has begun (their prompt's plan was asked for)
        self.decode_plan: tuple | None = None  # (step number, table, expected, demand) for the next decode step
        self.ready = threading.Condition()
        self.step_no = 0
        self.recall_sum = [0.0] * len(cfg.experts)
        self.recall_n = 0
        self.late = 0  # decode steps whose table was not ready in time (the previous one was used)
        self.cpu_s = 0.0  # CPU seconds of the predictor's thread (it shares rank 0's cores)
        self.waited_s = 0.0  # seconds rank 0's scheduler waited for a table (every rank waits with it)
        self._pending_demand: list | None = None
        self.thread = threading.Thread(target=self._run, name="predictor", daemon=True)
        self.thread.start()

    # -- the runtime's side (consumer) ---------------------------------------------------------------------------
    def on_submit(self, request) -> None:
        self.jobs.put(("prompt", request.id, list(request.prompt)))

    def on_finish(self, request) -> None:
        # through the queue, after the request's own prompt job: the thread owns the per-request state
        self.started.discard(request.id)
        self.jobs.put(("finished", request.id))

    def before_forward(self, kind, requests) -> Directive | None:
        plan = self._prefill_plan(requests) if kind == "prefill" else self._decode_plan(requests)
        if plan is None:
            self._pending_demand = None
            return None
        table, expected, demand = plan
        self._pending_demand = demand
        return self._directive(table, expected)

    def after_forward(self, counts, kind, requests) -> None:
        if self._pending_demand is None:
            return
        for i, (pred, actual) in enumerate(zip(self._pending_demand, counts)):
            active = {e for e, c in enumerate(actual) if c > 0}
            if active:
                top = sorted(range(len(pred)), key=lambda e: -pred[e])[:len(active)]
                self.recall_sum[i] += len(active & set(top)) / len(active)
        self.recall_n += 1

    def stats(self) -> ControllerStats:
        recall = tuple(r / self.recall_n for r in self.recall_sum) if self.recall_n else ()
        return ControllerStats(self.name, self.slots, self._replicas(), self.table_changes, recall, self.late,
                               self.cpu_s, self.waited_s)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def held(self) -> int:
        """Requests the policy holds state for (0 once every request is done and the thread has caught up)."""
        with self.ready:
            return len(self.state) + len(self.prefill)

    def _prefill_plan(self, requests) -> tuple | None:
        """The prompts whose first chunk this is: their predicted demand, summed (waiting up to `wait_s` for it)."""
        new = [r.id for r in requests if r.id not in self.started]
        self.started.update(new)
        t0 = time.perf_counter()
        with self.ready:
            self.ready.wait_for(lambda: all(i in self.prefill for i in new), timeout=self.wait_s if new else 0)
            plans = [self.prefill.pop(i) for i in new if i in self.prefill]
        self.waited_s += time.perf_counter() - t0
        if len(plans) > 1:
            return self._plan([[sum(d) for d in zip(*layer)] for layer in zip(*(p[2] for p in plans))])
        return plans[0] if plans else None

    def _decode_plan(self, requests) -> tuple | None:
        """The plan the thread made from the previous decode step's tokens (None if it is late: counted)."""
        step = self.step_no
        self.step_no += 1
        # this step's tokens go to the thread now: it prepares the NEXT step's table while this one runs
        self.jobs.put(("step", step, [(r.id, r.generated[-1]) for r in requests]))
        t0 = time.perf_counter()
        with self.ready:
            self.ready.wait_for(lambda: self.decode_plan is not None and self.decode_plan[0] >= step - 1,
                                timeout=self.wait_s if step else 0)
            plan = self.decode_plan[1:] if self.decode_plan is not None and self.decode_plan[0] == step - 1 else None
        self.waited_s += time.perf_counter() - t0
        if plan is None and step:
            self.late += 1
        return plan

    # -- the table-building thread (producer) ----------------------------------------------------------------------
    def _run(self) -> None:
        # one intra-op thread for the predictor: the setting is per thread (OpenMP), the engine keeps its own;
        # with the engine's threads on every core, a multi-threaded predictor only steals them
        torch.set_num_threads(1)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            t0 = time.thread_time()
            try:
                if job[0] == "prompt":
                    self._prompt(*job[1:])
                elif job[0] == "finished":
                    self._forget(job[1])
                else:
                    self._step(*job[1:])
            except Exception as err:  # noqa: BLE001 - a failed prediction falls back to the current table
                print(f"[predictor] {type(err).__name__}: {err}", flush=True)
            self.cpu_s += time.thread_time() - t0

    def _forget(self, sid: int) -> None:
        """A finished request's SRU state and its prefill plan if it was never used (it came too late, or the
        request ended at prefill as lm-eval's log-likelihood requests do)."""
        self.state.pop(sid, None)
        self.decoding.discard(sid)
        with self.ready:
            self.prefill.pop(sid, None)

    @torch.inference_mode()
    def _prompt(self, sid: int, prompt: list[int]) -> None:
        # reads [bos, x_1 .. x_{n-1}]: row j predicts token j+1's routes; x_n is read with the first decode step
        ids = torch.tensor([[self.model.cfg.bos_id] + prompt[:-1]])
        logits, state = self.model(ids)
        demand = [lg[0].softmax(-1).sum(0).tolist() for lg in logits]  # the prompt's tokens, per layer [E]
        self.state[sid] = (state, prompt[-1])
        plan = self._plan(demand)
        with self.ready:
            self.prefill[sid] = plan
            self.ready.notify_all()

    @torch.inference_mode()
    def _step(self, step: int, fed: list[tuple[int, int]]) -> None:
        """The tokens of decode step `step` -> the demand and table of step `step + 1`."""
        known = [(sid, tok) for sid, tok in fed if sid in self.state]
        now = {sid for sid, _ in fed}
        for sid in self.decoding - now:  # decoded before, not any more: finished
            self.state.pop(sid, None)
        self.decoding = now
        if not known:
            return
        # a sequence's first decode step also reads its prompt's last token
        first = [k for k, (sid, _) in enumerate(known) if isinstance(self.state[sid], tuple)]
        for k in first:
            sid = known[k][0]
            state, last = self.state[sid]
            self.state[sid] = self.model(torch.tensor([[last]]), state)[1]
        ids = torch.tensor([[tok] for _, tok in known])  # [B, 1]
        state = torch.cat([self.state[sid] for sid, _ in known], dim=1)  # [layers, B, dim]
        logits, state = self.model(ids, state)
        for k, (sid, _) in enumerate(known):
            self.state[sid] = state[:, k:k + 1]
        demand = [lg[:, 0].softmax(-1).sum(0).tolist() for lg in logits]  # next step's tokens, per layer [E]
        plan = self._plan(demand)
        with self.ready:
            self.decode_plan = (step, *plan)
            self.ready.notify_all()

    def _plan(self, demand: list[list[float]]) -> tuple:
        table = keep_or_replace(self.table, plan_replicas(self.cfg, self.ep, demand, self.slots, hedge=True), demand,
                                self.ep)
        expected = [sorted((e for e in range(len(d)) if d[e] >= 0.05), key=lambda e: -d[e]) for d in demand]
        return table, expected, demand


def make_controller(config: ServeConfig, cfg: ModelConfig, ep: int) -> Controller:
    """Rank 0's controller for `config.placement` over `ep` ranks."""
    if config.placement == "predictive":
        from export.serve.placement.predictor import load_predictor

        return PredictiveController(cfg, ep, config.replica_budget, load_predictor(config.package))
    return {"none": Controller, "reactive": ReactiveController}[config.placement](cfg, ep, config.replica_budget)
