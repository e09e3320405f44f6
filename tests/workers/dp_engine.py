"""Worker for tests/test_dp_serving.py: the serving engine's scenarios at the launcher's world size.

    python tests/workers/dp_engine.py PKG OUT.json [none|reactive|predictive|-] [EXCHANGE]                  # 1 rank
    deepspeed --num_gpus 2 tests/workers/dp_engine.py PKG OUT.json [none|reactive|predictive|-] [EXCHANGE]  # DP + EP 2

EXCHANGE: --expert-exchange (auto, all-to-all, all-reduce).

Rank 0 schedules (export/serve/engine.py) and writes, per scenario, every request's greedy tokens, the
rank that held it, and the engine's counters; the other ranks follow its steps. Scenarios:
  * staggered: requests arriving between steps (one decodes alone first: the other rank has no rows);
  * burst: 6 prompts at once (one batched prefill forward) and the same prompts one at a time;
  * chunked: a long prompt under a step budget of 8 tokens (prefilled in chunks) next to a decoding one;
  * scored: echo + logprobs of a prompt chunked over several steps.
On 2 ranks without --placement, then `own`: each rank its own requests and scheduler (coordinator.py `OwnRequests`): the
prompts split between the ranks, then one rank with a request and the other with none; and `own_served`: the same
engine as the server runs it (rank 0 `lead`s, spreading the requests it is given; the others `follow`).
"""

import json
import sys
from pathlib import Path

from export.serve.config import ServeConfig
from export.serve.engine import Engine
from export.serve.request import SamplingParams
from pipeline import dist

PROMPTS = ["And God said", "To be, or not to be, that is the question:", "The LORD is my shepherd; I shall not want.",
           "In the beginning", "Friends, Romans, countrymen, lend me your ears", "Blessed are the meek"]
LONG = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep.")


def run(engine: Engine, seqs) -> None:
    while not all(s.finished for s in seqs):
        engine.step()


def record(seqs) -> list[dict]:
    return [{"tokens": s.generated, "rank": s.rank, "reason": s.finish_reason, "text": s.text} for s in seqs]


def scenarios(engine: Engine) -> dict:
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0)  # noqa: E731
    enc = engine.encode
    out = {}
    # staggered arrivals; `alone`: steps where some rank held no running sequence while another decoded
    alone = 0
    seqs = [engine.submit(enc(PROMPTS[0]), greedy(12))]
    for _ in range(2):
        engine.step()
        alone += len({s.rank for s in engine.running}) < engine.dp
    seqs.append(engine.submit(enc(PROMPTS[1]), greedy(9)))
    engine.step()
    seqs += [engine.submit(enc(PROMPTS[2]), greedy(11)), engine.submit(enc(PROMPTS[3]), greedy(7))]
    run(engine, seqs)
    out["staggered"] = {"requests": record(seqs), "alone_steps": alone}
    # a burst prefilled in one forward, then the same prompts one at a time
    before = engine.stats["prefill_forwards"]
    burst = [engine.submit(enc(p), greedy(8)) for p in PROMPTS]
    run(engine, burst)
    batched_forwards = engine.stats["prefill_forwards"] - before
    single = []
    for p in PROMPTS:
        single.append(engine.submit(enc(p), greedy(8)))
        run(engine, single[-1:])
    out["burst"] = {"batched": record(burst), "single": record(single), "batched_prefill_forwards": batched_forwards}
    # a prompt longer than the step budget, chunked while another request decodes
    budget = engine.max_batched_tokens
    engine.max_batched_tokens = 8
    before = engine.stats["prefill_forwards"]
    seqs = [engine.submit(enc(PROMPTS[0]), greedy(20))]
    engine.step()
    seqs.append(engine.submit(enc(LONG), greedy(10)))
    run(engine, seqs)
    out["chunked"] = {"requests": record(seqs), "prefill_forwards": engine.stats["prefill_forwards"] - before,
                      "long_prompt_tokens": len(enc(LONG))}
    # echo + logprobs over the chunks
    scored = engine.submit(enc(LONG), SamplingParams(max_tokens=2, temperature=0, echo=True, logprobs=2))
    run(engine, [scored])
    engine.max_batched_tokens = budget
    whole = engine.submit(enc(LONG), SamplingParams(max_tokens=2, temperature=0, echo=True, logprobs=2))
    run(engine, [whole])
    out["scored"] = {"chunked": scored.prompt_logprobs, "whole": whole.prompt_logprobs,
                     "chunked_top": [sorted(t) if t else None for t in scored.prompt_top],
                     "whole_top": [sorted(t) if t else None for t in whole.prompt_top],
                     "tokens": [scored.generated, whole.generated]}
    out["stats"] = dict(engine.stats)
    out["rank_expert_tokens"] = engine.rank_expert_tokens()
    out["blocks_in_use"] = [pool.used() for pool in engine.scheduler.pools]
    out["dp"] = engine.dp
    placement = engine.placement_stats()
    out["exchange"] = placement.exchange.transport if placement.exchange is not None else None
    out["gathered_layers"] = placement.exchange.gathered if placement.exchange is not None else 0
    out["native_experts"] = engine.worker.decoder.native_experts if engine.worker.decoder is not None else None
    out["native_tables"] = engine.worker.decoder.tables_held if engine.worker.decoder is not None else 0
    if placement.controller is not None:
        out["placement_balancedness"] = placement.exchange.balancedness
        out["table_changes"] = placement.controller.table_changes
    return out


