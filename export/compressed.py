"""A quantised student in its family's Hugging Face format, as llm-compressor writes it (compressed-tensors):
`moe-pipeline export RUN --format hf --quantize int8|int4|w8a8`.

    moe-pipeline export runs/qwen3-moe-mos --format hf --quantize w8a8      # -> RUN/hf-w8a8: vLLM's CPU server
    moe-pipeline export runs/qwen3-moe-mos --format hf --quantize int4      # -> RUN/hf-int4: W4A16 (GPUs)
    python -m vllm.entrypoints.openai.api_server --model runs/qwen3-moe-mos/hf-w8a8
    AutoModelForCausalLM.from_pretrained("runs/qwen3-moe-mos/hf-int4")       # needs compressed-tensors installed

The schemes are llm-compressor's, with our quantiser's values (export/gptq.py: GPTQ calibrated on the run's training
split with every token through every expert, or `--quantize-method rtn`), the same values and scales our package
stores (`export --quantize`):

  int8   W8A16: int8 weights, one scale per output channel (symmetric); the activations stay in the model's dtype.
         Format `pack-quantized` (four int8 to an int32), as llm-compressor writes weight-only int8.
  int4   W4A16: int4 weights, one scale per `--group-size` inputs of a row (128 by default); `pack-quantized` (eight to
         an int32). For GPU kernels (Marlin, Machete); vLLM's x86 CPU backend has no int4 MoE.
  w8a8   W8A8: int8 weights per output channel as int8, and the inputs of every quantised linear quantised to int8
         per token as they arrive (dynamic, symmetric); `int-quantized`. What vLLM's x86 CPU backend runs for MoE
         models (its int8 oneDNN linears and int8 fused experts); weight-only int8 experts are refused there.

The tensors are compressed-tensors' own: each quantised linear's values and scale go through the library's compressor
for the scheme's format (`weight` int8 [out, in], or `weight_packed` int32 with `weight_shape`; `weight_scale`
[out, 1] or [out, groups]), and config.json's `quantization_config` is written by the library's ModelCompressor
(targets `Linear`; ignored: the routers, Qwen2-MoE's shared-expert gate and the output layer unless
`--quantize-head`, as llm-compressor's MoE recipes ignore them). The scales are fp32 (vLLM holds them in fp32;
llm-compressor writes the model's dtype), so every reader sees exactly the weights our package has. Everything else is
the family's checkpoint as export/native.py writes it (bf16 by default).
"""

from __future__ import annotations

import torch

from pipeline.families import FAMILIES
from pipeline.model import GPT, ModelConfig
from pipeline.schemes import SCHEMES as ALL_SCHEMES, named

# ours -> llm-compressor's preset name (pipeline/schemes.py)
SCHEMES = {name: s.compressed_preset for name, s in ALL_SCHEMES.items() if s.compressed_preset}


class CompressedExportError(ValueError):
    """A quantised checkpoint this writer cannot express, or a missing library; the message says what works."""


def require() -> None:
    """compressed-tensors importable, or a CompressedExportError saying how to install it."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as err:
        raise CompressedExportError(f"--format hf --quantize writes compressed-tensors, which is not installed "
                                    f"({err}): pip install 'moe-pipeline[compressed]' (compressed-tensors>=0.20, "
                                    f"torch>=2.10)") from err


def weight_scheme(scheme: str) -> str:
    """The weights' kind (pipeline/schemes.py `Scheme.stored`) of a compressed-tensors scheme: int8 for W8A16 and
    W8A8."""
    return named(scheme, "--quantize", among=tuple(SCHEMES)).stored


def ct_scheme(scheme: str, group: int):
    """compressed-tensors' QuantizationScheme of `scheme` (targets: every Linear), its format chosen by the library's
    own rule (`infer_module_format`, what llm-compressor calls when it saves)."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if scheme not in SCHEMES:
        raise ValueError(f"--quantize {scheme!r} with --format hf: one of {', '.join(SCHEMES)}")
    int4 = scheme == "int4"
    weights = QuantizationArgs(num_bits=4 if int4 else 8, type="int", symmetric=True, dynamic=False,
                               strategy="group" if int4 else "channel", group_size=group if int4 else None)
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token") \
        if scheme == "w8a8" else None
    out = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    out.format = infer_module_format(torch.nn.Linear, out).value
    return out


def ignored(cfg: ModelConfig, head_quantized: bool) -> list[str]:
    """The modules a scheme targeting every Linear leaves alone, as llm-compressor's recipes for these families list
    them: the routers (they choose every token's experts), Qwen2-MoE's shared-expert gate (each family's
    `compressed_ignore`, pipeline/families/), the output layer."""
    return ([] if head_quantized else ["lm_head"]) + list(FAMILIES[cfg.family].compressed_ignore)


def quantization_config(cfg: ModelConfig, scheme: str, group: int, head_quantized: bool):
    """compressed-tensors' QuantizationConfig of a checkpoint written here (status: compressed)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    ct = ct_scheme(scheme, group)
    return QuantizationConfig(config_groups={"group_0": ct}, format=ct.format, ignore=ignored(cfg, head_quantized),
                              quantization_status=QuantizationStatus.COMPRESSED)


def check_groups(kinds: dict[str, str], model: GPT, scheme: str, group: int) -> None:
    """Refuse an int4 export whose weights do not all divide into groups of `group` inputs (compressed-tensors has one
    scheme for every Linear here, and vLLM's group kernels take whole groups), naming the weight and what works."""
    if scheme != "int4":
        return
    shapes = dict(model.named_parameters())
    for name, kind in kinds.items():
        if kind != "int4":
            inputs = shapes[name].shape[1]
            raise CompressedExportError(f"--quantize int4 --format hf: {name} has rows of {inputs} inputs, which do "
                                        f"not divide into groups of {group} (--group-size); pass a --group-size "
                                        f"dividing every layer's inputs (a multiple of 64), or --quantize int8|w8a8")


def compressed_tensors(cfg: ModelConfig, kinds: dict[str, str], stored: dict[str, torch.Tensor], scheme: str,
                       group: int) -> dict[str, torch.Tensor]:
    """{the family's tensor name: tensor} of every quantised weight (our parameter names in `kinds`, their values and
    scales in `stored` as export.package.quantize_stage gives them), compressed by compressed-tensors' compressor of
    the scheme's format. A parameter the family splits (a SwiGLU fc1: gate, up) is split along its rows, scales too."""
    from compressed_tensors.compressors import BaseCompressor

    from pipeline.hf_import import hf_sources
    from pipeline.quantize import dequantized, scale_name, unpack_int4, values_name

    ct = ct_scheme(scheme, group)
    compressor = BaseCompressor.get_value_from_registry(ct.format)
    out = {}
    for name, kind in kinds.items():
        values, scale = stored[values_name(name, kind)], stored[scale_name(name)]
        q = unpack_int4(values) if kind == "int4" else values
        keys = hf_sources(cfg, name)
        for key, qp, sp in zip(keys, q.chunk(len(keys)), scale.chunk(len(keys))):
            module = key[:-len(".weight")]
            weight = dequantized(qp, sp, group)  # exactly q * scale in fp32: the compressor rounds it back to q
            parts = compressor.compress({"weight": weight, "weight_scale": sp.reshape(len(sp), -1).float()}, ct)
            out.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
    return out
