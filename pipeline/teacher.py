"""The teacher stage: train the recipe's PR-MoE teacher (or load an existing one) into `runs/<name>/teacher/`.

    moe-pipeline teacher recipes/tiny.yaml             # 1 rank
    moe-pipeline teacher recipes/tiny.yaml --nproc 2   # 2 ranks, expert parallel, via the DeepSpeed launcher
    moe-pipeline teacher recipes/olmoe-mos.yaml --set teacher.load=/models/OLMoE-1B-7B-0924   # a Hugging Face one

The finished directory describes itself: `config.json` (the model), `model.safetensors` (global
expert ids), `tokenizer/`, `checkpoints/` (DeepSpeed's, resumable) and `DONE.json`. For a Hugging Face
teacher (pipeline/hf_import.py) nothing is trained or copied: `source.json` records the checkpoint's
directory, its files' sha256 and the name map, and every later load reads the checkpoint through it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from pipeline import data as data_lib
from pipeline.artifacts import CONFIG, INDEX, TOKENIZER, WEIGHTS, atomic_write_text, cache_root, read_model_config
from pipeline import dist
from pipeline.dist import Ranks, barrier
from pipeline.artifacts import DTYPES
from pipeline.build import (build_model, expert_parallel_degrees, load_frozen, load_hf_teacher, meta_counts,
                            teacher_config)
from pipeline.model import ModelConfig, init_weights
from pipeline.recipe import Recipe, RecipeError
from pipeline.runs import RunDir
from pipeline.train import evaluate, train_model
from pipeline.weights import ep_rank_of, save_weights

STAGE = "teacher"


def prepare(recipe: Recipe, ranks: Ranks) -> data_lib.PreparedData:
    """Tokenize once: every rank asks for the cache; the first builds it under the cache's file lock while the others
    wait on the lock, not in a collective (whose 30-minute timeout a paper-scale corpus outlasts), then read it. A
    failed build fails each rank the same way. On several nodes each node's ranks share their node's cache (or one
    on shared storage)."""
    try:
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
        if not src.is_dir():  # a Hub name, say: read_hf_config says what to do
            from pipeline.hf_import import HFImportError, read_hf_config

            try:
                read_hf_config(src)
            except HFImportError as err:
                raise RecipeError("teacher.load", str(src), str(err)) from None
        raise RecipeError("teacher.load", str(src), "a teacher directory with config.json, model.safetensors and "
                          "tokenizer/ (one made by `moe-pipeline teacher`), or a Hugging Face checkpoint") from None
    want = teacher_config(recipe)
    diff = [f"{k} {getattr(loaded, k)} (recipe: {getattr(want, k)})" for k in ARCHITECTURE
            if getattr(loaded, k) != getattr(want, k)]
    if diff:
        raise RecipeError("teacher.load", str(src), "a teacher matching the recipe's model and data; it differs in "
                          + ", ".join(diff) + ": set model.* / data.* to the teacher's values")
    return loaded


def check_hf_loadable(recipe: Recipe, src: Path) -> ModelConfig:
    """The config of the Hugging Face checkpoint `teacher.load` names, its files checked against it from their
    headers alone (every tensor there, in its shape, none unaccounted for); else a RecipeError."""
    from pipeline.hf_import import HFImportError, check_checkpoint, model_config

    try:
        cfg = model_config(recipe.hf_teacher(), src / CONFIG)
        check_checkpoint(src, cfg)
    except HFImportError as err:
        raise RecipeError("teacher.load", str(src), str(err)) from None
    return cfg


def check_hf_tokenizer(recipe: Recipe, src: Path) -> None:
    """The data's tokenizer is the checkpoint's (the teacher's logits index its vocabulary), checked before any data
    is prepared: a BPE trained on the data never is; GPT-2's or a directory's must equal the one the checkpoint
    ships (one it does not ship is the user's word)."""
    tok = recipe.data.tokenizer
    fix = ("leave data.tokenizer out (it defaults to the teacher's tokenizer.json) or point it at a directory with "
           "the teacher's tokenizer.json")
    if tok == "bpe":
        raise RecipeError("data.tokenizer", tok, f"the teacher's own tokenizer, not one trained on the data: {fix}")
    if not (src / "tokenizer.json").is_file():
        return
    try:
        mine = data_lib.gpt2_tokenizer() if tok == "gpt2" else data_lib.checkpoint_tokenizer(Path(tok))
    except ValueError as err:
        raise RecipeError.from_message(str(err)) from None
    if mine.get_vocab() != data_lib.checkpoint_tokenizer(src).get_vocab():
        raise RecipeError("data.tokenizer", tok, f"the teacher's own tokenizer ({src}): {fix}")


def check_hardware(recipe: Recipe) -> None:
    import torch

    for name, train in recipe.trainings():
        if train.precision == "fp16" and not torch.cuda.is_available():
            raise RecipeError(f"{name}.precision", "fp16", "bf16 or fp32 on a machine without GPUs "
                              "(DeepSpeed's fp16 loss scaling is for GPUs), e.g. --set " + f"{name}.precision=bf16 "
                              f"(with {name}.zero_stage 1 or 2)")


def run_teacher(recipe: Recipe, run: RunDir, ranks: Ranks, redo: bool = False) -> Path:
    """The teacher stage: the recipe's checks, then one of `import_hf_teacher` (a Hugging Face checkpoint),
    `load_teacher` (`teacher.load` of our own) or `train_teacher`, then the stage's files and DONE.json. Returns the
    finished stage directory. Collective over all ranks."""
    t0 = time.time()
    run.check_recipe(recipe, redo)
    if run.skip(STAGE, ranks, redo, "train again"):
        return run.stage(STAGE)
    check_hardware(recipe)
    hf = recipe.hf_teacher() is not None
    if hf and not recipe.teacher.load:  # refused before anything is written
        raise RecipeError("teacher.architecture", recipe.teacher.architecture, "a shape for `plan` and the recipe's "
                          "checks only: set teacher.load to a checkpoint of this architecture (a Hugging Face-family "
                          "teacher is imported, not trained here)")
    src = Path(recipe.teacher.load) if recipe.teacher.load else None
    cfg = check_hf_loadable(recipe, src) if hf else check_loadable(recipe, src) if src else teacher_config(recipe)
    if hf:
        check_hf_tokenizer(recipe, src)
    prepared = prepare(recipe, ranks)  # data errors stop us here, before anything is written
    if src and not hf and data_lib.load_tokenizer(src / TOKENIZER).get_vocab() != prepared.tokenizer.get_vocab():
        raise RecipeError("teacher.load", str(src), "a teacher whose tokenizer is the one data.* builds "
                          "(same data.tokenizer, data.vocab_size and data.train as when it was trained)")
    if ranks.rank == 0:
        run.write_recipe(recipe)
    work = run.open(STAGE, ranks, redo)
    val = data_lib.PackedTokens(prepared.val, recipe.data.seq_len, prepared.eod_id)
    info: dict = {"inputs": {"recipe_sha256": run.recipe_sha256(), "data_cache": prepared.cache_dir.name}}

    if hf:
        model, summary = import_hf_teacher(recipe, src, cfg, work, val, ranks)
    elif src:
        model, summary = load_teacher(recipe, src, work, val, ranks)
    else:
        model, summary = train_teacher(recipe, cfg, prepared, val, run, work, ranks)
    if ranks.rank == 0:
        write_stage_files(work, cfg, prepared)
        info.update(summary, params=meta_counts(cfg), world_size=ranks.world,
                    expert_parallel=expert_parallel_degrees(model),
                    wall_seconds=round(time.time() - t0, 1),
                    # the same tokens val_loss scores (EOD included): the loss a unigram model would get
                    val_unigram_entropy=data_lib.unigram_entropy(prepared.val))
        run.finish(STAGE, info)
        print(f"[teacher] done in {info['wall_seconds']:.0f}s: validation loss {summary['val_loss']:.4f} "
              f"(unigram entropy of the held-out text {info['val_unigram_entropy']:.4f}) -> {run.stage(STAGE)}",
              flush=True)
    barrier()
    return run.stage(STAGE)


def import_hf_teacher(recipe: Recipe, src: Path, cfg: ModelConfig, work: Path, val: data_lib.PackedTokens,
                      ranks: Ranks):
    """A Hugging Face checkpoint as the teacher: nothing trained or copied, the checkpoint is read where it is
    (`source.json` records its files' sha256 and the name map). Returns (model, summary)."""
    from pipeline.hf_import import checkpoint_files, name_map
    from pipeline.weights import file_facts, write_source

    model = load_hf_teacher(src, ranks.world, recipe.distributed.ep_size, DTYPES[recipe.teacher.eval.precision],
                            device=dist.device())
    summary = {"loaded_from": str(src.resolve()), "format": cfg.family,
               "val_loss": evaluate(model, val, recipe.teacher.eval.eval_batches,
                                    recipe.teacher.eval.micro_batch_size, ranks)}
    names = checkpoint_files(src)  # each rank hashes its share of the files
    files = {k: v for part in dist.gather_json(file_facts(src, names[ranks.rank::ranks.world])) for k, v in part.items()}
    if ranks.rank == 0:
        write_source(work, src, files, name_map(cfg), {"format": "huggingface", "model_type": cfg.family})
    return model, summary


def hf_checkpoint_stage(ckpt: Path, stage: Path, dtype, info: dict | None = None) -> Path:
    """A Hugging Face checkpoint written as a finished teacher stage directory, unscored and on one process: its
    weights as our model's in `dtype` (model.safetensors, with `info` in its metadata), its model config, its tokenizer
    and DONE.json (the checkpoint's path). What the tests and the peer benchmark export from; `moe-pipeline teacher`
    with `teacher.load` instead scores the checkpoint and reads it in place (`import_hf_teacher`). Returns `stage`."""
    from pipeline.artifacts import DONE
    from pipeline.hf_import import model_config, read_hf_config

    ckpt, stage = Path(ckpt), Path(stage)
    stage.mkdir(parents=True, exist_ok=True)
    save_weights(load_hf_teacher(ckpt, dtype=dtype), stage, {"stage": STAGE, **(info or {})})
    (stage / CONFIG).write_text(json.dumps(model_config(read_hf_config(ckpt), ckpt / CONFIG).to_dict(), indent=1))
    data_lib.save_tokenizer(data_lib.load_tokenizer(ckpt), stage / TOKENIZER)
    (stage / DONE).write_text(json.dumps({"stage": STAGE, "steps": 0, "loaded_from": str(ckpt.resolve())}))
    return stage


def load_teacher(recipe: Recipe, src: Path, work: Path, val: data_lib.PackedTokens, ranks: Ranks):
    """A teacher made by `moe-pipeline teacher` (`teacher.load`): scored on the held-out split, its weight files
    linked (or copied) into the stage. Returns (model, summary)."""
    model = load_frozen(src, ranks.world, recipe.distributed.ep_size, dist.device())
    summary = {"loaded_from": str(src.resolve()),
               "val_loss": evaluate(model, val, recipe.teacher.eval.eval_batches,
                                    recipe.teacher.eval.micro_batch_size, ranks)}
    if ranks.rank == 0:
        for name in [WEIGHTS, INDEX] + [p.name for p in src.glob("model-*.safetensors")]:
            if (src / name).is_file():
                _link_or_copy(src / name, work / name)
    return model, summary


def train_teacher(recipe: Recipe, cfg: ModelConfig, prepared: data_lib.PreparedData, val: data_lib.PackedTokens,
                  run: RunDir, work: Path, ranks: Ranks):
    """The recipe's PR-MoE teacher trained from its seed on DeepSpeed (expert parallel over the ranks), its weights
    saved into the stage. Returns (model, summary)."""
    model = build_model(cfg, ranks.world, recipe.distributed.ep_size, groups=False)  # deepspeed.initialize makes them
    init_weights(model, recipe.seed, ep_rank_of)
    train = data_lib.PackedTokens(prepared.train, recipe.data.seq_len, prepared.eod_id)
    summary = train_model(model, recipe.teacher.train, train, val, run, STAGE, work, recipe.seed, ranks,
                          monitor=recipe.monitor, job=f"{recipe.name}-{STAGE}")
    save_weights(model, work, {"stage": STAGE, "recipe": recipe.name})
    return model, summary


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
