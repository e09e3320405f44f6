"""The served model, built in one place: a package and a layout in, the model this rank serves out.

    from export.serve.served import serve_model
    served = serve_model(ServeConfig(package="runs/tiny/package"), dist.init())
    engine = Engine(served.model, served.tokenizer, exchange=served.exchange, layout=served.layout, ...)
    # (export/serve/engine.py `Engine.from_config` does this)

In order:

1. the package verified (export/package.py) and the layout chosen (`data_parallel_layout`): data parallel, each
   rank its own rows and the experts placed over the ranks; or sliced (--tp-size, --ep-size below the rank count),
   every rank running rank 0's rows through DeepSpeed's inference engine (export/inference.py `load_package`:
   DeepSpeed's modules, which its engine owns, are served as they are);
2. the weights resolved (`served_weights`): the package's stored int8/int4, `--quantize`, or the package's dtype;
3. the data-parallel model assembled (`placed_model`): every MoE layer a `PlacedMoE` whose experts come through
   this rank's `Exchange` (export/serve/placement/exchange.py `place_experts`), then the CPU kernels swapped in as
   gpt-fast swaps linears (export/serve/kernels/swaps.py): the linears, each attention layer a `FusedAttention`
   (one q/k/v projection), the norms, and the quantised weights;
4. the large weights moved into a file mapping (export/serve/kernels/mapping.py `map_weights`), before any kernel
   holds them.

The native decoder (export/serve/decode.py) reads the result through its typed per-layer spec (`decode_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from export.serve import kernels
from export.serve.config import ServeConfig
from export.serve.placement.exchange import Exchange, place_experts
from pipeline.model import GPT, ModelConfig
from pipeline.schemes import SCHEMES

if TYPE_CHECKING:
    from export.inference import Layout


@dataclass(frozen=True)
class ServedWeights:
    """What the served weights are: `scheme` (int8, int4, w8a8: the kernels' quantised weights; None: the package's
    dtype), with `head` the output layer too; `stored`: a quantised package's scheme (its manifest's `quantization`),
    whose values and scales are taken as stored."""

    scheme: str | None = None
    head: bool = False
    stored: dict | None = None

    def describe(self) -> str:
        if self.scheme is None:
            return "package dtype"
        return (f"{self.scheme}{' with the output layer' if self.head else ''}"
                f"{' (stored)' if self.stored is not None else ' (quantised at load)'}")


@dataclass(frozen=True)
class Served:
    """What this rank serves: the model, its tokenizer, its expert exchange (the data-parallel path; None where
    DeepSpeed's engine slices the model), the layout, the weights, and the bytes moved into the file mapping."""

    model: GPT
    tokenizer: object
    exchange: Exchange | None
    layout: Layout
    weights: ServedWeights
    mapped_bytes: int

    @property
    def data_parallel(self) -> bool:
        return self.exchange is not None


def data_parallel_layout(cfg: ModelConfig, config: ServeConfig, world: int) -> bool:
    """Whether `config` on `world` ranks serves data parallel (each rank its own sequences, an expert all-to-all
    in every MoE layer): no tensor slicing, and every MoE layer's experts split over all the ranks (no expert
    slicing). Otherwise one group runs rank 0's rows on every rank (DeepSpeed's inference engine)."""
    if (config.tp_size or 1) > 1 or (config.ep_size or world) != world:
        return False
    return all(n % world == 0 for n in cfg.experts)


def served_weights(config: ServeConfig, stored: dict | None, dp: bool, experts: list[int], world: int) -> ServedWeights:
    """The weights `config` serves from a package whose manifest's `quantization` is `stored` (None: not
    quantised), on the data-parallel path (`dp`) or not. Refuses, naming the flag, a --quantize the package or this
    CPU cannot serve."""
    scheme, head = config.quantize, config.quantize_head
    if stored is not None:
        if scheme is not None and SCHEMES[scheme].stored != stored["scheme"]:
            raise ValueError(f"--quantize {scheme}: this package holds {stored['scheme']} weights (exported with "
                             f"--quantize {stored['scheme']}; an int8 one also serves --quantize w8a8); drop "
                             f"--quantize, or serve a package exported without it")
        if not dp:  # DeepSpeed's sliced path reads the package's dequantised weights
            return ServedWeights()
        # an int8 package under --quantize w8a8: its weights, int8 inputs
        scheme, head = scheme or stored["scheme"], head or stored["head"]
    elif scheme is not None and not dp:
        raise ValueError(f"--quantize {scheme}: the data-parallel layout only, and this package's experts "
                         f"{list(experts)} do not split evenly over {world} ranks")
    if scheme is not None and SCHEMES[scheme].needs and not hasattr(kernels.kernel(), SCHEMES[scheme].kernel_op):
        raise ValueError(f"--quantize {scheme}: its kernels need a CPU with {SCHEMES[scheme].needs} (and the GEMV "
                         f"kernel built); serve --quantize int8 (weight-only) instead")
    return ServedWeights(scheme, head, stored)


def _stored_dense(model: GPT, src: Path, stored: dict | None, files: dict | None) -> dict:
    """{weight name: its quantised weight} of the dense part of a quantised package (`stored`: its manifest's
    `quantization`), read as stored; {} for another package."""
    if stored is None:
        return {}
    from pipeline.build import meta_model
    from pipeline.model import split_expert_key
    from pipeline.quantize import scale_name, values_name, weight_kinds
    from pipeline.weights import read_tensors

    kinds = {n: k for n, k in weight_kinds(meta_model(model.cfg), stored["scheme"], stored["head"], stored["group"]).items()
             if split_expert_key(n) is None}
    raw = read_tensors(src, [t for n, k in kinds.items() for t in (values_name(n, k), scale_name(n))], files)
    return {n: kernels.stored_weight(raw[values_name(n, k)], raw[scale_name(n)]) for n, k in kinds.items()}


def swap_kernels(model: GPT, src: Path, weights: ServedWeights, files: dict | None = None) -> GPT:
    """The CPU kernels swapped into `model` in place (export/serve/kernels/swaps.py): the few-row kernel and oneDNN
    for the linears, one `FusedAttention` per attention layer, RMSNorm in one call, and `weights`' quantised weights
    (a stored package's read from `src` as they are)."""
    kernels.serving_linears(model)
    kernels.serving_norms(model)
    if weights.scheme is not None:
        kernels.quantize_linears(model, weights.scheme, head=weights.head,
                                 stored=_stored_dense(model, src, weights.stored, files))
    return model


@dataclass(frozen=True)
class PlacedModel:
    """The data-parallel path's model with its kernels swapped in, this rank's exchange, and the layout."""

    model: GPT
    exchange: Exchange
    layout: Layout


def placed_model(cfg: ModelConfig, src: Path, ranks, dtype: torch.dtype, resident_fraction: float = 1.0,
                 files: dict | None = None, transport: str = "auto", quantize: str | None = None,
                 quantize_head: bool = False, stored: dict | None = None) -> PlacedModel:
    """The model of `cfg` from the weights in `src` (a package or a stage directory) as the data-parallel path
    serves it on this rank: the MoE placed (`place_experts`: every rank holds the dense part and the gates, its
    experts through its `Exchange`), then the kernels swapped in (`swap_kernels`). `files`: what verification saw
    of each file (every read compares it with the open file first). `quantize` (int8, int4, w8a8): the experts and
    the dense linears quantised as they load (CPU only), with `quantize_head` the output layer too; `stored`: a
    quantised package's scheme, its values and scales taken as they are."""
    from export.inference import Layout

    model, exchange = place_experts(cfg, src, ranks, dtype, resident_fraction, files, transport, quantize)
    swap_kernels(model, src, ServedWeights(quantize, quantize_head, stored), files)
    return PlacedModel(model, exchange, Layout(ranks.world, 1, tuple(ranks.world for _ in cfg.experts), ranks.world))


def serve_model(config: ServeConfig, ranks) -> Served:
    """The model `config` serves on this rank (module docstring: verified, laid out, weights resolved, placed and
    swapped, mapped). Collective with several ranks."""
    from export.inference import load_package, plan_layout
    from export.package import package_dtype, read_tokenizer, verified_package

    verified = verified_package(config.package, config.checksums)
    cfg = verified.cfg
    dp = data_parallel_layout(cfg, config, ranks.world)
    weights = served_weights(config, verified.manifest.get("quantization"), dp, cfg.experts, ranks.world)
    if dp:
        placed = placed_model(cfg, config.package, ranks, package_dtype(verified.manifest, config.dtype),
                              config.resident_experts, files=verified.files, transport=config.expert_exchange,
                              quantize=weights.scheme, quantize_head=weights.head, stored=weights.stored)
        model, exchange, layout = placed.model, placed.exchange, placed.layout
        tokenizer = read_tokenizer(config.package, verified.files)
    else:
        model, tokenizer = load_package(config.package, ranks, ep_size=config.ep_size, checksums=config.checksums,
                                        dtype=config.dtype, tp_size=config.tp_size)
        exchange, layout = None, plan_layout(cfg, ranks.world, config.ep_size, config.tp_size)
    mapped = kernels.map_weights(model, exchange) if next(model.parameters()).device.type == "cpu" else 0
    return Served(model, tokenizer, exchange, layout, weights, mapped)
