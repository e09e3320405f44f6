"""export/serve/scheduler.py alone, no model: admission by KV blocks, preemption and recomputation, chunked
prefill, the data-parallel rank choice, prefix-cache hits; the typed step's JSON round trip."""

from __future__ import annotations

import pytest

from export.serve.request import Request, SamplingParams
from export.serve.scheduler import BlockPool, Scheduler, block_keys
from export.serve.step import RowResult, Step


def request(i: int, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(i, list(prompt), SamplingParams(max_tokens=max_tokens, **params))


def rows(plan, kind=None):
    return [row for f in plan.step.forwards if kind in (None, f.kind) for rs in f.rows for row in rs]


def run_step(sched: Scheduler, token=lambda req: 1000 + len(req.generated)):
    """One step as the engine runs it, with a made-up sampler: the step's tokens are computed, each sampled row
    appends `token(req)`, a request at max_tokens finishes. Returns the plan."""
    plan = sched.schedule()
    Step.from_json(plan.step.to_json())  # every step crosses the ranks as JSON
    sched.computed(plan)
    for row in rows(plan):
        req = plan.requests[row.seq]
        if row.sample:
            req.generated.append(token(req))
            if len(req.generated) >= req.params.max_tokens:
                req.finished = True
                sched.finish(req)
    return plan


def test_requests_are_admitted_by_free_blocks_not_by_a_row_count():
    sched = Scheduler(ranks=1, blocks=8, block_size=4, max_batch=32, max_batched_tokens=64)
    reqs = [request(i, range(10 * i, 10 * i + 10)) for i in range(3)]  # 10 tokens: 3 blocks each
    for r in reqs:
        sched.add(r)
    plan = run_step(sched)
    assert [r.id for r in plan.admitted] == [0, 1] and list(sched.waiting) == [reqs[2]]  # 6 of 8 blocks; 3 more: no
    assert [len(sched.tables[r.id]) for r in reqs[:2]] == [3, 3] and sched.pools[0].available() == 2
    first = rows(plan)
    assert [(r.start, len(r.tokens), r.sample, len(r.blocks)) for r in first] == [(0, 10, True, 3)] * 2
    while sched.pending():
        run_step(sched)
    assert all(len(r.generated) == 4 for r in reqs) and sched.pools[0].used() == 0


def test_the_newest_sequence_is_preempted_and_recomputed_from_its_prompt_and_generated_tokens():
    # 4 blocks of 4 tokens: two 7-token prompts fit (2 blocks each); their 9th token needs a third block each
    sched = Scheduler(ranks=1, blocks=4, block_size=4, max_batch=8, max_batched_tokens=64)
    old, new = request(0, range(7), max_tokens=6), request(1, range(50, 57), max_tokens=6)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled, one token each: 8 tokens, 7 computed
    plan = run_step(sched)  # decode: the 8th token of each fits the second block
    assert not plan.preempted
    plan = run_step(sched)  # the 9th token needs a new block: none free, so `new` (the newest) goes
    assert [r.id for r in plan.preempted] == [1] and new.num_computed == 0 and new.preemptions == 1
    assert list(sched.waiting) == [new] and 1 in plan.step.freed and len(sched.tables[0]) == 3
    assert sched.stats["preemptions"] == 1
    generated_before = list(new.generated)
    plan = run_step(sched)
    while not any(r.seq == 1 for r in rows(plan)):
        plan = run_step(sched)
    # recomputed: from its prompt and what it had generated, after the part of it still in the prefix cache
    resumed = next(r for r in rows(plan) if r.seq == 1)
    assert resumed.start % 4 == 0 and resumed.tokens == (list(range(50, 57)) + generated_before)[resumed.start:]
    assert resumed.sample and len(resumed.blocks) == len(sched.tables[1])
    assert not any(n.seq == 1 for n in plan.step.new)  # its sampler lives on: no second NewSeq
    while sched.pending():
        run_step(sched)
    assert len(new.generated) == 6 and sched.pools[0].used() == 0


def test_a_sequence_is_never_failed_for_lack_of_blocks_while_the_pool_holds_it_alone():
    # 6 blocks x 4 tokens = 24 tokens; each request alone needs 20; five of them thrash the pool but all finish
    sched = Scheduler(ranks=1, blocks=6, block_size=4, max_batch=8, max_batched_tokens=64)
    reqs = [request(i, range(100 * i, 100 * i + 8), max_tokens=12) for i in range(5)]
    for r in reqs:
        sched.add(r)
    for _ in range(500):
        if not sched.pending():
            break
        run_step(sched)
    assert all(len(r.generated) == 12 for r in reqs) and sched.stats["preemptions"] > 0
    assert sched.pools[0].used() == 0 and not sched.tables


def test_decode_tokens_go_first_and_a_long_prompt_is_chunked_over_steps():
    sched = Scheduler(ranks=1, blocks=64, block_size=4, max_batch=8, max_batched_tokens=8)
    short = request(0, range(3), max_tokens=10)
    sched.add(short)
    run_step(sched)
    long = request(1, range(200, 221))  # 21 tokens with a budget of 8, less the decode token: 7 a step
    sched.add(long)
    chunks = []
    while not long.generated:
        plan = run_step(sched)
        assert [r.seq for r in rows(plan, "decode")] == [0]  # the short one decodes in every step
        chunks += [(r.start, len(r.tokens), r.sample) for r in rows(plan, "prefill")]
    assert chunks == [(0, 7, False), (7, 7, False), (14, 7, True)]
    assert sum(n for _, n, _ in chunks) == 21


def test_max_prefill_seqs_splits_a_step_into_several_prefill_forwards():
    sched = Scheduler(ranks=2, blocks=64, block_size=4, max_batch=8, max_batched_tokens=64, max_prefill_seqs=1)
    for i in range(3):
        sched.add(request(i, range(10 * i, 10 * i + 5)))
    plan = sched.schedule()
    assert [f.kind for f in plan.step.forwards] == ["prefill", "prefill"]
    assert [[len(rs) for rs in f.rows] for f in plan.step.forwards] == [[1, 1], [1, 0]]  # every rank runs both


def test_mixed_steps_put_decode_tokens_and_prompt_chunks_in_one_forward_within_the_token_budget():
    sched = Scheduler(ranks=1, blocks=64, block_size=4, max_batch=8, max_batched_tokens=12, mixed=True)
    sched.add(request(0, range(5), max_tokens=8))
    first = run_step(sched)  # the first prompt alone
    assert [f.kind for f in first.step.forwards] == ["prefill"] and first.decode_rows == 0
    sched.add(request(1, range(100, 120), max_tokens=8))  # 20 tokens: chunks of what the budget leaves
    chunks = []
    for _ in range(2):
        plan = run_step(sched)
        assert [f.kind for f in plan.step.forwards] == ["mixed"] and plan.decode_rows == 1
        (decode, *prompt), = plan.step.forwards[0].rows
        assert decode.seq == 0 and len(decode.tokens) == 1 and decode.sample  # decode rows first
        chunks += [(r.start, len(r.tokens)) for r in prompt]
    assert chunks == [(0, 11), (11, 9)]  # 12 tokens a step: 1 decode token, the rest of the budget the prompt's
    plan = run_step(sched)
    assert [f.kind for f in plan.step.forwards] == ["decode"] and plan.decode_rows == 2


def test_a_new_sequence_goes_to_the_least_loaded_rank_or_where_its_prefix_is_cached():
    sched = Scheduler(ranks=2, blocks=64, block_size=4, max_batch=8, max_batched_tokens=256)
    a, b = request(0, range(40)), request(1, range(100, 110))
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert (a.rank, b.rank) == (0, 1)  # rank 0 runs 40 tokens: the next goes to rank 1
    c = request(2, range(200, 204))
    sched.add(c)
    run_step(sched)
    assert c.rank == 1
    # a prompt sharing a's first 36 tokens: rank 0 would compute 5 of its 41 tokens, rank 1 all of them
    d = request(3, list(range(36)) + [7, 7, 7, 7, 7])
    sched.add(d)
    plan = run_step(sched)
    assert d.rank == 0 and rows(plan)[0].start == 36 and sched.tables[3][:9] == sched.tables[0][:9]


def test_prefix_hits_share_full_blocks_never_the_last_token_and_not_for_scored_prompts():
    sched = Scheduler(ranks=1, blocks=32, block_size=4, max_batch=8, max_batched_tokens=256)
    first = request(0, range(16), max_tokens=1)
    sched.add(first)
    run_step(sched)
    assert first.finished and sched.pools[0].used() == 0 and len(sched.pools[0].evictable) == 4  # cached, held by none
    again = request(1, range(16), max_tokens=1)  # all 4 blocks cached: 3 are taken, the last token is recomputed
    sched.add(again)
    plan = sched.schedule()
    (row,) = rows(plan)
    assert row.start == 12 and row.tokens == [12, 13, 14, 15] and row.sample
    assert sched.stats["prefix_hits"] == 12 and sched.stats["prefix_queries"] == 32
    assert [sched.pools[0].refs[b] for b in sched.tables[1][:3]] == [1, 1, 1]
    sched.computed(plan)
    sched.finish(again)
    scored = request(2, range(16), max_tokens=1, echo=True, logprobs=1)  # every position scored: nothing cached
    sched.add(scored)
    (row,) = rows(sched.schedule())
    assert row.start == 0 and row.score == 0 and row.targets == list(range(1, 16))


def test_the_least_recently_used_cached_blocks_are_evicted_first():
    pool = BlockPool(blocks=4, block_size=2)
    keys = block_keys([1, 2, 3, 4], 2, [])
    a = pool.allocate(2)
    for block, key in zip(a, keys):
        pool.register(block, key)
    pool.release(a)  # the tail first in line for eviction: the prefix outlives it
    assert pool.cached(keys) == a and pool.available() == 4
    b = pool.allocate(3)  # 2 free ones, then the least recently used cached block: a's tail
    assert a[1] in b and a[0] not in b and pool.cached(keys) == a[:1]
    pool.acquire(pool.cached(keys))
    assert pool.available() == 0
    with pytest.raises(RuntimeError, match="1 blocks asked, 0 available"):
        pool.allocate(1)


def test_block_keys_name_the_whole_prefix():
    assert block_keys([1, 2, 3, 4], 2, [])[1] != block_keys([9, 9, 3, 4], 2, [])[1]  # same block, other prefix
    assert block_keys([1, 2, 3, 4, 5], 2, []) == block_keys([1, 2, 3, 4, 6], 2, [])  # the partial block: no key


def test_min_tokens_bans_the_end_token_and_aborts_free_blocks():
    sched = Scheduler(ranks=1, blocks=16, block_size=4, max_batch=8, max_batched_tokens=64, eos=50256)
    r = request(0, range(5), max_tokens=8, min_tokens=2)
    sched.add(r)
    assert rows(run_step(sched))[0].banned == [50256]
    assert rows(run_step(sched))[0].banned == [50256]
    assert rows(run_step(sched))[0].banned is None  # two tokens generated: the end token may come
    sched.abort(r.id)
    plan = sched.schedule()
    assert plan.aborted == [r] and not plan.step.forwards and sched.pools[0].used() == 0
    sched.add(request(1, range(3)))
    plan = sched.schedule()
    assert plan.step.freed == [0] and plan.step.ended == [0]  # the ranks hear of it with the next step


def test_row_results_round_trip():
    res = RowResult(3, token=17, logprob=-0.5, top=[[17, -0.5]])
    assert RowResult.from_json(res.to_json()) == res