def own_requests(engine: Engine, ranks) -> dict:
    """Each rank its own requests (coordinator.py `OwnRequests`, every rank stepping until every rank is done): the prompts
    split between the ranks in a burst, then PROMPTS[0] on rank 0 alone while the other ranks have nothing. Every
    prompt's greedy tokens, in order, on every rank."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    mine = {i: engine.submit(engine.encode(p), greedy) for i, p in enumerate(PROMPTS) if i % ranks.world == ranks.rank}
    steps = 0
    while engine.step() is not None:
        steps += 1
    alone = [engine.submit(engine.encode(PROMPTS[0]), greedy)] if ranks.rank == 0 else []
    alone_steps = 0
    while engine.step() is not None:
        alone_steps += 1
    got = {int(i): t for part in dist.gather_json({i: s.generated for i, s in mine.items()}) for i, t in part.items()}
    return {"tokens": [got[i] for i in range(len(PROMPTS))], "steps": steps, "alone_steps": alone_steps,
            "alone": alone[0].generated if alone else None, "stats": dict(engine.stats),
            "blocks_in_use": [pool.used() for pool in engine.scheduler.pools]}


def served(engine: Engine, ranks) -> dict | None:
    """Behind the server (rank 0 the front of OwnRequests, the others `follow`): every prompt submitted on rank 0 and
    spread over the ranks (streamed tokens counted), pings while the ranks step and while idle, a request another rank
    runs aborted mid-way, echo + logprobs of a prompt another rank runs. Rank 0's record (None elsewhere), with every
    rank's KV blocks in use at the end."""
    out = None
    if ranks.rank != 0:
        engine.follow()
    else:
        engine.coordinator.front = True
        greedy = lambda n: SamplingParams(max_tokens=n, temperature=0)  # noqa: E731
        streamed: dict[int, int] = {}

        def count(seq):
            streamed[seq.id] = streamed.get(seq.id, 0) + 1

        def lead_until(seqs):
            while not all(s.finished for s in seqs):
                engine.step()
            while engine.coordinator.busy:  # the step that finds nothing to do
                engine.step()

        try:
            before = [engine.scheduler_stats()["prefix_queries"], engine.scheduler.stats["prefix_queries"]]
            burst = [engine.submit(engine.encode(p), greedy(8), on_token=count) for p in PROMPTS]
            remote = [s.id in engine.coordinator.remote for s in burst]
            lead_until(burst)
            engine.ping()  # idle: a Ping message
            idle_status = list(engine.rank_status)
            # a request another rank runs, aborted while it decodes; a ping while the ranks step
            here = engine.submit(engine.encode(PROMPTS[0]), greedy(30))
            there = engine.submit(engine.encode(PROMPTS[1]), greedy(30))
            aborted_remote = there.id in engine.coordinator.remote
            for _ in range(4):
                engine.step()
            queues = [engine.queue_lengths(), round(engine.kv_usage() * engine.kv.blocks * ranks.world, 6)]
            engine.rank_status = []
            engine.ping()  # busy: in the next step's gather
            engine.abort(there)
            lead_until([here, there])
            busy_status = list(engine.rank_status)
            # echo + logprobs on the other rank
            first = engine.submit(engine.encode(PROMPTS[0]), greedy(4))
            scored = engine.submit(engine.encode(LONG), SamplingParams(max_tokens=2, temperature=0, echo=True,
                                                                        logprobs=2))
            scored_remote = scored.id in engine.coordinator.remote
            lead_until([first, scored])
            # /metrics' prefix-cache queries over both ranks since `before`: every prompt but the scored one (no
            # cache lookup)
            queried = [engine.scheduler_stats()["prefix_queries"] - before[0],
                       engine.scheduler.stats["prefix_queries"] - before[1],
                       sum(len(s.prompt) for s in [*burst, here, there, first])]
            out = {"tokens": [s.generated for s in burst], "remote": remote,
                   "streamed": [streamed.get(s.id, 0) for s in burst],
                   "reasons": [s.finish_reason for s in burst], "idle_status": idle_status,
                   "busy_status": busy_status, "aborted": [there.finish_reason, len(there.generated), aborted_remote],
                   "here": here.generated, "scored": scored.prompt_logprobs, "scored_tokens": scored.generated,
                   "scored_remote": scored_remote, "left": [len(engine.coordinator.remote), engine.pending()],
                   "queues": queues + [engine.queue_lengths(), engine.kv_usage()],
                   "stats": dict(engine.stats), "queried": queried}
        finally:
            engine.stop_followers()
    blocks = dist.gather_json(sum(pool.used() for pool in engine.scheduler.pools))
    if out is not None:
        out["blocks_in_use"] = blocks
    return out


def main() -> None:
    pkg, path = Path(sys.argv[1]), Path(sys.argv[2])
    placement = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    exchange = sys.argv[4] if len(sys.argv) > 4 else "auto"
    if len(sys.argv) > 5 and sys.argv[5] == "native":  # the CPU kernels on these small weights too: decode forwards
        from export.serve import kernels                # in csrc/decode_model.cpp's DecodeModel (export/serve/decode.py)

        kernels.weights.SERVE_FROM = 0
    ranks = dist.init()
    config = ServeConfig(package=pkg, ep_size=ranks.world if ranks.world > 1 else None, placement=placement,
                         replica_budget=0.5, max_batch=4, checksums=False, expert_exchange=exchange,
                         # each rank caches its own prefixes: with it on, the tokens computed (and routed to the
                         # experts) would depend on which rank a repeated prompt lands on
                         prefix_caching=False)
    engine = Engine.from_config(config, ranks)
    result = None
    if ranks.rank != 0:
        engine.follow()
    else:
        try:
            result = scenarios(engine)
        finally:
            engine.stop_followers()
            engine.close()
    if ranks.world > 1 and placement is None:
        engine = Engine.from_config(config, ranks, own_requests=True)
        own = own_requests(engine, ranks)
        own_served = served(engine, ranks)
        if result is not None:
            result["own"], result["own_served"] = own, own_served
    if result is not None:
        path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
