"""Knowledge-distillation losses and the staged-KD schedule (Mixture-of-Students, DeepSpeed-MoE 2022).

    total = alpha * CE(student, labels) + beta(step) * T^2 * D(p_teacher(T) || p_student(T))   (+ the MoE aux loss)

Shapes: logits [B, T, V], labels [B, T], loss_mask [B, T] (1.0 for a real target token).
Every term is averaged over real tokens (the mask's sum), not over B x seq_len, and both terms
use the same mask: the reference implementation's KL counted padding and end-of-document
positions and divided by the configured sequence length. T^2 keeps the gradient scale of the
soft term independent of the temperature (Hinton et al., 2015).

After `kd.stop_at` beta is 0 and the teacher does not run at all (staged KD); `kd.decay_steps`
ramps beta down linearly before the stop instead of cutting it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.model import masked_cross_entropy
from pipeline.recipe import KDSpec


DIVERGENCES = ("kl", "reverse_kl", "jsd")
# rows per chunk x vocabulary. On a CPU 1 MiB of fp32, so a chunk's passes stay in cache; on an accelerator
# each chunk is ~15 kernel launches, and 2^18 elements would be ~5 rows at the paper's vocabulary (50,304):
# a 4k-token micro-batch would be ~800 launch-bound iterations, so there a chunk is 2^26 elements (~1,300
# rows; each of the chunk's ~6 fp32 temporaries is 256 MiB).
CHUNK_ELEMENTS = 1 << 18
ACCELERATOR_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Token rows per chunk of the fused KD pass on `device`."""
    elements = CHUNK_ELEMENTS if torch.device(device).type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // vocab)


def _check_kind(kind: str) -> None:
    if kind not in DIVERGENCES:
        raise ValueError(f"kd.divergence = {kind!r}: one of {', '.join(map(repr, DIVERGENCES))}")


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
               kind: str = "kl") -> torch.Tensor:
    """Per-token divergence [B, T] between the temperature-softened distributions (in fp32), by autograd.

    kl: forward KL(p_t || p_s) (the paper's); reverse_kl: KL(p_s || p_t); jsd: Jensen-Shannon.
    The definition; training uses `fused_kd_loss`, which equals it in value and gradient.
    """
    _check_kind(kind)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # [B, T, V]
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if kind == "kl":
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if kind == "reverse_kl":
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s, log_t) - math.log(2.0)  # log of the mixture
    return 0.5 * (log_t.exp() * (log_t - log_m)).sum(-1) + 0.5 * (log_s.exp() * (log_s - log_m)).sum(-1)


