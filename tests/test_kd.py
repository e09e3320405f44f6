"""KD loss and staged schedule, against small hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

import distill.kd as kd_module
from distill.kd import beta_at, divergence, fused_kd_loss, kd_loss
from pipeline.model import masked_cross_entropy
from pipeline.recipe import KDSpec


def softmax(row, t):
    e = [math.exp(x / t) for x in row]
    return [x / sum(e) for x in e]


def test_loss_matches_a_hand_computed_reference():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 4)
    t = torch.randn(2, 3, 4)
    labels = torch.tensor([[1, 2, 3], [0, 1, 2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 3 real tokens of 6
    kd = KDSpec(alpha=0.7, beta=0.5, temperature=2.0, divergence="kl")
    out = kd_loss(s, labels, mask, t, kd, beta=0.5)

    ce_sum = kl_sum = 0.0
    for b, i in [(0, 0), (0, 1), (1, 0)]:
        ps = softmax(s[b, i].tolist(), 1.0)
        ce_sum += -math.log(ps[labels[b, i]])
        pt_T, ps_T = softmax(t[b, i].tolist(), 2.0), softmax(s[b, i].tolist(), 2.0)
        kl_sum += sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt_T, ps_T))
    ce, kl = ce_sum / 3, kl_sum / 3  # averaged over the 3 real tokens, not over 6 positions
    assert out["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert out["kd"].item() == pytest.approx(kl, rel=1e-5)
    assert out["loss"].item() == pytest.approx(0.7 * ce + 0.5 * 4.0 * kl, rel=1e-5)  # alpha, beta, T^2


def test_divergences_vanish_on_equal_inputs_and_differ_otherwise():
    t = torch.randn(2, 5, 7)
    for kind in ("kl", "reverse_kl", "jsd"):
        assert divergence(t, t, 1.5, kind).abs().max().item() < 1e-6  # KL(t, t) == 0
    s = torch.randn(2, 5, 7)
    kl, rkl, jsd = (divergence(s, t, 1.0, k) for k in ("kl", "reverse_kl", "jsd"))
    torch.testing.assert_close(rkl, divergence(t, s, 1.0, "kl"))  # reverse KL is KL with the roles swapped
    assert (kl > 0).all() and (jsd > 0).all() and (jsd <= math.log(2) + 1e-6).all()


def test_without_teacher_or_beta_the_loss_is_alpha_ce():
    s, labels = torch.randn(1, 4, 5), torch.randint(0, 5, (1, 4))
    kd = KDSpec(alpha=2.0)
    a = kd_loss(s, labels, None, None, kd, beta=1.0)
    b = kd_loss(s, labels, None, torch.randn(1, 4, 5), kd, beta=0.0)
    torch.testing.assert_close(a["loss"], 2.0 * a["ce"])
    torch.testing.assert_close(b["loss"], a["loss"])


def test_schedule_cut_and_linear_decay():
    cut = KDSpec(beta=1.0, stop_at=6)
    assert [beta_at(s, cut, 6) for s in range(8)] == [1, 1, 1, 1, 1, 1, 0, 0]
    ramp = KDSpec(beta=2.0, stop_at=6, decay_steps=4)
    assert [beta_at(s, ramp, 6) for s in range(8)] == [2, 2, 2.0, 1.5, 1.0, 0.5, 0, 0]
    assert beta_at(10**6, KDSpec(stop_at=None), None) == 1.0  # KD all the way


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_fused_loss_equals_autograd_composition_in_value_and_gradient(kind, temperature):
    """kd_loss's one-pass fused objective == alpha*masked CE + beta*T^2*masked mean of `divergence`, by autograd."""
    torch.manual_seed(1)
    shape, vocab = (3, 70), 300  # 210 tokens: several chunks of the fused loop when CHUNK_ELEMENTS is small
    s = torch.randn(*shape, vocab, requires_grad=True)
    t = torch.randn(*shape, vocab) * 2
    labels = torch.randint(0, vocab, shape)
    mask = (torch.rand(shape) > 0.3).float()
    kd = KDSpec(alpha=0.7, beta=0.5, temperature=temperature, divergence=kind)

    out = kd_loss(s, labels, mask, t, kd, beta=0.4)
    out["loss"].backward()
    fused_grad, s.grad = s.grad, None

    ce = masked_cross_entropy(s, labels, mask)
    soft = (divergence(s, t, temperature, kind) * mask).sum() / mask.sum()
    ref = 0.7 * ce + 0.4 * temperature ** 2 * soft
    ref.backward()
    torch.testing.assert_close(out["loss"], ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["ce"], ce.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["kd"], soft.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, s.grad, rtol=1e-4, atol=1e-8)
    assert fused_grad[mask == 0].abs().max() == 0  # masked positions get no gradient


