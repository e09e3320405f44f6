"""The DeepSpeed training loop shared by the teacher and the student stages.

One function, `train_model`: `deepspeed.initialize` with MoE parameter groups, the recipe's
precision and ZeRO stage; warmup + cosine learning rate; gradient clipping and accumulation;
the MoE aux loss; a progress bar with loss, lr and tokens/s; `metrics.jsonl`; periodic held-out
validation; DeepSpeed checkpoints (per-expert files) every N steps that resume exactly (optimizer,
scheduler, data position, RNG); consolidated safetensors weights at the end.

A stage passes `step_fn` to change what a micro-batch computes (the student's KD loss does).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from pipeline.data import PackedTokens, global_sample_ids
from pipeline.dist import Ranks, all_reduce_, barrier, rng_state, set_rng_state
from pipeline.artifacts import atomic_write_text
from pipeline.model import GPT
from pipeline.monitor import deepspeed_sections, write_record
from pipeline.recipe import MonitorSpec, TrainSpec
from pipeline.runs import RunDir

CHECKPOINTS = "checkpoints"


def _clock() -> float:
    """time.perf_counter() once the accelerator's queued work is done (on a GPU the host runs ahead of the device:
    a window timed without the sync counts launches, not steps). Read once per logged window, not per step."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()
    return time.perf_counter()


def deepspeed_config(train: TrainSpec, world: int, monitors: dict | None = None) -> dict:
    """The DeepSpeed JSON, generated from the recipe (never templated by hand); `monitors`: the recipe's
    monitor section as DeepSpeed's entries (pipeline.monitor.deepspeed_sections)."""
    return {**(monitors or {}),
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.global_batch_size // (train.micro_batch_size * world),
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": train.precision == "bf16"},
        # bf16 (ZeRO 1-2, as the recipe checks): gradients accumulated over the micro-steps and reduced between the
        # ranks in fp32 (DeepSpeed's BF16 optimizer at stage 1, ZeRO's separate accumulation buffer at 2), not in bf16
        **({"data_types": {"grad_accum_dtype": "fp32"}} if train.precision == "bf16" else {}),
        # loss_scale 0: dynamic loss scaling, as the paper's fp16 runs
        "fp16": {"enabled": train.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 1 << 30,  # our progress bar and metrics.jsonl report instead
        "wall_clock_breakdown": False,
    }


def lr_lambda(train: TrainSpec) -> Callable[[int], float]:
    """Multiplier of `train.lr` at a step: linear warmup, then cosine down to `min_lr` at the last step."""
    floor = train.min_lr / train.lr

    def f(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def param_groups(model: GPT, weight_decay: float) -> list[dict]:
    """Decay matrices only (not biases or LayerNorm), then split experts into their own groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def make_optimizer(model: GPT, train: TrainSpec) -> torch.optim.Optimizer:
    """AdamW over `param_groups`: in fp16 and bf16 DeepSpeed's ZeRO optimizer wraps it (the recipe asks for ZeRO 1-2
    there), which scales the loss, accumulates as `deepspeed_config` says and clips by the norm of every gradient,
    the experts' summed over the expert-parallel group; in fp32 it is the optimizer."""
    return torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, betas=tuple(train.betas),
                             eps=train.eps)


def make_engine(model: GPT, train: TrainSpec, world: int, monitors: dict | None = None):
    """`deepspeed.initialize` of `model` for the recipe's training section: (engine, scheduler)."""
    import deepspeed

    optimizer = make_optimizer(model, train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(train, world, monitors))
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        # fp32 without ZeRO: the engine clips through this method (DeepSpeed's `clip_grad_norm_`, which averages the
        # ranks' norms, each with its own experts in); ZeRO's optimizers clip by the norm of every gradient, each
        # expert once, and so does this
        engine.clip_fp32_gradients = lambda: clip_grad_norm_with_experts_(engine.module.parameters(),
                                                                          engine.gradient_clipping())
    return engine, scheduler


