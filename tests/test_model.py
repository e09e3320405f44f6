"""The model's spec, as parity tests: reference MoE == DeepSpeed MoE, cache == full forward,
one expert == the dense MLP, residual mixing == its definition, init independent of the layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import GPT, MLP, KVCache, ModelConfig, MoE, init_weights, masked_cross_entropy, param_counts


from conftest import model_config as config


def pair(cfg: ModelConfig, seed: int = 0) -> tuple[GPT, GPT]:
    ref, ds = GPT(cfg, moe_impl="reference"), GPT(cfg, moe_impl="deepspeed")
    init_weights(ref, seed)
    init_weights(ds, seed)
    return ref, ds


def test_reference_and_deepspeed_share_parameter_names():
    ref, ds = pair(config())
    assert list(ref.state_dict()) == list(ds.state_dict())


@pytest.mark.parametrize("mlp_type", ["standard", "residual"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_reference_moe_equals_deepspeed_moe(mlp_type, top_k):
    ref, ds = pair(config(mlp_type=mlp_type, top_k=top_k))
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    a, b = ref.eval()(ids, labels=ids), ds.eval()(ids, labels=ids)
    torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)
    for ca, cb in zip(a.expert_counts, b.expert_counts):
        assert ca.tolist() == cb.tolist()


@pytest.mark.parametrize("top_k", [2, 4])
def test_raw_routes_match_deepspeed(top_k):
    """renormalize false (Qwen2-MoE's and OLMoE's norm_topk_prob false): DeepSpeed's gate made a RawTopKGate at
    construction, holding the router DeepSpeed initialised (same names, same draws from the RNG), routes as the
    reference does, and differs from a renormalising one."""
    from pipeline.model import raw_topk_gate

    cfg = config(mlp_type="standard", top_k=top_k, renormalize=False, experts=(8, 8))
    ref, ds = pair(cfg)
    torch.manual_seed(3)
    GPT(cfg, moe_impl="deepspeed")
    after_raw = torch.rand(1)
    torch.manual_seed(3)
    GPT(config(mlp_type="standard", top_k=top_k, renormalize=True, experts=(8, 8)), moe_impl="deepspeed")
    assert torch.equal(torch.rand(1), after_raw)  # building the raw gate drew nothing more
    gates = [m.moe.deepspeed_moe.gate for m in ds.modules() if isinstance(m, MoE)]
    assert gates and all(type(g) is raw_topk_gate() for g in gates)
    assert list(ref.state_dict()) == list(ds.state_dict())
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    a, b = ref.eval()(ids), ds.eval()(ids)
    torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)
    renormalised = GPT(dataclasses.replace(cfg, renormalize=True), moe_impl="reference")
    renormalised.load_state_dict(ref.state_dict())
    assert not torch.allclose(renormalised.eval()(ids).logits, a.logits, atol=1e-4)


def test_top2_token_dropping_matches_deepspeed():
    """With an eval capacity both implementations drop the same (choice, token) slots and renormalise alike."""
    ref, ds = pair(config(mlp_type="standard", top_k=2, eval_capacity_factor=0.5, min_capacity=0))
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    a, b = ref.eval()(ids), ds.eval()(ids)
    torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)


def test_evaluation_does_not_draw_random_numbers():
    """Random token selection is a training-time device: eval must not consume the RNG."""
    _, ds = pair(config(mlp_type="standard", eval_capacity_factor=0.5))
    ids = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = ds.eval()(ids).logits
    assert torch.equal(torch.get_rng_state(), before)
    torch.testing.assert_close(ds(ids).logits, first)


def test_training_capacity_drops_tokens_and_eval_does_not():
    cfg = config(mlp_type="standard", capacity_factor=0.25, min_capacity=0)
    ref, ds = pair(cfg)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    for model in (ref, ds):
        moe = model.moe_layers()[1]
        moe.train()
        dropped = (moe(x)[0].abs().sum(-1) == 0).sum().item()  # a dropped token gets a zero MoE output
        moe.eval()
        kept = (moe(x)[0].abs().sum(-1) == 0).sum().item()
        assert dropped >= 32 - 4 * 2  # 32 tokens, 4 experts, capacity ceil(32/4 * 0.25) = 2 each
        assert kept == 0


def test_one_expert_equals_the_dense_mlp():
    cfg = config(experts=(1, 1), mlp_type="standard")
    moe = MoE(cfg, num_experts=1, impl="deepspeed").eval()
    mlp = MLP(cfg)
    mlp.load_state_dict(moe.moe.deepspeed_moe.experts.deepspeed_experts[0].state_dict())
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(moe(x)[0], mlp(x))  # a single expert gets every token with gate weight 1


def test_residual_mixing_matches_its_definition():
    cfg = config(mlp_type="residual", top_k=1)
    for impl in ("reference", "deepspeed"):
        moe = MoE(cfg, num_experts=4, impl=impl).eval()
        torch.manual_seed(0)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(2, 8, 32)
        out = moe(x)[0]
        tokens = x.reshape(-1, 32)
        probs = F.linear(tokens, moe.moe.deepspeed_moe.gate.wg.weight).softmax(-1)
        p1, e1 = probs.max(-1)
        experts = moe.moe.deepspeed_moe.experts.deepspeed_experts
        routed = torch.stack([p1[i] * experts[int(e1[i])](tokens[i]) for i in range(len(tokens))])
        c = moe.moe.coefficient(tokens).softmax(-1)  # (c0, c1) per token
        expected = routed * c[:, :1] + moe.moe.mlp(tokens) * c[:, 1:]
        torch.testing.assert_close(out.reshape(-1, 32), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "deepspeed"])
def test_kv_cache_decoding_equals_full_forward(impl):
    cfg = config(top_k=2)
    model = GPT(cfg, moe_impl=impl).eval()
    init_weights(model, 3)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache(cfg, batch=2, max_len=20)
        parts = [model(ids[:, :7], cache=cache).logits, model(ids[:, 7:12], cache=cache).logits]
        parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_context_overflow_is_an_error():
    model = GPT(config())
    with pytest.raises(ValueError, match="exceed the model's context of 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_init_does_not_depend_on_expert_layout():
    """Expert e of a layer gets the same weights as global expert e on any rank of any EP degree."""
    cfg = config()
    whole = GPT(cfg)
    init_weights(whole, 7)
    half = GPT(cfg)  # pretend this is rank 1 of 2: its local expert 0 is global expert 2 of layer 2
    for moe in half.moe_layers():
        moe.ep_size = 2
    init_weights(half, 7, ep_rank_of=lambda moe: 1)
    w = whole.blocks[3].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    h = half.blocks[3].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    torch.testing.assert_close(h[0].fc1.weight, w[2].fc1.weight)
    assert not torch.equal(w[0].fc1.weight, w[1].fc1.weight)  # experts start different
    torch.testing.assert_close(half.wte.weight, whole.wte.weight)


def test_masked_loss_averages_over_real_tokens():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float)
    nll = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none").reshape(2, 5)
    expected = (nll[0, 0] + nll[0, 1] + nll[1, 0]) / 3
    torch.testing.assert_close(masked_cross_entropy(logits, labels, mask), expected)


def test_aux_loss_is_the_balancing_loss_times_its_coefficient():
    cfg = config(mlp_type="standard", aux_loss_coef=0.5)
    model = GPT(cfg).eval()
    init_weights(model, 0)
    ids = torch.randint(0, 256, (2, 16))
    out = model(ids)
    # recompute the GShard loss E * sum(mean gate prob * fraction routed) from the gates' inputs
    captured = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: captured.append(args[0])) for m in model.moe_layers()]
    model(ids)
    for h in hooks:
        h.remove()
    total = 0.0
    for moe, x in zip(model.moe_layers(), captured):
        probs = F.linear(x.reshape(-1, 32), moe.moe.deepspeed_moe.gate.wg.weight).softmax(-1)
        frac = F.one_hot(probs.argmax(-1), moe.num_experts).float().mean(0)
        total += moe.num_experts * (probs.mean(0) * frac).sum()
    torch.testing.assert_close(out.aux_loss, 0.5 * total)


def test_param_counts_count_every_expert_and_active_ones():
    cfg = config(mlp_type="residual", experts=(2, 4), tie_embeddings=True)
    counts = param_counts(GPT(cfg))
    h = 32
    expert = 8 * h * h + 5 * h
    dense_part = sum(p.numel() for n, p in GPT(cfg).named_parameters() if "deepspeed_experts" not in n)
    assert counts["total"] == dense_part + 6 * expert
    assert counts["active_per_token"] == dense_part + 2 * expert  # one routed expert per MoE layer (top-1)


def test_a_model_without_moe_layers_works():
    """A dense student (no MoE layer): forward, loss without a balancing term, cache decoding, counts."""
    cfg = config(experts=(), moe_layers=())
    model = GPT(cfg).eval()
    init_weights(model, 0)
    assert model.moe_layers() == []
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    assert out.aux_loss.item() == 0.0 and out.expert_counts == [] and torch.isfinite(out.loss)
    cache = KVCache(cfg, batch=2, max_len=12)
    steps = [model(ids[:, :6], cache=cache).logits] + [model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), out.logits, atol=1e-5, rtol=1e-5)
    counts = param_counts(model)
    assert counts["total"] == counts["active_per_token"] == sum(p.numel() for p in model.parameters())


def test_the_optional_shape_fields_are_resolved_once_and_a_saved_config_reads_back_equal():
    """head_dim, kv_heads, ffn_hidden, expert_hidden and renormalize: None on the way in, resolved by the config
    itself (so no code resolves them again), given values kept; to_dict -> ModelConfig is the identity."""
    cfg = config(top_k=2, experts=(2, 4))
    assert (cfg.head_dim, cfg.kv_heads, cfg.ffn_hidden, cfg.expert_hidden, cfg.renormalize) == (8, 4, 128, 128, True)
    assert config(top_k=1).renormalize is False
    given = config(head_dim=16, kv_heads=2, ffn_hidden=96, expert_hidden=48, renormalize=False, top_k=2)
    assert (given.head_dim, given.kv_heads, given.ffn_hidden, given.expert_hidden, given.renormalize) == \
        (16, 2, 96, 48, False)
    assert config(ffn_hidden=96).expert_hidden == 96  # the experts default to the dense width
    for c in (cfg, given):
        assert ModelConfig(**c.to_dict()) == c and None not in [c.to_dict()[k] for k in ("head_dim", "kv_heads", "ffn_hidden", "expert_hidden", "renormalize")]
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        config(kv_heads=3)


def test_route_drops_past_capacity_in_token_order_and_renormalises_top2():
    from pipeline.model import group_by_expert, route

    logits = torch.tensor([[2.0, 1.0, 0.0], [3.0, 0.0, 1.0], [2.5, 0.5, 0.0], [0.0, 0.0, 4.0]])
    r = route(logits, top_k=1, renormalize=False, capacity=2)
    assert r.experts[:, 0].tolist() == [0, 0, 0, 2] and r.counts.tolist() == [3, 0, 1]
    assert r.keep[:, 0].tolist() == [True, True, False, True]  # expert 0's third token is dropped
    probs = logits.softmax(-1)
    assert torch.allclose(r.weights[:, 0], probs.max(-1).values * r.keep[:, 0])  # top-1: the raw probability
    token, choice, per_expert = group_by_expert(r, 3)
    assert per_expert == [2, 0, 1] and token.tolist() == [0, 1, 3]
    r2 = route(logits, top_k=2, renormalize=True)
    torch.testing.assert_close(r2.weights.sum(-1), torch.ones(4))
    assert r2.aux.item() == pytest.approx(3 * (probs.mean(0) * F.one_hot(r2.experts[:, 0], 3).float().mean(0)).sum().item())

