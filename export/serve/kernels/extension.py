"""The serving kernels' C++ extension (csrc/): built at first use, one build per instruction set and prefetch hint.

    from export.serve.kernels import kernel
    k = kernel()                 # the extension's module, built or loaded once per process; None where it cannot be

The extension is built with torch.utils.cpp_extension (a C++ compiler and ninja, as DeepSpeed's own CPU ops need;
cached under ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), one build per instruction set (`cpu_isa`):
AVX-512, with AVX512_BF16's bf16 dot products where the CPU has them and AMX's tiles where it has those, or AVX2 +
FMA; and per prefetch hint (`prefetch_hint`: Intel and AMD CPUs stream the weight fastest with different ones).
Without it (another CPU, no compiler: one warning), few rows go where more rows go (oneDNN).
`serve --cpu-linears onednn` leaves the kernel out, `aten` every layer as it is (F.linear): options.py.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch

import export.serve.kernels.options as options

CSRC = Path(__file__).resolve().parent / "csrc"
# one extension from csrc/, a file an op (csrc/kernels.h lists them), compiled as two translation units of about
# equal work, in parallel (csrc/ops_dense.cpp says why)
SOURCES = [CSRC / "ops_dense.cpp", CSRC / "ops_model.cpp"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
ISA_FLAGS = {"AMX_BF16": [*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
             "AVX512_BF16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
             "AVX512": _AVX512, "AVX2": ["-mavx2", "-mfma"]}

_kernel_lock = threading.Lock()
_kernel: object | None = None
_kernel_tried = False
_built_hint: str | None = None


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` are served by this module here (and it is not switched off)."""
    return (options.current().linears != "aten" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def kernel():
    """The kernels' extension (csrc/), built or loaded once per process; None where it cannot be."""
    global _kernel, _kernel_tried
    if options.current().linears == "onednn":
        return None
    if _kernel_tried:
        return _kernel
    with _kernel_lock:
        if _kernel_tried:
            return _kernel
        isa = cpu_isa()
        if isa not in ISA_FLAGS:
            warnings.warn(f"CPU capability {isa}: no GEMV kernel for it (AVX-512 or AVX2 + FMA); few-row linears "
                          "use oneDNN", stacklevel=2)
        else:
            try:
                _kernel = build(isa)
            except Exception as err:  # no compiler, no ninja, a read-only cache: serve without it
                warnings.warn(f"the kernels' extension ({CSRC}) was not built ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}); few-row linears "
                              f"use oneDNN", stacklevel=2)
        _kernel_tried = True
        return _kernel



def _cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo line starting with `key` ("flags", "vendor_id"); "" where there is none (not Linux)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(key)), "")
    except OSError:
        return ""


def cpu_isa() -> str:
    """torch's CPU capability, as AVX512_BF16 where the CPU also has AVX512_BF16 (VDPBF16PS: bf16 dot products,
    Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on) and AVX512_VNNI (VPDPBUSD: int8 dot products; every
    CPU with AVX512_BF16 has it), and as AMX_BF16 where it also has AMX's bf16 tiles
    (Intel Sapphire Rapids on); torch reports neither. Without /proc/cpuinfo (not Linux): the AVX-512 build, whose
    bf16 path needs no extension."""
    isa = torch.backends.cpu.get_cpu_capability()
    flags = set(_cpuinfo("flags").split())
    if isa == "AVX512" and {"avx512_bf16", "avx512_vnni"} <= flags:
        return "AMX_BF16" if {"amx_tile", "amx_bf16"} <= flags else "AVX512_BF16"
    return isa


def prefetch_hint(choice: str | None = None) -> str:
    """How the kernel prefetches the weight it streams: "t0" (into every cache level) on Intel CPUs, "nta"
    (non-temporal, sparing the caches) elsewhere; `choice` (default the options' `--prefetch`) t0 or nta decides
    instead. Why by vendor: on an Intel Xeon (Sapphire Rapids) T0 streamed the output layer faster and made whole
    decode steps quicker, on an AMD EPYC (Zen 4) NTA's spared caches did (benchmarks/decode_bandwidth.py,
    benchmarks/peer_bench.py; docs/results.md)."""
    choice = (choice or options.current().prefetch).lower()
    if choice in ("t0", "nta"):
        return choice
    if choice != "auto":
        raise ValueError(f"--prefetch {choice!r}: use t0, nta or auto (t0 on Intel CPUs, else nta)")
    return "t0" if "GenuineIntel" in _cpuinfo("vendor_id") else "nta"


def build(isa: str, hint: str | None = None):
    """csrc/ compiled for `isa` (a key of ISA_FLAGS) with the prefetch `hint` (default `prefetch_hint()`),
    or loaded from the extensions cache."""
    from torch.utils.cpp_extension import load

    global _built_hint
    hint = hint or prefetch_hint()
    _built_hint = hint
    t0 = ["-DMOE_PREFETCH_T0"] if hint == "t0" else []
    return load(name=f"moe_pipeline_kernels_{isa.lower()}" + ("_t0" if t0 else ""), sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS[isa], *t0], verbose=False)



def built():
    """The kernel if this process has built or loaded it, else None (without building it)."""
    return _kernel if _kernel_tried else None


def built_hint() -> str | None:
    """The prefetch hint the kernel was built with (None before it is built)."""
    return _built_hint


def kernel_has(op: str, x: torch.Tensor) -> bool:
    """Whether the kernel is here with `op` and takes x: on the CPU, fp32 or bf16."""
    k = kernel()
    return k is not None and hasattr(k, op) and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
