"""`MoEPipelineForCausalLM`: an exported moe-pipeline model as a Hugging Face causal LM.

Shipped as remote code inside every exported package, next to `moe_model.py` (a copy of
pipeline/model.py): the math is that file's `GPT` with the plain-PyTorch ("reference") MoE, so
a package loads and generates in any process: no launcher, no torch.distributed, no DeepSpeed.
In eval mode the reference MoE equals DeepSpeed's (no token dropping unless the config sets
`eval_capacity_factor`).

    tok = AutoTokenizer.from_pretrained(package_dir)
    model = AutoModelForCausalLM.from_pretrained(package_dir, trust_remote_code=True)
    out = model.generate(**tok("And God said", return_tensors="pt"), max_new_tokens=20, do_sample=False)

Design:
  * parameter names: the GPT's modules (wte, wpe, blocks, ln_f, lm_head) are this model's own
    children, so `state_dict()` names are exactly the GPT's and the package's model.safetensors
    loads unchanged; `forward` runs `GPT.forward` on them.
  * tied embeddings: `_tied_weights_keys` ties lm_head.weight to wte.weight when
    `tie_word_embeddings` (= tie_embeddings); a package without lm_head.weight loads cleanly.
  * gate in fp32: `_keep_in_fp32_modules_strict` keeps every router weight (`...gate.wg`) in fp32
    when the model loads in bf16/fp16; the reference router computes in fp32 anyway.
  * quantised packages (export --quantize; config.json's `moe_pipeline_quantization`): the quantised
    linears are moe_quantize.py's `QuantizedLinear` (pipeline/quantize.py), whose buffers are the stored
    int8/int4 values and fp32 scales; each forward computes with the weight they stand for.
  * KV cache: Hugging Face's own `Cache` (a `DynamicCache` by default, what `generate` creates,
    reorders for beam search, crops, ...) seen through the interface moe_model's attention uses.
  * no padding: sequences of a batch must have the same length (an attention_mask with a 0
    is an error): the model has learned positions and no key-padding mask.
  * context: prompt + new tokens may not exceed `seq_len` (max_position_embeddings); `generate`
    says so before it starts.
"""

import dataclasses

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moe_pipeline import MoEPipelineConfig

# the output's cache field: `cache` in recent transformers 5 releases, `past_key_values` before (5.17 has that)
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
from .moe_model import GPT, Cache, KVCache


class _CacheView(Cache):
    """A Hugging Face `Cache` as moe_model's cache protocol (`moe_model.Cache`): `length` is the cached
    length before this forward (GPT.forward advances it once all layers ran, whereas the Cache's own
    length grows layer by layer); one length for the whole batch, so no positions or mask."""

    def __init__(self, cache: HFCache):
        self.cache = cache
        self.length = cache.get_seq_length()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(k, v, layer)  # [B, H, past+T, C/H] each


class _GenerationConfig(GenerationConfig):
    """Hugging Face derives a model's generation defaults from the model config's fields of the same
    names: our `top_k` (experts per token) is not sampling's top_k, so it is left out."""

    @classmethod
    def from_model_config(cls, model_config) -> GenerationConfig:
        fields = model_config if isinstance(model_config, dict) else model_config.to_dict()
        return GenerationConfig.from_model_config({k: v for k, v in fields.items() if k != "top_k"})


class MoEPipelineForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoEPipelineConfig
    generation_config_class = _GenerationConfig
    base_model_prefix = ""  # no base-model wrapper: parameter names are the GPT's, from the top
    main_input_name = "input_ids"
    _input_embed_layer = "wte"
    _tied_weights_keys = {"lm_head.weight": "wte.weight"}  # applied only when config.tie_word_embeddings
    _keep_in_fp32_modules_strict = ["gate.wg"]
    _no_split_modules = ["Block"]

    def __init__(self, config: MoEPipelineConfig):
        super().__init__(config)
        self.cfg = config.to_model_config()  # GPT.forward reads self.cfg
        gpt = GPT(self.cfg, moe_impl="reference")
        quantization = getattr(config, "moe_pipeline_quantization", None)
        if quantization:  # export --quantize: those linears hold the stored int8/int4 values and scales
            from .moe_quantize import quantized_modules_

            quantized_modules_(gpt, quantization["scheme"], quantization["head"], quantization["group"])
        for name, module in gpt.named_children():  # wte, wpe, drop, blocks, ln_f, lm_head (tied as the GPT ties it)
            self.add_module(name, module)
        self.post_init()

    def _unset_moe_top_k(self):
        """A package without generation_config.json gets generation defaults read from config.json,
        `top_k` included: undo that one (see _GenerationConfig)."""
        gen = self.generation_config
        if getattr(gen, "_from_model_config", False) and gen.top_k == self.cfg.top_k:
            gen.top_k = GenerationConfig().top_k

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, past_key_values: HFCache | None = None,
                use_cache: bool | None = None, cache: HFCache | KVCache | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast | tuple:
        """Logits [B, T, vocab] for `input_ids` [B, T] (after the `cache`'s tokens, if any);
        `loss` as Hugging Face computes it for causal LMs (labels shifted inside, -100 ignored,
        mean over the rest; the MoE balancing loss is not added). `cache` (transformers >= 5.24's
        name) or `past_key_values`: a Hugging Face `Cache`, or moe_model's `KVCache`."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("MoEPipelineForCausalLM takes input_ids (inputs_embeds is not supported)")
        if output_attentions or output_hidden_states:
            raise ValueError("MoEPipelineForCausalLM returns no attentions or hidden states; "
                             "set output_attentions=False and output_hidden_states=False")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("MoEPipelineForCausalLM does not support padding (the attention_mask has zeros): "
                             "pass sequences of equal length, or generate one prompt at a time")
        cache = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        view = cache if cache is None or isinstance(cache, Cache) else _CacheView(cache)  # ours, or HF's seen as ours

        B, T = input_ids.shape
        start = view.length if view is not None else 0
        if position_ids is not None and not torch.equal(
                position_ids.to(input_ids.device).expand(B, T),
                torch.arange(start, start + T, device=input_ids.device).expand(B, T)):
            raise ValueError(f"position_ids must be {start}..{start + T - 1} (after the cache's {start} tokens): "
                             "the model has learned positions and no padding support")
        if start + T > self.cfg.seq_len:
            raise ValueError(f"{start + T} tokens exceed the model's context of {self.cfg.seq_len} "
                             "(max_position_embeddings): shorten the prompt or lower max_new_tokens")

        logits = GPT.forward(self, input_ids, cache=view).logits  # [B, T, vocab]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
        return out.to_tuple() if return_dict is False else out

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, *args, **kwargs):
        """`GenerationMixin.generate`, after checking that the requested length fits the context."""
        self._unset_moe_top_k()
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            gen = generation_config if generation_config is not None else self.generation_config
            new = kwargs.get("max_new_tokens", gen.max_new_tokens)
            total = ids.shape[-1] + new if new is not None else kwargs.get("max_length")
            if total is not None and total > self.cfg.seq_len:
                raise ValueError(f"generating to {total} tokens exceeds the model's context of {self.cfg.seq_len} "
                                 f"(max_position_embeddings): use max_new_tokens <= {self.cfg.seq_len - ids.shape[-1]}")
        return super().generate(inputs, generation_config, *args, **kwargs)


MoEPipelineForCausalLM.register_for_auto_class("AutoModelForCausalLM")
