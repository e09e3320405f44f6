"""The student stage: a Mixture-of-Students distilled from the run's teacher into `runs/<name>/student/`.

    moe-pipeline distill recipes/tiny.yaml             # teacher stage (skipped when done), then this
    moe-pipeline distill recipes/tiny.yaml --nproc 2   # both expert parallel over 2 ranks

The student keeps `student.layers` of the teacher's layers (`student.layer_selection`), starts from
their weights or from scratch (`student.init`), and trains with the shared DeepSpeed loop on
alpha*CE + beta(step)*T^2*KD + aux. The frozen teacher runs on the same ranks with its own expert
parallelism, in eval mode (no token dropping), without gradients, and not at all once beta is 0.
The finished directory holds what the teacher's does plus `selection.json` (kept layers, scores).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from distill.kd import beta_at, kd_loss
from distill.student import (block_importance, expert_scores, init_from_teacher, select_experts, select_layers,
                             student_config)
from pipeline import data as data_lib
from pipeline import dist
from pipeline.dist import Ranks, barrier
from pipeline.artifacts import CONFIG, DTYPES, TOKENIZER, atomic_write_text
from pipeline.model import GPT, init_weights
from pipeline.recipe import Recipe, RecipeError
from pipeline.build import build_model, expert_parallel_degrees, load_frozen, meta_counts
from pipeline.runs import RunDir
from pipeline.teacher import STAGE as TEACHER, prepare
from pipeline.train import evaluate, train_model
from pipeline.weights import ep_rank_of, save_weights

STAGE = "student"
SELECTION = "selection.json"


def load_teacher(teacher_dir: Path, recipe: Recipe, ranks: Ranks) -> GPT:
    """The frozen teacher, expert parallel like the student, on this rank's device, in eval mode."""
    dtype = DTYPES[recipe.student.train.precision]
    return load_frozen(teacher_dir, ranks.world, recipe.distributed.ep_size, dist.device(), dtype)


def calibration_batches(recipe: Recipe, train: data_lib.PackedTokens, ranks: Ranks):
    """`student.calibration_batches` micro-batches: the first blocks of the training split's order, different
    on each rank."""
    s = recipe.student
    micro = s.train.micro_batch_size
    first = ranks.rank * s.calibration_batches * micro
    return (train.batch([(first + b * micro + i) % train.num_blocks for i in range(micro)])
            for b in range(s.calibration_batches))


def choose_layers(recipe: Recipe, teacher: GPT, train: data_lib.PackedTokens, ranks: Ranks) -> dict:
    """Which teacher layers the student keeps (and, for `importance`, every block's score), and in the MoE
    layers `student.experts` prunes, which experts (with every expert's score)."""
    s = recipe.student
    scores = None
    if s.layer_selection == "importance":
        scores = block_importance(teacher, calibration_batches(recipe, train, ranks))
    moe_count = recipe.moe_layer_count(s.layers)
    kept = select_layers(teacher.cfg, s.layers, moe_count, s.layer_selection, scores)
    full = student_config(teacher.cfg, kept)
    cfg = student_config(teacher.cfg, kept, s.experts)  # refuses more experts than a kept layer has
    selection = {"method": s.layer_selection, "kept_teacher_layers": kept, "scores": scores,
                 "moe_layers": list(cfg.moe_layers), "experts": list(cfg.experts)}
    pruned = [kept[p] for p, e, f in zip(cfg.moe_layers, cfg.experts, full.experts) if e < f]
    if pruned:
        ranking = expert_scores(teacher, calibration_batches(recipe, train, ranks), s.expert_selection)
        keep = {kept[p]: e for p, e in zip(cfg.moe_layers, cfg.experts)}
        selection.update(expert_selection=s.expert_selection,
                         expert_scores={str(t): ranking[t] for t in pruned},
                         kept_experts={str(t): select_experts(ranking[t], keep[t]) for t in pruned})
    return selection


def kept_experts(selection: dict) -> dict[int, list[int]]:
    """selection.json's kept experts per pruned teacher layer (JSON keys are strings)."""
    return {int(t): ids for t, ids in selection.get("kept_experts", {}).items()}


