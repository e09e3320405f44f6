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

import torch
import torch.nn.functional as F

from pipeline.model import masked_cross_entropy
from pipeline.recipe import KDSpec


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
               kind: str = "kl") -> torch.Tensor:
    """Per-token divergence [B, T] between the temperature-softened distributions (computed in fp32).

    kl: forward KL(p_t || p_s) (the paper's); reverse_kl: KL(p_s || p_t); jsd: Jensen-Shannon.
    """
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # [B, T, V]
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    # F.kl_div(input, target) is sum target * (log target - input), fused (one pass, no temporaries)
    if kind == "kl":
        return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    if kind == "jsd":
        log_m = torch.logaddexp(log_s, log_t) - torch.log(torch.tensor(2.0))  # log of the mixture
        return 0.5 * (log_t.exp() * (log_t - log_m)).sum(-1) + 0.5 * (log_s.exp() * (log_s - log_m)).sum(-1)
    raise ValueError(f"kd.divergence = {kind!r}: one of 'kl', 'reverse_kl', 'jsd'")


def masked_mean(per_token: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    if loss_mask is None:
        return per_token.mean()
    mask = loss_mask.float()
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def kd_loss(student_logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None,
            teacher_logits: torch.Tensor | None, kd: KDSpec, beta: float) -> dict[str, torch.Tensor]:
    """The student's objective without the aux loss: {'loss', 'ce', 'kd'} (kd = the unweighted divergence)."""
    ce = masked_cross_entropy(student_logits, labels, loss_mask)
    if teacher_logits is None or beta == 0:
        soft = torch.zeros((), device=student_logits.device)
    else:
        soft = masked_mean(divergence(student_logits, teacher_logits, kd.temperature, kd.divergence), loss_mask)
    loss = kd.alpha * ce + beta * kd.temperature ** 2 * soft
    return {"loss": loss, "ce": ce, "kd": soft}


def beta_at(step: int, kd: KDSpec, stop_step: int | None) -> float:
    """beta for a 0-indexed student step: kd.beta, ramped to 0 over decay_steps before stop_step, then 0."""
    if stop_step is None:
        return kd.beta
    if step >= stop_step:
        return 0.0
    if kd.decay_steps and step >= stop_step - kd.decay_steps:
        return kd.beta * (stop_step - step) / kd.decay_steps
    return kd.beta
