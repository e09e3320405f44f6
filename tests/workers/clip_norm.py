"""Worker for tests/test_precision.py and benchmarks/gpu_check.py: the gradient norm DeepSpeed clips by, for every
precision and ZeRO stage the project generates, on the same fp32 gradients.

    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank tests/workers/clip_norm.py OUT.json   # EP 2
    python tests/workers/clip_norm.py OUT.json [fused-adam]                                                # 1 rank

Each case builds the tiny test model (expert parallel over the ranks) and its engine exactly as training does
(`pipeline.train.make_engine`), then backpropagates, through the engine's forward (where DeepSpeed hooks its loss
scaling), a loss whose gradient is known exactly in fp32, bf16 and fp16: sum(p * c) for every parameter p, with
c = 2^-6 for the shared parameters and (1 + rank) / 16 for this rank's experts, which DeepSpeed then divides by the
data-parallel world size W. So the norm with the experts is sqrt(N + (E_0 + E_1) / W^2) and the norm without them
sqrt(N), computed here in fp64 from the parameters' sizes. Rank 0 writes each case's norm as the engine's optimizer
reports it (fp32 without ZeRO: what the engine's `clip_fp32_gradients` returns, `pipeline.train.make_engine`'s), every rank's, the loss
scale and both references to OUT.json.
"""

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline import dist  # noqa: E402
from pipeline.build import build_model  # noqa: E402
from pipeline.model import ModelConfig  # noqa: E402
from pipeline.recipe import TrainSpec  # noqa: E402
from pipeline.train import make_engine, param_groups  # noqa: E402

SHARED, EXPERT = 2.0 ** -6, 1 / 16
# the project's combinations (the recipe refuses fp16 and bf16 without ZeRO), then fp16 without ZeRO as DeepSpeed builds
# it for torch's AdamW, what the project passed before (FP16_UnfusedOptimizer); `fused-adam` (FP16_Optimizer, its
# FusedAdam: a C++ build of about a minute on a CPU) runs when named on the command line
CASES = [("fp32", 0, "project"), ("fp32", 1, "project"), ("fp32", 2, "project"), ("bf16", 1, "project"),
         ("bf16", 2, "project"), ("fp16", 1, "project"), ("fp16", 2, "project"), ("fp16", 0, "torch-adamw")]


class KnownGradient(torch.nn.Module):
    """The model, whose forward is sum(p * c) over its parameters: every gradient known exactly in any precision."""

    def __init__(self, gpt, rank: int):
        super().__init__()
        self.gpt, self.rank = gpt, rank

    def forward(self, x):
        from deepspeed.moe.utils import is_moe_param

        return sum((p.float() * ((1 + self.rank) * EXPERT if is_moe_param(p) else SHARED)).sum()
                   for p in self.parameters()) + x.sum() * 0


def run_case(ranks, precision: str, stage: int, optimizer: str) -> dict:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.moe.utils import is_moe_param

    cfg = ModelConfig(vocab_size=256, seq_len=32, layers=4, hidden=32, heads=4, experts=(2, 4), moe_layers=(1, 3),
                      mlp_type="residual", top_k=1, capacity_factor=1.0, eval_capacity_factor=None, min_capacity=4,
                      aux_loss_coef=0.01, ffn_mult=4, dropout=0.0, tie_embeddings=True, init_std=0.02)
    torch.manual_seed(0)
    model = build_model(cfg, ranks.world, groups=False)
    train = TrainSpec(steps=1, micro_batch_size=1, global_batch_size=ranks.world, lr=1e-3, grad_clip=1.0,
                      precision=precision, zero_stage=stage)
    model = KnownGradient(model, ranks.rank)
    if optimizer != "project":
        import deepspeed
        from deepspeed.ops.adam import FusedAdam

        from pipeline.train import deepspeed_config

        kind = torch.optim.AdamW if optimizer == "torch-adamw" else FusedAdam
        opt = kind(param_groups(model, train.weight_decay), lr=train.lr)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(train, ranks.world))
    else:
        engine, _ = make_engine(model, train, ranks.world)
    # DeepSpeed divides an expert's gradient by the data-parallel world size (through the all-to-all its tokens come
    # from every rank); this loss reaches a rank's experts from that rank alone, so their gradients are c / world
    shared = sum(p.numel() for p in engine.module.parameters() if not is_moe_param(p)) * SHARED ** 2
    expert = sum(p.numel() for p in engine.module.parameters() if is_moe_param(p)) * \
        ((1 + ranks.rank) * EXPERT / ranks.world) ** 2
    experts_all = dist.all_reduce_(torch.tensor([expert], dtype=torch.float64, device=dist.device())).item()
    engine.backward(engine(torch.zeros(1, device=engine.device)))
    clipped = []
    if precision == "fp32" and stage == 0:  # the engine clips through this method and keeps no norm: record it
        clip = engine.clip_fp32_gradients
        engine.clip_fp32_gradients = lambda: clipped.append(float(clip())) or clipped[-1]
    engine.step()
    reported = clipped[0] if clipped else float(engine.get_global_grad_norm())
    norms = dist.gather_numbers([reported])
    get_accelerator().empty_cache()
    return {"precision": precision, "zero_stage": stage, "optimizer": optimizer,
            "wrapper": type(engine.optimizer).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
            "loss_scale": getattr(engine.optimizer, "loss_scale", None), "norm": reported, "norm_per_rank": [n[0] for n in norms],
            "with_experts": math.sqrt(shared + experts_all), "without_experts": math.sqrt(shared),
            "mean_of_rank_norms": sum(math.sqrt(shared + e[0]) for e in dist.gather_numbers([expert])) / ranks.world}


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    ranks = dist.init()
    fp16 = get_accelerator().is_fp16_supported()
    results = {"world": ranks.world, "device": get_accelerator().device_name(), "fp16_supported": bool(fp16),
               "cases": []}
    for precision, stage, optimizer in CASES + ([("fp16", 0, "fused-adam")] if "fused-adam" in sys.argv[2:] else []):
        if precision == "fp16" and not fp16:
            continue
        results["cases"].append(run_case(ranks, precision, stage, optimizer))
    if ranks.rank == 0:
        out = Path(sys.argv[1])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
