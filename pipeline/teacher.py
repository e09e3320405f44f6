"""The teacher stage: train the recipe's PR-MoE teacher (or load an existing one) into `runs/<name>/teacher/`.

    moe-pipeline teacher recipes/tiny.yaml             # 1 rank
    moe-pipeline teacher recipes/tiny.yaml --nproc 2   # 2 ranks, expert parallel, via the DeepSpeed launcher

The finished directory describes itself: `config.json` (the model), `model.safetensors` (global
expert ids), `tokenizer/`, `checkpoints/` (DeepSpeed's, resumable) and `DONE.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from pipeline import data as data_lib
from pipeline import dist
from pipeline.dist import Ranks, barrier
from pipeline.model import GPT, ModelConfig, init_weights, param_counts
from pipeline.recipe import Recipe, RecipeError
from pipeline.files import atomic_write_text
from pipeline.runs import RunDir
from pipeline.train import evaluate, train_model
from pipeline.weights import WEIGHTS, INDEX, ep_rank_of, load_weights, save_weights

STAGE = "teacher"
CONFIG = "config.json"
TOKENIZER = "tokenizer"


def cache_root() -> Path:
    return Path(os.environ.get("MOE_PIPELINE_CACHE", Path.home() / ".cache" / "moe-pipeline"))


def model_config(recipe: Recipe) -> ModelConfig:
    """The teacher's ModelConfig: MoE on layers moe_every, 2*moe_every, ... (1-indexed). A student's comes
    from the teacher's and the layers it keeps (distill.student.student_config)."""
    m = recipe.model
    return ModelConfig(vocab_size=recipe.vocab_size(), seq_len=recipe.data.seq_len,
                       layers=m.layers, hidden=m.hidden, heads=m.heads, experts=tuple(m.experts),
                       moe_layers=tuple(range(m.moe_every - 1, m.layers, m.moe_every)),
                       mlp_type=m.mlp_type,
                       top_k=m.top_k, capacity_factor=m.capacity_factor,
                       eval_capacity_factor=m.eval_capacity_factor, min_capacity=m.min_capacity,
                       aux_loss_coef=m.aux_loss_coef, ffn_mult=m.ffn_mult, dropout=m.dropout,
                       tie_embeddings=m.tie_embeddings, init_std=m.init_std)


def read_model_config(stage_dir: Path) -> ModelConfig:
    path = Path(stage_dir) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: make it with `moe-pipeline teacher RECIPE`")
    return ModelConfig(**json.loads(path.read_text()))


def prepare(recipe: Recipe, ranks: Ranks) -> data_lib.PreparedData:
    """Tokenize once (local rank 0 builds the cache, the others then read it)."""
    try:
        if ranks.local_rank == 0:
            prepared = data_lib.prepare_data(recipe.data, cache_root())
        barrier()
        if ranks.local_rank != 0:
            prepared = data_lib.prepare_data(recipe.data, cache_root())
    except ValueError as err:  # data errors name their recipe key
        raise RecipeError.from_message(str(err)) from None
    if prepared.vocab_size > recipe.vocab_size():
        raise RecipeError("data.vocab_size", prepared.vocab_size,
                          f"<= the model's vocabulary ({recipe.vocab_size()})")
    return prepared


def write_stage_files(work: Path, cfg: ModelConfig, prepared: data_lib.PreparedData) -> None:
    atomic_write_text(work / CONFIG, json.dumps(cfg.to_dict(), indent=1))
    if (work / TOKENIZER).exists():
        shutil.rmtree(work / TOKENIZER)
    data_lib.save_tokenizer(prepared.tokenizer, work / TOKENIZER)


# the fields that make two models the same network (the rest are training settings)
ARCHITECTURE = ("vocab_size", "seq_len", "layers", "hidden", "heads", "experts", "moe_layers", "mlp_type", "top_k",
                "ffn_mult", "tie_embeddings")


def check_loadable(recipe: Recipe, src: Path) -> ModelConfig:
    """The config of `teacher.load`, if it is the network the recipe describes; else a RecipeError."""
    try:
        loaded = read_model_config(src)
    except FileNotFoundError:
        raise RecipeError("teacher.load", str(src), "a teacher directory with config.json, model.safetensors and "
                          "tokenizer/ (one made by `moe-pipeline teacher`)") from None
    want = model_config(recipe)
    diff = [f"{k} {getattr(loaded, k)} (recipe: {getattr(want, k)})" for k in ARCHITECTURE
            if getattr(loaded, k) != getattr(want, k)]
    if diff:
        raise RecipeError("teacher.load", str(src), "a teacher matching the recipe's model and data; it differs in "
                          + ", ".join(diff) + ": set model.* / data.* to the teacher's values")
    return loaded


