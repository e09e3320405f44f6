"""Mixtral (`model_type` "mixtral", MixtralForCausalLM): every layer MoE, experts as w1/w3/w2 under block_sparse_moe,
top-k always renormalised, no attention biases; llama.cpp runs it as `llama` with experts.

    recipes/hf/mixtral.json, recipes/mixtral-8x7b-mos.yaml    # Mixtral-8x7B's config.json; its distillation recipe
"""

from __future__ import annotations

from pipeline.families.base import Family, HFShape, Refusal, every_layer


class Mixtral(Family):
    def read_hf(self, raw, get, layers, experts):
        width = get("intermediate_size")
        return HFShape(moe_layers=every_layer(layers), expert_hidden=width, ffn_hidden=width, qkv_bias=False,
                       out_bias=False, renormalize=True)

    def write_hf(self, cfg, experts, dense):
        return {"intermediate_size": cfg.expert_hidden, "num_local_experts": experts, "sliding_window": None}

    def gguf_metadata(self, writer, cfg):
        writer.add_vocab_size(cfg.vocab_size)  # what the converter writes for llama
        writer.add_rope_dimension_count(cfg.head_dim)


FAMILY = Mixtral(
    model_type="mixtral", title="Mixtral", architecture="MixtralForCausalLM",
    refusals=(Refusal("sliding_window", "sliding-window attention is not supported; set it to null if the model was "
                                        "trained with full attention"),),
    rope_theta=1e6, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
    gguf_arch="LLAMA", gguf_permute_qk=True,  # llama.cpp's llama rotates adjacent pairs: the converter permutes q, k
    gguf_experts_key="layers.{layer}.feed_forward.experts.{proj}.weight",  # the name its converter gives them
    compressed_ignore=("re:.*block_sparse_moe.gate$",))
