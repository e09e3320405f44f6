"""What a Hugging Face MoE family is to us: the typed record each module of pipeline/families/ fills.

A `Family` holds, for one Hugging Face `model_type`, everything that is not the Llama-style layout all our families
share: how its config.json becomes the family part of a `ModelConfig` and back (`read_hf`, `write_hf`), what of its
config.json we cannot run exactly (`refusals`), its tensor names where they differ (`moe_prefix`, `expert_names`), its
llama.cpp architecture and that writer's quirks (`gguf_*`), and the modules compressed-tensors leaves alone
(`compressed_ignore`). pipeline/hf_import.py, export/native.py, export/gguf.py and export/compressed.py read it;
pipeline/families/__init__.py says what a new family's module defines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pipeline.model import ModelConfig

# get(*names, default=...): the first of `names` config.json sets (not null), else `default`; with no default, an
# HFImportError naming the field (pipeline/hf_import.py passes it in, so a family module needs no error of its own)
Get = Callable[..., Any]


def _set(value) -> bool:
    return value is not None


@dataclass(frozen=True)
class Refusal:
    """A config.json field whose value we cannot run exactly. Refused when `refused(value)` (default: set, not null),
    as "{config.json}: {field} {value}: {why}"; `why` says what is unsupported and, where there is one, the fix."""

    field: str
    why: str
    refused: Callable[[Any], bool] = _set

    def message(self, raw: dict) -> str | None:
        """The error for this config.json (`raw`), or None when it is accepted."""
        value = raw.get(self.field)
        if not self.refused(value):
            return None
        shown = ("true" if value else "false") if isinstance(value, bool) else value  # as config.json spells it
        return f"{self.field} {shown}: {self.why}"


@dataclass(frozen=True)
class HFShape:
    """The family part of a `ModelConfig`, read from a config.json by `Family.read_hf`: where the experts are, the
    widths, the attention biases, the top-k renormalisation and Qwen2-MoE's shared expert."""

    moe_layers: tuple[int, ...]
    expert_hidden: int  # each expert's width
    ffn_hidden: int  # a dense layer's width (the expert width in families with no dense layers)
    qkv_bias: bool
    out_bias: bool
    renormalize: bool  # top-k weights rescaled to sum to 1
    shared_expert_hidden: int = 0  # 0: none


@dataclass(frozen=True)
class Family:
    """One Hugging Face MoE family. Data fields here; a family's module subclasses it for `read_hf` and `write_hf`
    (and the GGUF hooks where llama.cpp's converter has quirks for it) and makes its one instance `FAMILY`."""

    model_type: str  # config.json's model_type, and ModelConfig.family of a model imported from it
    title: str  # the family's own spelling in messages ("Qwen3-MoE")
    architecture: str  # transformers' class, config.json's `architectures` on export ("Qwen3MoeForCausalLM")
    refusals: tuple[Refusal, ...] = ()  # checked in order on import, after the rotary and activation checks
    qk_norm: str = "none"  # ModelConfig.qk_norm: "none" | "head" | "full"
    rope_theta: float = 10000.0  # when config.json names none (transformers' default for the family)
    dense_layers: bool = False  # config.json can list dense layers (Qwen's mlp_only_layers); else every layer is MoE
    # tensor names: "model.layers.{i}.{moe_prefix}.gate.weight" (the router) and
    # "model.layers.{i}.{moe_prefix}.experts.{e}.{name}.weight", name one of expert_names = (gate, up, down)
    moe_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # GGUF: gguf-py's MODEL_ARCH member llama.cpp runs the family as (None: none, refused)
    gguf_arch: str | None = None
    gguf_permute_qk: bool = False  # q and k rows permuted as the converter permutes llama's (adjacent-pair rotation)
    gguf_experts_key: str = "model.layers.{layer}.mlp.experts.{proj}.weight"  # the name gguf-py maps to stacked experts
    # compressed-tensors: the modules a scheme targeting every Linear leaves alone (besides lm_head): the routers and
    # what else llm-compressor's recipes for the family ignore
    compressed_ignore: tuple[str, ...] = ("re:.*mlp.gate$",)

    def read_hf(self, raw: dict, get: Get, layers: int, experts: int) -> HFShape:
        """The family part of the `ModelConfig` of config.json `raw` (`layers` layers, `experts` experts a layer)."""
        raise NotImplementedError(f"{type(self).__name__}.read_hf")

    def write_hf(self, cfg: ModelConfig, experts: int, dense: list[int]) -> dict:
        """The config.json keys of the family's own (beyond the ones every family shares, export/native.py) of a model
        of `cfg` with `experts` experts a MoE layer and the dense layers `dense`; `read_hf` reads them back."""
        raise NotImplementedError(f"{type(self).__name__}.write_hf")

    def gguf_refusal(self, cfg: ModelConfig) -> str | None:
        """Why llama.cpp's architecture cannot run this model of the family, or None."""
        return None

    def gguf_metadata(self, writer, cfg: ModelConfig) -> None:
        """The hyper-parameters llama.cpp's converter adds for this family, on gguf-py's GGUFWriter `writer`."""


def every_layer(layers: int) -> tuple[int, ...]:
    """Mixtral's and OLMoE's rule: every layer is an MoE layer."""
    return tuple(range(layers))


def sparse_step_layers(get: Get, layers: int, experts: int) -> tuple[int, ...]:
    """Qwen's rule: layer i is MoE unless in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0."""
    step, dense = get("decoder_sparse_step", default=1), set(get("mlp_only_layers", default=[]))
    return tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
