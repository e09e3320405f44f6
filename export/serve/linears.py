"""Linear layers for serving on the CPU: a GEMV kernel of ours for a few rows, oneDNN for more.

    from export.serve.linears import serving_linears
    serving_linears(model)       # every large enough nn.Linear of a CPU model in eval mode, in place

PyTorch's CPU `F.linear` goes to MKL, which on this machine's AMD EPYC runs at half speed: ~20 GB/s of weight
read at batch 1, fp32 (a plain read of the same bytes: ~42 GB/s), 2-3x slower than oneDNN at 2-512 rows.
`torch.ops.mkldnn._linear_pointwise` (oneDNN) runs the dense layers' many rows on a copy of the weight prepacked
into its blocked layout (1.1-1.6x faster than on the plain weight at 5-257 rows on an AMD EPYC with AVX512_BF16,
the same results): a second copy of those weights (attention, dense MLPs, lm_head; not the experts, which stay as
they are, nothing to reorder when one loads). For 1-8
rows (batch-1 and small-batch decode) `csrc/gemv.cpp` reads the weight once at the memory's speed: ~42 GB/s
where oneDNN reaches ~31 and MKL ~21, under a competing process ~28 against ~21. On a CPU with AMX (Intel Sapphire Rapids on) the
second copy of a bf16 weight is packed for the kernel's `amx_linear` instead, which streams it once for 2-256 rows
(VDPBF16PS and oneDNN's AMX GEMM both fell to a half or less of the memory's speed at 8-32 rows there). Measured by
benchmarks/decode_bandwidth.py (batch-1 decode against the read-bandwidth bound). A weight under 512K elements
(the tiny recipe's) goes to F.linear for more rows: as fast as oneDNN at that size, and oneDNN compiles and keeps
a primitive for every row count it meets (a soak's RSS grew 5-7%); for larger ones oneDNN sees row counts rounded
up to 8 sizes per octave (`bucket`).

The kernel is built at first use with torch.utils.cpp_extension (a C++ compiler and ninja, as DeepSpeed's own CPU
ops need; cached under ~/.cache/torch_extensions, one build per instruction set: AVX-512, with AVX512_BF16's bf16
dot products where the CPU has them, or AVX2 + FMA; and per prefetch hint, `prefetch_hint`: Intel and AMD CPUs
stream the weight fastest with different ones). Without it (another CPU, no compiler: one warning), few rows
go where more rows go. fp32 and bf16 on a CPU with oneDNN only. Where oneDNN has no bf16 primitive (CPUs without
AVX-512), bf16 rows past the kernel's go through the kernel eight at a time (F.linear's bf16 fallback there took
twice as long: 1.41 s against 0.69 s for 64 rows of a 50,304 x 512 lm_head, one AVX2 thread).
MOE_PIPELINE_CPU_LINEARS=onednn leaves the kernel out, =0 leaves every layer as it is (F.linear).

The model's output layer also gets a `HeadScreen`: greedy rows' tokens from an int8 copy of it plus the exact rows
its error bound cannot rule out (the same tokens, about half the bytes; MOE_PIPELINE_HEAD_SCREEN=0: none).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from export.serve import transport
from pipeline.quantize import (INT4_GROUP, dequantized, fits_int4, int8_rows, pack_int4, quantize_int4, quantize_int8,
                               unpack_int4)

SERVE_FROM = 1 << 14  # weights with fewer elements stay plain nn.Linear (F.linear's call is cheapest)
# below this, more rows go to F.linear: as fast there, and no primitive cache to grow. 1 << 19: the Qwen3-MoE of the
# peer benchmark has experts' down projections of 768 x 1024 (786K), which F.linear (aten::mm) ran at ~290 GFLOPS in
# a prefill where oneDNN runs ~400 (16 prompts of 128 tokens: 4,252 / 4,173 against 4,016 / 3,989 tok/s at 1 << 20)
ONEDNN_FROM = 1 << 19
PACK_ROWS = 32  # the row count oneDNN's packed weight layout is chosen for (a decode batch's)
# how a ServingWeight runs more rows than the few-row kernel takes (`ServingWeight.more`; csrc/gemv.cpp `DecodeLinear`
# takes the same codes): oneDNN on its packed copy, the kernel MAX_ROWS rows at a time, F.linear; and an nn.Linear left
# as it is (F.linear at every row count)
MORE_ONEDNN, MORE_CHUNKS, MORE_ATEN, MORE_PLAIN = 0, 1, 2, 3
MORE_INT8 = 4  # csrc/gemv.cpp DecodeLinear: an Int8Weight (its int8 weight, and its scales where `packed` goes)
MORE_INT4 = 5  # and an Int4Weight (its packed weight, its group scales)
MORE_W8A8 = 6  # and a W8A8Weight (its tiles, its scales and rows' sums)
ENV = "MOE_PIPELINE_CPU_LINEARS"  # 1 (default) | onednn | 0
PREFETCH_ENV = "MOE_PIPELINE_PREFETCH"  # t0 | nta; unset: `prefetch_hint`'s choice for this CPU
SOURCE = Path(__file__).resolve().parent / "csrc" / "gemv.cpp"
SOURCES = [SOURCE, SOURCE.parent / "sampling.cpp"]  # one extension: the linears and the rest, the sampler
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
ISA_FLAGS = {"AMX_BF16": [*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
             "AVX512_BF16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
             "AVX512": _AVX512, "AVX2": ["-mavx2", "-mfma"]}

_kernel_lock = threading.Lock()
_kernel: object | None = None
_kernel_tried = False


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` are served by this module here (and it is not switched off)."""
    return (os.environ.get(ENV, "1") != "0" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def kernel():
    """The few-row kernel (csrc/gemv.cpp), built or loaded once per process; None where it cannot be."""
    global _kernel, _kernel_tried
    if os.environ.get(ENV, "1") == "onednn":
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
                warnings.warn(f"the GEMV kernel {SOURCE.name} was not built ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}); few-row linears "
                              f"use oneDNN", stacklevel=2)
        _kernel_tried = True
        return _kernel


MAP_ENV = "MOE_PIPELINE_MAP_WEIGHTS"  # 1 (default) | 0: served weights stay in anonymous memory
MAP_FROM = 1 << 20  # storages of at least this many bytes are moved into the mapping
SCREEN_ENV = "MOE_PIPELINE_HEAD_SCREEN"  # 1 (default) | 0: greedy rows read the whole output layer (`HeadScreen`)


def map_weights(*roots, directory: str | None = None) -> int:
    """The large CPU weights reachable from `roots` (modules with their ServingWeights, the experts' residency)
    moved into one file mapping: a file in `directory` (default: the temporary directory) mapped shared (under
    MADV_HUGEPAGE) and unlinked, each storage's bytes copied in, then each storage takes its part of the mapping
    as its memory (csrc/gemv.cpp `adopt_storage`: every tensor on it follows: views, detached copies, references
    the kernels hold; the anonymous copy is freed). Not what an object marked `file_backed` holds (the package's
    memory-mapped experts, export/serve/placement/residency.py `ExpertStore`: already a file). Returns the bytes
    moved; 0 without the kernel or with MOE_PIPELINE_MAP_WEIGHTS=0.

    Why: Linux keeps the page cache of a file on disk in large folios that map as 2 MB pages (ext4 and XFS on recent
    kernels: /proc/meminfo's FileHugePages), where anonymous memory may get 4 KB pages only (this VM's: AnonHugePages
    0 kB even under MADV_HUGEPAGE). A decode step streams every active weight once, and with 4 KB pages the stream
    crosses a page (a TLB miss, a prefetcher restart) every 4 KB: the bf16 lm_head of the peer benchmark's Qwen3-MoE
    (103 MB, 2 threads, AMD EPYC) read 48-50 GB/s from a mapping against 40 from anonymous memory, 15 rounds
    alternated in one process; our server at 1 concurrent, 5 alternated rounds: 159.2 against 133.1 tok/s. llama.cpp
    reads its GGUF through mmap the same way. The cost: the weights' bytes go once to that directory's disk (the
    kernel writes the dirty pages back after the start), and under memory pressure the kernel may drop clean pages
    and read them back from there."""
    k = kernel()
    if k is None or not hasattr(k, "adopt_storage") or os.environ.get(MAP_ENV, "1") == "0":
        return 0
    storages: dict[int, torch.Tensor] = {}  # data_ptr -> a uint8 view of the whole storage
    seen, stack = set(), list(roots)
    while stack:
        o = stack.pop()
        if (id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool))
                or getattr(o, "file_backed", False)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type != "cpu" or o.layout != torch.strided or o.is_mkldnn:
                continue
            try:
                st = o.untyped_storage()
            except NotImplementedError:  # an opaque tensor (oneDNN's packed weights): no storage to move
                continue
            if (st.nbytes() >= MAP_FROM
                    and st.data_ptr() not in storages and getattr(st, "filename", None) is None):
                storages[st.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(st)
        elif isinstance(o, nn.Module):
            stack.extend(vars(o).values())
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif type(o).__module__.startswith(("export.", "pipeline.")) and hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    if not storages:
        return 0
    import mmap
    import tempfile

    views = sorted(storages.values(), key=lambda v: v.data_ptr())
    offsets, total = [], 0
    for v in views:  # one after another, 64-byte aligned
        offsets.append(total)
        total += (v.numel() + 63) // 64 * 64
    fd, path = tempfile.mkstemp(prefix="moe-pipeline-weights-", dir=directory)
    try:
        os.ftruncate(fd, total)
        region = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    # the page cache's folios are made as the copy below faults them in: PMD-sized under MADV_HUGEPAGE (524 of the
    # peer package's 529 MB as 2 MB pages, where the bytes written with write() came out 320 MB so)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    mapping = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while a storage uses it
    for v, off in zip(views, offsets):
        mapping[off:off + v.numel()].copy_(v)
        k.adopt_storage(v, mapping, off)
    del views, storages
    try:  # the heap keeps the freed copies (pipeline/dist.py `tune_cpu_allocator`): back to the OS
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return total


REDUCE_ENV = "MOE_PIPELINE_LOCAL_REDUCE"  # 1 (default) | 0: DeepSpeed's shared-memory all-reduce instead
REDUCE_SLOT_BYTES = 4 << 20  # a rank's slot in the shared region (two a rank): larger tensors go a slot at a time


def attach_local_reduce() -> bool:
    """Between the ranks of one machine on the CPU accelerator (`transport.shared_memory_reduce`), the serving ranks' sums
    (`transport.fast_all_reduce_`: the expert exchange, the step results; the decode kernel's gathered layers) through
    csrc/gemv.cpp `local_reduce_`, which waits for the other ranks without holding a core, instead of DeepSpeed's
    kernel, which spins. Collective (every rank, once, before the first forward); False where it does not apply
    (1 rank, several machines, no kernel here, or MOE_PIPELINE_LOCAL_REDUCE=0 on any rank: they agree first)."""
    import torch.distributed as td

    from pipeline import dist

    if not (td.is_initialized() and td.get_world_size() > 1 and transport.shared_memory_reduce()):
        return False
    k = kernel()
    wanted = os.environ.get(REDUCE_ENV, "1") != "0" and k is not None and hasattr(k, "local_reduce_")
    if not all(row[0] for row in dist.gather_numbers([float(wanted)])):
        return False
    world = td.get_world_size()
    region = transport.shared_region(world * 64 + 2 * world * REDUCE_SLOT_BYTES)
    k.local_reduce_attach(region, td.get_rank(), world, REDUCE_SLOT_BYTES)
    transport.use_local_reduce(k.local_reduce_, getattr(k, "local_gather", None))
    return True


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


def prefetch_hint() -> str:
    """How the kernel prefetches the weight it streams: "t0" (into every cache level) on Intel CPUs, "nta"
    (non-temporal, sparing the caches) elsewhere; MOE_PIPELINE_PREFETCH=t0|nta decides instead. Measured with the
    kernel alone and in whole decode steps of benchmarks/peer_bench.py's Qwen3-MoE package: on an Intel Xeon
    (Sapphire Rapids, 2 cores) T0 read the bf16 lm_head at 14.2 GB/s against NTA's 11.7, and steps of 1, 8 and 32
    rows took 11%, 11% and 4% less time (medians); on an AMD EPYC (Zen 4) NTA's spared caches made steps 4-8%
    faster."""
    hint = os.environ.get(PREFETCH_ENV, "").lower()
    if hint in ("t0", "nta"):
        return hint
    if hint:
        raise ValueError(f"{PREFETCH_ENV}={hint!r}: use t0 or nta (or leave it unset: t0 on Intel CPUs, else nta)")
    return "t0" if "GenuineIntel" in _cpuinfo("vendor_id") else "nta"


def build(isa: str, hint: str | None = None):
    """csrc/gemv.cpp compiled for `isa` (a key of ISA_FLAGS) with the prefetch `hint` (default `prefetch_hint()`),
    or loaded from the extensions cache."""
    from torch.utils.cpp_extension import load

    hint = hint or prefetch_hint()
    t0 = ["-DMOE_PREFETCH_T0"] if hint == "t0" else []
    return load(name=f"moe_pipeline_gemv_{isa.lower()}" + ("_t0" if t0 else ""), sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS[isa], *t0], verbose=False)


