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
    from export.serve.engine import SamplingParams

    prompts = [engine.encode(t) for t in ("And God said", "To be, or not to be, that is the question:",
                                          "In the beginning God created the heaven and the earth. And the")]
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
    assert max(engine.stats["batch_sizes"]) == 3  # decode steps really were shared
    assert sorted(engine.cache.free) == [0, 1, 2] and not engine.running


def test_seeded_sampling_is_reproducible_and_top_p_limits_the_choice(engine):
    from export.serve.engine import SamplingParams, generate, sample

    p = engine.encode("And God said")
    a, b = (generate(engine, [p], SamplingParams(max_tokens=8, temperature=1.0, seed=7))[0].generated for _ in range(2))
    assert a == b
    logits = torch.tensor([3.0, 2.0, 0.0, -1.0])
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(i))
             for i in range(50)}
    assert picks == {0}  # the top token alone holds 0.66 > 0.5 of the mass


def test_stop_strings_and_end_of_text(engine):
    from export.serve.engine import SamplingParams, generate

    p = engine.encode("And God said")
    free = generate(engine, [p], SamplingParams(max_tokens=10, temperature=0))[0]
    if len(free.text) > 2:
        stop = free.text[1:3]
        cut = generate(engine, [p], SamplingParams(max_tokens=10, temperature=0, stop=[stop]))[0]
        assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.index(stop)]
    with pytest.raises(ValueError, match="context"):
        engine.submit(p, SamplingParams(max_tokens=engine.cfg.seq_len))