def test_fused_loss_chunking_does_not_change_the_result(monkeypatch):
    torch.manual_seed(2)
    s, t = torch.randn(2, 33, 50), torch.randn(2, 33, 50)
    labels, w = torch.randint(0, 50, (2, 33)), torch.rand(2, 33)
    whole = fused_kd_loss(s, labels, w, t, 2 * w, 1.5, "jsd")
    monkeypatch.setattr(kd_module, "CHUNK_ELEMENTS", 50 * 7)  # 7 rows per chunk, the last one short
    chunked = fused_kd_loss(s, labels, w, t, 2 * w, 1.5, "jsd")
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b)


def test_bf16_student_logits_get_a_bf16_gradient():
    s = torch.randn(2, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    out = kd_loss(s, torch.randint(0, 16, (2, 4)), None, torch.randn(2, 4, 16), KDSpec(), beta=1.0)
    out["loss"].backward()
    assert s.grad.dtype == torch.bfloat16 and torch.isfinite(s.grad.float()).all()


def _reference_grad(s, t, labels, mask, kd, beta):
    """fp32 autograd of the objective's definition (alpha * masked CE + beta * T^2 * masked mean divergence)."""
    s32 = s.detach().float().requires_grad_(True)
    ce = masked_cross_entropy(s32, labels, mask)
    soft = (divergence(s32, t.float(), kd.temperature, kd.divergence) * mask).sum() / mask.sum()
    (kd.alpha * ce + beta * kd.temperature ** 2 * soft).backward()
    return s32.grad


def _scaled_grad_error(dtype, vocab, tokens, kind, scale, seed=0):
    """Relative L1 error of kd_loss's gradient in `dtype` with the loss scaled as DeepSpeed's fp16 optimizer does
    ((loss * scale).backward(), then grads / scale), against fp32 autograd of the definition."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, tokens // 2)
    s = (torch.randn(*shape, vocab, generator=g) * 2).to(dtype).requires_grad_(True)
    t = (torch.randn(*shape, vocab, generator=g) * 2).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.1).float()
    kd = KDSpec(alpha=1.0, beta=1.0, temperature=1.0 if kind != "jsd" else 2.0, divergence=kind)
    out = kd_loss(s, labels, mask, t, kd, beta=1.0)
    (out["loss"] * scale).backward()
    assert s.grad.dtype == dtype
    got = s.grad.float() / scale
    want = _reference_grad(s, t, labels, mask, kd, 1.0)
    return float((got - want).abs().sum() / want.abs().sum())


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("dtype, scale", [(torch.float16, 2.0 ** 16), (torch.bfloat16, 1.0)])
def test_half_precision_gradient_equals_fp32_autograd_under_the_loss_scale(kind, dtype, scale, monkeypatch):
    """fp16 with DeepSpeed's initial loss scale 2^16 (inf in fp16 itself) and bf16 unscaled, across chunk
    boundaries (7 rows per chunk): the gradient was stored in the half dtype before scaling and flushed."""
    monkeypatch.setattr(kd_module, "CHUNK_ELEMENTS", 7 * 4096)
    assert _scaled_grad_error(dtype, 4096, 256, kind, scale) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("dtype, scale", [(torch.float16, 2.0 ** 16), (torch.bfloat16, 1.0)])
def test_half_precision_gradient_at_the_papers_vocabulary(kind, dtype, scale):
    """V = 50,304 and a 1,024-token micro-batch (per-token weight ~1e-3): ~5 rows per CPU chunk, so ~200 chunks."""
    assert _scaled_grad_error(dtype, 50304, 1024, kind, scale) < 1e-2
