"""The fused KD loss's gradient in fp16 and bf16 against fp32 autograd, at the paper's vocabulary, with the loss
scale applied as DeepSpeed's fp16 optimizer applies it ((loss * scale).backward(), then grads / scale).

    .venv/bin/python benchmarks/kd_precision.py                    # V = 50,304, 2 x 512 tokens, scale 2^16 for fp16
    .venv/bin/python benchmarks/kd_precision.py --tokens 4096      # the paper's 2 x 2048-token micro-batch
    python benchmarks/kd_precision.py --device cuda --tokens 4096 --json kd.json   # on a GPU (benchmarks/gpu_check.py)

Side by side in one run, for kl, reverse_kl and jsd:
  * `fused now`: distill/kd.py as it is (the gradient kept in fp32, scaled, then cast to the student's dtype);
  * `before`: the same closed-form gradient rounded to the student's dtype first and then multiplied by the
    loss scale in that dtype, which is what distill/kd.py did before (`grad` stored `empty_like(student)`,
    backward `grad * grad_loss.to(grad.dtype)`);
and for each: the relative L1 error against fp32 autograd of the definition, and the share of the fp32
gradient's nonzero entries that came out zero. Target (tests/test_kd.py): relative L1 < 1e-2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distill.kd import divergence, kd_loss  # noqa: E402
from pipeline.model import masked_cross_entropy  # noqa: E402
from pipeline.recipe import KDSpec  # noqa: E402


def measure(kind: str, dtype: torch.dtype, scale: float, vocab: int, tokens: int, seed: int = 0,
            device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same logits whatever the device
    shape = (2, tokens // 2)
    s = (torch.randn(*shape, vocab, generator=g) * 2).to(device=device, dtype=dtype).requires_grad_(True)
    t = (torch.randn(*shape, vocab, generator=g) * 2).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, shape, generator=g).to(device)
    mask = (torch.rand(shape, generator=g) > 0.1).float().to(device)
    kd = KDSpec(alpha=1.0, beta=1.0, temperature=1.0, divergence=kind)
    (kd_loss(s, labels, mask, t, kd, beta=1.0)["loss"] * scale).backward()
    now = s.grad.float() / scale
    # fp32 autograd of the definition: the reference, and the closed form before any rounding
    s32 = s.detach().float().requires_grad_(True)
    ce = masked_cross_entropy(s32, labels, mask)
    soft = (divergence(s32, t.float(), 1.0, kind) * mask).sum() / mask.sum()
    (ce + soft).backward()
    ref = s32.grad
    before = (ref.to(dtype) * torch.tensor(scale, device=ref.device).to(dtype)).float() / scale
    out = {}
    for name, got in (("now", now), ("before", before)):
        finite = torch.isfinite(got)
        err = float(((got - ref).abs() * finite).sum() / ref.abs().sum()) if finite.all() else float("inf")
        out[name] = {"rel_l1": err, "flushed": float(((got == 0) & (ref != 0)).float().mean()),
                     "nonfinite": float((~finite).float().mean())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="where the logits and both gradients are computed (cpu, cuda)")
    p.add_argument("--json", type=Path, default=None, help="also write every case's numbers here")
    args = p.parse_args(argv)
    print(f"V = {args.vocab}, {args.tokens} tokens (per-token weight {1 / (0.9 * args.tokens):.1e}) on {args.device}")
    print(f"{'dtype':>9} {'scale':>7} {'kind':>11} | {'before: rel L1':>15} {'flushed':>8} {'inf/nan':>8} | "
          f"{'now: rel L1':>12} {'flushed':>8}")
    worst, cases = 0.0, []
    for dtype, scale in ((torch.float16, 2.0 ** 16), (torch.float16, 2.0 ** 8), (torch.bfloat16, 1.0)):
        for kind in ("kl", "reverse_kl", "jsd"):
            r = measure(kind, dtype, scale, args.vocab, args.tokens, device=args.device)
            b, n = r["before"], r["now"]
            worst = max(worst, n["rel_l1"])
            cases.append({"dtype": str(dtype).removeprefix("torch."), "scale": scale, "kind": kind, **r})
            print(f"{str(dtype).removeprefix('torch.'):>9} {scale:>7g} {kind:>11} | {b['rel_l1']:>15.3e} "
                  f"{b['flushed']:>8.1%} {b['nonfinite']:>8.1%} | {n['rel_l1']:>12.3e} {n['flushed']:>8.1%}")
    print(f"target: rel L1 < 1e-2 now; worst {worst:.3e}")
    if args.json is not None:
        result = {"vocab": args.vocab, "tokens": args.tokens, "device": args.device, "target_rel_l1": 1e-2,
                  "worst_rel_l1": worst, "cases": cases}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