def clip_grad_norm_with_experts_(parameters, max_norm: float) -> torch.Tensor:
    """Scale every gradient by max_norm / (norm + 1e-6) where that is below 1, the norm taken over every gradient of
    the model once (collective): the shared parameters' (the same on every rank after DeepSpeed's all-reduce) and
    each expert's, summed over its expert-parallel group (an expert's replicas hold the same gradient). Returns the
    norm (fp32), as DeepSpeed's `clip_grad_norm_` does."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    params = [p for p in parameters if p.grad is not None]
    shared = torch.zeros((), dtype=torch.float64, device=params[0].grad.device if params else None)
    experts: dict[str, torch.Tensor] = {}
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if is_moe_param(p):
            experts[p.group_name] = experts.get(p.group_name, 0) + sq
        else:
            shared += sq
    total = shared
    for name in sorted(experts):  # the same groups in the same order on every rank
        total = total + all_reduce_(experts[name], group=groups._get_expert_parallel_group(name))
    norm = total.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm


def keep_fp32_masters(engine, model: GPT) -> None:
    """In fp16 and bf16, put the optimizer's fp32 master weights (what the optimizer updated) into `model`, in fp32:
    the weights a stage publishes are then the trained ones, not their fp16/bf16 roundings (the MoE gates included).
    DeepSpeed's `safe_get_full_fp32_param` assembles each from the ranks' ZeRO partitions (an expert's from its
    expert-data-parallel group). Collective; in fp32 nothing to do."""
    from deepspeed.utils import safe_get_full_fp32_param

    if not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return
    masters = [safe_get_full_fp32_param(p) for p in model.parameters()]  # the same order on every rank
    missing = [n for (n, _), m in zip(model.named_parameters(), masters) if m is None]
    if missing:
        raise RuntimeError(f"DeepSpeed kept no fp32 master for {missing[0]} (and {len(missing) - 1} more)")
    model.float()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters):
            p.copy_(m.view_as(p))


def lm_step(engine, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The teacher's micro-batch: LM cross-entropy + MoE aux loss."""
    out = engine(batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    return out.loss, {"lm_loss": out.lm_loss.detach(), "aux_loss": out.aux_loss.detach()}


@torch.no_grad()
def evaluate(model: GPT, val: PackedTokens, batches: int | None, micro: int, ranks: Ranks) -> float:
    """Mean held-out loss per real token over the first `batches` x `micro` blocks (None: all of them).

    The blocks are the same whatever the world size: rank r takes batches r, r+world, ...
    Every rank runs the same number of forwards, since the expert all-to-all needs all of them;
    a rank with no batch left repeats one and does not count it.
    """
    was_training = model.training
    model.eval()  # no token dropping, no dropout
    device = next(model.parameters()).device
    blocks = val.num_blocks if batches is None else batches * micro
    batches = -(-blocks // micro)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(-(-batches // ranks.world)):
        b = i * ranks.world + ranks.rank
        first = b * micro if b < batches else 0
        ids = [(first + j) % val.num_blocks for j in range(micro)]
        batch = {k: v.to(device) for k, v in val.batch(ids).items()}
        # count each block once: a short last batch is padded, a spare rank's batch not counted at all
        weight = torch.tensor([1.0 if b < batches and first + j < blocks else 0.0 for j in range(micro)], device=device)
        mask = batch["loss_mask"] * weight[:, None]
        out = model(batch["input_ids"], labels=batch["labels"], loss_mask=mask)
        n = mask.sum()
        total += torch.stack([out.lm_loss.double() * n, n.double()])
    model.train(was_training)
    total = all_reduce_(total)
    return (total[0] / total[1]).item()


def _rng_path(ckpt_dir: Path, tag: str, rank: int) -> Path:
    return ckpt_dir / tag / f"rng_rank{rank}.pt"


def _prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    tags = sorted((d for d in ckpt_dir.glob("global_step*") if d.is_dir()),
                  key=lambda d: int(d.name.removeprefix("global_step")))
    for d in tags[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def train_model(model: GPT, train: TrainSpec, train_data: PackedTokens, val_data: PackedTokens,
                run: RunDir, stage: str, work_dir: Path, seed: int, ranks: Ranks,
                step_fn=lm_step, val_extra: dict | None = None, monitor: MonitorSpec | None = None,
                job: str | None = None) -> dict:
    """Train `model` in place (resuming from `work_dir/checkpoints` if present). Returns a summary.

    `step_fn(engine, batch, step) -> (loss, {name: scalar tensor})` computes one micro-batch; the
    named values are averaged into metrics.jsonl. `val_extra` is logged next to each validation loss.
    `monitor` (the recipe's section) also sends every record to DeepSpeed's monitors, as job `job`.
    """
    ckpt_dir = work_dir / CHECKPOINTS
    engine, scheduler = make_engine(model, train, ranks.world, deepspeed_sections(monitor, run.root, job or stage))

    start = 0
    if (ckpt_dir / "latest").is_file():
        _, client = engine.load_checkpoint(str(ckpt_dir))
        start = int(client["step"])
        tag = (ckpt_dir / "latest").read_text().strip()
        set_rng_state(torch.load(_rng_path(ckpt_dir, tag, ranks.rank), weights_only=True))
        if ranks.rank == 0:
            run.truncate_metrics(stage, after_step=start)
            print(f"[{stage}] resumed from {ckpt_dir / tag} at step {start}", flush=True)
    else:
        torch.manual_seed(seed)  # dropout and the gate's random token selection

    micro, world = train.micro_batch_size, ranks.world
    accum = train.global_batch_size // (micro * world)
    tokens_per_step = train.global_batch_size * train_data.seq_len
    bar = tqdm(total=train.steps, initial=start, desc=stage, unit="step", disable=ranks.rank != 0,
               dynamic_ncols=True)
    sums: dict[str, torch.Tensor] = {}
    window_start, window_steps, t0 = _clock(), 0, time.perf_counter()
    val_loss = None
    engine.train()
    for step in range(start, train.steps):
        lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
        ids = global_sample_ids(train_data.num_blocks, seed, step * train.global_batch_size, train.global_batch_size)
        for m in range(accum):
            first = (m * world + ranks.rank) * micro
            batch = {k: v.to(engine.device) for k, v in train_data.batch(ids[first:first + micro]).items()}
            loss, parts = step_fn(engine, batch, step)
            engine.backward(loss)
            engine.step()
            for k, v in {"loss": loss.detach(), **parts}.items():
                sums[k] = sums.get(k, 0) + v.float() / accum
        window_steps += 1
        done = step + 1
        if done % train.log_every == 0 or done == train.steps:
            names = sorted(sums)
            values = all_reduce_(torch.stack([sums[k] for k in names]).double()) / (world * window_steps)
            elapsed = _clock() - window_start
            record = {"stage": stage, "step": done, "tokens": done * tokens_per_step,
                      **{k: round(v, 5) for k, v in zip(names, values.tolist())},
                      "lr": lr, "tokens_per_s": round(tokens_per_step * window_steps / elapsed, 1)}
            if engine.fp16_enabled():  # the dynamic loss scale and the updates it skipped (overflow) so far
                record.update(loss_scale=engine.optimizer.loss_scale, skipped_steps=int(engine.skipped_steps))
            if ranks.rank == 0:
                run.log(record)
                write_record(engine, record, f"Train/{stage}")
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
            sums, window_steps = {}, 0
        if done % train.eval_every == 0 or done == train.steps:
            val_loss = evaluate(engine.module, val_data, train.eval_batches, micro, ranks)
            if ranks.rank == 0:
                record = {"stage": stage, "step": done, "tokens": done * tokens_per_step, "val_loss": round(val_loss, 5),
                          **(val_extra or {})}
                run.log(record)
                write_record(engine, record, f"Val/{stage}")
                extra = "".join(f", {k} {v:.4f}" for k, v in (val_extra or {}).items())
                bar.write(f"[{stage}] step {done}: validation loss {val_loss:.4f}{extra}")
        if done % train.checkpoint_every == 0 or done == train.steps:  # the last step's too: its fp32 masters and
            # optimizer state, which the published weights do not carry, and a kill while publishing resumes here
            tag = f"global_step{done}"
            _rng_path(ckpt_dir, tag, ranks.rank).parent.mkdir(parents=True, exist_ok=True)
            torch.save(rng_state(), _rng_path(ckpt_dir, tag, ranks.rank))
            engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": done}, save_latest=False)
            barrier()
            if ranks.rank == 0:
                # `latest` names a checkpoint only once every rank has written all of it, and is
                # replaced atomically: a kill at any moment leaves a resumable directory
                atomic_write_text(ckpt_dir / "latest", tag)
                _prune_checkpoints(ckpt_dir, train.checkpoint_keep)
        if window_steps == 0:  # a new tokens/s window starts after this step's logging, eval and checkpoint
            window_start = _clock()
        bar.update(1)
    bar.close()
    if val_loss is None:  # resumed at the very end: report the held-out loss anyway
        val_loss = evaluate(engine.module, val_data, train.eval_batches, micro, ranks)
    keep_fp32_masters(engine, model)
    # skipped_steps: optimizer steps DeepSpeed's fp16 loss scaler skipped on overflow (kept in its checkpoints, so
    # a resumed run counts them all); 0 in fp32 and bf16
    return {"steps": train.steps, "resumed_from_step": start, "val_loss": val_loss,
            "skipped_steps": int(engine.skipped_steps), "tokens_per_step": tokens_per_step,
            "train_seconds": round(time.perf_counter() - t0, 2)}
