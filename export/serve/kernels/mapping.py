"""The served weights moved into one file mapping (`map_weights`; csrc/transport.cpp `adopt_storage`). The ranks'
shared-memory reduce that csrc/transport.cpp also holds is attached by the rank transport (export/serve/transport.py
`attach_local_reduce`).

    from export.serve.kernels import map_weights
    map_weights(model, exchange) # after the model is placed and its linears swapped
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import export.serve.kernels.options as options
from export.serve.kernels.extension import kernel

MAP_FROM = 1 << 20  # storages of at least this many bytes are moved into the mapping


def map_weights(*roots, directory: str | None = None) -> int:
    """The large CPU weights reachable from `roots` (modules with their ServingWeights, the experts' residency)
    moved into one file mapping: a file in `directory` (default: the temporary directory) mapped shared (under
    MADV_HUGEPAGE) and unlinked, each storage's bytes copied in, then each storage takes its part of the mapping
    as its memory (csrc/transport.cpp `adopt_storage`: every tensor on it follows: views, detached copies, references
    the kernels hold; the anonymous copy is freed). Not what an object marked `file_backed` holds (the package's
    memory-mapped experts, export/serve/placement/residency.py `ExpertStore`: already a file). Returns the bytes
    moved; 0 without the kernel or with `serve --no-map-weights`.

    Why: Linux keeps the page cache of a file on disk in large folios that map as 2 MB pages (ext4 and XFS on recent
    kernels: /proc/meminfo's FileHugePages), where anonymous memory may get 4 KB pages only (this VM's: AnonHugePages
    0 kB even under MADV_HUGEPAGE). A decode step streams every active weight once, and with 4 KB pages the stream
    crosses a page (a TLB miss, a prefetcher restart) every 4 KB, and reads slower than from a mapping (the server's
    batch-1 tokens/s with and without: docs/serving.md, `--no-map-weights`). llama.cpp reads its GGUF through mmap the
    same way. The cost: the weights' bytes go once to that directory's disk (the
    kernel writes the dirty pages back after the start), and under memory pressure the kernel may drop clean pages
    and read them back from there."""
    k = kernel()
    if k is None or not hasattr(k, "adopt_storage") or not options.current().map_weights:
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