class ServingWeight:
    """A [out, in] weight (as it was: contiguous, its own dtype) and the linear that fits a call's row count."""

    def __init__(self, weight: torch.Tensor, pack: bool = False):
        self.weight = weight.detach().contiguous()
        self.gemv = kernel()
        # more rows: oneDNN, where it runs this dtype (bf16 needs AVX-512: on an AVX2 CPU it has no bf16 primitive)
        self.onednn = self.weight.numel() >= ONEDNN_FROM and (
            self.weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        # `pack`: a second copy of the weight for more rows, beside the plain one the few-row kernel reads. Dense
        # layers only: an expert stays one copy (residency loads and drops experts as they are). On a CPU with AMX
        # (bf16): packed into AMX tiles for the kernel's `amx_linear`, 2 to AMX_MAX_ROWS rows at the memory's speed
        # (Sapphire Rapids, 2 cores, bf16 lm_head: 8 rows 7.8 ms, 32 rows 11.5 ms, where oneDNN's AMX GEMM took
        # 13.5 and 20.0); otherwise oneDNN's own blocked copy: 1.1-1.6x faster at 5-257 rows than on the plain one
        # (bf16 lm_head at 32 rows on an AMD EPYC: 16.4 -> 10.2 ms), the same results to the bit
        # past the kernel's rows without oneDNN: bf16 (no bf16 GEMM on this CPU) through the kernel, else F.linear
        self.more = MORE_ONEDNN if self.onednn else MORE_CHUNKS if (
            self.gemv is not None and self.weight.dtype == torch.bfloat16 and self.weight.numel() >= ONEDNN_FROM) \
            else MORE_ATEN
        self.packed, self.amx = self.weight, None
        if pack and self.onednn and amx_packs(self.weight):
            self.amx = self.gemv.amx_pack(self.weight)
        elif pack and self.onednn and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.amx is not None and 1 < rows <= self.gemv.AMX_MAX_ROWS and x.dtype == self.weight.dtype:
            y = self.gemv.amx_linear(x.reshape(rows, x.shape[-1]).contiguous(), self.amx, self.weight.shape[0], bias)
            return y.view(*x.shape[:-1], self.weight.shape[0])
        if self.gemv is not None and 0 < rows <= self.gemv.MAX_ROWS and x.dtype == self.weight.dtype:
            y = self.gemv.linear(x.reshape(rows, x.shape[-1]).contiguous(), self.weight, bias)
            return y.view(*x.shape[:-1], self.weight.shape[0])
        if self.more != MORE_ONEDNN:
            if self.more == MORE_CHUNKS and rows > 0 and x.dtype == self.weight.dtype:  # the kernel, 8 rows at a time
                flat = x.reshape(rows, x.shape[-1]).contiguous()
                n = self.gemv.MAX_ROWS
                y = torch.cat([self.gemv.linear(flat[i:i + n], self.weight, bias) for i in range(0, rows, n)])
                return y.view(*x.shape[:-1], self.weight.shape[0])
            return F.linear(x, self.weight, bias)  # a small weight (and without the kernel, few rows: MKL's GEMV is
            # single-threaded)
        padded = bucket(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        flat = x.new_zeros(padded, x.shape[-1])
        flat[:rows] = x.reshape(rows, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")[:rows]
        return y.view(*x.shape[:-1], self.weight.shape[0])


def amx_packs(weight: torch.Tensor) -> bool:
    """Whether `weight` goes to the kernel's AMX linear for 2 to AMX_MAX_ROWS rows: a bf16 weight of a multiple of
    32 inputs, on a CPU with AMX whose kernel build has it and whose process Linux gave the tile state."""
    k = kernel()
    return (k is not None and hasattr(k, "amx_linear") and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and weight.device.type == "cpu" and k.amx_ready())


def bucket(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per octave (at most 12.5% more rows; up to 8 rows as they are). oneDNN
    keeps a compiled primitive for every shape it meets (up to 1024, each ~0.5-1 MB): a server's row counts (decode
    batches, prefill chunks) are nearly every number up to --max-batched-tokens, and its memory grew by 5-7% over
    a soak; with buckets, ~8 shapes per octave and weight."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def serves(weight: torch.Tensor) -> bool:
    """Whether this module serves `weight` (large enough, and its dtype and device are `available`)."""
    return weight.numel() >= SERVE_FROM and available(weight.dtype, weight.device)


def serving_weight(weight: torch.Tensor) -> torch.Tensor | ServingWeight:
    """`weight` as a `ServingWeight` where this module serves it, else itself (`linear` takes either)."""
    return ServingWeight(weight) if serves(weight) else weight


def linear(x: torch.Tensor, weight: "torch.Tensor | ServingWeight | QuantizedWeight",
           bias: torch.Tensor | None = None) -> torch.Tensor:
    return weight.linear(x, bias) if isinstance(weight, (ServingWeight, QuantizedWeight)) else F.linear(x, weight, bias)


class ServingLinear(nn.Module):
    """An nn.Linear for inference whose weight is a `ServingWeight` (the bias stays a parameter). `screen`: for the
    output layer, its `HeadScreen` where one applies (else None)."""

    def __init__(self, layer: nn.Linear, screen: bool = False):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.served = ServingWeight(layer.weight, pack=True)
        self.bias = layer.bias
        self.screen = HeadScreen.of(self.served, self.bias) if screen else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.served.linear(x, self.bias)

    def extra_repr(self) -> str:
        how = "GEMV kernel for 1-8 rows, oneDNN" if self.served.gemv is not None else "oneDNN"
        if isinstance(self.served, QuantizedWeight):
            how = f"{type(self.served).__name__} ({self.served.KERNEL})"
        elif self.served.amx is not None:
            how = f"GEMV kernel for 1 row, AMX for 2-{self.served.gemv.AMX_MAX_ROWS}, oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, {how}"


DEQUANTIZE_ABOVE = 64  # rows above which a quantised weight is dequantised for one oneDNN GEMM (the kernels: 8 a pass)


class QuantizedWeight:
    """A [out, in] weight held quantised (`Int8Weight`, `Int4Weight`): `q` its values as the kernels read them, `scale`
    its scales. `linear(x, bias)` for x of any rows in fp32 or bf16, as ServingWeight's (on the CPU through the kernel;
    elsewhere, or without it, F.linear on the weight it stands for); `dequantized(dtype)` that weight."""

    KERNEL = ""  # the csrc/gemv.cpp op that runs it
    MORE = -1  # its code for the native decoder's linears (csrc/gemv.cpp DecodeLinear)

    @staticmethod
    def held_bytes(out: int, inputs: int) -> int:
        """Bytes a weight of [out, inputs] holds in this form: its values and scales."""
        raise NotImplementedError

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q.contiguous(), scale.contiguous()
        self.gemv = kernel()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.gemv is None or not hasattr(self.gemv, self.KERNEL) or x.device.type != "cpu" or rows == 0 \
                or rows > DEQUANTIZE_ABOVE:  # no kernel here, or a prefill's rows: oneDNN on the weight it stands for
            return F.linear(x, self.dequantized(x.dtype).to(x.device), bias)
        y = self._kernel_linear(x.reshape(rows, x.shape[-1]).contiguous(), bias)
        return y.view(*x.shape[:-1], self.q.shape[0])


def _check_int8(name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless q is int8 [out, in] and scale fp32 [out] (one scale per output row)."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError(f"{name}: q int8 [out, in] and scale fp32 [out], not {q.dtype} {tuple(q.shape)} and "
                         f"{scale.dtype} {tuple(scale.shape)}")


class Int8Weight(QuantizedWeight):
    """int8 with one fp32 scale per output row (`quantize_int8`: w ~ scale[:, None] * q), read at 1 byte a weight by
    csrc/gemv.cpp (`int8_linear`; as an expert, `expert_mlps` and the routed layers)."""

    KERNEL, MORE = "int8_linear", MORE_INT8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        _check_int8(type(self).__name__, q, scale)
        super().__init__(q, scale)

    @staticmethod
    def held_bytes(out: int, inputs: int) -> int:
        return out * inputs + 4 * out

    @classmethod
    def of(cls, w: torch.Tensor) -> "Int8Weight":
        return cls(*quantize_int8(w))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(self.q, self.scale).to(dtype)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemv.int8_linear(x, self.q, self.scale, bias)


class Int4Weight(QuantizedWeight):
    """int4, two values a byte, with one fp32 scale per `group` inputs of a row (pipeline/quantize.py `quantize_int4`,
    `pack_int4`), read at half a byte a weight by csrc/gemv.cpp (`int4_linear`; as an expert, `expert_mlps` and the
    routed layers). `of` refuses a row whose inputs are not a multiple of the group (`fits`)."""

    KERNEL, MORE = "int4_linear", MORE_INT4

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, group: int = INT4_GROUP):
        O, half = packed.shape if packed.dim() == 2 else (0, 0)
        if packed.dtype != torch.uint8 or packed.dim() != 2 or scale.dtype != torch.float32 or \
                scale.shape != (O, 2 * half // group) or not self.fits(2 * half, group):
            raise ValueError(f"Int4Weight: packed uint8 [out, in / 2] and scale fp32 [out, in / {group}] with in a "
                             f"multiple of {group}, not {packed.dtype} {tuple(packed.shape)} and {scale.dtype} "
                             f"{tuple(scale.shape)}")
        super().__init__(packed, scale)
        self.group = group

    fits = staticmethod(fits_int4)

    @staticmethod
    def held_bytes(out: int, inputs: int, group: int = INT4_GROUP) -> int:
        return out * inputs // 2 + 4 * out * (inputs // group)

    @classmethod
    def of(cls, w: torch.Tensor, group: int = INT4_GROUP) -> "Int4Weight":
        q, scale = quantize_int4(w, group)
        return cls(pack_int4(q), scale, group)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], 2 * self.q.shape[1]))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(unpack_int4(self.q), self.scale, self.group).to(dtype)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemv.int4_linear(x, self.q, self.scale, bias, self.group)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to int8 steps, one scale a row (s = max |x| / 127, as vLLM's dynamic per-token W8A8 and
    csrc/gemv.cpp `w8a8_linear`), in fp32: s * round(x / s)."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(xf / s).clamp(-127, 127) * s


