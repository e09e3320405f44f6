"""The serving engine behind `moe-pipeline serve`: one rank's loop between its scheduler and its worker.

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine
    from export.serve.request import SamplingParams
    engine = Engine.from_config(ServeConfig(package="runs/tiny/package"))
    req = engine.submit(engine.encode("And God said"), SamplingParams(max_tokens=16))
    while not req.finished:
        engine.step()
    print(engine.decode(req.generated))

Each step: the scheduler decides it (export/serve/scheduler.py: queues, token budgets, data-parallel ranks, KV
blocks, preemption, prefix caching), the placement controller adds its directive to each forward
(export/serve/placement/controller.py), the worker runs this rank's rows (export/serve/worker.py: its paged KV
cache, its samplers), and the sampled tokens go to their requests (stop conditions, streaming, answers), which
retire when done. How several ranks step together is the coordinator's (export/serve/coordinator.py): rank 0
planning every rank's rows (`RankZero`: tensor or expert slicing, --placement, one rank), or each data-parallel
rank its own requests (`OwnRequests`, the server's default where it applies). `submit`, `step`, `has_work` and the
queue figures go through it.

  * Data parallel (export/serve/served.py `data_parallel_layout`): each rank runs its own sequences, and tokens cross ranks only
    in each MoE layer's expert exchange (export/serve/placement/exchange.py); a rank with no rows still joins it.
  * Tensor or expert slicing (`--tp-size`, `--ep-size` below the rank count): one data-parallel group;
    every rank runs rank 0's rows through DeepSpeed's inference engine (export/inference.py).
  * KV memory (`--kv-cache-memory`, `--max-model-len`, `--block-size`): a pool of fixed-size blocks per
    rank, sized by a memory budget (export/serve/kv_cache.py `plan_kv`), never max-batch x the model's context.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch

from export.serve import ranks as rank_msgs
from export.serve import transport
from export.serve.config import ServeConfig
from export.serve.coordinator import coordinator_for
from export.serve.kernels.options import KernelOptions, configure
from export.serve.kv_cache import plan_kv, served_kv
from export.serve.placement.controller import Controller, ControllerStats, make_controller
from export.serve.placement.exchange import Exchange, ExchangeStats
from export.serve.placement.load import ExpertLoad
from export.serve.request import Detokenizer, Request, SamplingParams
from export.serve.scheduler import Plan, Scheduler
from export.serve.served import ServedWeights, serve_model
from export.serve.step import Forward, RowResult, Step
from export.serve.worker import Worker
from pipeline.model import GPT

if TYPE_CHECKING:
    from export.inference import Layout


@dataclasses.dataclass(frozen=True)
class PlacementStats:
    """Expert placement as /metrics, the server and tests read it: rank 0's controller (with --placement) and this
    rank's exchange (the data-parallel path), None where there is none."""

    controller: ControllerStats | None
    exchange: ExchangeStats | None


