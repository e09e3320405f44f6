"""`MoEPipelineConfig`: the Hugging Face config of an exported moe-pipeline model.

Shipped as remote code inside every exported package, next to `moe_model.py` (a copy of
pipeline/model.py) and `modeling_moe_pipeline.py`. It holds every `ModelConfig` field under its
own name, plus the standard Hugging Face names as aliases (`hidden_size` is `hidden`, ...), so
both our code and generic tools read the same values. The export step builds config.json with
`hf_config_dict` (importable from the repository: this module imports `moe_model` only inside
`to_model_config`).

    config = AutoConfig.from_pretrained(package_dir, trust_remote_code=True)
    model_cfg = config.to_model_config()    # the ModelConfig the package's weights were trained with
"""

import dataclasses

from transformers import PretrainedConfig


def auto_map() -> dict:
    """The `auto_map` of config.json: which remote-code class each Auto class loads."""
    return {
        "AutoConfig": "configuration_moe_pipeline.MoEPipelineConfig",
        "AutoModelForCausalLM": "modeling_moe_pipeline.MoEPipelineForCausalLM",
    }


class MoEPipelineConfig(PretrainedConfig):
    """Every `ModelConfig` field (see moe_model.py for their meaning) plus Hugging Face's names.

    The model fields have no defaults here: their defaults live in one place, the recipe schema
    (pipeline/recipe.py). Build one with `from_model_config`; `to_model_config` names any
    field a config.json lacks.
    """

    model_type = "moe_pipeline"
    # Hugging Face's standard names read and write our fields (generate, caches and tools use them)
    attribute_map = {
        "max_position_embeddings": "seq_len",
        "hidden_size": "hidden",
        "num_hidden_layers": "layers",
        "num_attention_heads": "heads",
        "tie_word_embeddings": "tie_embeddings",
    }

    # -- ModelConfig fields (None: not set; eval_capacity_factor=None means no token dropping)
    vocab_size: int | None = None
    seq_len: int | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    experts: list[int] | None = None
    moe_layers: list[int] | None = None
    mlp_type: str | None = None
    top_k: int | None = None
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    min_capacity: int | None = None
    aux_loss_coef: float | None = None
    ffn_mult: int | None = None
    dropout: float | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = None
    # the family fields (None here: the ModelConfig default, the PR-MoE GPT's)
    family: str | None = None
    norm: str | None = None
    norm_eps: float | None = None
    positions: str | None = None
    rope_theta: float | None = None
    head_dim: int | None = None
    kv_heads: int | None = None
    qk_norm: str | None = None
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    activation: str | None = None
    mlp_bias: bool | None = None
    ffn_hidden: int | None = None
    expert_hidden: int | None = None
    renormalize: bool | None = None
    shared_expert_hidden: int | None = None

    # -- tokens and generation
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    use_cache: bool = True

    # -- facts about the weights, for readers of config.json (not read by the code)
    moe_impl_train: str = "deepspeed"  # trained with deepspeed.moe; the package runs the plain-torch reference MoE
    gate_dtype: str = "float32"  # the router (gate.wg) is stored and run in fp32 whatever the model's dtype

    def to_model_config(self):
        """The `ModelConfig` of the package's `moe_model.py`; names the fields this config lacks."""
        from .moe_model import ModelConfig

        values, missing = {}, []
        for f in dataclasses.fields(ModelConfig):
            value = getattr(self, f.name, None)
            if value is None and f.default is not dataclasses.MISSING:  # a family field: its default
                continue
            if value is None and "None" not in str(f.type):  # only Optional fields may be None
                missing.append(f.name)
            values[f.name] = value
        if missing:
            raise ValueError(f"config.json of this moe_pipeline model lacks {', '.join(missing)}; "
                             "fix: write it with export.hf.configuration_moe_pipeline.hf_config_dict(model_config, ...)")
        return ModelConfig(**values)

    @classmethod
    def from_model_config(cls, cfg, **kwargs) -> "MoEPipelineConfig":
        """From a `ModelConfig` (pipeline.model or a package's moe_model); kwargs: any other config field."""
        return cls(**cfg.to_dict(), **kwargs)


MoEPipelineConfig.register_for_auto_class()


def hf_config_dict(cfg, torch_dtype: str, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """The complete config.json of a package whose weights are `cfg`'s and stored in `torch_dtype`
    ("float32", "bfloat16"): what `save_pretrained` writes (transformers 5: `dtype`, not `torch_dtype`)
    plus `auto_map` and `architectures`, so `Auto*.from_pretrained(dir, trust_remote_code=True)` loads it."""
    config = MoEPipelineConfig.from_model_config(cfg, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                                                 dtype=torch_dtype, architectures=["MoEPipelineForCausalLM"])
    out = config.to_diff_dict()  # model_type, transformers_version, dtype as a string, every field above
    out["auto_map"] = auto_map()
    return out
