"""Qwen2-MoE (`model_type` "qwen2_moe", Qwen2MoeForCausalLM; Qwen1.5-MoE): dense layers by decoder_sparse_step and
mlp_only_layers, a shared expert mixed by a sigmoid gate, q/k/v biases; llama.cpp runs it as `qwen2moe`.

    recipes/hf/qwen2_moe.json, recipes/qwen1.5-moe-a2.7b-mos.yaml    # Qwen1.5-MoE-A2.7B's config.json; its recipe
"""

from __future__ import annotations

from pipeline.families.base import Family, HFShape, Refusal, sparse_step_layers


class Qwen2MoE(Family):
    def read_hf(self, raw, get, layers, experts):
        moe_layers = sparse_step_layers(get, layers, experts)
        return HFShape(moe_layers=moe_layers, expert_hidden=get("moe_intermediate_size"),
                       ffn_hidden=get("intermediate_size"), qkv_bias=bool(get("qkv_bias", default=True)),
                       out_bias=False, renormalize=bool(get("norm_topk_prob", default=False)),
                       shared_expert_hidden=int(get("shared_expert_intermediate_size", default=0)))

    def write_hf(self, cfg, experts, dense):
        return {"intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.expert_hidden,
                "num_experts": experts, "norm_topk_prob": cfg.renormalize, "decoder_sparse_step": 1,
                "mlp_only_layers": dense, "use_sliding_window": False, "qkv_bias": cfg.qkv_bias,
                "shared_expert_intermediate_size": cfg.shared_expert_hidden}

    def gguf_metadata(self, writer, cfg):
        writer.add_expert_feed_forward_length(cfg.expert_hidden)


FAMILY = Qwen2MoE(
    model_type="qwen2_moe", title="Qwen2-MoE", architecture="Qwen2MoeForCausalLM",
    refusals=(Refusal("use_sliding_window", "sliding-window attention is not supported", refused=bool),),
    dense_layers=True, gguf_arch="QWEN2MOE",
    compressed_ignore=("re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"))  # the router, the shared expert's gate