def check_hardware(recipe: Recipe) -> None:
    import torch

    for name, train in (("teacher.train", recipe.teacher.train), ("student.train", recipe.student.train)):
        if train.precision == "fp16" and not torch.cuda.is_available():
            raise RecipeError(f"{name}.precision", "fp16", "bf16 or fp32 on a machine without GPUs "
                              "(DeepSpeed's fp16 loss scaling is for GPUs), e.g. --set " + f"{name}.precision=bf16")


def run_teacher(recipe: Recipe, run: RunDir, ranks: Ranks, redo: bool = False) -> Path:
    """Train (or load) the teacher; returns the finished stage directory. Collective over all ranks."""
    t0 = time.time()
    run.check_recipe(recipe, redo)
    if run.done(STAGE) and not redo:
        if ranks.rank == 0:
            print(f"[teacher] already done: {run.stage(STAGE)} (pass --redo to train again)", flush=True)
        return run.stage(STAGE)
    check_hardware(recipe)
    src = Path(recipe.teacher.load) if recipe.teacher.load else None
    cfg = check_loadable(recipe, src) if src else model_config(recipe)
    prepared = prepare(recipe, ranks)  # data errors stop us here, before anything is written
    if src and data_lib.load_tokenizer(src / TOKENIZER).get_vocab() != prepared.tokenizer.get_vocab():
        raise RecipeError("teacher.load", str(src), "a teacher whose tokenizer is the one data.* builds "
                          "(same data.tokenizer, data.vocab_size and data.train as when it was trained)")
    if ranks.rank == 0:
        run.write_recipe(recipe)
        run.start(STAGE, redo)
    barrier()
    work = run.partial(STAGE)
    check_world_size(work, ranks)
    val = data_lib.PackedTokens(prepared.val, recipe.data.seq_len, prepared.eod_id)
    info: dict = {"inputs": {"recipe_sha256": run.recipe_sha256(), "data_cache": prepared.cache_dir.name}}

    if src:
        model = GPT(cfg, moe_impl="deepspeed", world_size=ranks.world, ep_size=recipe.distributed.ep_size)
        model.to(dist.device())
        _set_groups(model)
        load_weights(model, src)
        summary = {"loaded_from": str(src.resolve()),
                   "val_loss": evaluate(model, val, recipe.teacher.train.eval_batches,
                                        recipe.teacher.train.micro_batch_size, ranks)}
        if ranks.rank == 0:
            for name in [WEIGHTS, INDEX] + [p.name for p in src.glob("model-*.safetensors")]:
                if (src / name).is_file():
                    _link_or_copy(src / name, work / name)
    else:
        model = GPT(cfg, moe_impl="deepspeed", world_size=ranks.world, ep_size=recipe.distributed.ep_size)
        init_weights(model, recipe.seed, ep_rank_of)
        train = data_lib.PackedTokens(prepared.train, recipe.data.seq_len, prepared.eod_id)
        summary = train_model(model, recipe.teacher.train, train, val, run, STAGE, work, recipe.seed, ranks)
        save_weights(model, work, {"stage": STAGE, "recipe": recipe.name})
    if ranks.rank == 0:
        write_stage_files(work, cfg, prepared)
        info.update(summary, params=_meta_counts(cfg), world_size=ranks.world,
                    wall_seconds=round(time.time() - t0, 1),
                    # the same tokens val_loss scores (EOD included): the loss a unigram model would get
                    val_unigram_entropy=data_lib.unigram_entropy(prepared.val))
        run.finish(STAGE, info)
        print(f"[teacher] done in {info['wall_seconds']:.0f}s: validation loss {summary['val_loss']:.4f} "
              f"(unigram entropy of the held-out text {info['val_unigram_entropy']:.4f}) -> {run.stage(STAGE)}",
              flush=True)
    barrier()
    return run.stage(STAGE)


def check_world_size(work: Path, ranks: Ranks) -> None:
    """A stage resumes only at the world size it started with (its checkpoints are split that way)."""
    path = work / "world_size"
    if path.is_file() and int(path.read_text()) != ranks.world:
        started = int(path.read_text())
        raise RecipeError("--nproc", ranks.world, f"{work} was started with {started} ranks and resumes only with "
                          f"--nproc {started}; or pass --redo to start over")
    barrier()
    if ranks.rank == 0:
        atomic_write_text(path, str(ranks.world))


def _meta_counts(cfg: ModelConfig) -> dict[str, int]:
    import torch

    with torch.device("meta"):
        return param_counts(GPT(cfg, moe_impl="reference"))


def _set_groups(model: GPT) -> None:
    """Outside deepspeed.initialize, DeepSpeed's MoE layers need their expert-parallel groups made by hand."""
    for moe in model.moe_layers():
        moe.moe.set_deepspeed_parallelism()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
