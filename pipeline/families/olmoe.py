"""OLMoE (`model_type` "olmoe", OlmoeForCausalLM): every layer MoE, q/k RMSNorm over the whole projection, top-k
renormalised only with norm_topk_prob; llama.cpp runs it as `olmoe`, multi-head attention only.

    recipes/hf/olmoe.json, recipes/olmoe-1b-7b-mos.yaml    # OLMoE-1B-7B's config.json; its distillation recipe
"""

from __future__ import annotations

from pipeline.families.base import Family, HFShape, Refusal, every_layer


class OLMoE(Family):
    def read_hf(self, raw, get, layers, experts):
        width, bias = get("intermediate_size"), bool(get("attention_bias", default=False))
        return HFShape(moe_layers=every_layer(layers), expert_hidden=width, ffn_hidden=width, qkv_bias=bias,
                       out_bias=bias, renormalize=bool(get("norm_topk_prob", default=False)))

    def write_hf(self, cfg, experts, dense):
        return {"intermediate_size": cfg.expert_hidden, "num_experts": experts, "norm_topk_prob": cfg.renormalize,
                "attention_bias": cfg.qkv_bias, "clip_qkv": None}

    def gguf_refusal(self, cfg):
        if cfg.kv_heads != cfg.heads:
            return (f"this OLMoE model has {cfg.kv_heads} key/value heads of {cfg.heads}; llama.cpp's olmoe takes its "
                    f"k norm over the whole hidden size (multi-head attention, as OLMoE's own checkpoints)")
        return None


FAMILY = OLMoE(
    model_type="olmoe", title="OLMoE", architecture="OlmoeForCausalLM",
    refusals=(Refusal("clip_qkv", "clipping q/k/v is not supported"),),
    qk_norm="full", gguf_arch="OLMOE")
