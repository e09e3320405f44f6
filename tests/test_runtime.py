"""export/serve/engine.py: continuous batching over the slot KV cache gives each request what it would get alone."""

from __future__ import annotations

import pytest
import torch

from conftest import model_config


@pytest.fixture(scope="module")
def engine():
    from export.serve.engine import Engine
    from pipeline.data import gpt2_tokenizer
    from pipeline.model import GPT, init_weights

    cfg = model_config(vocab_size=50304, seq_len=48)
    model = GPT(cfg, moe_impl="reference")
    init_weights(model, 3)
    return Engine(model.eval(), gpt2_tokenizer(cfg.seq_len), max_batch=3)


def alone(engine, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full forwards without any cache: the reference."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            t = int(engine.model(torch.tensor([seq])).logits[0, -1].argmax())
            if t == engine.eos:
                break
            seq.append(t)
    return seq[len(prompt):]


def test_staggered_arrivals_share_steps_and_match_each_request_alone(engine):
    from export.serve.request import SamplingParams

    prompts = [engine.encode(t) for t in ("And God said", "To be, or not to be, that is the question:",
                                          "In the beginning God created the heaven and the earth. And the")]
    sizes = []
    engine.on_decode = sizes.append
    seqs = [engine.submit(prompts[0], SamplingParams(max_tokens=9, temperature=0))]
    engine.step()
    engine.step()
    seqs.append(engine.submit(prompts[1], SamplingParams(max_tokens=7, temperature=0)))
    engine.step()
    seqs.append(engine.submit(prompts[2], SamplingParams(max_tokens=11, temperature=0)))
    seqs.append(engine.submit(prompts[0], SamplingParams(max_tokens=5, temperature=0)))  # waits: 3 slots
    while not all(s.finished for s in seqs):
        engine.step()
    for prompt, seq in zip(prompts + [prompts[0]], seqs):
        assert seq.generated == alone(engine, prompt, seq.params.max_tokens)
    assert max(sizes) == 3 and len(sizes) == engine.stats["decode_steps"]  # decode steps really were shared
    assert engine.scheduler.pools[0].used() == 0 and not engine.running


def test_seeded_sampling_is_reproducible_and_top_p_limits_the_choice(engine):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams
    from export.serve.sampling import Sampler, sample_batch
    from export.serve.step import Sampling

    p = engine.encode("And God said")
    a, b = (generate(engine, [p], SamplingParams(max_tokens=8, temperature=1.0, seed=7))[0].generated for _ in range(2))
    assert a == b
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    picks = {sample_batch([Sampler.of(Sampling(1.0, top_p=0.5, seed=i), 4)], logits)[0]["token"] for i in range(50)}
    assert picks == {0}  # the top token alone holds 0.66 > 0.5 of the mass


def test_stop_strings_and_end_of_text(engine):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    p = engine.encode("And God said")
    free = generate(engine, [p], SamplingParams(max_tokens=10, temperature=0))[0]
    if len(free.text) > 2:
        stop = free.text[1:3]
        cut = generate(engine, [p], SamplingParams(max_tokens=10, temperature=0, stop=[stop]))[0]
        assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.index(stop)]
    with pytest.raises(ValueError, match="context"):
        engine.submit(p, SamplingParams(max_tokens=engine.cfg.seq_len))


# -- one request cannot stop the engine, starve it or bloat it -----------------------------------------

def test_a_tiny_temperature_is_greedy_and_an_error_fails_its_request_alone(engine):
    """temperature 1e-40 made logits / T overflow to inf and multinomial raise in the engine loop; an error while
    serving one request (here its own streaming callback raising) failed every request."""
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    p = engine.encode("And God said")
    greedy = generate(engine, [p], SamplingParams(max_tokens=6, temperature=0))[0].generated
    assert generate(engine, [p], SamplingParams(max_tokens=6, temperature=1e-40, seed=1))[0].generated == greedy

    def hung_up(req):
        raise RuntimeError("the client's event loop is closed")

    bad = engine.submit(p, SamplingParams(max_tokens=6, temperature=0), on_token=hung_up)
    good = engine.submit(engine.encode("To be, or not"), SamplingParams(max_tokens=6, temperature=0))
    while not (bad.finished and good.finished):
        engine.step()
    assert bad.finish_reason == "error" and "event loop is closed" in bad.text
    assert good.finish_reason == "length" and good.generated == alone(engine, good.prompt, 6)
    assert not engine.running and engine.scheduler.pools[0].used() == 0  # the failed one's slot came back


