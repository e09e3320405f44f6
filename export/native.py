"""A student in its teacher's own Hugging Face family: `moe-pipeline export RUN --format hf`.

A model imported from Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE (pipeline/hf_import.py), and the students distilled
from it, are written back as that family's checkpoint: its config.json with the student's depth (dense layers
listed in Qwen's `mlp_only_layers`), safetensors under the Hub's tensor names (one shard, or shards with an
index), the tokenizer, and a manifest of checksums. `AutoModelForCausalLM.from_pretrained(dir)` then loads it
as the family's own class with no remote code, so vLLM, SGLang and llama.cpp's converters can take it.

    moe-pipeline export runs/olmoe-1b-7b-mos --format hf [--dtype bf16] [--out DIR]   # the student
    from export.native import export_native, write_native
    export_native("runs/olmoe-1b-7b-mos/student", out_dir, "bf16")   # a finished stage
    write_native(model, out_dir, tokenizer, dtype=torch.bfloat16)     # a model in memory

These families have one expert count per model and no PR-MoE residual MLP: a pyramid, a student whose layers
were pruned to different expert counts, or a PR-MoE model is refused (NativeExportError), and our package
(`moe-pipeline export RUN`, remote code) is its format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.artifacts import CONFIG, DONE, DTYPE_NAMES, DTYPES, MANIFEST, TOKENIZER, read_model_config, sha256_file
from pipeline.hf_import import SUPPORTED, hf_sources
from pipeline.model import GPT, ModelConfig

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
DEFAULT_SHARD_BYTES = 5 << 30


class NativeExportError(ValueError):
    """A model the family's format cannot express; the message says why and which format can."""


def native_config(cfg: ModelConfig, dtype: torch.dtype, bos: int | None = None, eos: int | None = None) -> dict:
    """The family's config.json for a model of `cfg` (an imported teacher or one of its students)."""
    fam = cfg.family
    ours = "our package (`moe-pipeline export RUN`, loaded with trust_remote_code=True) is its format"
    if fam not in SUPPORTED:
        raise NativeExportError(f"--format hf: this model is a {fam} model, not one imported from "
                                f"{', '.join(SUPPORTED)}; {ours}")
    if len(set(cfg.experts)) > 1:
        raise NativeExportError(f"--format hf: its MoE layers have different expert counts {list(cfg.experts)} (a "
                                f"pyramid, or experts pruned per layer); {fam} has one count per model; {ours}")
    if cfg.mlp_type != "standard":
        raise NativeExportError(f"--format hf: a {cfg.mlp_type} MoE (PR-MoE's residual MLP) has no {fam} form; {ours}")
    dense = [i for i in range(cfg.layers) if not cfg.is_moe(i)]
    if dense and fam in ("mixtral", "olmoe"):
        raise NativeExportError(f"--format hf: layers {dense} are dense; every {fam} layer is an MoE layer; {ours}")
    experts = cfg.experts[0] if cfg.experts else 0
    out = {
        "architectures": [ARCHITECTURES[fam]], "model_type": fam, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": cfg.aux_loss_coef,
        "torch_dtype": DTYPE_NAMES[dtype], "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
    }
    if fam == "mixtral":
        out.update(intermediate_size=cfg.expert_hidden, num_local_experts=experts, sliding_window=None)
    elif fam == "olmoe":
        out.update(intermediate_size=cfg.expert_hidden, num_experts=experts, norm_topk_prob=cfg.renormalize,
                   attention_bias=cfg.qkv_bias, clip_qkv=None)
    else:
        out.update(intermediate_size=cfg.ffn_hidden, moe_intermediate_size=cfg.expert_hidden, num_experts=experts,
                   norm_topk_prob=cfg.renormalize, decoder_sparse_step=1, mlp_only_layers=dense,
                   use_sliding_window=False)
        if fam == "qwen2_moe":
            out.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_hidden)
        else:
            out.update(attention_bias=cfg.qkv_bias, head_dim=cfg.head_dim)
    return out


def native_tensors(model: GPT, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of `model` (all experts local) under the family's Hub name, in `dtype` (gates too: these
    families store the router in the model's dtype)."""
    from pipeline.weights import unique_params

    out = {}
    for name, p in unique_params(model):
        keys = hf_sources(model.cfg, name)
        parts = p.detach().chunk(len(keys), dim=0) if len(keys) > 1 else (p.detach(),)
        for key, part in zip(keys, parts):
            out[key] = part.to(dtype).contiguous()
    return out


def write_native(model: GPT, out: Path, tokenizer=None, dtype: torch.dtype = torch.bfloat16, force: bool = False,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` as its family's checkpoint in `out` (atomically: a temporary directory, then rename)."""
    from export.package import _write_shards, staged

    out = Path(out)
    config = native_config(model.cfg, dtype, getattr(tokenizer, "bos_token_id", None),
                           getattr(tokenizer, "eos_token_id", None))
    with staged(out, force) as tmp:
        weights = _write_shards(native_tensors(model, dtype), tmp, max_shard_bytes, {"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        manifest = {"format": f"hf-{model.cfg.family}", "weights": weights, "files": {
            p.name: {"sha256": sha256_file(p), "size": p.stat().st_size} for p in sorted(tmp.iterdir()) if p.is_file()}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def export_native(stage_dir: Path, out: Path, dtype: str = "bf16", force: bool = False,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a finished stage (a student of an imported teacher, or the teacher) as its family's checkpoint in
    `out`. What the family cannot express is refused before any weight is read (NativeExportError)."""
    from pipeline import data as data_lib
    from pipeline.build import load_stage_model

    stage_dir = Path(stage_dir)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if not (stage_dir / DONE).is_file():
        raise FileNotFoundError(f"{stage_dir / DONE} is missing: the stage is not finished "
                                f"(run `moe-pipeline distill RECIPE` first)")
    native_config(read_model_config(stage_dir), DTYPES[dtype])  # refused here, before anything is read or written
    if Path(out).exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it, or --out another directory")
    model = load_stage_model(stage_dir, DTYPES[dtype])
    return write_native(model, out, data_lib.load_tokenizer(stage_dir / TOKENIZER), DTYPES[dtype], force,
                        max_shard_bytes)
