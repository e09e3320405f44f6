"""The weight formats, one record each: what `--quantize` takes, where it can be written, and what runs it.

    from pipeline.schemes import SCHEMES, named, written_by
    SCHEMES["int4"].compressed_preset      # 'W4A16': llm-compressor's preset (export --format hf)
    written_by("gguf")                     # ('q8_0', 'q4_0', 'bf16')
    named("w8a8", "serve --quantize")      # the record, or a ValueError naming the flag and the choices

Export (`export --quantize`: our package, a family's compressed-tensors checkpoint, GGUF), serving
(`serve --quantize`, the weight classes and kernels of export/serve/linears.py), the CLI's choices and
the package manifest's schema all read this table; a new weight format is a record here, its
quantisation (pipeline/quantize.py), its weight class and kernel op, and the writers that take it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str  # what --quantize takes
    formats: tuple[str, ...]  # the export formats that write it: "package" (ours), "hf" (compressed-tensors), "gguf"
    packing: str  # how its weights are stored, in words
    stored: str | None = None  # the weights' kind in our package and in pipeline/quantize.py: "int8" or "int4"
    serve: bool = False  # `serve --quantize` takes it (quantised as the package loads)
    kernel_op: str | None = None  # the op of the CPU kernels (export/serve/csrc) that runs it
    compressed_preset: str | None = None  # llm-compressor's preset name (compressed-tensors)
    gguf_type: str | None = None  # the GGML tensor type of its linears (gguf.GGMLQuantizationType)
    gguf_head_type: str | None = None  # the output layer's, where llama.cpp keeps it wider
    needs: str | None = None  # a CPU feature its serving kernel needs


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("int8", ("package", "hf"), "int8 weights, one scale per output row (symmetric); inputs in the model's dtype",
           stored="int8", serve=True, kernel_op="int8_linear", compressed_preset="W8A16"),
    Scheme("int4", ("package", "hf"), "int4 weights two a byte, one scale per group of inputs of a row (symmetric)",
           stored="int4", serve=True, kernel_op="int4_linear", compressed_preset="W4A16"),
    Scheme("w8a8", ("hf",), "int8 weights per output row, and each row of a linear's inputs rounded to int8 as it "
           "arrives (dynamic per token: vLLM's W8A8)", stored="int8", serve=True, kernel_op="w8a8_linear",
           compressed_preset="W8A8", needs="AVX512_VNNI"),
    Scheme("q8_0", ("gguf",), "blocks of 32 values with one fp16 scale (llama.cpp)", gguf_type="Q8_0"),
    Scheme("q4_0", ("gguf",), "blocks of 32 4-bit values with one fp16 scale, the output layer in Q8_0 (llama.cpp)",
           gguf_type="Q4_0", gguf_head_type="Q8_0"),
    Scheme("bf16", ("gguf",), "bf16, unquantised (llama.cpp's BF16 file type)", gguf_type="BF16"),
)}
STORED = tuple(dict.fromkeys(s.stored for s in SCHEMES.values() if s.stored))  # ("int8", "int4")
SERVED = tuple(name for name, s in SCHEMES.items() if s.serve)  # ("int8", "int4", "w8a8")


def written_by(fmt: str) -> tuple[str, ...]:
    """The schemes export `--format fmt` writes."""
    return tuple(name for name, s in SCHEMES.items() if fmt in s.formats)


def named(name: str, flag: str = "--quantize", among: tuple[str, ...] | None = None) -> Scheme:
    """The record of `name`, or a ValueError naming `flag` and the choices (`among`: a subset, default all)."""
    choices = among if among is not None else tuple(SCHEMES)
    if name not in choices:
        raise ValueError(f"{flag} {name!r}: one of {', '.join(choices)}")
    return SCHEMES[name]
