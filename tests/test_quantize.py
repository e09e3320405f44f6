"""Weight-only quantisation (issue 29): the schemes (pipeline/quantize.py), and int8 in the serving runtime.
`serve --quantize int8` quantises a package's linears and experts as it loads (export/serve/linears.py
`quantize_linears`, `Int8Weight`; the experts in export/serve/placement/residency.py `ExpertStore.load`), and the
engine runs them through csrc/gemv.cpp's int8 kernels, the native decoder's included. The reference: the same engine
on the dequantised weights, through the plain kernels."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import ROOT, model_config

sys.path.insert(0, str(ROOT / "benchmarks"))

TINY = ["model.hidden=128", "model.heads=4", "model.experts=[4, 8]", "data.seq_len=128"]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    from common import random_package

    return random_package(tmp_path_factory.mktemp("quantize") / "pkg", layers=4, overrides=TINY, dtype="fp32")


def dequantised_twin(quantised, plain) -> int:
    """`plain` (an engine of the same package) given `quantised`'s int8 weights, dequantised, as plain served weights
    (the linears, the fused q/k/v, every resident expert), its native decoder rebuilt on them; returns how many."""
    from export.serve.decode import Decoder
    from export.serve.linears import FusedQKV, HeadScreen, Int4Weight, Int8Weight, ServingLinear, ServingWeight

    count, kinds = 0, (Int8Weight, Int4Weight)
    for mq, mp in zip(quantised.worker.model.modules(), plain.worker.model.modules()):
        if isinstance(mq, ServingLinear) and isinstance(mq.served, kinds):
            mp.served, count = ServingWeight(mq.served.dequantized()), count + 1
            if mp.screen is not None:  # the output layer (--quantize-head): its screen on the weights it now has
                mp.screen = HeadScreen.of(mp.served, mp.bias)
        if isinstance(getattr(mq, "qkv", None), FusedQKV) and isinstance(mq.qkv.weight, kinds):
            mp.qkv.weight, count = ServingWeight(mq.qkv.weight.dequantized()), count + 1
    resident = plain.exchange.residency.resident
    for key, (w1, b1, w2, b2) in quantised.exchange.residency.resident.items():
        assert isinstance(w1, kinds) and type(w1) is type(w2)
        resident[key] = (ServingWeight(w1.dequantized()), b1, ServingWeight(w2.dequantized()), b2)
        count += 1
    plain.worker.decoder = Decoder.of(plain.worker.model, plain.worker.cache)
    return count


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantised_at_load_serves_what_its_dequantised_weights_give(package, scheme):
    """int8 and int4 (groups of 128). Greedy tokens (through the head's screen) and the top-5 log-probabilities of every token, 3 prompts decoded
    together for 10 tokens, equal to the same engine's on the dequantised weights (fp32: the int8 sums differ from
    F.linear's only in their order); the decode forwards ran in the native decoder with int8 weights; the output layer,
    the routers and the embeddings left in fp32."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.linears import QUANTIZED, ServingWeight
    from export.serve.request import SamplingParams

    quantised = Engine.from_config(ServeConfig(package=package, quantize=scheme, kv_cache_memory=0.05))
    plain = Engine.from_config(ServeConfig(package=package, kv_cache_memory=0.05))
    model = quantised.worker.model
    assert isinstance(model.lm_head.served, ServingWeight) and model.lm_head.served.weight.dtype == torch.float32
    assert all(b.mlp.moe.deepspeed_moe.gate.wg.weight.dtype == torch.float32 for b in model.blocks if b.is_moe)
    assert quantised.worker.decoder is not None  # the native decoder took the quantised weights
    # q/k/v and out in each of 4 layers, fc1 and fc2 of 2 dense MLPs and of the 2 MoE layers' residual MLPs, 12 experts
    assert dequantised_twin(quantised, plain) == 4 * 2 + 2 * 2 + 2 * 2 + 12
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 8000, (n,), generator=g).tolist() for n in (5, 9, 14)]
    for params in (SamplingParams(max_tokens=10, ignore_eos=True),
                   SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5)):
        got, want = generate(quantised, prompts, params), generate(plain, prompts, params)
        assert [r.generated for r in got] == [r.generated for r in want]
        for a, b in zip(got, want):
            assert len(a.token_logprobs) == (10 if params.logprobs else 0)
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
            for ta, tb in zip(a.top_logprobs, b.top_logprobs):
                assert ta.keys() == tb.keys() and list(ta.values()) == pytest.approx(list(tb.values()), abs=1e-4)
    assert quantised.stats["decode_steps"] >= 9
    held = [w for w in quantised.exchange.residency.resident.values()]
    assert all(type(w[0]) is QUANTIZED[scheme] and type(w[2]) is QUANTIZED[scheme] for w in held)
    assert type(model.blocks[0].attn.qkv.weight) is QUANTIZED[scheme]  # hidden 128: one group of int4 a row