class W8A8Weight(QuantizedWeight):
    """int8 weights with one fp32 scale per output row (as `Int8Weight`) whose inputs are rounded to int8 too, one
    scale per row of x (vLLM's W8A8 with dynamic per-token activations, compressed-tensors' `int-quantized`): VPDPBUSD
    multiplies 64 byte pairs an instruction, twice VDPBF16PS's, so past a few rows the products cost half as much
    (csrc/gemv.cpp `w8a8_linear`, `expert_mlps`). `q` holds the values in the kernel's tiles (`vnni_pack`), `scale`
    [2, out] the row scales and the rows' sums of q (the kernel's +128 offset of x comes off with them). CPUs whose
    kernel has no AVX512_VNNI (and other devices) compute the same thing with F.linear on x rounded to int8 steps and
    the dequantised weight."""

    KERNEL, MORE = "w8a8_linear", MORE_W8A8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, pack: bool = True):
        _check_int8(type(self).__name__, q, scale)
        self._shape = q.shape
        gemv = kernel()
        if pack and gemv is not None and hasattr(gemv, "vnni_pack") and q.device.type == "cpu":
            super().__init__(gemv.vnni_pack(q.contiguous()), torch.stack([scale, q.sum(1, dtype=torch.int32).float()]))
            self.rows = None
        else:  # no VNNI kernel (or `pack` False: the reference): the plain values, for F.linear
            super().__init__(q, scale)
            self.rows = q

    @classmethod
    def of(cls, w: torch.Tensor) -> "W8A8Weight":
        return cls(*quantize_int8(w))

    @classmethod
    def of_int8(cls, w: "Int8Weight") -> "W8A8Weight":
        return cls(w.q, w.scale)

    @staticmethod
    def held_bytes(out: int, inputs: int) -> int:
        return out * inputs + 8 * out  # the scales and the rows' sums (the tiles' padding left out)

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def values(self) -> torch.Tensor:
        """The int8 values [out, in], unpacked from the tiles where they are packed."""
        if self.rows is not None:
            return self.rows
        O, I = self._shape
        I4 = -(-I // 4) * 4
        tiles = self.q.view(-1, I4 // 4, 64, 4).permute(0, 2, 1, 3).reshape(-1, I4)
        return tiles[:O, :I]

    def scales(self) -> torch.Tensor:
        """The row scales [out]."""
        return self.scale[0] if self.rows is None else self.scale

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(self.values(), self.scales()).to(dtype)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemv.w8a8_linear(x, self.q, self.scale, bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.rows is None and x.device.type == "cpu" and rows > 0 and x.dtype in (torch.float32, torch.bfloat16):
            y = self._kernel_linear(x.reshape(rows, x.shape[-1]).contiguous(), bias)  # any rows: a prefill's too
            return y.view(*x.shape[:-1], self._shape[0])
        return w8a8_reference(x, self.dequantized(torch.float32).to(x.device), bias)


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a W8A8 linear computes, in PyTorch: F.linear in fp32 of x rounded to int8 steps (`int8_activations`) and
    the dequantised `weight`, in x's dtype (the kernel's reference; CPUs without AVX512_VNNI run it)."""
    y = F.linear(int8_activations(x), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


QUANTIZED = {"int8": Int8Weight, "int4": Int4Weight, "w8a8": W8A8Weight}  # serve --quantize: each scheme's class


def stored_weight(values: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """A quantised package's weight (export --quantize: int8 values [out, in], or int4 packed uint8 [out, in / 2]; its
    scales) as the kernels read it, no copy."""
    if values.dtype == torch.uint8:
        return Int4Weight(values, scale, 2 * values.shape[1] // scale.shape[1])
    return Int8Weight(values, scale)


def quantized_kind(scheme: str, inputs: list[int]) -> type[QuantizedWeight]:
    """The form `scheme` gives weights of these input widths, all of one kind (an expert's fc1 and fc2: the expert
    kernels take one kind a layer): int4 where every one's rows fit its groups, else int8 (w8a8: W8A8Weight)."""
    return Int4Weight if scheme == "int4" and all(Int4Weight.fits(i) for i in inputs) else \
        W8A8Weight if scheme == "w8a8" else Int8Weight


def quantized_weights(weights: list[torch.Tensor], scheme: str) -> list[QuantizedWeight]:
    """`weights` in the form `quantized_kind` gives them."""
    kind = quantized_kind(scheme, [w.shape[1] for w in weights])
    return [kind.of(w) for w in weights]


def as_scheme(w: QuantizedWeight, scheme: str) -> QuantizedWeight:
    """A stored weight as `scheme` runs it: an int8 package's Int8Weight as a W8A8Weight under w8a8 (the same values
    and scales), else itself."""
    return W8A8Weight.of_int8(w) if scheme == "w8a8" and type(w) is Int8Weight else w


class _Tries:
    """A screen's calls and fallbacks: a row count whose calls keep falling back (candidates past `most`: flat
    logits) stops trying after GIVE_UP of them (more than half of its calls)."""

    GIVE_UP = 8

    def _start(self) -> None:
        self.tried: dict[int, list[int]] = {}  # row count -> [calls, fallbacks]
        self.calls = self.fallbacks = 0  # screened calls, and those that read the whole layer after all

    def _try(self, n: int) -> bool:
        tried = self.tried.setdefault(n, [0, 0])
        if tried[1] >= self.GIVE_UP and 2 * tried[1] > tried[0]:
            return False
        self.calls += 1
        tried[0] += 1
        return True

    def _result(self, n: int, out: torch.Tensor) -> list[int] | None:
        if out.numel() == 0:
            self.fallbacks += 1
            self.tried[n][1] += 1
            return None
        return out.tolist()


class HeadScreen(_Tries):
    """The greedy rows' argmax of an output layer, read from an int8 copy of its weight (half of bf16's bytes, a
    quarter of fp32's) and exact (csrc/gemv.cpp `screen_argmax`, `screen_argmax_vnni`): the same token as the
    argmax_rows of the layer's logits as the few-row kernel writes them (passes of up to MAX_ROWS rows), to the bit,
    for ~half the layer's reading and, past a few rows, for fewer instructions. A batch-1 decode step of the peer
    benchmark's Qwen3-MoE reads 162 MB, 103 MB of it the bf16 output layer (50,304 x 1024).

    Each output row o is stored as q[o] = round(w[o] / scale[o]) (int8, scale = max |w[o]| / 127) and err[o], a
    bound, per unit of |x|'s L1 norm, on |exact sum - scale[o] * (q[o] . x)|: the row's largest quantisation error
    max |w[o] - scale[o] q[o]| (measured in float64, where it is exact), plus both sums' fp32 roundings (I
    additions of terms at most (max |w[o]| + scale[o]) |x_i| each: 2 I 2^-24 per unit, doubled). The kernel then
    recomputes, as the few-row kernel does, every row whose interval can reach the best one's (a handful on a trained
    model: its logits are peaked). With AVX512_VNNI (the AVX512_BF16 and AMX builds) the rows of x are rounded to
    int8 too (one scale a row) and multiplied by VPDPBUSD, 1 to VNNI_MAX_ROWS (64) rows a call: err2, top and norm
    bound what that rounding adds (`screen_argmax_vnni`), and q is kept only as a `W8A8Weight` (`int8`). On
    the Qwen3-MoE head (AMD EPYC, 2 cores) 8 / 16 / 32 rows took 2.3 / 3.4 / 6.5 ms where the whole layer took 5.9 /
    6.6 / 10.7 (oneDNN past 8 rows) and the bf16 x int8 screen 3.6 at 8. Past 8 rows the tokens are the few-row
    kernel's (8 rows a pass), where the unscreened layer runs oneDNN's GEMM: both are fp32 sums of the same bf16
    products rounded once; near-ties can differ between the two.

    `topk` does the same for rows that sample among their top_k largest logits (and greedy rows whose logits a
    processor edits, k = 1): every token that can be among them, computed exactly, the rest -inf (the same
    distribution, for the screen's bytes and one row of the layer a candidate: on a trained model's peaked logits a
    few dozen; the peer benchmark's random model's flat ones give ~1,000 for top_k 40, past TOPK_MOST at 32 rows).

    Not for: a bias, a weight that is not finite, rows the head would send to AMX (`amx_linear`'s other sums), rows
    that sample from the whole vocabulary (top_p, min_p alone: the nucleus needs every logit) or ask for
    log-probabilities. A row count whose calls keep falling back (candidates past `most`:
    flat logits) stops trying after GIVE_UP of them. MOE_PIPELINE_HEAD_SCREEN=0: none."""

    CHUNK = 4096  # output rows quantised at a time (a float64 copy of this many rows at most)
    MOST = 1 / 16  # candidates (all rows of a call) past this share of the outputs: the whole layer instead
    # the same with VNNI on a bf16 layer, where each row's own candidates are re-checked (one row of w each, not the
    # union for every row): the peer benchmark's random Qwen3-MoE gives 2,100-2,900 candidates for 32 rows (its
    # logits are flat; 1/16 of its outputs is 3,144), re-checked in ~0.3 ms where a fallback costs the whole layer
    MOST_PER_ROW = 1 / 4
    TOPK_MOST = 512  # `topk`: candidates a row may have at least, however many rows (the peer model's top_k 40: ~100)

    def __init__(self, served: ServingWeight):
        w = served.weight
        O, I = w.shape
        self.served, self.gemv = served, served.gemv
        self.q = torch.empty(O, I, dtype=torch.int8)
        self.scale = torch.empty(O, dtype=torch.float32)
        self.err = torch.empty(O, dtype=torch.float32)
        # the int8 x int8 screen's other bounds (`screen_argmax_vnni`): the weights' error per unit of |x|_2, and
        # each row's scale * max |q| and scale * |q|_2 (the inputs' rounding's weight, per unit of |e|_1, |e|_2)
        self.vnni = hasattr(self.gemv, "screen_argmax_vnni")
        self.err2, self.top, self.norm = (torch.empty(O, dtype=torch.float32) for _ in range(3))
        rounding = 4 * I * 2.0 ** -24
        self.finite = True  # every weight finite (a NaN or inf one makes its row's largest |w| so): else unusable
        up = torch.tensor(float("inf"))
        for lo in range(0, O, self.CHUNK):
            part = w[lo:lo + self.CHUNK].double()
            top, q, scale = int8_rows(part)
            self.finite = self.finite and bool(torch.isfinite(top).all())
            d = part - scale.double()[:, None] * q
            bound = (d.abs().amax(1) + rounding * (top + scale.double())) * (1 + 1e-6)
            self.q[lo:lo + self.CHUNK] = q.to(torch.int8)
            self.scale[lo:lo + self.CHUNK] = scale
            self.err[lo:lo + self.CHUNK] = torch.nextafter(bound.float(), up)
            if self.vnni:
                # |sum x d| <= |x|_2 |d|_2, and the sums' roundings sum |x_i| (|w_i| + scale) <= |x|_2 |(|w| + s)|_2
                err2 = (d.norm(dim=1) + rounding * (part.abs() + scale.double()[:, None]).norm(dim=1)) * (1 + 1e-6)
                self.err2[lo:lo + self.CHUNK] = torch.nextafter(err2.float(), up)
                s64 = scale.double()
                self.top[lo:lo + self.CHUNK] = torch.nextafter((s64 * q.abs().amax(1) * (1 + 1e-6)).float(), up)
                self.norm[lo:lo + self.CHUNK] = torch.nextafter((s64 * q.norm(dim=1) * (1 + 1e-6)).float(), up)
        if self.vnni:  # the int8 copy as a W8A8 weight holds it (the kernel's tiles, scales and rows' sums) only
            self.int8 = W8A8Weight(self.q, self.scale)
            del self.q
        self.rows = self.gemv.VNNI_MAX_ROWS if self.vnni else self.gemv.MAX_ROWS  # most rows a call screens
        self.most = max(1, int(O * (self.MOST_PER_ROW if self.vnni and w.dtype == torch.bfloat16 else self.MOST)))
        self._start()

    @classmethod
    def of(cls, served: ServingWeight, bias: torch.Tensor | None) -> "HeadScreen | None":
        w = served.weight
        if (os.environ.get(SCREEN_ENV, "1") == "0" or bias is not None or served.gemv is None
                or not hasattr(served.gemv, "screen_argmax") or w.device.type != "cpu"
                or w.dtype not in (torch.float32, torch.bfloat16)):
            return None
        screen = cls(served)
        return screen if screen.finite else None

    def _fits(self, x: torch.Tensor) -> bool:
        """Whether the screen takes these rows: 1 to `rows` of them in the head's dtype, one alone where the head
        would send more to AMX."""
        n = x.shape[0]
        return 0 < n <= self.rows and x.dtype == self.served.weight.dtype and (self.served.amx is None or n == 1)

    def argmax(self, x: torch.Tensor) -> list[int] | None:
        """Each row's token of hidden states x [n, C] (the head's dtype), as argmax_rows(head(x)); None where the
        screen does not apply (then the caller runs the whole head)."""
        n = x.shape[0]
        if not self._fits(x) or not self._try(n):
            return None  # this many rows' candidates keep passing `most` (flat logits): the whole layer at once
        if self.vnni:
            out = self.gemv.screen_argmax_vnni(x.contiguous(), self.served.weight, self.int8.q, self.int8.scale,
                                               self.err, self.err2, self.top, self.norm, self.most)
        else:
            out = self.gemv.screen_argmax(x.contiguous(), self.served.weight, self.q, self.scale, self.err, self.most)
        return self._result(n, out)

    def topk(self, x: torch.Tensor, ks: list[int], edited: list[list[int]]):
        """The logits of the rows of hidden states x [n, C] that sample among their ks[i] largest (top_k; 1 for a
        greedy row whose logits a processor edits), every token that can be among those after the processors
        (`edited[i]`: the tokens they touch, always computed), as the whole head writes them, the rest left out:
        (offsets [n + 1], tokens, logits fp32), row i's at offsets[i]:offsets[i + 1]. Sampling from these with every
        other logit -inf is sampling from the head's own (csrc/gemv.cpp `screened_topk`). None where the screen does
        not apply (flat logits: candidates past `most` a row; then the caller runs the whole head)."""
        n = x.shape[0]
        if not self._fits(x) or not self._try(-n):  # the row counts' tries kept apart from argmax's
            return None
        ks_t = torch.tensor(ks, dtype=torch.long)
        O = self.served.weight.shape[0]
        distinct = [sorted({t for t in e if 0 <= t < O}) for e in edited]
        offsets = torch.zeros(n + 1, dtype=torch.long)
        offsets[1:] = torch.tensor([len(e) for e in distinct], dtype=torch.long).cumsum(0)
        tokens = torch.tensor([t for e in distinct for t in e], dtype=torch.long)
        most = max(self.TOPK_MOST, self.most // n)  # a row's candidates, each one row of the layer read again
        if self.vnni:
            out = self.gemv.screen_topk_vnni(x.contiguous(), self.served.weight, self.int8.q, self.int8.scale,
                                             self.err, self.err2, self.top, self.norm, most, ks_t, offsets, tokens)
        else:
            out = self.gemv.screen_topk(x.contiguous(), self.served.weight, self.q, self.scale, self.err, most, ks_t,
                                        offsets, tokens)
        if not out:
            self.fallbacks += 1
            self.tried[-n][1] += 1
            return None
        return tuple(out)


class QuantizedHeadScreen(_Tries):
    """HeadScreen for an output layer held quantised (`--quantize-head`): each greedy row's token as argmax_rows of the
    layer's own logits (`int4_linear`, `int8_linear`), to the bit, through csrc/gemv.cpp `screen_argmax_i4` or
    `screen_argmax_i8`: x rounded to int8 and the stored weights read as they are by VPDPBUSD (64 products an
    instruction, where the layers' one-row passes do 32 by VDPBF16PS after widening each weight to bf16: compute-bound
    there; 1 to 64 rows, 8 a pass over the weight), then the candidates its bound cannot rule out computed again by
    the layer's kernel. Per output row it holds the dequantised row's largest |w| (`top`), its L2 norm and the fp32
    roundings' bound (`round`: both sides' sums, per unit of |x|_1 + |e|_1). Not for: a bias, int4 groups that are
    not a multiple of 128, CPUs without AVX512_VNNI (the kernel has neither op), MOE_PIPELINE_HEAD_SCREEN=0."""

    CHUNK, MOST_PER_ROW = HeadScreen.CHUNK, HeadScreen.MOST_PER_ROW  # 1 to 64 rows: candidates as the VNNI screen's

    def __init__(self, weight: "Int4Weight | Int8Weight"):
        O, I = weight.shape
        self.weight, self.gemv = weight, weight.gemv
        self.int4 = isinstance(weight, Int4Weight)
        self.top, self.norm, self.round = (torch.empty(O, dtype=torch.float32) for _ in range(3))
        # both sides' fp32 roundings: the layer's sums of I products (and int4's G groups); int4's screen adds its G
        # group terms, its offset and 16 lanes, each term at most (7 + 8 + 8) max scale |x_i| or |s xq_i| (s |xq|_1 <=
        # |x|_1 + |e|_1); int8's sums are exact integers, then two products (and one conversion past 2^24)
        group = weight.group if self.int4 else I
        rounding = 2 * (23 if self.int4 else 128) * (I + I // group + 32) * 2.0 ** -24
        up = torch.tensor(float("inf"))
        self.finite = bool(torch.isfinite(weight.scale).all())
        self.rowsum = None if self.int4 else weight.q.sum(1, dtype=torch.int32)
        for lo in range(0, O, self.CHUNK):
            scale = weight.scale[lo:lo + self.CHUNK]
            if self.int4:
                w = dequantized(unpack_int4(weight.q[lo:lo + self.CHUNK]), scale, weight.group).double()
            else:
                w = dequantized(weight.q[lo:lo + self.CHUNK], scale).double()  # q * scale is exact in fp32
            self.top[lo:lo + self.CHUNK] = torch.nextafter((w.abs().amax(1) * (1 + 1e-6)).float(), up)
            self.norm[lo:lo + self.CHUNK] = torch.nextafter((w.norm(dim=1) * (1 + 1e-6)).float(), up)
            biggest = scale.double().abs().reshape(scale.shape[0], -1).amax(1)
            self.round[lo:lo + self.CHUNK] = torch.nextafter((biggest * rounding * (1 + 1e-6)).float(), up)
        self.most = max(1, int(O * self.MOST_PER_ROW))
        self.rows = self.gemv.VNNI_MAX_ROWS  # most rows a call screens (MAX_ROWS a pass over the weight)
        self._start()

    @classmethod
    def of(cls, weight: "QuantizedWeight", bias: torch.Tensor | None) -> "QuantizedHeadScreen | None":
        op = "screen_argmax_i4" if isinstance(weight, Int4Weight) else "screen_argmax_i8"
        if (os.environ.get(SCREEN_ENV, "1") == "0" or bias is not None or type(weight) not in (Int4Weight, Int8Weight)
                or not hasattr(weight.gemv, op) or (op == "screen_argmax_i4" and weight.group % 128)
                or weight.q.device.type != "cpu"):
            return None
        screen = cls(weight)
        return screen if screen.finite else None

    def _fits(self, x: torch.Tensor) -> bool:
        """Whether the screen takes these rows: 1 to `rows` of them in the head's dtype, one alone where the head
        would send more to AMX."""
        n = x.shape[0]
        return 0 < n <= self.rows and x.dtype == self.served.weight.dtype and (self.served.amx is None or n == 1)

    def argmax(self, x: torch.Tensor) -> list[int] | None:
        """Each row's token of hidden states x [n, C] (fp32 or bf16), as argmax_rows(the layer(x)); None where the
        screen does not apply (then the caller runs the whole layer)."""
        n = x.shape[0]
        if not 0 < n <= self.rows or x.dtype not in (torch.float32, torch.bfloat16) or not self._try(n):
            return None
        w = self.weight
        if self.int4:
            out = self.gemv.screen_argmax_i4(x.contiguous(), w.q, w.scale, self.top, self.norm, self.round, w.group,
                                             self.most)
        else:
            out = self.gemv.screen_argmax_i8(x.contiguous(), w.q, w.scale, self.rowsum, self.top, self.norm,
                                             self.round, self.most)
        return self._result(n, out)


class FusedQKV:
    """An attention layer's q, k and v projections as one [q + k + v, C] weight, its output split by `sizes` (k and v
    narrower than q under grouped-query attention): a third of the weight reads' calls. Set as the layer's `qkv`
    (pipeline/model.py `Attention.qkv`), it takes the place of the three projections' method for that layer."""

    def __init__(self, attn: nn.Module):
        layers = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.sizes = [l.weight.shape[0] for l in layers]
        self.weight = ServingWeight(torch.cat([l.weight.detach() for l in layers]), pack=True)
        biases = [l.bias for l in layers]
        self.bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.weight.linear(x, self.bias).split(self.sizes, dim=-1)


GROUPED_MAX_ROWS = 16  # experts' mean rows up to which `expert_mlps` runs a layer's experts (more: oneDNN's GEMM)


def grouped_max_rows(x: torch.Tensor) -> int:
    """Experts' mean rows up to which `expert_mlps` runs a layer's experts over x's rows: GROUPED_MAX_ROWS (a decode
    batch's), or any number for bf16 on a CPU with AMX (its experts of more rows than a pass of VDPBF16PS go to AMX
    tiles that read the expert's weight as it is: a prefill too, in one call where oneDNN took two GEMMs and ~10
    operators an expert). W8A8 experts of a prefill go one at a time through `w8a8_linear` (grouped, in one engine
    at 32 concurrent: 1404.5 against 1407.4 tok/s, paired 0.99-1.02x)."""
    k = kernel()
    if k is not None and hasattr(k, "amx_ready") and x.dtype == torch.bfloat16 and k.amx_ready():
        return 1 << 40
    return GROUPED_MAX_ROWS


def _kernel_has(op: str, x: torch.Tensor) -> bool:
    """Whether the kernel is here with `op` and takes x: on the CPU, fp32 or bf16."""
    k = kernel()
    return k is not None and hasattr(k, op) and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def grouped_experts(x: torch.Tensor, counts: list[int]) -> bool:
    """Whether `expert_mlps` runs these experts: the kernel is here, x is on the CPU in its dtype, and the experts
    have few rows each (a decode batch's; a prefill's go one expert at a time to oneDNN's GEMM), or any number in
    bf16 where the kernel has AMX (`grouped_max_rows`)."""
    return _kernel_has("expert_mlps", x) and bool(counts) and sum(counts) <= grouped_max_rows(x) * len(counts)


def expert_mlps(x: torch.Tensor, counts: list[int], weights: list[tuple], swiglu: bool) -> torch.Tensor:
    """Every listed expert over its rows in one kernel call: x [rows, C] holds counts[i] rows of expert i in turn;
    weights[i] is its (fc1 weight, fc1 bias, fc2 weight, fc2 bias) (ServingWeight or tensor; biases for all or
    none). Returns [rows, C] in x's order: as fc2(act(fc1(x))) expert by expert, the same roundings."""
    w1, b1, w2, b2, s1, s2 = _expert_tensors(weights)
    return kernel().expert_mlps(x.contiguous(), counts, w1, b1, w2, b2, swiglu, s1, s2)


def local_layer(x: torch.Tensor, wg: torch.Tensor, top_k: int) -> bool:
    """Whether `routed_layer` runs an MoE layer over these tokens: the kernel is here, x is on the CPU in its
    dtype, the gate fp32, and the batch a decode batch's (a prefill's tokens go one expert at a time to oneDNN) or
    any batch in bf16 where the kernel has AMX (`grouped_max_rows`)."""
    return (_kernel_has("routed_experts", x) and 0 < x.shape[0] and wg.dtype == torch.float32
            and x.shape[0] * top_k <= grouped_max_rows(x) * wg.shape[0])


def routed_layer(x: torch.Tensor, wg: torch.Tensor, top_k: int, renormalize: bool, weights_of,
                 swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE layer whose experts are all here, in two kernel calls: the routing (pipeline/model.py `route`, no
    capacity) and every token's experts with their weighted sum. `weights_of(e)`: expert e's (fc1 weight, fc1 bias,
    fc2 weight, fc2 bias). Returns (output [S, C], tokens per expert [E])."""
    x = x.contiguous()
    mix, experts, counts = route(x, wg, top_k, renormalize)
    active = [e for e, n in enumerate(counts.tolist()) if n]
    w1, b1, w2, b2, s1, s2 = _expert_tensors([weights_of(e) for e in active])
    return kernel().routed_experts(x, experts, mix, active, w1, b1, w2, b2, swiglu, s1, s2), counts


def gathered_layer(total: int, x: torch.Tensor, wg: torch.Tensor, top_k: int) -> bool:
    """Whether `route`, `expert_pairs` and `combine_pairs` run an expert-parallel MoE layer of `total` tokens over
    every rank (the same answer on every rank: nothing here depends on this rank's own rows): the kernel is here,
    x on the CPU in its dtype, the gate fp32, and a decode-sized batch (GROUPED_MAX_ROWS, with AMX too: a prefill's
    [tokens, k, C] sum over the ranks would outweigh the exchange's)."""
    return (_kernel_has("expert_pairs", x) and 0 < total and wg.dtype == torch.float32
            and total * top_k <= GROUPED_MAX_ROWS * wg.shape[0])


def route(x: torch.Tensor, wg: torch.Tensor, top_k: int, renormalize: bool):
    """pipeline/model.py's routing in one kernel call: (weights [S, k] fp32, experts [S, k], tokens per expert [E])."""
    return kernel().route(x.contiguous(), wg.contiguous(), top_k, renormalize)


def expert_pairs(x: torch.Tensor, experts: torch.Tensor, mix: torch.Tensor, weights_of, swiglu: bool) -> torch.Tensor:
    """The outputs [S, k, C] of the (token, choice) pairs `experts` [S, k] names (-1: another rank's pair, left zero),
    each expert once over its tokens; `weights_of(e)`: expert e's (fc1 weight, fc1 bias, fc2 weight, fc2 bias)."""
    active = sorted(set(experts[experts >= 0].tolist()))
    if not active:
        return x.new_zeros(x.shape[0], experts.shape[1], x.shape[1])
    w1, b1, w2, b2, s1, s2 = _expert_tensors([weights_of(e) for e in active])
    return kernel().expert_pairs(x.contiguous(), experts.contiguous(), mix.contiguous(), active, w1, b1, w2, b2, swiglu,
                                 s1, s2)


def combine_pairs(y: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Each token's choices [S, k, C] weighted by mix [S, k] and summed, rounded as `routed_layer` rounds."""
    return kernel().combine_pairs(y.contiguous(), mix.contiguous())


def _expert_tensors(weights: list[tuple]) -> tuple[list, list, list, list, list, list]:
    """(w1s, b1s, w2s, b2s, s1s, s2s) as the kernel takes them: plain contiguous tensors, empty bias lists for none;
    int8 or int4 experts (`Int8Weight`, `Int4Weight`: every one alike, or none) give their int8 or packed tensors and
    their scales as s1s, s2s (else empty)."""
    kinds = {(type(w[0]), type(w[2])) for w in weights}
    quant = [isinstance(w[0], QuantizedWeight) for w in weights]
    if any(quant) and len(kinds) > 1:
        raise ValueError("an MoE layer's experts are int8 (Int8Weight) or int4 (Int4Weight) all or none, fc1 and fc2 "
                         "alike: quantise every expert the same way")

    if any(isinstance(w[0], W8A8Weight) and w[0].rows is not None for w in weights):
        raise ValueError("W8A8 experts without the kernel's tiles (no AVX512_VNNI build): the expert kernels cannot "
                         "run them")

    def raw(w):
        return w.q if isinstance(w, QuantizedWeight) else w.weight if isinstance(w, ServingWeight) else w.contiguous()

    w1 = [raw(w[0]) for w in weights]
    w2 = [raw(w[2]) for w in weights]
    b1 = [w[1].contiguous() for w in weights] if weights[0][1] is not None else []
    b2 = [w[3].contiguous() for w in weights] if weights[0][3] is not None else []
    s1 = [w[0].scale for w in weights] if all(quant) else []
    s2 = [w[2].scale for w in weights] if all(quant) else []
    return w1, b1, w2, b2, s1, s2


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of logits [n, V] (torch.argmax's answer), in one parallel kernel call on the CPU."""
    if _kernel_has("argmax_rows", x):
        return kernel().argmax_rows(x.contiguous()).tolist()
    return x.argmax(dim=-1).tolist()


class ServingRMSNorm(nn.Module):
    """pipeline/model.py's RMSNorm in one kernel call (csrc/gemv.cpp `rms_norm`: the same roundings) for CPU inputs
    of the weight's dtype; the module's own operators otherwise."""

    def __init__(self, norm: nn.Module, gemv):
        super().__init__()
        self.weight, self.eps, self.gemv = norm.weight, norm.eps, gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pipeline.model import RMSNorm

        if x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return RMSNorm.forward(self, x)
        return self.gemv.rms_norm(x.contiguous(), self.weight, self.eps)


def serving_norms(model: nn.Module) -> int:
    """Replace, in place, every RMSNorm of a CPU model in eval mode by `ServingRMSNorm`; returns how many."""
    from pipeline.model import RMSNorm

    gemv = kernel()
    if gemv is None or not hasattr(gemv, "rms_norm"):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is RMSNorm and available(child.weight.dtype, child.weight.device):
                setattr(module, name, ServingRMSNorm(child, gemv))
                count += 1
    return count


def quantize_linears(model: nn.Module, scheme: str = "int8", head: bool = False,
                     stored: dict[str, QuantizedWeight] | None = None) -> int:
    """After `serving_linears`: every served linear but the output layer (the model's `lm_head`, whose greedy rows the
    screen reads in int8 already; with `head`, it too, and its screen goes: the logits are the quantised layer's,
    its greedy rows read through `QuantizedHeadScreen` where that applies) and
    every fused q/k/v weight as `scheme`'s weight, in place; returns how many. `stored`: {weight name: weight} of a
    quantised package (`stored_weight`), taken as they are; the rest `quantized_weights` (weight-only, round to
    nearest; int8 one scale per output channel, int4 one per 128 inputs of a row). The routers, norms and embeddings
    (a tied head's embedding included) are left as they are."""
    stored = stored or {}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, ServingLinear) and (head or module is not getattr(model, "lm_head", None)) \
                and isinstance(module.served, ServingWeight):
            kept = stored.get(f"{name}.weight")
            module.served = as_scheme(kept, scheme) if kept else quantized_weights([module.served.weight], scheme)[0]
            # the output layer quantised: its greedy rows through its own screen (the logits are its own)
            module.screen = QuantizedHeadScreen.of(module.served, module.bias) \
                if module is getattr(model, "lm_head", None) else None
            count += 1
        qkv = getattr(module, "qkv", None)
        if isinstance(qkv, FusedQKV) and isinstance(qkv.weight, ServingWeight):
            parts = [stored.get(f"{name}.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")]
            if all(parts) and len({type(p) for p in parts}) == 1:  # the package's, rows stacked as the fused weight's
                qkv.weight = as_scheme(stored_weight(torch.cat([p.q for p in parts]),
                                                     torch.cat([p.scale for p in parts])), scheme)
            else:
                (qkv.weight,) = quantized_weights([qkv.weight.weight], scheme)
            count += 1
    return count


def serving_linears(model: nn.Module) -> int:
    """Replace, in place, every plain nn.Linear of `model` (eval, no grad) whose weight this module serves, and an
    attention layer's q, k, v by one fused projection; returns how many layers. Left alone: the MoE gates (`wg`:
    their fp32 weight is read by the router) and layers of other classes (DeepSpeed's sliced ones, say). A tied
    output layer shares the embedding's weight (no copy)."""
    count = 0
    for module in list(model.modules()):
        projections = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if all(type(l) is nn.Linear for l in projections) and hasattr(module, "qkv") and serves(projections[0].weight):
            module.qkv = FusedQKV(module)  # not a submodule (no parameters): shadows Attention.qkv for this layer
            for n in ("q_proj", "k_proj", "v_proj"):  # their weights now live in the fused copy only
                setattr(module, n, nn.Identity())
            count += 3
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name != "wg" and serves(child.weight):
                setattr(module, name, ServingLinear(child, screen=name == "lm_head" and module is model))
                count += 1
    return count
