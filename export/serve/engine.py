"""The serving engine behind `moe-pipeline serve`: the loop between the scheduler and the ranks.

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine
    from export.serve.request import SamplingParams
    engine = Engine.from_config(ServeConfig(package="runs/tiny/package"))
    req = engine.submit(engine.encode("And God said"), SamplingParams(max_tokens=16))
    while not req.finished:
        engine.step()
    print(engine.decode(req.generated))

Each step (`Engine.step`, rank 0): the scheduler decides it (export/serve/scheduler.py: queues, token
budgets, data-parallel ranks, KV blocks, preemption, prefix caching), the placement controller adds its
directive to each forward (export/serve/placement/controller.py), the typed step goes to every rank
(export/serve/step.py, ranks.py), every rank runs its rows (export/serve/worker.py: its paged KV cache,
its samplers), the sampled tokens come back in one gather, and rank 0 applies them to the requests
(stop conditions, streaming, answers).

  * Data parallel (`data_parallel_layout`): each rank runs its own sequences, and tokens cross ranks only
    in each MoE layer's expert exchange (export/serve/placement/exchange.py); a rank with no rows still joins it.
    With `own_requests` each rank also holds its own requests and scheduler and every rank calls `step_own`
    (as vLLM's data-parallel engines for MoE models): the ranks agree on each step's forwards in one small gather,
    with no step message and no gather of results. Behind the server (`spread`, the default where it applies:
    no --placement) rank 0's `submit` gives each request to the rank with the fewest, and the step's gather
    carries rank 0's orders (new requests, aborts, pings) and the other ranks' results of their last step, which
    rank 0 applies to its stand-ins of their requests (`lead`; the others `follow`).
  * Tensor or expert slicing (`--tp-size`, `--ep-size` below the rank count): one data-parallel group;
    every rank runs rank 0's rows through DeepSpeed's inference engine (export/inference.py).
  * KV memory (`--kv-cache-memory`, `--max-model-len`, `--block-size`): a pool of fixed-size blocks per
    rank, sized by a memory budget (export/serve/kv_cache.py), never max-batch x the model's context.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import TYPE_CHECKING

import torch

from export.serve import kernels
from export.serve import ranks as rank_msgs
from export.serve.config import ServeConfig
from export.serve.kv_cache import block_bytes, free_memory, pool_blocks, served_kv
from export.serve.placement.controller import Controller, ControllerStats, make_controller
from export.serve.placement.exchange import Exchange, ExchangeStats, placed_model
from export.serve.request import Detokenizer, Request, SamplingParams
from export.serve.scheduler import SCHED_STATS, Plan, Scheduler, cdiv
from export.serve.step import Forward, Row, RowResult, Step
from export.serve.worker import Worker
from pipeline.model import GPT, ModelConfig

if TYPE_CHECKING:
    from export.inference import Layout


# -- expert load -------------------------------------------------------------------------------------

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


# -- rank 0: the loop --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KVPlan:
    """How the KV cache was sized: blocks per rank of `block_size` tokens, the sequence length it serves, and why."""

    blocks: int
    block_size: int
    max_model_len: int
    bytes_per_rank: int
    budget: str  # where the budget came from
    lowered: str | None = None  # why max_model_len is below what was asked, if it is

    def describe(self) -> str:
        text = (f"KV cache: {self.blocks} blocks of {self.block_size} tokens per rank "
                f"({self.bytes_per_rank / 2**30:.2f} GiB, {self.blocks * self.block_size} tokens; {self.budget}); "
                f"max model length {self.max_model_len}")
        return text + (f" ({self.lowered})" if self.lowered else "")


def plan_kv(cfg: ModelConfig, heads: int, dtype: torch.dtype, device: torch.device, max_batch: int,
            kv_cache_memory: float | None = None, max_model_len: int | None = None, block_size: int = 16,
            local_ranks: int = 1) -> KVPlan:
    """Blocks per rank for `--kv-cache-memory` GiB (None: `kv_cache.free_memory`'s share for one of `local_ranks`
    ranks on this machine, at most what `max_batch` sequences of the model length fill), and the model length it
    serves: `--max-model-len` (None: the model's context), lowered with a reason when the pool cannot hold one such
    sequence."""
    asked = max_model_len or cfg.seq_len
    if asked > cfg.seq_len:
        raise ValueError(f"--max-model-len {asked}: the model's context is {cfg.seq_len} tokens; give at most that")
    per_block = block_bytes(cfg, heads, block_size, dtype)
    if kv_cache_memory is not None:
        budget, why = int(kv_cache_memory * 2**30), f"--kv-cache-memory {kv_cache_memory:g}"
        blocks = pool_blocks(cfg, heads, block_size, dtype, budget)
    else:
        budget, why = free_memory(device, local_ranks)
        blocks = min(pool_blocks(cfg, heads, block_size, dtype, budget), max_batch * cdiv(asked, block_size))
        why = f"default: {why}, at most --max-batch {max_batch} sequences of {asked} tokens"
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory: {budget / 2**20:.1f} MiB holds no KV block ({per_block / 2**20:.2f} MiB "
                         f"for {block_size} tokens over {cfg.layers} layers); give more memory or a smaller --block-size")
    return _fit(KVPlan(blocks, block_size, asked, blocks * per_block, why))


def _fit(plan: KVPlan) -> KVPlan:
    """`plan` with max_model_len lowered to what its pool holds, if the pool cannot hold one sequence of it."""
    room = plan.blocks * plan.block_size
    if room >= plan.max_model_len:
        return plan
    return dataclasses.replace(plan, max_model_len=room, lowered=f"lowered from {plan.max_model_len}: the KV cache "
                               f"holds {room} tokens; give --kv-cache-memory more to serve longer sequences")


@dataclasses.dataclass(frozen=True)
class PlacementStats:
    """Expert placement as /metrics, the server and tests read it: rank 0's controller (with --placement) and this
    rank's exchange (the data-parallel path), None where there is none."""

    controller: ControllerStats | None
    exchange: ExchangeStats | None


class Engine:
    """Continuous batching over data-parallel ranks (rank 0 schedules). Not thread safe except `submit` and `abort`.

    `max_batch`: sequences each rank runs at once; `max_batched_tokens`: tokens each rank runs in one step (decode
    tokens first, then prefill chunks); `max_prefill_seqs`: prompts per prefill forward on a rank (None: all of the
    step's). KV: `kv_cache_memory` GiB per rank (None: a share of the free memory, `plan_kv`), `max_model_len`,
    `block_size`, `prefix_caching`. The data-parallel path (each rank its own rows): `exchange`, this rank's expert
    exchange of a placed model (export/serve/placement/exchange.py `placed_model`), and on rank 0 with --placement
    its `controller`; without an exchange every rank runs the same rows. `layout`: how the model is spread over the
    ranks (None: one rank)."""

    def __init__(self, model: GPT, tokenizer, max_batch: int = 32, ranks=None, max_batched_tokens: int = 2048,
                 max_prefill_seqs: int | None = None, kv_cache_memory: float | None = None,
                 max_model_len: int | None = None, block_size: int = 16, prefix_caching: bool = True,
                 exchange: Exchange | None = None, layout: Layout | None = None, controller: Controller | None = None,
                 own_requests: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.detokenize = Detokenizer(tokenizer)
        self.cfg = model.cfg
        self.ranks = ranks
        world = ranks.world if ranks is not None else 1
        rank = ranks.rank if ranks is not None else 0
        self.exchange, self.layout, self.controller = exchange, layout, controller
        self.dp = world if exchange is not None else 1
        self.world = world
        if own_requests and (self.dp < 2 or controller is not None):
            raise ValueError("own_requests: each data-parallel rank its own requests needs several data-parallel ranks "
                             "and no --placement controller (it plans every rank's forwards on rank 0)")
        self.own = own_requests
        # rank 0 of an own engine behind the server: `submit` spreads the requests over the ranks; `remote` holds
        # its stand-ins of the requests other ranks run ({id: (request, rank)}), fed by their results, and
        # `_orders` what the next step's gather tells the ranks (new requests, aborts)
        self.spread = False
        self.remote: dict[int, tuple[Request, int]] = {}
        self._orders: dict[str, list] = {"submit": [], "abort": []}
        self._front = threading.Lock()
        self.busy = False  # an own engine's ranks are stepping together (idle, the others wait for a Wake)
        self._ping_due = False
        self._relay: list | None = None  # ranks > 0 following rank 0's server: their last step's results
        # own: each rank's books at the last step (`_books`: running, waiting, kv_blocks, decode_rows, SCHED_STATS)
        self.rank_queues: list[dict[str, int]] = []
        heads, dtype, device = served_kv(model)
        kv = plan_kv(self.cfg, heads, dtype, device, max_batch, kv_cache_memory, max_model_len, block_size,
                     local_ranks=ranks.local_world if ranks is not None else 1)
        # the data-parallel ranks' sums (expert exchange, step results) wait without spinning where they share a machine
        if self.dp > 1:
            kernels.attach_local_reduce()
        if world > 1:  # every rank's pool alike: the scheduler hands out the same block ids on each
            from pipeline import dist

            fewest = int(min(row[0] for row in dist.gather_numbers([kv.blocks])))
            kv = _fit(dataclasses.replace(kv, blocks=fewest, bytes_per_rank=fewest * kv.bytes_per_rank // kv.blocks))
        self.kv = kv
        self.max_model_len = kv.max_model_len
        # the weights into a file mapping (2 MB pages where anonymous memory gets 4 KB ones), before any kernel holds
        # them; on the CPU
        self.mapped_bytes = kernels.map_weights(model, exchange) if device.type == "cpu" else 0
        self.worker = Worker(model, kv.blocks, kv.block_size, rank if self.dp > 1 else 0, single=world == 1,
                             exchange=exchange, tokenizer=tokenizer)
        self.device = self.worker.device
        # decode tokens and prompt chunks in one forward where the ranks pack rows of different lengths (the CPU
        # attention kernel), and no placement policy plans prefill and decode forwards apart
        self.scheduler = Scheduler(1 if own_requests else self.dp, kv.blocks, kv.block_size, max_batch,
                                   max_batched_tokens, max_prefill_seqs, prefix_caching, eos=tokenizer.eos_token_id,
                                   mixed=self.worker.cache.packs and controller is None)
        self.max_batch = max_batch
        self.ids = itertools.count()
        self.steps = 0
        self.stats = {"forwards": 0, "tokens_in": 0, "tokens_out": 0, "decode_steps": 0, "prefill_forwards": 0,
                      "failed": 0}
        self.on_decode = None  # callback(batch size) after each decode step (the server's metrics)
        self.closed: str | None = None  # why the engine stopped (fail_all), refusing new requests
        self.load = ExpertLoad(self.cfg, world, layout)
        self.rank_status: list[dict] = []  # every rank's last answer to `ping` (rank 0)
        self.rank_status_at: float | None = None

    @classmethod
    def from_config(cls, config: ServeConfig, ranks=None, own_requests: bool | None = False) -> "Engine":
        """The engine for `config` on this rank. Data parallel (`data_parallel_layout`): the experts placed by a
        replica table (export/serve/placement/; the native one without --placement) and exchanged between the
        ranks, with rank 0's controller; else the package loaded for its tensor- or expert-sliced layout
        through DeepSpeed's inference engine (export/inference.py). `own_requests` None: where it applies
        (several data-parallel ranks, no --placement; the server's choice). Collective with several ranks."""
        from export.inference import load_package, plan_layout
        from export.package import package_dtype, read_tokenizer, verified_package
        from pipeline import dist

        ranks = ranks or dist.init()
        if config.nproc != ranks.world:
            raise ValueError(f"--nproc {config.nproc}: {ranks.world} rank(s) are running; the flags were checked for "
                             f"{config.nproc} (start as many ranks, or drop --nproc)")
        verified = verified_package(config.package, config.checksums)
        dp = data_parallel_layout(verified.cfg, config, ranks.world)
        if own_requests is None:  # decided alike on every rank (rank 0 alone holds the controller)
            own_requests = dp and ranks.world > 1 and config.placement is None
        stored = verified.manifest.get("quantization")  # export --quantize: the package's int8/int4 weights
        quantize, quantize_head = config.quantize, config.quantize_head
        if stored is not None:
            if quantize not in (None, stored["scheme"]) and (quantize, stored["scheme"]) != ("w8a8", "int8"):
                raise ValueError(f"--quantize {quantize}: this package holds {stored['scheme']} weights (exported with "
                                 f"--quantize {stored['scheme']}; an int8 one also serves --quantize w8a8); drop "
                                 f"--quantize, or serve a package exported without it")
            quantize, quantize_head = (quantize or stored["scheme"], quantize_head or stored["head"]) if dp \
                else (None, False)  # an int8 package under --quantize w8a8: its weights, int8 inputs
        if quantize == "w8a8" and not hasattr(kernels.kernel(), "w8a8_linear"):
            raise ValueError("--quantize w8a8: its int8 x int8 kernels need a CPU with AVX512_VNNI (and the GEMV "
                             "kernel built); serve --quantize int8 (weight-only) instead")
        if not dp and config.quantize is not None and stored is None:
            raise ValueError(f"--quantize {config.quantize}: the data-parallel layout only, and this package's experts "
                             f"{list(verified.cfg.experts)} do not split evenly over {ranks.world} ranks")
        if not dp:
            model, tok = load_package(config.package, ranks, ep_size=config.ep_size, checksums=config.checksums,
                                      dtype=config.dtype, tp_size=config.tp_size)
            exchange, layout = None, plan_layout(verified.cfg, ranks.world, config.ep_size, config.tp_size)
        else:
            placed = placed_model(verified.cfg, config.package, ranks, package_dtype(verified.manifest, config.dtype),
                                  config.resident_experts, files=verified.files, transport=config.expert_exchange,
                                  quantize=quantize, quantize_head=quantize_head, stored=stored)
            model, exchange, layout = placed.model, placed.exchange, placed.layout
            tok = read_tokenizer(config.package, verified.files)
        controller = None
        if config.placement is not None and ranks.rank == 0:
            controller = make_controller(config, model.cfg, ranks.world)
        return cls(model, tok, max_batch=config.max_batch, ranks=ranks, max_batched_tokens=config.max_batched_tokens,
                   max_prefill_seqs=config.max_prefill_seqs, kv_cache_memory=config.kv_cache_memory,
                   max_model_len=config.max_model_len, block_size=config.block_size,
                   prefix_caching=config.prefix_caching, exchange=exchange, layout=layout, controller=controller,
                   own_requests=own_requests)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def eos(self) -> int | None:
        """The end token: it finishes a request (unless ignore_eos) and is not sampled before min_tokens."""
        return self.scheduler.eos

    @eos.setter
    def eos(self, value: int | None) -> None:
        self.scheduler.eos = value

    @property
    def max_batched_tokens(self) -> int:
        return self.scheduler.max_batched_tokens

    @max_batched_tokens.setter
    def max_batched_tokens(self, value: int) -> None:
        self.scheduler.max_batched_tokens = value

    # -- requests (any thread) ---------------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> Request:
        """A new request (from any thread). With `spread` it runs on the rank with the fewest requests (rank 0 on
        a tie), the others' through the next step's gather (`lead`)."""
        if not prompt:
            raise ValueError("prompt: empty (give at least one token)")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"maximum model length of {self.max_model_len} tokens (the model's context is "
                             f"{self.cfg.seq_len}; serve --max-model-len, --kv-cache-memory)")
        seq = Request(next(self.ids), list(prompt), params, on_token=on_token, on_finish=on_finish)
        if self.controller is not None:
            self.controller.on_submit(seq)
        if self.closed is not None:  # after fail_all: nobody would ever finish it
            raise RuntimeError(f"the engine stopped: {self.closed}")
        if self.spread:
            with self._front:
                loads = [self.scheduler.pending()] + [0] * (self.world - 1)
                for _, r in self.remote.values():
                    loads[r] += 1
                rank = loads.index(min(loads))
                if rank:
                    self.remote[seq.id] = (seq, rank)
                    self._orders["submit"].append([seq.id, rank, seq.prompt, dataclasses.asdict(params)])
                    return seq
        self.scheduler.add(seq)
        return seq

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences over every rank: where each rank schedules its own, the others' as the last
        step's gather said (0 once idle), and the requests not yet sent to them as waiting."""
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        for q in self._others():
            running += q["running"]
            waiting += q["waiting"]
        if self.spread:
            waiting += len(self._orders["submit"])
        return running, waiting

    def kv_usage(self) -> float:
        """The fraction of KV blocks in use over every rank's pool (vLLM's kv_cache_usage_perc)."""
        if not self.spread or not self.rank_queues:
            return self.scheduler.kv_usage()
        used = sum(pool.used() for pool in self.scheduler.pools) + sum(q["kv_blocks"] for q in self._others())
        return used / (self.kv.blocks * len(self.rank_queues))

    def scheduler_stats(self) -> dict[str, int]:
        """The schedulers' counters (prefix-cache queries and hits, preemptions) over every rank: where each rank
        schedules its own, the others' as of the last step's gather."""
        stats = dict(self.scheduler.stats)
        for q in self._others():
            for key in SCHED_STATS:
                stats[key] += q[key]
        return stats

    def _others(self) -> list[dict[str, int]]:
        """With `spread`, the other ranks' books as of the last step's gather (`rank_queues`); else none."""
        return [q for r, q in enumerate(self.rank_queues) if r != self.worker.rank] if self.spread else []

    def _books(self, plan: Plan) -> dict[str, int]:
        """This rank's books for a step's gather: sequences running and waiting, KV blocks in use, the step's decode
        rows, the scheduler's counters."""
        sched = self.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "kv_blocks": sum(pool.used() for pool in sched.pools), "decode_rows": plan.decode_rows,
                **{key: sched.stats[key] for key in SCHED_STATS}}

    def pending(self) -> int:
        """Requests not finished: this rank's, and with `spread` those it gave the other ranks."""
        if not self.spread:
            return self.scheduler.pending()
        with self._front:
            return self.scheduler.pending() + len(self.remote) + len(self._orders["abort"])

    def fail_all(self, message: str) -> None:
        """Finish every waiting and running sequence with finish_reason 'error' (the engine cannot go on); later
        submits are refused."""
        self.closed = message
        with self._front:
            stand_ins, self.remote = [seq for seq, _ in self.remote.values()], {}
        for seq in self.scheduler.drain() + stand_ins:
            if not seq.finished:
                seq.text = message
                try:
                    seq.finish("error")
                except Exception:  # noqa: BLE001 - its client's event loop is gone
                    pass

    def abort(self, seq: Request) -> None:
        """End `seq` at the next step (from any thread): a waiting one never runs, a running one frees its blocks."""
        with self._front:
            if seq.id in self.remote:  # another rank runs it: told in the next step's gather
                self._orders["abort"].append(seq.id)
                return
        self.scheduler.abort(seq.id)

    def _retired(self, req: Request) -> None:
        """A request is done (finished, aborted or failed): its blocks and the controller's state for it go."""
        self.scheduler.finish(req)
        if self.controller is not None:
            self.controller.on_finish(req)

    def _fail(self, req: Request, err: BaseException | str) -> None:
        """An error serving one request fails that request alone; the others go on."""
        self.stats["failed"] += 1
        req.text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        if not req.finished:
            try:
                req.finish("error")
            except Exception:  # noqa: BLE001 - its own callback failed: nobody left to tell
                pass
        if req.id not in self.remote:  # a stand-in of another rank's request: `_take_remote` forgets it
            self._retired(req)

    # -- one step ------------------------------------------------------------------------------------------------

    def step(self) -> int:
        """Schedule; every rank runs the step's forwards (prefill chunks, then one decode token of every running
        sequence); take the sampled tokens; retire. Returns tokens generated."""
        if self.own:
            raise RuntimeError("step: an engine made with own_requests=True steps with step_own (or lead, behind "
                               "the server) on every rank")
        plan = self.scheduler.schedule()
        self._aborted(plan)
        step = self._directed(plan)
        self.steps += 1
        if not step.forwards:
            return 0
        self._count(plan, step.forwards)
        if self.world > 1:
            rank_msgs.send(step)
        mine = self.worker.execute(step)
        self.stats["forwards"] += len(step.forwards)
        results = [[RowResult.from_json(r) for r in rows] for rows in rank_msgs.gather_results(
            [r.to_json() for r in mine])] if self.dp > 1 else [mine]
        for fwd, (counts, loads) in zip(step.forwards, self.worker.counts):
            self.load.add(counts, loads)
            if self.controller is not None:
                self.controller.after_forward(self.load.last, fwd.kind, self._requests(plan, fwd))
        return self._take_results(plan, [res for rows in results for res in rows])

    def step_own(self, note: dict | None = None) -> int | None:
        """`own_requests` (each data-parallel rank its own requests and scheduler, as vLLM's data-parallel engines
        for MoE models): schedule this rank's step; agree with the other ranks on the step's forwards in one small
        gather (each rank's forward count, requests pending, tokens a forward, and its `note`: rank 0's orders behind
        the server, another rank's results of its last step there; `_heard`); run as many forwards as the rank with
        the most has (this rank's rows; another rank's stand in by their token count, which is all the expert
        exchange needs of them; a rank with none joins with no rows); take this rank's results. No step message and
        no gather of results: rank 0's scheduling and results are its own rows' only. Collective: every rank calls
        it until it returns None, which every rank does at the same step (no rank has a forward, a pending request
        or orders); else the tokens generated on this rank."""
        from pipeline import dist

        if not self.own:
            raise RuntimeError("step_own: an engine made with own_requests=True (else rank 0 steps, the others follow)")
        plan = self.scheduler.schedule()
        self._aborted(plan)
        mine = plan.step.forwards
        tokens = [sum(len(row.tokens) for row in fwd.rows[0]) for fwd in mine]
        if self._relay is not None:  # a rank following rank 0's server: its last step's results go to rank 0
            note, self._relay = ({"results": self._relay} if self._relay else None), []
        orders = bool(note and (note.get("submit") or note.get("abort")))  # requests for the next step
        table = dist.gather_json([len(mine), self.scheduler.pending() + orders, tokens, note, self._books(plan)])
        self.rank_queues = [row[4] for row in table]
        self._heard([row[3] for row in table])
        ping = bool(table[0][3] and table[0][3].get("ping"))
        n = max(row[0] for row in table)
        self.steps += 1
        if n == 0:
            if ping:
                self._pinged()
            return None if not any(row[1] for row in table) else 0
        me = self.worker.rank
        forwards = []
        for i in range(n):
            rows = [(mine[i].rows[0] if i < len(mine) else []) if r == me else
                    [Row(seq=-1, start=0, tokens=[0] * row[2][i])] if i < row[0] and row[2][i] else []
                    for r, row in enumerate(table)]
            forwards.append(Forward(mine[i].kind if i < len(mine) else "decode", rows))
        step = Step(forwards, [dataclasses.replace(new, rank=me) for new in plan.step.new], plan.step.freed,
                    plan.step.ended)
        self._count(plan, mine, sum(q["decode_rows"] for q in self.rank_queues))
        results = self.worker.execute(step)
        if self._relay is not None:
            self._relay = [r.to_json() for r in results]
        self.stats["forwards"] += n
        for expert_counts, loads in self.worker.counts:
            self.load.add(expert_counts, loads)
        made = self._take_results(plan, results)
        if ping:
            self._pinged()
        return made

    # -- behind the server, each rank its own requests (rank 0 leads, the others follow) ------------------------

    def lead(self) -> int:
        """Rank 0 of an own engine behind the server (`spread`): one step of every rank (`step_own`), waking the
        others first when they were idle; the step's gather takes them the requests `submit` gave them, the aborts
        and a due ping, and brings their results, applied to rank 0's stand-ins (their callbacks: the HTTP
        answers). Returns the tokens generated on this rank; idle again once a step finds nothing to do."""
        if not self.busy:
            rank_msgs.send(rank_msgs.Wake())
            self.busy = True
        with self._front:
            submit, abort = self._orders["submit"], self._orders["abort"]
            self._orders = {"submit": [], "abort": []}
        for rid in abort:  # the stand-in ends now; the rank that runs it forgets it at its next step
            self._forget(rid, "abort")
        note = {"submit": submit, "abort": abort} if submit or abort else {}
        if self._ping_due:
            note["ping"], self._ping_due = True, False
        made = self.step_own(note or None)
        if made is None:
            self.busy = False
            return 0
        return made

    def _heard(self, notes: list) -> None:
        """Every rank's note of a step's gather (`step_own`): rank 0 applies the others' results to its stand-ins;
        another rank takes the requests and aborts rank 0 ordered for it."""
        me = self.worker.rank
        if me == 0:
            for note in notes[1:]:
                for raw in (note or {}).get("results", ()):
                    self._take_remote(RowResult.from_json(raw))
            return
        orders = notes[0] or {}
        for rid, rank, prompt, params in orders.get("submit", ()):
            if rank == me:
                self.scheduler.add(Request(rid, prompt, SamplingParams(**params)))
        for rid in orders.get("abort", ()):
            self.scheduler.abort(rid)

    def _take_remote(self, res: RowResult) -> None:
        """Another rank's result for one of its requests, on rank 0's stand-in: the same stop conditions and
        detokenization as that rank applied (so both finish it at the same token), and the callbacks."""
        held = self.remote.get(res.seq)
        if held is None or held[0].finished:  # aborted here meanwhile
            return
        seq = held[0]
        if res.error is not None:
            self._fail(seq, res.error)
        else:
            self._take_one(seq, res)
        if seq.finished:
            self._forget(seq.id)

    def _forget(self, rid: int, reason: str | None = None) -> None:
        """A stand-in is done (`reason`: finish it so first)."""
        with self._front:
            held = self.remote.pop(rid, None)
            if held is None:
                return
        if reason is not None and not held[0].finished:
            try:
                held[0].finish(reason)
            except Exception:  # noqa: BLE001 - its client's event loop is gone: nobody left to tell
                pass

    def _pinged(self) -> None:
        """A ping in a step's gather: every rank answers with its status (rank 0 records them)."""
        status = self._status()
        if self.worker.rank == 0:
            self.rank_status, self.rank_status_at = [s.to_dict() for s in status], time.time()

    def _count(self, plan: Plan, forwards: list[Forward], decode_rows: int | None = None) -> None:
        """A step's books before it runs: decode steps (and the server's callback with their rows, over every rank:
        `decode_rows` where each rank schedules its own), prefill forwards."""
        rows = plan.decode_rows if decode_rows is None else decode_rows
        if rows:
            self.stats["decode_steps"] += 1
            if self.on_decode is not None:
                self.on_decode(rows)
        self.stats["prefill_forwards"] += sum(f.kind != "decode" for f in forwards)

    def _aborted(self, plan: Plan) -> None:
        """Finish the requests the scheduler took out of its queues for this step (aborted)."""
        for req in plan.aborted:
            try:
                req.finish("abort")
            except Exception:  # noqa: BLE001 - its client's event loop is gone: nobody left to tell
                pass
            if self.controller is not None:
                self.controller.on_finish(req)

    @staticmethod
    def _requests(plan: Plan, fwd: Forward) -> list[Request]:
        return [plan.requests[row.seq] for rows in fwd.rows for row in rows]

    def _directed(self, plan: Plan) -> Step:
        """`plan`'s step with the placement controller's directive in each forward (the replica table and the
        experts to prefetch), as JSON."""
        if self.controller is None:
            return plan.step
        forwards = []
        for fwd in plan.step.forwards:
            directive = self.controller.before_forward(fwd.kind, self._requests(plan, fwd))
            forwards.append(dataclasses.replace(fwd, placement=directive.to_json() if directive is not None else None))
        return dataclasses.replace(plan.step, forwards=forwards)

    def _take_results(self, plan: Plan, results: list[RowResult]) -> int:
        """Apply every rank's results: errors first (a failed sequence's blocks are not cached), then the step's
        tokens are computed (the prefix cache registers full blocks), then prompt scores and sampled tokens."""
        for res in results:
            if res.error is not None and not plan.requests[res.seq].finished:
                self._fail(plan.requests[res.seq], res.error)
        self.scheduler.computed(plan)
        made = 0
        for res in results:
            seq = plan.requests[res.seq]
            if not seq.finished and res.error is None:
                made += self._take_one(seq, res)
        for seq in plan.requests.values():
            if seq.finished and seq in self.scheduler.running:
                self._retired(seq)
        return made

    def _take_one(self, seq: Request, res: RowResult) -> int:
        """One row's prompt scores and sampled token on its request; the tokens taken (0 or 1)."""
        try:
            if res.scores is not None:
                seq.add_prompt_scores(res.score_start, res.scores)
            if res.token is not None:
                if not seq.generated:
                    self.stats["tokens_in"] += len(seq.prompt)
                took = seq.take(res.token, res.logprob, res.top, self.eos, self.detokenize)
                self.stats["tokens_out"] += took
                return took
        except Exception as err:  # noqa: BLE001 - its tokenizer, its callback: this request alone fails
            self._fail(seq, err)
        return 0

    @property
    def expert_tokens(self) -> list[torch.Tensor]:
        return self.load.tokens

    def rank_expert_tokens(self) -> list[list[int]]:
        return self.load.per_rank()

    def placement_stats(self) -> PlacementStats:
        """Expert placement now: rank 0's controller and this rank's exchange (each None where there is none)."""
        return PlacementStats(self.controller.stats() if self.controller is not None else None,
                              self.exchange.stats() if self.exchange is not None else None)

    def close(self) -> None:
        """Rank 0, when done: stop the placement controller's thread, if it has one."""
        if self.controller is not None:
            self.controller.close()

    # -- the other ranks (export/serve/ranks.py) --------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run this rank's part of every step rank 0 sends, answer its pings, until it says stop."""
        if self.own:  # rank 0 leads behind the server: this rank's results ride in each step's gather
            self._relay = []
        while True:
            msg = rank_msgs.receive()
            if isinstance(msg, rank_msgs.Stop):
                return
            if isinstance(msg, rank_msgs.Ping):  # rank 0 checks that every rank is alive and asks how it is
                self._status()
                continue
            if isinstance(msg, rank_msgs.Wake):  # own requests: step together until no rank has anything to do
                while self.step_own() is not None:
                    pass
                continue
            mine = self.worker.execute(msg)
            if self.dp > 1:
                rank_msgs.gather_results([r.to_json() for r in mine])

    def ping(self) -> None:
        """Rank 0: one round trip with every rank (a dead rank makes it raise within the collective's
        timeout); records each rank's status in `rank_status`. While an own engine's ranks step together
        (`lead`), in the next step's gather instead."""
        if self.busy:
            self._ping_due = True
            return
        rank_msgs.send(rank_msgs.Ping())
        self.rank_status = [s.to_dict() for s in self._status()]
        self.rank_status_at = time.time()

    def _status(self) -> list[rank_msgs.RankStatus]:
        return rank_msgs.gather_status(self.ranks.rank if self.ranks else 0, self.worker.forwards, self.worker.forward_s,
                                       self.exchange.stats() if self.exchange is not None else None,
                                       placed=self.controller is not None)

    def stop_followers(self) -> None:
        rank_msgs.send(rank_msgs.Stop())


def data_parallel_layout(cfg: ModelConfig, config: ServeConfig, world: int) -> bool:
    """Whether `config` on `world` ranks serves data parallel (each rank its own sequences, an expert all-to-all
    in every MoE layer): no tensor slicing, and every MoE layer's experts split over all the ranks (no expert
    slicing). Otherwise one group runs rank 0's rows on every rank (DeepSpeed's inference engine)."""
    if (config.tp_size or 1) > 1 or (config.ep_size or world) != world:
        return False
    return all(n % world == 0 for n in cfg.experts)


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """Submit `prompts` together and step until all are done (offline batch use and tests)."""
    seqs = [engine.submit(p, dataclasses.replace(params, stop=list(params.stop or []))) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    return seqs
