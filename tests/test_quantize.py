"""Weight-only quantisation (issue 29): the schemes (pipeline/quantize.py), and int8 in the serving runtime.
`serve --quantize int8` quantises a package's linears and experts as it loads (export/serve/kernels
`quantize_linears`, `Int8Weight`; the experts in export/serve/placement/residency.py `ExpertStore.load`), and the
engine runs them through csrc/quantized.cpp's int8 kernels, the native decoder's included. The reference: the same
engine on the dequantised weights, through the plain kernels."""

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
    from export.serve.kernels import FusedQKV, HeadScreen, Int4Weight, Int8Weight, ServingLinear, ServingWeight

    count, kinds = 0, (Int8Weight, Int4Weight)
    for mq, mp in zip(quantised.worker.model.modules(), plain.worker.model.modules()):
        if isinstance(mq, ServingLinear) and isinstance(mq.served, kinds):
            mp.served, count = ServingWeight(mq.served.dequantized()), count + 1
            if mp.screen is not None:  # the output layer (--quantize-head): its screen on the weights it now has
                mp.screen = HeadScreen.of(mp.served, mp.bias)
        if isinstance(mq, FusedQKV) and isinstance(mq.weight, kinds):
            mp.weight, count = ServingWeight(mq.weight.dequantized()), count + 1
    resident = plain.exchange.residency.resident
    for key, (w1, b1, w2, b2) in quantised.exchange.residency.resident.items():
        assert isinstance(w1, kinds) and type(w1) is type(w2)
        resident[key] = (ServingWeight(w1.dequantized()), b1, ServingWeight(w2.dequantized()), b2)
        count += 1
    plain.worker.decoder = Decoder.of(plain.worker.model, plain.worker.cache)
    return count


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantised_at_load_serves_what_its_dequantised_weights_give(package, scheme):
    """int8 and int4 (groups of 128). Greedy tokens (through the head's screen) and the top-5 log-probabilities of every token, 4 prompts decoded
    together for 10 tokens (one of 100 tokens), equal to the same engine's on the dequantised weights (fp32: the int8 sums differ from
    F.linear's only in their order); the decode forwards ran in the native decoder with int8 weights; the output layer,
    the routers and the embeddings left in fp32."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.kernels import QUANTIZED, ServingWeight
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
    prompts = [torch.randint(100, 8000, (n,), generator=g).tolist() for n in (5, 9, 14, 100)]  # 100: a prefill
    # whose experts take more rows than the grouped kernel (one GEMM each) and whose linears dequantise for oneDNN
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
    w1, b1, w2, b2 = held[0]
    assert quantised.exchange.residency.store.nbytes() == sum(  # an expert's memory, as held
        t.numel() * t.element_size() for t in (w1.q, w1.scale, w2.q, w2.scale, *(b for b in (b1, b2) if b is not None)))
    assert type(model.blocks[0].attn.qkv_proj.weight) is QUANTIZED[scheme]  # hidden 128: one group of int4 a row


def test_the_output_layer_quantised_too(package):
    """--quantize-head: the output layer int8 as well (the package head's screen dropped: the logits are the quantised
    layer's, its greedy rows through its own screen where the kernel has one); tokens and log-probabilities those of
    the same engine on the dequantised weights, head included."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.kernels import Int8Weight
    from export.serve.request import SamplingParams

    quantised = Engine.from_config(ServeConfig(package=package, quantize="int8", quantize_head=True,
                                               kv_cache_memory=0.05))
    plain = Engine.from_config(ServeConfig(package=package, kv_cache_memory=0.05))
    head = quantised.worker.model.lm_head
    assert isinstance(head.served, Int8Weight) and (head.screen is not None) == hasattr(head.served.gemv,
                                                                                        "screen_argmax_i8")
    assert quantised.worker.model.wte.weight.dtype == torch.float32  # a tied head's embedding stays
    assert dequantised_twin(quantised, plain) == 4 * 2 + 2 * 2 + 2 * 2 + 12 + 1
    prompts = [[101, 202, 303, 404], [7, 77, 777]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    got, want = generate(quantised, prompts, params), generate(plain, prompts, params)
    assert [r.generated for r in got] == [r.generated for r in want]
    for a, b in zip(got, want):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantised_output_layer_screens_its_greedy_rows(package, monkeypatch, scheme):
    """--quantize int8|int4 --quantize-head: the greedy rows go through the quantised head's screen
    (export/serve/kernels/heads.py `QuantizedHeadScreen`: its stored weights x int8, the candidates then exact), with
    the same tokens as the same engine reading its whole output layer (`--no-head-screen`), one prompt and four
    decoded together; rows that ask for log-probabilities read the whole layer."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.kernels import QUANTIZED, QuantizedHeadScreen, kernel
    from export.serve.request import SamplingParams

    if not hasattr(kernel(), "screen_argmax_i4"):
        pytest.skip("the quantised heads' screens need an AVX512_VNNI build of the kernel")
    screened = Engine.from_config(ServeConfig(package=package, quantize=scheme, quantize_head=True,
                                              kv_cache_memory=0.05))
    whole = Engine.from_config(ServeConfig(package=package, quantize=scheme, quantize_head=True, kv_cache_memory=0.05,
                                           head_screen=False))
    head = screened.worker.model.lm_head
    assert type(head.served) is QUANTIZED[scheme] and isinstance(head.screen, QuantizedHeadScreen)
    assert whole.worker.model.lm_head.screen is None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 8000, (n,), generator=g).tolist() for n in (3, 6, 11, 17)]
    for batch in ([prompts[0]], prompts):
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        assert [r.generated for r in generate(screened, batch, params)] == \
            [r.generated for r in generate(whole, batch, params)]
    assert head.screen.calls - head.screen.fallbacks >= 11  # answered by the screen
    calls = head.screen.calls
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    got, want = generate(screened, prompts, params), generate(whole, prompts, params)
    assert [r.generated for r in got] == [r.generated for r in want] and head.screen.calls == calls


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


def test_the_shipped_quantisation_names_the_registry_s_stored_kinds():
    """pipeline/quantize.py ships alone in packages (torch its only import), so it names the stored kinds itself: the
    scheme registry's (pipeline/schemes.py), in the same order."""
    from pipeline.quantize import KINDS
    from pipeline.schemes import STORED

    assert KINDS == STORED


# -- export --quantize: quantised packages ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_packages(small_run, tmp_path_factory):
    """`moe-pipeline export RUN --quantize int8|int4` (GPTQ on 32 calibration blocks of the run's training split), and
    the plain fp32 package of the same run. int4 in groups of 64: the run's hidden size is 64."""
    from conftest import cli

    out = tmp_path_factory.mktemp("quantized")
    cli("export", str(small_run), "--out", str(out / "plain"))
    for scheme in ("int8", "int4"):
        cli("export", str(small_run), "--out", str(out / scheme), "--quantize", scheme, "--calibration-blocks", "32",
            *(["--group-size", "64"] if scheme == "int4" else []))
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_package_verifies_and_loads_as_the_weights_it_stores(quantized_packages, scheme):
    """The package holds each quantised linear as its values and scales (int8 [out, in], or int4 packed two a byte with
    a scale per 64 inputs), the routers in fp32 and the rest in the package's dtype; `verify` passes; the manifest
    records the scheme and GPTQ's report (every block's output error below round to nearest's on the same Hessian);
    our loader and transformers' remote code both give the model those weights stand for, with the same logits; and
    they are not the plain package's weights rounded to nearest (GPTQ moved them)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from export.inference import load_package
    from export.package import verify_package
    from pipeline.quantize import quantize_int8, quantize_int4, pack_int4, stored_dequantized

    pkg = quantized_packages / scheme
    assert verify_package(pkg) == []
    manifest = json.loads((pkg / "manifest.json").read_text())
    q = manifest["quantization"]
    group = 64 if scheme == "int4" else 128
    assert (q["scheme"], q["method"], q["group"], q["head"]) == (scheme, "gptq", group, False)
    assert q[f"{scheme}_weights"] == q["weights"]  # every row fits the groups
    assert q["calibration_blocks"] == 32 and q["round_to_nearest"] == {} and q["weights"] > 0
    assert q["relative_error"] and all(0 < r < 1 for r in q["relative_error"].values())
    assert all(sum(c) > 0 for c in q["routed_tokens"].values())
    stored = load_file(str(pkg / "model.safetensors"))
    plain = load_file(str(quantized_packages / "plain" / "model.safetensors"))
    expert = next(k for k in sorted(stored) if k.endswith("deepspeed_experts.0.fc1.weight_scale"))[:-len("_scale")]
    values = stored[expert] if scheme == "int8" else stored[expert + "_packed"]
    assert values.dtype == (torch.int8 if scheme == "int8" else torch.uint8)
    assert values.shape[1] == plain[expert].shape[1] // (1 if scheme == "int8" else 2)
    assert stored[expert + "_scale"].dtype == torch.float32
    assert stored[expert.split(".experts.")[0] + ".gate.wg.weight"].dtype == torch.float32
    assert expert not in stored or scheme == "int8"
    rtn = quantize_int8(plain[expert]) if scheme == "int8" else quantize_int4(plain[expert], group)
    rtn = (rtn[0] if scheme == "int8" else pack_int4(rtn[0]), rtn[1])
    assert not torch.equal(values, rtn[0])  # GPTQ, not round to nearest
    want = stored_dequantized(values, stored[expert + "_scale"], group)
    model, tok = load_package(pkg)
    assert torch.equal(dict(model.named_parameters())[expert], want)
    hf = AutoModelForCausalLM.from_pretrained(str(pkg), trust_remote_code=True)
    ids = torch.tensor([tok.encode("In the beginning God created the heaven and the earth.")])
    assert torch.allclose(hf(ids).logits, model(ids).logits, atol=1e-5)
    assert "QuantizedLinear" in {type(m).__name__ for m in hf.modules()}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_package_serves_its_stored_weights(quantized_packages, scheme):
    """`serve` on a quantised package runs its stored values and scales through the int8/int4 kernels (no second
    rounding: the served weights are exactly the stored ones), tokens and log-probabilities those of the same engine
    on the dequantised weights; a different --quantize is refused naming the package's scheme."""
    from safetensors.torch import load_file

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.kernels import QUANTIZED, QuantizedWeight
    from export.serve.request import SamplingParams
    from pipeline.quantize import scale_name, values_name

    pkg = quantized_packages / scheme
    quantised = Engine.from_config(ServeConfig(package=pkg, kv_cache_memory=0.05))
    plain = Engine.from_config(ServeConfig(package=pkg, kv_cache_memory=0.05))
    stored = load_file(str(pkg / "model.safetensors"))
    for name, module in quantised.worker.model.named_modules():  # the dense linears large enough to be served
        if isinstance(getattr(module, "served", None), QuantizedWeight):
            assert torch.equal(module.served.q, stored[values_name(f"{name}.weight", scheme)])
            assert torch.equal(module.served.scale, stored[scale_name(f"{name}.weight")])
    (w1, _, w2, _), = [v for k, v in quantised.exchange.residency.resident.items() if k == (0, 1)]
    from pipeline.model import expert_key

    fc1 = expert_key(quantised.worker.model.cfg.moe_layers[0], 1, "fc1.weight")
    assert type(w1) is QUANTIZED[scheme] and torch.equal(w1.q, stored[values_name(fc1, scheme)])
    held = sum(t.numel() * t.element_size() for w in (w1, w2) for t in (w.q, w.scale)) + \
        sum(b.numel() * b.element_size() for b in quantised.exchange.residency.resident[(0, 1)][1::2] if b is not None)
    assert quantised.exchange.residency.store.nbytes() == held  # an expert's memory, as held
    assert dequantised_twin(quantised, plain) > 0
    prompts = [[101, 202, 303, 404], [7, 77, 777, 7777, 5]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    got, want = generate(quantised, prompts, params), generate(plain, prompts, params)
    assert [r.generated for r in got] == [r.generated for r in want]
    for a, b in zip(got, want):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    other = "int4" if scheme == "int8" else "int8"
    with pytest.raises(ValueError, match=f"--quantize {other}: this package holds {scheme} weights"):
        Engine.from_config(ServeConfig(package=pkg, quantize=other, kv_cache_memory=0.05))


def test_verify_checks_the_quantization_against_the_tensors(quantized_packages, tmp_path):
    """A manifest whose scheme is not the one its tensors were written in, or of a scheme this code does not know, is
    a listed problem naming the tensors or the key."""
    import json
    import shutil

    from export.package import verify_package

    pkg = tmp_path / "pkg"
    shutil.copytree(quantized_packages / "int4", pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["quantization"]["scheme"] = "int8"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_package(pkg)
    assert any("_packed is not part of the model" in p for p in problems)
    assert any("missing (config.json implies it)" in p for p in problems)
    manifest["quantization"]["scheme"] = "fp8"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    assert verify_package(pkg) == ['manifest.json: quantization.scheme must be "int8" or "int4", got a string "fp8"']


def test_gptq_lowers_the_output_error_of_round_to_nearest():
    """pipeline/quantize.py `gptq` on inputs with correlated features: the values within range, the output error
    tr(dW H dW^T) below round to nearest's for int8 and int4, several weights in one call each as alone; an input no
    token reached gets weight 0; a Hessian of NaNs is refused (LinAlgError), which export falls back from."""
    from pipeline.quantize import gptq, quantize_int4, quantize_int8, rounding_error

    g = torch.Generator().manual_seed(0)
    B, O, I = 2, 32, 256
    X = torch.randn(B, 1024, I, generator=g) @ torch.randn(I, I, generator=g) * 0.3
    X[:, :, 5] = 0
    H = X.transpose(1, 2) @ X
    W = torch.randn(B, O, I, generator=g) * 0.02
    for kind, top, rtn in (("int8", 127, quantize_int8), ("int4", 7, quantize_int4)):
        q, scale = gptq(W, H, kind)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= top and (q[:, :, 5] == 0).all()
        near = [rtn(W[b]) for b in range(B)]
        ours = rounding_error(W, q, scale, H)
        theirs = rounding_error(W, torch.stack([n[0] for n in near]), torch.stack([n[1] for n in near]), H)
        assert (ours < 0.8 * theirs).all()
        q1, s1 = gptq(W[1:], H[1:], kind)
        assert torch.equal(q1[0], q[1]) and torch.equal(s1[0], scale[1])
    with pytest.raises(torch.linalg.LinAlgError):
        gptq(W[:1], torch.full((1, I, I), float("nan")), "int8")


def w8a8_twin(quantised, plain) -> int:
    """`plain` (an engine of the same package) given `quantised`'s W8A8 weights as the reference computes them:
    F.linear on each row of the inputs rounded to int8 steps and the dequantised weight (`W8A8Weight` unpacked, no
    kernel), its decode forwards in Python (no native decoder); returns how many. Its MoE layers must also run one
    expert at a time (`python_experts`)."""
    from export.serve.kernels import FusedQKV, ServingLinear, W8A8Weight

    def ref(w):
        assert isinstance(w, W8A8Weight) and w.rows is None  # the kernel's tiles
        return W8A8Weight(w.values().clone(), w.scales().clone(), pack=False)

    count = 0
    for mq, mp in zip(quantised.worker.model.modules(), plain.worker.model.modules()):
        if isinstance(mq, ServingLinear) and isinstance(mq.served, W8A8Weight):
            mp.served, mp.screen, count = ref(mq.served), None, count + 1
        if isinstance(mq, FusedQKV) and isinstance(mq.weight, W8A8Weight):
            mp.weight, count = ref(mq.weight), count + 1
    resident = plain.exchange.residency.resident
    for key, (w1, b1, w2, b2) in quantised.exchange.residency.resident.items():
        resident[key] = (ref(w1), b1, ref(w2), b2)
        count += 1
    plain.worker.decoder = None
    return count


def python_experts(monkeypatch):
    """Every MoE layer's experts one at a time in Python (export/serve/placement/exchange.py's loop), not the kernel."""
    from export.serve import kernels

    monkeypatch.setattr(kernels, "grouped_experts", lambda *a: False)
    monkeypatch.setattr(kernels, "local_layer", lambda *a: False)


def test_w8a8_serves_what_int8_inputs_through_the_dequantised_weights_give(package, quantized_packages, monkeypatch):
    """--quantize w8a8 (int8 weights, each row of a linear's inputs rounded to int8 with its own scale: vLLM's dynamic
    per-token W8A8), on a package quantised at load and on an int8 package's stored weights: every linear, fused
    q/k/v and expert a W8A8Weight run by the kernel's int8 x int8 products (the native decoder and the grouped expert
    kernel included; a prefill of 100 tokens through `w8a8_linear` at any rows); greedy tokens and log-probabilities
    those of the reference (inputs rounded to int8 steps in fp32, F.linear on the dequantised weights, the experts
    one at a time in Python), fp32, within a few int8 steps of an input. int4 packages refuse it naming the
    scheme."""
    from export.serve.config import ServeConfig
    from export.serve.engine import Engine, generate
    from export.serve.kernels import W8A8Weight, kernel
    from export.serve.request import SamplingParams

    if not hasattr(kernel(), "w8a8_linear"):
        pytest.skip("this CPU's kernel has no AVX512_VNNI build")
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    for pkg, longest in ((package, 100), (quantized_packages / "int8", 50)):  # the stored one's context: 64
        prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (5, 9, 14, longest)]
        quantised = Engine.from_config(ServeConfig(package=pkg, quantize="w8a8", kv_cache_memory=0.05))
        assert quantised.worker.decoder is not None
        held = list(quantised.exchange.residency.resident.values())
        assert held and all(type(w[0]) is W8A8Weight and type(w[2]) is W8A8Weight for w in held)
        if pkg == package:  # (the stored package's layers are too small to be served: F.linear's)
            assert type(quantised.worker.model.blocks[0].attn.qkv_proj.weight) is W8A8Weight
        got = generate(quantised, prompts, params)
        assert quantised.stats["decode_steps"] >= 7
        plain = Engine.from_config(ServeConfig(package=pkg, kv_cache_memory=0.05))
        twins = w8a8_twin(quantised, plain)  # linears and experts
        assert twins == 4 * 2 + 2 * 2 + 2 * 2 + 12 if pkg == package else twins > len(held)
        with monkeypatch.context() as m:
            python_experts(m)
            want = generate(plain, prompts, params)
        assert [r.generated for r in got] == [r.generated for r in want]
        for a, b in zip(got, want):  # an input ~1e-7 apart upstream (attention's kernel and SDPA sum in other orders)
            # can land on the other side of an int8 step, moving the outputs by that step: a looser tolerance
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=3e-3)
            for ta, tb in zip(a.top_logprobs, b.top_logprobs):
                assert ta.keys() == tb.keys() and list(ta.values()) == pytest.approx(list(tb.values()), abs=3e-3)
    with pytest.raises(ValueError, match="--quantize w8a8: this package holds int4 weights"):
        Engine.from_config(ServeConfig(package=quantized_packages / "int4", quantize="w8a8", kv_cache_memory=0.05))
    from export.serve import kernels

    monkeypatch.setattr(kernels, "kernel", lambda: None)  # a CPU without the kernel (or without AVX512_VNNI)
    with pytest.raises(ValueError, match="--quantize w8a8: its kernels need a CPU with AVX512_VNNI"):
        Engine.from_config(ServeConfig(package=package, quantize="w8a8", kv_cache_memory=0.05))
