"""The batched sampler (export/serve/sampling.py) and its kernel (csrc/sampling.cpp) against the settings' meaning:
each setting's distribution, vLLM's penalties, seeded draws that do not depend on the batch, grammars."""

from __future__ import annotations

import math

import pytest
import torch

from export.serve.sampling import Sampler, _edits, gumbel_noise, sample_batch
from export.serve.step import Sampling


def kernel_built() -> bool:
    from export.serve import kernels

    k = kernels.kernel()
    return k is not None and hasattr(k, "sample_rows")


PATHS = [pytest.param(False, id="reference"),
         pytest.param(True, id="kernel", marks=pytest.mark.skipif(not kernel_built(), reason="no CPU kernel here "
                                                                  "(export/serve/kernels/csrc not built)"))]


def target(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution a setting asks for, computed the plain way (a full sort, as vLLM's sampler): temperature,
    then min_p, then top_k, then top_p, renormalized."""
    x = logits.double() / s.temperature
    p = torch.softmax(x, -1)
    if s.min_p > 0:
        x = x.masked_fill(p < s.min_p * p.max(), -math.inf)
    if 0 < s.top_k < x.numel():
        x = x.masked_fill(x < x.topk(s.top_k).values[-1], -math.inf)
    p = torch.softmax(x, -1)
    if s.top_p < 1:
        sp, order = p.sort(descending=True)
        keep = sp.cumsum(0) - sp < s.top_p
        p = torch.zeros_like(p).scatter_(0, order[keep], sp[keep])
    return p / p.sum()


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("setting", [
    Sampling(1.0), Sampling(0.7, top_p=0.8), Sampling(1.3, top_k=5), Sampling(1.0, min_p=0.1),
    Sampling(0.9, top_p=0.9, top_k=12, min_p=0.02)], ids=["plain", "top_p", "top_k", "min_p", "all"])
def test_each_settings_draws_follow_its_distribution(fast, setting):
    torch.manual_seed(0)
    V, n = 40, 4000
    logits = torch.randn(V) * 1.5
    samplers = [Sampler.of(Sampling(**{**setting.__dict__, "seed": i}), V) for i in range(n)]
    tokens = [p["token"] for p in sample_batch(samplers, logits.expand(n, V).contiguous(), fast=fast)]
    want = target(logits, setting)
    got = torch.bincount(torch.tensor(tokens), minlength=V).double() / n
    assert want[torch.tensor(tokens)].min() > 0  # nothing outside the kept set, ever
    assert (got - want).abs().sum() / 2 < 0.04  # total variation, ~3x the sampling noise at 4,000 draws


@pytest.mark.skipif(not kernel_built(), reason="no CPU kernel here (export/serve/kernels/csrc not built)")
def test_the_kernel_and_the_reference_draw_the_same_tokens():
    torch.manual_seed(1)
    V, n = 1000, 64
    logits = (torch.randn(n, V) * 3).bfloat16()
    settings = [Sampling(0.8, top_p=0.9, seed=i, top_k=[0, 20][i % 2], min_p=[0.0, 0.05][i % 3 == 0])
                for i in range(n)]
    a = sample_batch([Sampler.of(s, V) for s in settings], logits, fast=True)
    b = sample_batch([Sampler.of(s, V) for s in settings], logits, fast=False)
    same = sum(x["token"] == y["token"] for x, y in zip(a, b))
    assert same >= n - 2  # a draw within float rounding of a token's edge may fall on either side


@pytest.mark.parametrize("fast", PATHS)
def test_greedy_rows_take_the_first_largest_and_extreme_settings_collapse_to_it(fast):
    V = 50
    logits = torch.zeros(4, V)
    logits[:, 7] = logits[:, 9] = 3.0  # a tie: the first wins, as torch.argmax
    logits[:, 30] = 2.9
    settings = [Sampling(0.0), Sampling(1.0, top_k=1, seed=3), Sampling(1.0, top_p=1e-6, seed=4),
                Sampling(1.0, min_p=1.0, seed=5)]
    picks = sample_batch([Sampler.of(s, V) for s in settings], logits, fast=fast)
    assert picks[0]["token"] == 7
    assert all(p["token"] in (7, 9) for p in picks[1:])


@pytest.mark.parametrize("fast", PATHS)
def test_a_seed_gives_the_same_tokens_in_any_batch(fast):
    torch.manual_seed(2)
    V = 300
    mine = Sampling(0.9, top_p=0.95, top_k=40, seed=1234, frequency_penalty=0.4)
    steps = [torch.randn(V) * 2 for _ in range(12)]
    alone = Sampler.of(mine, V)
    in_batch = Sampler.of(mine, V)
    others = [Sampler.of(Sampling(1.0, seed=i), V) for i in range(31)]
    a, b = [], []
    for step in steps:
        a.append(sample_batch([alone], step[None], fast=fast)[0]["token"])
        batch = torch.randn(32, V)
        batch[17] = step
        b.append(sample_batch(others[:17] + [in_batch] + others[17:], batch, fast=fast)[17]["token"])
    assert a == b and len(set(a)) > 1


def test_gumbel_numbers_depend_on_seed_counter_and_token_alone_and_the_kernel_makes_the_same():
    g = gumbel_noise([1, 1, 2, 1], [0, 1, 0, 0], 4000)
    assert g.dtype == torch.float32 and g.shape == (4, 4000) and torch.isfinite(g).all()
    assert torch.equal(g[0], g[3]) and not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.equal(gumbel_noise([1], [0], 10)[0], g[0, :10])  # a token's number does not depend on the width
    big = gumbel_noise(list(range(50)), [5] * 50, 4000).double()
    assert abs(float(big.mean()) - 0.5772) < 0.01 and abs(float(big.std()) - math.pi / math.sqrt(6)) < 0.01  # Gumbel
    if kernel_built():
        from export.serve import kernels

        seeds = [1, 2**63 + 5, 7]
        made = kernels.kernel().gumbel_rows(torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds]),
                                            torch.tensor([0, 3, 9]), 4000)
        assert (made - gumbel_noise(seeds, [0, 3, 9], 4000)).abs().max() < 1e-5  # polynomial logarithms there


def vllm_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], s: Sampling) -> torch.Tensor:
    """vLLM's `apply_penalties` on one row: repetition over prompt and output, then frequency and presence over the
    output, after logit_bias."""
    x = logits.float().clone()
    for t, b in s.logit_bias or ():
        x[t] += b
    V = x.numel()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    seen = counts > 0
    seen[torch.tensor(prompt, dtype=torch.long)] = True
    rep = torch.where(seen, torch.tensor(s.repetition_penalty), torch.tensor(1.0))
    x = torch.where(x > 0, x / rep, x * rep)
    return x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()


def test_penalties_and_bias_are_vllms():
    torch.manual_seed(3)
    V = 64
    settings = [Sampling(0.0, repetition_penalty=1.3, prompt=[1, 2, 3, 40]),
                Sampling(0.0, frequency_penalty=0.7, presence_penalty=-0.4),
                Sampling(0.0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.1,
                         logit_bias=[[5, 2.5], [6, -3.0]], prompt=[6, 7]),
                Sampling(0.0)]
    samplers = [Sampler.of(s, V) for s in settings]
    outputs = [[], [], [], []]
    for _ in range(10):  # some output to penalize: greedy on random logits, each row's own
        logits = torch.randn(4, V) * 2
        for i, pick in enumerate(sample_batch(samplers, logits)):
            outputs[i].append(pick["token"])
    logits = torch.randn(4, V) * 2
    offsets, tokens, values = _edits(samplers, [None, [9], None, None], logits)
    edited = logits.clone()
    rows = torch.repeat_interleave(torch.arange(4), offsets.diff())
    edited[rows, tokens] = values
    for i, s in enumerate(settings):
        want = vllm_penalties(logits[i], s.prompt or [], outputs[i], s)
        if i == 1:
            want[9] = -math.inf  # the banned token
        assert torch.allclose(edited[i], want, atol=1e-5), i
    assert offsets[-1] - offsets[-2] == 0  # a row with no processor reads no token


@pytest.mark.parametrize("fast", PATHS)
def test_bias_bans_and_logprobs(fast):
    torch.manual_seed(4)
    V = 500
    logits = (torch.randn(3, V) * 2).bfloat16()
    top = int(logits[0].float().argmax())
    samplers = [Sampler.of(Sampling(0.0, logit_bias=[[11, 100.0]]), V),
                Sampler.of(Sampling(1.0, seed=1, logprobs=3), V),
                Sampler.of(Sampling(0.0, logprobs=0), V)]
    banned = [None, None, [int(logits[2].float().argmax())]]
    picks = sample_batch(samplers, logits, banned, fast=fast)
    assert picks[0] == {"token": 11} and top != 11
    logp = torch.log_softmax(logits[1].float(), -1)
    assert picks[1]["logprob"] == pytest.approx(float(logp[picks[1]["token"]]), abs=1e-5)
    assert [t for t, _ in picks[1]["top"]] == logp.topk(3).indices.tolist()
    assert picks[2]["token"] != banned[2][0] and picks[2]["top"] == []


@pytest.fixture(scope="module")
def grammars():
    from export.serve.grammar import Grammars
    from pipeline.data import gpt2_tokenizer

    return Grammars(gpt2_tokenizer(), 50304)


@pytest.mark.parametrize("fast", PATHS)
def test_grammar_rows_share_a_step_with_free_rows_and_give_valid_json(fast, grammars):
    import json

    import jsonschema

    from export.serve.grammar import grammar_of
    from pipeline.data import gpt2_tokenizer

    tok = gpt2_tokenizer()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    spec = grammar_of("json_schema", schema)
    choice = grammar_of("choice", ["red", "green", "blue"])
    samplers = [Sampler.of(Sampling(1.0, seed=9, grammar=spec), 50304, grammars.matcher),
                Sampler.of(Sampling(1.0, seed=2), 50304, grammars.matcher),
                Sampler.of(Sampling(0.0, grammar=choice), 50304, grammars.matcher)]
    out = [[], [], []]
    torch.manual_seed(5)
    for _ in range(60):
        done = [s.matcher is not None and s.matcher.done for s in samplers]  # then only the end token may come
        picks = sample_batch(samplers, torch.randn(3, 50304).bfloat16(), fast=fast)
        for i, p in enumerate(picks):
            if not done[i]:
                out[i].append(p["token"])
            else:
                assert p["token"] == tok.eos_token_id
        if samplers[0].matcher.done and samplers[2].matcher.done:
            break
    assert samplers[0].matcher.error is None and samplers[0].matcher.done
    text = tok.decode([t for t in out[0] if t != tok.eos_token_id])
    jsonschema.validate(json.loads(text), schema)
    assert tok.decode([t for t in out[2] if t != tok.eos_token_id]) in ("red", "green", "blue")
    assert len(set(out[1])) > 1  # the free row sampled freely


@pytest.mark.parametrize("kind, value, why", [
    ("json_schema", {"type": "nope"}, "nope"), ("regex", "a(b", "regex"), ("choice", [], "non-empty"),
    ("grammar", "start: undefined_rule", "undefined_rule"), ("json_schema", "{not json", "not valid JSON")])
def test_bad_constraints_say_why(kind, value, why):
    from export.serve.grammar import grammar_of

    with pytest.raises(ValueError, match=why):
        grammar_of(kind, value)


@pytest.mark.parametrize("fast", PATHS)
def test_a_row_with_one_allowed_token_takes_it_at_any_seed(fast):
    """Masked tokens weigh nothing, so no draw lands on one (seed 0 once drew the first masked token)."""
    V = 300
    logits = torch.randn(8, V)
    banned = [[t for t in range(V) if t != 123]] * 8
    samplers = [Sampler.of(Sampling(1.0, seed=seed, top_p=[1.0, 0.5][seed % 2]), V) for seed in range(8)]
    assert [p["token"] for p in sample_batch(samplers, logits, banned, fast=fast)] == [123] * 8