def test_echo_logprobs_are_scored_in_row_chunks_with_the_same_values(engine):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    prompt = engine.encode("In the beginning God created the heaven and the earth. And the earth was without form")
    whole = generate(engine, [prompt], SamplingParams(max_tokens=1, temperature=0, echo=True, logprobs=2))[0]
    engine.worker.SCORE_ROWS = 4  # an instance attribute: 5+ chunks for this prompt
    try:
        chunked = generate(engine, [prompt], SamplingParams(max_tokens=1, temperature=0, echo=True, logprobs=2))[0]
    finally:
        del engine.worker.SCORE_ROWS
    assert len(whole.prompt_logprobs) == len(prompt) and whole.prompt_logprobs[0] is None
    assert chunked.prompt_logprobs == pytest.approx(whole.prompt_logprobs, abs=1e-5)
    assert [sorted(t) if t else t for t in chunked.prompt_top] == [sorted(t) if t else t for t in whole.prompt_top]
    assert chunked.generated == whole.generated
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(torch.tensor([prompt])).logits[0].float(), -1)
    assert chunked.prompt_logprobs[1:] == pytest.approx([float(logp[i, t]) for i, t in enumerate(prompt[1:])], abs=1e-4)


def test_aborted_requests_never_run_or_free_their_slot(engine):
    from export.serve.request import SamplingParams

    p = engine.encode("And God said")
    steps = engine.stats["decode_steps"]  # the module's engine: other tests' steps before these
    running = [engine.submit(p, SamplingParams(max_tokens=30, temperature=0)) for _ in range(3)]  # 3 slots
    waiting = engine.submit(p, SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    engine.abort(running[0])
    engine.abort(waiting)
    engine.step()
    assert running[0].finish_reason == "abort" and len(running[0].generated) <= 2
    assert waiting.finish_reason == "abort" and waiting.generated == [] and waiting.rank is None
    while engine.pending():
        engine.step()
    assert [r.finish_reason for r in running[1:]] == ["length", "length"]
    assert engine.scheduler.pools[0].used() == 0
    # nothing the engine keeps grows with its lifetime (a list of every decode step's batch size did)
    # (the first step prefills and samples each request's first token: 29 decode steps for 30 tokens)
    assert all(isinstance(v, int) for v in engine.stats.values()) and engine.stats["decode_steps"] - steps >= 29


def test_streamed_text_never_shows_what_a_later_token_changes():
    """Byte-level BPE decodes a multibyte character split over tokens as "\ufffd" first, and a stop string's first
    characters are cut once it completes: `stable_text` holds both back, so every streamed prefix is a
    prefix of the final text."""
    from export.serve.request import Detokenizer, Request, SamplingParams
    from pipeline.data import gpt2_tokenizer

    tok = gpt2_tokenizer(64)
    text = "Sing, O muse \U0001d11e of the wrath of Achilles"  # a 4-byte character: several byte tokens
    ids = tok.encode(text)
    assert "\ufffd" in "".join(tok.decode(ids[:k]) for k in range(1, len(ids)))  # it really is split
    streaming, whole = Detokenizer(tok), Detokenizer(tok)
    whole.backend = None  # as for a tokenizer that cleans up spaces: the whole text decoded every token
    assert streaming.backend is not None
    for detokenize in (streaming, whole):
        for stop in (["wrath"], ["of the w", "zzz"], []):
            req = Request(0, [0], SamplingParams(max_tokens=len(ids), stop=stop))
            shown, texts = [], []
            for k, t in enumerate(ids, 1):
                if req.finished:
                    break
                req.append(t, None, None, None, detokenize)
                shown.append(req.stable_text())
                texts.append((req.text, tok.decode(ids[:k])))
            assert all(req.text.startswith(s) for s in shown), (stop, shown)
            assert all("\ufffd" not in s for s in shown[:-1])
            assert req.text == (text[:text.index(stop[0])] if stop else text)
            # the running text is the tokenizer's decode of the tokens so far, less a character still split
            assert all(full.startswith(got) and not full[len(got):].strip("\ufffd") for got, full in texts[:-1])


def test_a_prompt_that_cannot_be_scored_fails_alone_after_its_forward(engine):
    """Scoring runs between the vocabulary projection's chunks (collective under tensor slicing): an error there is
    kept until the forward has finished on every rank, then fails that request alone."""
    from export.serve.request import SamplingParams

    p = engine.encode("And God said unto Moses")
    bad = engine.submit(p, SamplingParams(max_tokens=2, echo=True, logprobs=10 ** 6))  # more alternatives than V
    good = engine.submit(p, SamplingParams(max_tokens=4, temperature=0))
    while engine.pending():
        engine.step()
    assert bad.finish_reason == "error" and "ScoringError" not in bad.text and bad.text
    assert good.generated == alone(engine, p, 4) and engine.scheduler.pools[0].used() == 0
    engine.fail_all("stopping")
    with pytest.raises(RuntimeError, match="the engine stopped"):
        engine.submit(p, SamplingParams(max_tokens=1))  # nobody would ever finish it
    engine.closed = None  # the module's engine serves the other tests


# -- batched and chunked prefill ------------------------------------------------------------------------

def test_a_burst_is_prefilled_in_one_padded_forward_with_each_prompts_own_tokens(engine):
    """Prompts of different lengths arriving together share one prefill forward (padded, per-row positions, the
    padding never routed to an expert) and get the tokens each gets alone."""
    from export.serve.request import SamplingParams

    prompts = [engine.encode(t) for t in ("And God said", "To be, or not to be, that is the question:", "Let")]
    before = engine.stats["prefill_forwards"]
    seqs = [engine.submit(p, SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    assert engine.stats["prefill_forwards"] - before == 1
    for p, s in zip(prompts, seqs):
        assert s.generated == alone(engine, p, 6)


def test_a_prompt_longer_than_the_step_budget_is_chunked_and_decoding_goes_on(engine):
    from export.serve.request import SamplingParams

    # a prompt no earlier test sent: no prefix-cache hit shortens it
    long = engine.encode("Now the serpent was more subtil than any beast of the field which the LORD God had made")
    short = engine.encode("And God said")
    engine.max_batched_tokens = 5
    try:
        before = engine.stats["prefill_forwards"]
        first = engine.submit(short, SamplingParams(max_tokens=12, temperature=0))
        engine.step()
        second = engine.submit(long, SamplingParams(max_tokens=5, temperature=0))
        made = []
        while not (first.finished and second.finished):
            engine.step()
            made.append(len(first.generated))
    finally:
        engine.max_batched_tokens = 2048
    # the long prompt took several steps, and the short request decoded a token in every one of them
    assert engine.stats["prefill_forwards"] - before >= len(long) // 5
    assert made[:len(long) // 5] == list(range(2, 2 + len(long) // 5))
    assert second.generated == alone(engine, long, 5) and first.generated == alone(engine, short, 12)
    assert engine.scheduler.pools[0].used() == 0


def test_a_seed_gives_the_same_tokens_in_any_batch_and_choices_share_the_prompt(engine):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    p = engine.encode("In the beginning God created the heaven and the earth. And the earth was without form, and "
                      "void; and darkness was upon the face of the deep.")
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=50, seed=21, frequency_penalty=0.3)
    alone = generate(engine, [p], params)[0].generated
    others = [engine.encode("To be, or not to be"), engine.encode("O Romeo, Romeo")]
    for batch in ([others[0], p], [others[0], others[1], p]):  # the same request beside others, seeded alike
        assert generate(engine, batch, params)[-1].generated == alone
    # n choices of one prompt: the later ones wait for the first's prompt blocks and take them from the prefix cache
    before = engine.scheduler.stats["prefix_hits"]
    fresh = engine.encode("Then the LORD God said, It is not good that the man should be alone; I will make him an help.")
    children = generate(engine, [fresh] * 3, SamplingParams(max_tokens=4, temperature=1.0, seed=5))
    full = (len(fresh) - 1) // engine.scheduler.block_size * engine.scheduler.block_size
    assert full > 0 and engine.scheduler.stats["prefix_hits"] - before == 2 * full
    assert all(len(c.generated) == 4 for c in children)


def test_sampled_rows_and_edited_greedy_rows_take_the_same_tokens_through_the_head_s_screen():
    """Served as `moe-pipeline serve` serves it (export/serve/kernels/swaps.py `serving_linears`: the output layer with
    its HeadScreen), rows that sample among their top_k and greedy rows with penalties or logit_bias take their logits'
    candidates from the screen (`HeadScreen.topk`, none falling back), rows sampled at a temperature (and min_p) are
    drawn from it (`HeadScreen.sample`, none falling back), rows under top_p where its bounds decide; all take the
    same tokens, seeded, as with the whole output layer read; three requests decoded together and alone."""
    from export.serve.engine import Engine, generate
    from export.serve.kernels import kernel, serving_linears
    from export.serve.request import SamplingParams
    from pipeline.data import gpt2_tokenizer
    from pipeline.model import GPT, init_weights

    if kernel() is None:
        pytest.skip("no kernel on this machine: no screen")
    cfg = model_config(vocab_size=50304, seq_len=48)
    model = GPT(cfg, moe_impl="reference")
    init_weights(model, 3)
    model.eval().requires_grad_(False)
    serving_linears(model)
    engine = Engine(model, gpt2_tokenizer(cfg.seq_len), max_batch=3)
    screen = model.lm_head.screen
    prompts = [engine.encode(t) for t in ("And God said", "To be, or not to be", "O Romeo, Romeo")]
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=40, seed=21, frequency_penalty=0.3,
                             presence_penalty=0.2),
              SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, logit_bias=[[11, 2.0]]),
              SamplingParams(max_tokens=8, temperature=1.0, top_k=5, min_p=0.1, seed=3),
              SamplingParams(max_tokens=8, temperature=0.8, seed=9),
              SamplingParams(max_tokens=8, temperature=1.1, min_p=0.05, seed=10),
              SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=11)]

    def run():
        together = [r.generated for p in params for r in generate(engine, prompts, p)]
        return together, [generate(engine, [prompts[1]], p)[0].generated for p in params]

    got = run()
    assert screen.calls >= 6 * 8 and screen.tried[("sample", False)][0] >= 2 * 8
    assert all(tried[1] == 0 for key, tried in screen.tried.items() if key != ("sample", True))
    model.lm_head.screen = None
    try:
        assert got == run()
    finally:
        model.lm_head.screen = screen
    assert got[0][1::3] == got[1]  # prompt 1 alone as beside the others
