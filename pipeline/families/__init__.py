"""The Hugging Face MoE families a teacher is imported from and a student exported to, one module each, keyed by
config.json's `model_type`: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

    from pipeline.families import FAMILIES, family
    family("qwen3_moe").architecture          # "Qwen3MoeForCausalLM"
    FAMILIES.get(cfg.family)                  # None for our own PR-MoE GPT ("pr-moe"), which has no such record

All of them are Llama-style decoders (RMSNorm, rotary positions, SwiGLU experts, a linear router); what differs is in
the `Family` record (pipeline/families/base.py), read by pipeline/hf_import.py (config.json -> ModelConfig, the name
map, refusals), export/native.py (`--format hf`), export/gguf.py (`--format gguf`) and export/compressed.py
(`--format hf --quantize`). None of them branches on a family's name.

A new family is one module here, its line in FAMILIES below, its recipes and its test:

  pipeline/families/<model_type>.py   defines FAMILY, an instance of a subclass of `Family` that
      sets    model_type, title, architecture; and where they are not the defaults: refusals, qk_norm, rope_theta,
              dense_layers, moe_prefix, expert_names, gguf_arch (None: no GGUF), gguf_permute_qk, gguf_experts_key,
              compressed_ignore
      defines read_hf(raw, get, layers, experts) -> HFShape   (config.json -> the family part of ModelConfig)
              write_hf(cfg, experts, dense) -> dict          (that part -> the family's own config.json keys)
      may     gguf_refusal(cfg) -> str | None, gguf_metadata(writer, cfg)   (llama.cpp's quirks for it)
  pipeline/families/__init__.py        its FAMILY in FAMILIES (the order in which messages list the families)
  recipes/hf/<model_type>.json         a published config.json of the family; recipes/<model>-mos.yaml, its recipe
  tests/hf_checkpoints.py              a tiny transformers model of the family, for the import and export tests

A family whose layout is not the shared one (other tensor names for attention or norms, a router with a bias, another
activation) needs more than these fields: pipeline/hf_import.py's name map and pipeline/model.py first.
"""

from __future__ import annotations

from pipeline.families import mixtral, olmoe, qwen2_moe, qwen3_moe
from pipeline.families.base import Family, HFShape, Refusal

FAMILIES: dict[str, Family] = {f.model_type: f for f in (mixtral.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY,
                                                         olmoe.FAMILY)}


def family(model_type: str) -> Family:
    """The family of `model_type` (a config.json's, or ModelConfig.family); a KeyError lists the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise KeyError(f"model_type {model_type!r} is not supported; supported families: "
                       f"{', '.join(FAMILIES)}") from None


__all__ = ["FAMILIES", "Family", "HFShape", "Refusal", "family"]