class _FusedKD(torch.autograd.Function):
    """sum_i w_ce[i] * CE_i + w_div[i] * D_i and its gradient, in one chunked pass over the tokens.

    The gradient with respect to the student's logits has a closed form, so the forward computes
    it chunk by chunk while the chunk is in cache, and backward only scales it. Plain autograd
    walks the whole [B, T, V] logits about a dozen times (log_softmax, exp, sub, mul and their
    backwards) and computes the student's log-softmax twice (CE and KD); on the tiny recipe that
    made a KD step cost 2x a plain one (benchmarks/kd_step_time.py). With z = student / T,
    p_s = softmax(z), p_1 = softmax(student) and h = dD/dp_s:
        CE:          dCE/dstudent = p_1 - onehot(label)
        kl:          dD/dz = p_s - p_t
        reverse_kl:  h = log p_s - log p_t,          dD/dz = p_s * (h - <p_s, h>)
        jsd:         h = (log p_s - log m) / 2,      dD/dz = p_s * (h - <p_s, h>)
    and dD/dstudent = dD/dz / T. The teacher and the weights get no gradient.
    Returns (loss, ce [N], div [N]); the per-token values are for logging (no gradient).

    Precision: the gradient is kept in fp32 and cast to the student's dtype only in backward, after
    `grad_loss` (the loss scale, with fp16) has multiplied it. Each entry is a per-token weight (1 /
    real tokens, ~2.4e-4 for 2 x 2048 tokens) times a probability difference: stored in fp16 before
    scaling, 97-99% of the entries at the paper's vocabulary flushed to zero, and DeepSpeed's initial
    scale 2^16 itself is inf in fp16. Scaled first, fp16 holds them.
    """

    @staticmethod
    def forward(ctx, student, teacher, labels, w_ce, w_div, temperature: float, kind: str):  # noqa: D102
        vocab = student.shape[-1]
        s_rows, t_rows = student.reshape(-1, vocab), teacher.reshape(-1, vocab)
        labels, w_ce, w_div = labels.reshape(-1, 1), w_ce.reshape(-1, 1).float(), w_div.reshape(-1, 1).float()
        n = s_rows.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=student.device)
        div = torch.empty(n, dtype=torch.float32, device=student.device)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty(s_rows.shape, dtype=torch.float32, device=student.device) if want_grad else None
        inv_t = 1.0 / temperature
        step = chunk_rows(vocab, student.device)
        for i in range(0, n, step):
            j = min(n, i + step)
            z, u, y = s_rows[i:j].float(), t_rows[i:j].float(), labels[i:j]
            wc, wd = w_ce[i:j], w_div[i:j] * inv_t
            log_1 = torch.log_softmax(z, -1)
            ce[i:j] = -log_1.gather(1, y).squeeze(1)
            if temperature == 1.0:
                log_s, p_1w = log_1, None  # p_1 = p_s: the CE gradient reuses the KD pass's exp
            else:
                log_s = torch.log_softmax(z * inv_t, -1)
                p_1w = log_1.exp_().mul_(wc) if want_grad else None  # w_ce * p_1
                u = u * inv_t
            log_t = torch.log_softmax(u, -1)
            if kind == "kl":
                p_t = log_t.exp()
                div[i:j] = (p_t * log_t.sub_(log_s)).sum(-1)
                if not want_grad:
                    continue
                p_s = log_s.exp_()
                if p_1w is None:  # (w_ce + w_div) p_s - w_div p_t
                    g = p_s.mul_(wc + wd).sub_(p_t.mul_(wd))
                else:
                    g = p_s.sub_(p_t).mul_(wd).add_(p_1w)
            else:
                p_s = log_s.exp()
                if kind == "reverse_kl":
                    h = log_s.sub_(log_t)  # log p_s - log p_t
                    div[i:j] = (p_s * h).sum(-1)
                else:  # jsd
                    log_m = torch.logaddexp(log_s, log_t).sub_(math.log(2.0))
                    div[i:j] = 0.5 * ((log_t.exp() * (log_t - log_m)).sum(-1) + (p_s * (log_s - log_m)).sum(-1))
                    h = log_s.sub_(log_m).mul_(0.5)
                if not want_grad:
                    continue
                g = h.sub_((p_s * h).sum(-1, keepdim=True)).mul_(p_s).mul_(wd)
                g.add_(p_s.mul_(wc) if p_1w is None else p_1w)
            grad[i:j] = g.scatter_add_(1, y, -wc)  # - w_ce onehot(label)
        ctx.save_for_backward(grad)
        ctx.shape, ctx.dtype = student.shape, student.dtype
        loss = (w_ce.squeeze(1) * ce).sum() + (w_div.squeeze(1) * div).sum()
        ctx.mark_non_differentiable(ce, div)
        return loss, ce, div

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_div):  # noqa: D102
        (grad,) = ctx.saved_tensors
        # scale in fp32, then cast: the loss scale lifts the entries into fp16's range before they are rounded
        scaled = (grad * grad_loss.float()).to(ctx.dtype).view(ctx.shape)
        return scaled, None, None, None, None, None, None


def fused_kd_loss(student_logits: torch.Tensor, labels: torch.Tensor, w_ce: torch.Tensor, teacher_logits: torch.Tensor,
                  w_div: torch.Tensor, temperature: float, kind: str = "kl"):
    """(sum w_ce * CE + w_div * D, per-token CE, per-token D): the KD objective in one fused pass.

    Equal in value and in gradient to the same sum over `masked_cross_entropy`'s per-token terms and
    `divergence` (tests/test_kd.py), a fraction of the cost; only the student's logits get a gradient.
    """
    _check_kind(kind)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: teacher and student must share the vocabulary")
    loss, ce, div = _FusedKD.apply(student_logits, teacher_logits.detach(), labels, w_ce.detach(), w_div.detach(),
                                   float(temperature), kind)
    return loss, ce.view(labels.shape), div.view(labels.shape)


def kd_loss(student_logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None,
            teacher_logits: torch.Tensor | None, kd: KDSpec, beta: float) -> dict[str, torch.Tensor]:
    """The student's objective without the aux loss: {'loss', 'ce', 'kd'} (kd = the unweighted divergence)."""
    if teacher_logits is None or beta == 0:
        ce = masked_cross_entropy(student_logits, labels, loss_mask)
        return {"loss": kd.alpha * ce, "ce": ce, "kd": torch.zeros((), device=student_logits.device)}
    mask = torch.ones(labels.shape, device=labels.device) if loss_mask is None else loss_mask.float()
    per_token = mask / mask.sum().clamp_min(1.0)  # the mean over real tokens
    loss, ce, div = fused_kd_loss(student_logits, labels, kd.alpha * per_token, teacher_logits,
                                  beta * kd.temperature ** 2 * per_token, kd.temperature, kd.divergence)
    return {"loss": loss, "ce": (ce * per_token).sum(), "kd": (div * per_token).sum()}


def beta_at(step: int, kd: KDSpec, stop_step: int | None) -> float:
    """beta for a 0-indexed student step: kd.beta, ramped to 0 over decay_steps before stop_step, then 0."""
    if stop_step is None:
        return kd.beta
    if step >= stop_step:
        return 0.0
    if kd.decay_steps and step >= stop_step - kd.decay_steps:
        return kd.beta * (stop_step - step) / kd.decay_steps
    return kd.beta
