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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.artifacts import CONFIG, DONE, DTYPE_NAMES, DTYPES, MANIFEST, TOKENIZER, read_model_config, sha256_file
from pipeline.families import FAMILIES
from pipeline.hf_import import SUPPORTED, hf_sources
from pipeline.model import GPT, ModelConfig

if TYPE_CHECKING:
    from export.package import Quantize

DEFAULT_SHARD_BYTES = 5 << 30


class NativeExportError(ValueError):
    """A model the family's format cannot express; the message says why and which format can."""


def native_config(cfg: ModelConfig, dtype: torch.dtype, bos: int | None = None, eos: int | None = None) -> dict:
    """The family's config.json for a model of `cfg` (an imported teacher or one of its students): the keys every
    family shares, and the family's own (pipeline/families/: `write_hf`)."""
    fam = FAMILIES.get(cfg.family)
    ours = "our package (`moe-pipeline export RUN`, loaded with trust_remote_code=True) is its format"
    if fam is None:
        raise NativeExportError(f"--format hf: this model is a {cfg.family} model, not one imported from "
                                f"{', '.join(SUPPORTED)}; {ours}")
    if len(set(cfg.experts)) > 1:
        raise NativeExportError(f"--format hf: its MoE layers have different expert counts {list(cfg.experts)} (a "
                                f"pyramid, or experts pruned per layer); {cfg.family} has one count per model; {ours}")
    if cfg.mlp_type != "standard":
        raise NativeExportError(f"--format hf: a {cfg.mlp_type} MoE (PR-MoE's residual MLP) has no {cfg.family} form; "
                                f"{ours}")
    dense = [i for i in range(cfg.layers) if not cfg.is_moe(i)]
    if dense and not fam.dense_layers:
        raise NativeExportError(f"--format hf: layers {dense} are dense; every {cfg.family} layer is an MoE layer; "
                                f"{ours}")
    experts = cfg.experts[0] if cfg.experts else 0
    return {
        "architectures": [fam.architecture], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": cfg.aux_loss_coef,
        "torch_dtype": DTYPE_NAMES[dtype], "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
        **fam.write_hf(cfg, experts, dense),
    }


def native_tensors(model: GPT, dtype: torch.dtype, skip=()) -> dict[str, torch.Tensor]:
    """Every tensor of `model` (all experts local) under the family's Hub name, in `dtype` (gates too: these
    families store the router in the model's dtype); our parameters in `skip` left out."""
    from pipeline.weights import unique_params

    out = {}
    for name, p in unique_params(model):
        if name in skip:
            continue
        keys = hf_sources(model.cfg, name)
        parts = p.detach().chunk(len(keys), dim=0) if len(keys) > 1 else (p.detach(),)
        for key, part in zip(keys, parts):
            out[key] = part.to(dtype).contiguous()
    return out


def write_native(model: GPT, out: Path, tokenizer=None, dtype: torch.dtype = torch.bfloat16, force: bool = False,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, quantized: Quantized | None = None) -> Path:
    """Write `model` as its family's checkpoint in `out` (atomically: a temporary directory, then rename); with
    `quantized`, its quantised weights as compressed-tensors (export/compressed.py)."""
    from export.package import _write_shards, staged

    out = Path(out)
    config = native_config(model.cfg, dtype, getattr(tokenizer, "bos_token_id", None),
                           getattr(tokenizer, "eos_token_id", None))
    tensors = native_tensors(model, dtype, skip=quantized.kinds if quantized else ())
    if quantized is not None:
        from export.compressed import compressed_tensors

        tensors.update(compressed_tensors(model.cfg, quantized.kinds, quantized.stored, quantized.scheme,
                                          quantized.group))
    with staged(out, force) as tmp:
        weights = _write_shards(tensors, tmp, max_shard_bytes, {"format": "pt"})
        del tensors
        (tmp / CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        if quantized is not None:  # config.json's quantization_config, by compressed-tensors' own writer
            from compressed_tensors.compressors import ModelCompressor

            from export.compressed import quantization_config

            qc = quantization_config(model.cfg, quantized.scheme, quantized.group, "lm_head.weight" in quantized.kinds)
            ModelCompressor(quantization_config=qc).update_config(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        manifest = {"format": f"hf-{model.cfg.family}", "weights": weights,
                    **({"quantization": quantized.manifest()} if quantized is not None else {}),
                    "files": {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
                              for p in sorted(tmp.iterdir()) if p.is_file()}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


@dataclass
class Quantized:
    """A model's quantised weights for `write_native`: the compressed-tensors scheme (export/compressed.py SCHEMES),
    int4's group, {our weight: "int8" | "int4"}, their stored values and scales, the quantiser's report."""

    scheme: str
    group: int
    kinds: dict[str, str]
    stored: dict[str, torch.Tensor]
    report: dict

    def manifest(self) -> dict:
        from export.compressed import SCHEMES

        return {"scheme": self.scheme, "compressed_tensors": SCHEMES[self.scheme],
                "group": self.group if self.scheme == "int4" else None, **self.report}


def export_native(stage_dir: Path, out: Path, dtype: str = "bf16", force: bool = False,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, quantize: Quantize | None = None,
                  scheme: str | None = None, progress: bool = False) -> Path:
    """Write a finished stage (a student of an imported teacher, or the teacher) as its family's checkpoint in
    `out`; with `quantize` (its weights' kind, method, group, calibration) and `scheme` (export/compressed.py
    SCHEMES: int8, int4, w8a8), quantised as compressed-tensors. What the family cannot express is refused before any
    weight is read (NativeExportError; export.compressed.CompressedExportError for the quantisation)."""
    from pipeline import data as data_lib
    from pipeline.build import load_stage_model, meta_model

    stage_dir = Path(stage_dir)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if not (stage_dir / DONE).is_file():
        raise FileNotFoundError(f"{stage_dir / DONE} is missing: the stage is not finished "
                                f"(run `moe-pipeline distill RECIPE` first)")
    cfg = read_model_config(stage_dir)
    native_config(cfg, DTYPES[dtype])  # refused here, before anything is read or written
    if quantize is not None:
        from export.compressed import check_groups, require, weight_scheme
        from pipeline.quantize import weight_kinds

        scheme = scheme or quantize.scheme
        if weight_scheme(scheme) != quantize.scheme:
            raise ValueError(f"export_native: scheme {scheme!r} quantises weights to {weight_scheme(scheme)}, "
                             f"not {quantize.scheme}")
        require()
        shapes = meta_model(cfg)
        check_groups(weight_kinds(shapes, quantize.scheme, quantize.head, quantize.group), shapes, scheme,
                     quantize.group)
    if Path(out).exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it, or --out another directory")
    quantized = None
    if quantize is None:
        model = load_stage_model(stage_dir, DTYPES[dtype])
    else:
        from export.package import quantize_stage

        model, kinds, stored, report = quantize_stage(stage_dir, cfg, quantize, progress)
        quantized = Quantized(scheme, quantize.group, kinds, stored, {**report, "head": quantize.head})
    return write_native(model, out, data_lib.load_tokenizer(stage_dir / TOKENIZER), DTYPES[dtype], force,
                        max_shard_bytes, quantized)