def test_the_output_layer_quantised_too(package):
    """--quantize-head: the output layer int8 as well (its screen dropped: the logits are the quantised layer's); tokens
    and log-probabilities those of the same engine on the dequantised weights, head included."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.linears import Int8Weight
    from export.serve.request import SamplingParams

    quantised = Engine.from_config(ServeConfig(package=package, quantize="int8", quantize_head=True,
                                               kv_cache_memory=0.05))
    plain = Engine.from_config(ServeConfig(package=package, kv_cache_memory=0.05))
    head = quantised.worker.model.lm_head
    assert isinstance(head.served, Int8Weight) and head.screen is None
    assert quantised.worker.model.wte.weight.dtype == torch.float32  # a tied head's embedding stays
    assert dequantised_twin(quantised, plain) == 4 * 2 + 2 * 2 + 2 * 2 + 12 + 1
    prompts = [[101, 202, 303, 404], [7, 77, 777]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    got, want = generate(quantised, prompts, params), generate(plain, prompts, params)
    assert [r.generated for r in got] == [r.generated for r in want]
    for a, b in zip(got, want):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


def test_quantize_is_refused_where_it_cannot_run(package):
    """--quantize on a sliced layout (tensor slicing) is refused naming the flag and what to do."""
    from export.serve.config import ServeConfig, ServeConfigError

    with pytest.raises(ServeConfigError, match=r"--quantize int8: .*drop --tp-size"):
        ServeConfig.from_flags({"package": package, "quantize": "int8", "tp_size": 2})
    with pytest.raises(ServeConfigError, match=r"--quantize 'int2'"):
        ServeConfig.from_flags({"package": package, "quantize": "int2"})
    with pytest.raises(ServeConfigError, match=r"--quantize-head needs --quantize"):
        ServeConfig.from_flags({"package": package, "quantize_head": True})


def test_the_schemes_round_each_weight_to_its_nearest_step():
    """pipeline/quantize.py: int8 per row and int4 per group of a row (a last group shorter than the rest) each within
    half a step of the weight, their values in range, what they stand for as `dequantized` gives it; fake_quantize_
    replaces every linear weight but the routers', the residual coefficient's and the output layer's, and counts the
    bytes they hold quantised."""
    from pipeline.model import GPT
    from pipeline.quantize import dequantized, fake_quantize_, quantize_int4, quantize_int8

    torch.manual_seed(0)
    w = torch.randn(6, 300)
    for (q, scale), top, step in ((quantize_int8(w), 127, lambda s: s[:, None]),
                                  (quantize_int4(w, group=128), 7, lambda s: s.repeat_interleave(128, 1)[:, :300])):
        assert q.dtype == torch.int8 and int(q.abs().max()) == top
        assert ((dequantized(q, scale) - w).abs() <= step(scale) / 2 * (1 + 1e-6)).all()
    assert quantize_int4(w)[1].shape == (6, 3)
    model = GPT(model_config(mlp_type="residual"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = fake_quantize_(model, "int4")
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith(".weight") for n in changed)
    assert not any(k in n for n in changed for k in ("wg", "coefficient", "lm_head", "wte", "ln"))
    assert any("experts" in n for n in changed) and held["tensors"] == len(changed)
    assert held["bytes"] == pytest.approx(held["weights"] / 2 + sum(
        -(-p.shape[1] // 128) * p.shape[0] * 4 for n, p in model.named_parameters() if n in changed))
    with pytest.raises(ValueError, match="quantisation 'fp8': one of int8, int4"):
        fake_quantize_(model, "fp8")
