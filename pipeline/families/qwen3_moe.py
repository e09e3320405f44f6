"""Qwen3-MoE (`model_type` "qwen3_moe", Qwen3MoeForCausalLM): dense layers by decoder_sparse_step and mlp_only_layers,
per-head q/k RMSNorm, a head width of its own (head_dim); llama.cpp runs it as `qwen3moe`.

    recipes/hf/qwen3_moe.json, recipes/qwen3-30b-a3b-mos.yaml    # Qwen3-30B-A3B's config.json; its recipe
"""

from __future__ import annotations

from pipeline.families.base import Family, HFShape, Refusal, sparse_step_layers


class Qwen3MoE(Family):
    def read_hf(self, raw, get, layers, experts):
        moe_layers, bias = sparse_step_layers(get, layers, experts), bool(get("attention_bias", default=False))
        return HFShape(moe_layers=moe_layers, expert_hidden=get("moe_intermediate_size"),
                       ffn_hidden=get("intermediate_size"), qkv_bias=bias, out_bias=bias,
                       renormalize=bool(get("norm_topk_prob", default=False)))

    def write_hf(self, cfg, experts, dense):
        return {"intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.expert_hidden,
                "num_experts": experts, "norm_topk_prob": cfg.renormalize, "decoder_sparse_step": 1,
                "mlp_only_layers": dense, "use_sliding_window": False, "attention_bias": cfg.qkv_bias,
                "head_dim": cfg.head_dim}

    def gguf_metadata(self, writer, cfg):
        writer.add_expert_feed_forward_length(cfg.expert_hidden)


FAMILY = Qwen3MoE(
    model_type="qwen3_moe", title="Qwen3-MoE", architecture="Qwen3MoeForCausalLM",
    refusals=(Refusal("use_sliding_window", "sliding-window attention is not supported", refused=bool),),
    qk_norm="head", dense_layers=True, gguf_arch="QWEN3MOE")