def make_kd_step(teacher: GPT, recipe: Recipe):
    """The student's micro-batch: the teacher's logits (only while beta > 0), then the KD objective."""
    kd, stop = recipe.kd, recipe.kd_stop_step()

    def kd_step(engine, batch: dict[str, torch.Tensor], step: int):
        beta = beta_at(step, kd, stop)
        teacher_logits = None
        if beta > 0:
            with torch.no_grad():
                teacher_logits = teacher(batch["input_ids"]).logits
        out = engine(batch["input_ids"])
        parts = kd_loss(out.logits, batch["labels"], batch["loss_mask"], teacher_logits, kd, beta)
        loss = parts["loss"] + out.aux_loss
        return loss, {"lm_loss": parts["ce"].detach(), "kd_loss": parts["kd"].detach(),
                      "aux_loss": out.aux_loss.detach(), "beta": torch.tensor(float(beta), device=loss.device)}

    return kd_step


def run_student(recipe: Recipe, run: RunDir, ranks: Ranks, redo: bool = False) -> Path:
    """Distill the student from the finished teacher stage. Collective over all ranks."""
    t0 = time.time()
    teacher_dir = run.stage(TEACHER)
    if not run.done(TEACHER):
        raise FileNotFoundError(f"{teacher_dir}/DONE.json is missing: run `moe-pipeline teacher` (or distill) first")
    if run.skip(STAGE, ranks, redo, "distill again"):
        return run.stage(STAGE)
    prepared = prepare(recipe, ranks)
    if data_lib.load_tokenizer(teacher_dir / TOKENIZER).get_vocab() != prepared.tokenizer.get_vocab():
        raise RecipeError("data.tokenizer", recipe.data.tokenizer, f"the teacher's tokenizer ({teacher_dir / TOKENIZER}):"
                          " teacher and student must share one vocabulary")
    work = run.open(STAGE, ranks, redo)
    train = data_lib.PackedTokens(prepared.train, recipe.data.seq_len, prepared.eod_id)
    val = data_lib.PackedTokens(prepared.val, recipe.data.seq_len, prepared.eod_id)

    teacher = load_teacher(teacher_dir, recipe, ranks)
    if (work / SELECTION).is_file():  # a resumed stage keeps the layers it chose
        selection = json.loads((work / SELECTION).read_text())
    else:
        selection = choose_layers(recipe, teacher, train, ranks)
        if ranks.rank == 0:
            atomic_write_text(work / SELECTION, json.dumps(selection, indent=1))
    kept = selection["kept_teacher_layers"]
    cfg = student_config(teacher.cfg, kept, selection["experts"])
    student = build_model(cfg, ranks.world, recipe.distributed.ep_size, groups=False)  # deepspeed.initialize makes them
    if recipe.student.init == "teacher":
        init_from_teacher(student, teacher_dir, kept, kept_experts(selection))
    else:
        init_weights(student, recipe.seed + 1, ep_rank_of)  # +1: not the teacher's own initial weights

    train_spec = recipe.student.train
    teacher_val = evaluate(teacher, val, train_spec.eval_batches, train_spec.micro_batch_size, ranks)
    summary = train_model(student, train_spec, train, val, run, STAGE, work, recipe.seed, ranks,
                          step_fn=make_kd_step(teacher, recipe), val_extra={"teacher_val_loss": round(teacher_val, 5)},
                          monitor=recipe.monitor, job=f"{recipe.name}-{STAGE}")
    save_weights(student, work, {"stage": STAGE, "recipe": recipe.name})
    if ranks.rank == 0:
        atomic_write_text(work / CONFIG, json.dumps(cfg.to_dict(), indent=1))
        if (work / TOKENIZER).exists():
            shutil.rmtree(work / TOKENIZER)
        shutil.copytree(teacher_dir / TOKENIZER, work / TOKENIZER)
        info = {"inputs": {"recipe_sha256": run.recipe_sha256(), "data_cache": prepared.cache_dir.name,
                           "teacher": str(teacher_dir.resolve())},
                **summary, "teacher_val_loss": teacher_val, "kd_stop_step": recipe.kd_stop_step(),
                "kept_teacher_layers": kept, "params": meta_counts(cfg), "teacher_params": meta_counts(teacher.cfg),
                "world_size": ranks.world, "expert_parallel": expert_parallel_degrees(student),
                "wall_seconds": round(time.time() - t0, 1)}
        run.finish(STAGE, info)
        print(f"[student] done in {info['wall_seconds']:.0f}s: validation loss {summary['val_loss']:.4f} "
              f"(teacher {teacher_val:.4f}), kept teacher layers {kept} -> {run.stage(STAGE)}", flush=True)
    barrier()
    return run.stage(STAGE)