class Engine:
    """Continuous batching on one rank, stepping with the others through its `coordinator`. Not thread safe except
    `submit` and `abort`.

    `max_batch`: sequences each rank runs at once; `max_batched_tokens`: tokens each rank runs in one step (decode
    tokens first, then prefill chunks); `max_prefill_seqs`: prompts per prefill forward on a rank (None: all of the
    step's). KV: `kv_cache_memory` GiB per rank (None: a share of the free memory, kv_cache.py `plan_kv`),
    `max_model_len`, `block_size`, `prefix_caching`. The data-parallel path (each rank its own rows): `exchange`,
    this rank's expert exchange of a placed model (export/serve/served.py `placed_model`), and on rank 0
    with --placement its `controller`; without an exchange every rank runs the same rows. `layout`: how the model is
    spread over the ranks (None: one rank). `own_requests`: each data-parallel rank its own requests and scheduler
    (`front`: this rank 0 takes every request and spreads them; export/serve/coordinator.py)."""

    def __init__(self, model: GPT, tokenizer, max_batch: int = 32, ranks=None, max_batched_tokens: int = 512,
                 max_prefill_seqs: int | None = None, kv_cache_memory: float | None = None,
                 max_model_len: int | None = None, block_size: int = 16, prefix_caching: bool = True,
                 exchange: Exchange | None = None, layout: Layout | None = None, controller: Controller | None = None,
                 own_requests: bool = False, front: bool = False):
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
        heads, dtype, device = served_kv(model)
        kv = plan_kv(self.cfg, heads, dtype, device, max_batch, kv_cache_memory, max_model_len, block_size,
                     local_ranks=ranks.local_world if ranks is not None else 1)
        # the data-parallel ranks' sums (expert exchange, step results) wait without spinning where they share a machine
        if self.dp > 1:
            transport.attach_local_reduce()
        if world > 1:  # every rank's pool alike: the scheduler hands out the same block ids on each
            from pipeline import dist

            kv = kv.with_blocks(int(min(row[0] for row in dist.gather_numbers([kv.blocks]))))
        self.kv = kv
        self.max_model_len = kv.max_model_len
        # from_config's served model: its weights' scheme, the bytes moved into the file mapping
        # (export/serve/served.py `serve_model`)
        self.weights, self.mapped_bytes = ServedWeights(), 0
        self.worker = Worker(model, kv.blocks, kv.block_size, rank if self.dp > 1 else 0, single=world == 1,
                             exchange=exchange, tokenizer=tokenizer)
        self.device = self.worker.device
        # decode tokens and prompt chunks in one forward where the ranks pack rows of different lengths (the CPU
        # attention kernel), and no placement policy plans prefill and decode forwards apart
        self.scheduler = Scheduler(1 if own_requests else self.dp, kv.blocks, kv.block_size, max_batch,
                                   max_batched_tokens, max_prefill_seqs, prefix_caching, eos=tokenizer.eos_token_id,
                                   mixed=self.worker.cache.packs and controller is None)
        self.ids = itertools.count()
        self.steps = 0
        self.stats = {"forwards": 0, "tokens_in": 0, "tokens_out": 0, "decode_steps": 0, "prefill_forwards": 0,
                      "failed": 0}
        self.on_decode = None  # callback(batch size) after each decode step (the server's metrics)
        self.closed: str | None = None  # why the engine stopped (fail_all), refusing new requests
        self.load = ExpertLoad(self.cfg, world, layout)
        self.rank_status: list[dict] = []  # every rank's last answer to `ping` (rank 0)
        self.rank_status_at: float | None = None
        self.config: ServeConfig | None = None  # from_config's, reported by /health
        self.coordinator = coordinator_for(self, own_requests, front)

    @classmethod
    def from_config(cls, config: ServeConfig, ranks=None, own_requests: bool | None = False,
                    front: bool = False) -> "Engine":
        """The engine for `config` on this rank, serving the model export/serve/served.py `serve_model`
        builds. Data parallel (`data_parallel_layout`): the experts placed by a
        replica table (export/serve/placement/; the native one without --placement) and exchanged between the
        ranks, with rank 0's controller; else the package loaded for its tensor- or expert-sliced layout
        through DeepSpeed's inference engine (export/inference.py). `own_requests` None: where it applies
        (several data-parallel ranks, no --placement; the server's choice); `front`: rank 0 takes every request and
        spreads them over the ranks (behind the server). Collective with several ranks."""
        from pipeline import dist

        ranks = ranks or dist.init(tune_allocator=config.malloc_tuning)
        configure(KernelOptions.of(config))  # the CPU kernels' options, before any weight is served
        if config.nproc != ranks.world:
            raise ValueError(f"--nproc {config.nproc}: {ranks.world} rank(s) are running; the flags were checked for "
                             f"{config.nproc} (start as many ranks, or drop --nproc)")
        served = serve_model(config, ranks)
        if own_requests is None:  # decided alike on every rank (rank 0 alone holds the controller)
            own_requests = served.data_parallel and ranks.world > 1 and config.placement is None
        model = served.model
        controller = None
        if config.placement is not None and ranks.rank == 0:
            controller = make_controller(config, model.cfg, ranks.world)
        engine = cls(model, served.tokenizer, max_batch=config.max_batch, ranks=ranks, max_batched_tokens=config.max_batched_tokens,
                     max_prefill_seqs=config.max_prefill_seqs, kv_cache_memory=config.kv_cache_memory,
                     max_model_len=config.max_model_len, block_size=config.block_size,
                     prefix_caching=config.prefix_caching, exchange=served.exchange, layout=served.layout,
                     controller=controller, own_requests=own_requests, front=front)
        engine.config, engine.weights, engine.mapped_bytes = config, served.weights, served.mapped_bytes
        return engine

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
        """A new request (from any thread); the coordinator decides which rank runs it."""
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
        self.coordinator.submit(seq)
        return seq

    def abort(self, seq: Request) -> None:
        """End `seq` at the next step (from any thread): a waiting one never runs, a running one frees its blocks."""
        self.coordinator.abort(seq)

    def pending(self) -> int:
        """Requests not finished: this rank's, and those it gave the other ranks."""
        return self.coordinator.pending()

    def has_work(self) -> bool:
        """Whether the loop should step now (requests pending, or the ranks stepping together)."""
        return self.coordinator.has_work()

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences over every rank."""
        return self.coordinator.queue_lengths()

    def kv_usage(self) -> float:
        """The fraction of KV blocks in use over every rank's pool (vLLM's kv_cache_usage_perc)."""
        return self.coordinator.kv_usage()

    def scheduler_stats(self) -> dict[str, int]:
        """The schedulers' counters (prefix-cache queries and hits, preemptions) over every rank."""
        return self.coordinator.scheduler_stats()

    def fail_all(self, message: str) -> None:
        """Finish every waiting and running sequence (and stand-in) with finish_reason 'error' (the engine cannot go
        on); later submits are refused."""
        self.coordinator.fail_all(message)

    # -- one step --------------------------------------------------------------------------------------------------

    def step(self) -> int | None:
        """One step of every rank (export/serve/coordinator.py): schedule; every rank runs the step's forwards (prefill
        chunks, then one decode token of every running sequence); take the sampled tokens; retire. Returns tokens
        generated (each rank its own requests, without a front: None once no rank has anything to do)."""
        return self.coordinator.step()

    def plan(self) -> tuple[Plan, Step]:
        """This rank's scheduling of a step: the plan, the aborted requests finished, and its step with the placement
        controller's directive in each forward (the replica table and the experts to prefetch), as JSON."""
        plan = self.scheduler.schedule()
        for req in plan.aborted:
            req.end("abort")
            if self.controller is not None:
                self.controller.on_finish(req)
        if self.controller is None:
            return plan, plan.step
        forwards = []
        for fwd in plan.step.forwards:
            directive = self.controller.before_forward(fwd.kind, self._requests(plan, fwd))
            forwards.append(dataclasses.replace(fwd, placement=directive.to_json() if directive is not None else None))
        return plan, dataclasses.replace(plan.step, forwards=forwards)

    def count(self, plan: Plan, forwards: list[Forward], decode_rows: int | None = None) -> None:
        """A step's books before it runs: decode steps (and the server's callback with their rows, over every rank:
        `decode_rows` where each rank schedules its own), prefill forwards."""
        rows = plan.decode_rows if decode_rows is None else decode_rows
        if rows:
            self.stats["decode_steps"] += 1
            if self.on_decode is not None:
                self.on_decode(rows)
        self.stats["prefill_forwards"] += sum(f.kind != "decode" for f in forwards)

    def execute(self, step: Step, plan: Plan) -> list[RowResult]:
        """This rank's rows of `step`, run; the experts' load of each forward booked (and told to the controller)."""
        results = self.worker.execute(step)
        self.stats["forwards"] += len(step.forwards)
        for fwd, (counts, loads) in zip(step.forwards, self.worker.counts):
            self.load.add(counts, loads)
            if self.controller is not None:
                self.controller.after_forward(self.load.last, fwd.kind, self._requests(plan, fwd))
        return results

    def take_results(self, plan: Plan, results: list[RowResult]) -> int:
        """Apply every rank's results: errors first (a failed sequence's blocks are not cached), then the step's
        tokens are computed (the prefix cache registers full blocks), then prompt scores and sampled tokens; retire
        the finished."""
        for res in results:
            if res.error is not None and not plan.requests[res.seq].finished:
                self.fail(plan.requests[res.seq], res.error)
        self.scheduler.computed(plan)
        made = 0
        for res in results:
            seq = plan.requests[res.seq]
            if not seq.finished and res.error is None:
                made += self.take_one(seq, res)
        for seq in plan.requests.values():
            if seq.finished and seq in self.scheduler.running:
                self._retired(seq)
        return made

    def take_one(self, seq: Request, res: RowResult) -> int:
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
            self.fail(seq, err)
        return 0

    def fail(self, req: Request, err: BaseException | str, retire: bool = True) -> None:
        """An error serving one request fails that request alone; the others go on. `retire` False: a stand-in of
        another rank's request (its rank retires it)."""
        self.stats["failed"] += 1
        req.text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        req.end("error")
        if retire:
            self._retired(req)

    def _retired(self, req: Request) -> None:
        """A request is done (finished, aborted or failed): its blocks and the controller's state for it go."""
        self.scheduler.finish(req)
        if self.controller is not None:
            self.controller.on_finish(req)

    @staticmethod
    def _requests(plan: Plan, fwd: Forward) -> list[Request]:
        return [plan.requests[row.seq] for rows in fwd.rows for row in rows]

    # -- the other ranks, status -------------------------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run this rank's part of every step rank 0 sends, answer its pings, until it says stop."""
        self.coordinator.follow()

    def ping(self) -> None:
        """Rank 0: one round trip with every rank (a dead rank makes it raise within the collective's timeout);
        records each rank's status in `rank_status`."""
        self.coordinator.ping()

    def stop_followers(self) -> None:
        self.coordinator.stop_followers()

    def status(self) -> list[rank_msgs.RankStatus]:
        """Collective: every rank's status (export/serve/ranks.py `gather_status`)."""
        return rank_msgs.gather_status(self.ranks.rank if self.ranks else 0, self.worker.forwards,
                                       self.worker.forward_s, self.exchange.stats() if self.exchange is not None else None,
                                       placed=self.controller is not None)

    def server_info(self) -> dict:
        """How this server runs, as /health reports it: every option in force (its ServeConfig, the API key left out),
        the CPU kernels' build, options and thresholds (export/serve/kernels/info.py), the engine's own choices."""
        from export.serve.decode import Decoder
        from export.serve.kernels.info import describe

        options = self.config.model_dump(mode="json", exclude={"api_key", "api_key_file"}) if self.config else None
        return {"options": options, "kernels": describe() if self.device.type == "cpu" else None,
                "engine": {"coordinator": type(self.coordinator).__name__, "data_parallel": self.dp,
                           "native_decoder": self.worker.decoder is not None,
                           "weights": self.weights.describe(), "mapped_bytes": self.mapped_bytes,
                           "kv_blocks": self.kv.blocks, "block_size": self.kv.block_size,
                           "max_model_len": self.max_model_len, "PACKED_TOKENS": Decoder.PACKED_TOKENS,
                           "TOPK_SCREEN": Worker.TOPK_SCREEN, "SCORE_ROWS": Worker.SCORE_ROWS}}

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


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """Submit `prompts` together and step until all are done (offline batch use and tests)."""
    seqs = [engine.submit(p, dataclasses.replace(params, stop=list(params.stop or []))) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    return seqs
