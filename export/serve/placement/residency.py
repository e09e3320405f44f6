"""Which experts one serving rank holds in memory: the package's experts mapped (`ExpertStore`), and the
resident ones (`Residency`): its native experts, the replicas the table gives it, offload and prefetch.

    moe-pipeline serve runs/tiny/package --placement predictive --resident-experts 0.5

    store = ExpertStore(pkg, cfg, torch.float32)
    resident = Residency(cfg, store, rank=0, ep=2, resident_fraction=0.5)
    w1, b1, w2, b2 = resident.weights(layer=0, expert=1)      # resident (a hit) or loaded now (a miss)

Offload and prefetch (`--resident-experts F`): a rank keeps only a fraction F of its native experts
resident (tensors in memory), the least recently used leaving first; the others stay in the package's
safetensors, memory-mapped (on a GPU machine: host memory), and are loaded when needed. Before each
forward the experts the table expects to be used (predicted or observed demand) are prefetched in a
loader thread, ahead of the layer that needs them; an expert needed and not resident is loaded on
demand (a miss). Replicas are loaded when a table gives them to this rank and dropped when it no
longer does. Hits and misses are counted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from export.serve.kernels import serving_weight
from export.serve.placement.algo import Table, native_rank
from pipeline.model import ModelConfig, expert_key, split_expert_key

EXPERT_PARTS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


class ExpertStore:
    """Every expert's tensors in the package (or stage directory), memory-mapped: the host tier. `load`
    copies one expert into resident tensors of `dtype` on `device` (the accelerator's: on a GPU machine, the
    host-to-device copy). The mapping is private copy-on-write, read only here: the files are never changed.

    The files stay open as long as the store. Touching the mapping of a file truncated since it was mapped
    kills the process (SIGBUS), so before each `load` the open files' size and modification time are
    compared with what verification saw (`files`: export/package.py's `VerifiedPackage.files`; without it,
    what the store saw when it opened them): a changed file fails that load with a FileChangedError."""

    file_backed = True  # its tensors are the package's files, mapped: export/serve/kernels/mapping.py `map_weights` leaves them

    def __init__(self, src: Path, cfg: ModelConfig, dtype: torch.dtype, files: dict | None = None,
                 device: torch.device | str = "cpu", quantize: str | None = None):
        import mmap
        import os

        from pipeline.artifacts import FileFacts, check_unchanged, open_regular
        from pipeline.weights import SAFETENSORS_DTYPES, read_header, weight_files

        self.src, self.cfg, self.dtype, self.device = Path(src), cfg, dtype, torch.device(device)
        # "int8", "int4" or "w8a8": each expert quantised as it loads (kernels.quantized_weights); on an int8 package,
        # "w8a8" runs its stored weights with int8 inputs (kernels.as_scheme)
        self.quantize = quantize
        if quantize == "w8a8" and cfg.activation == "swiglu" and cfg.expert_hidden % 64:
            raise ValueError(f"--quantize w8a8: the W8A8 expert kernel takes SwiGLU experts of a multiple of 64 "
                             f"columns (its tiles); these have {cfg.expert_hidden}: serve them with --quantize int8")
        self.where = weight_files(self.src, files)
        self._files, self._facts, self._maps, self._views = {}, {}, {}, {}
        self._stream = None  # on a GPU: the stream experts are copied on (`_to_gpu`)
        for f in sorted(set(self.where.values())):
            fh = self._files[f] = open_regular(self.src / f)
            self._facts[f] = files[f] if files is not None else FileFacts.of(os.fstat(fh.fileno()))
            check_unchanged(fh.fileno(), self.src / f, self._facts[f])
            header, start = read_header(fh, self.src / f)
            self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            check_unchanged(fh.fileno(), self.src / f, self._facts[f])  # what was mapped is what was verified
            for key, info in header.items():
                if split_expert_key(key) is not None:
                    begin, end = info["data_offsets"]
                    dt = SAFETENSORS_DTYPES[info["dtype"]]
                    count = (end - begin) // torch.empty((), dtype=dt).element_size()
                    view = torch.frombuffer(self._maps[f], dtype=dt, count=count, offset=start + begin)
                    self._views[key] = view.view(info["shape"])
        # a quantised package (export --quantize): experts load as their stored values and scales
        self.stored = any(k.endswith("_scale") for k in self._views)
        if self.stored and self.device.type != "cpu":
            raise ValueError(f"{self.src}: a quantised package (int8/int4 weights) is served on the CPU, whose kernels "
                             f"read them (export/serve/kernels/csrc); on a GPU export the run again without --quantize")

    def key(self, layer: int, expert: int, part: str) -> str:
        return expert_key(self.cfg.moe_layers[layer], expert, part)

    def load(self, layer: int, expert: int) -> tuple:
        """(fc1 weight, fc1 bias, fc2 weight, fc2 bias) of one expert, resident, in `dtype`; on the CPU the weights
        wrapped for the few-row kernel and oneDNN (export/serve/kernels: no copy, nothing reordered)."""
        from pipeline.artifacts import FileChangedError, check_unchanged

        parts = EXPERT_PARTS if self.cfg.mlp_bias else EXPERT_PARTS[::2]  # the families' experts have no biases
        keys = [self.key(layer, expert, p) for p in parts]
        for f in dict.fromkeys(self.where[k] for k in self._stored_keys(keys)):  # before touching the mapping
            try:
                check_unchanged(self._files[f].fileno(), self.src / f, self._facts[f])
            except FileChangedError as err:
                raise FileChangedError(f"expert {expert} of MoE layer {layer} not loaded: {err}") from None
        if self.stored:  # a quantised package: its experts' values and scales as they are (export --quantize)
            return self._stored(keys)
        if self.device.type == "cuda":
            tensors = self._to_gpu(keys)
        else:
            tensors = [self._views[k].to(device=self.device, dtype=self.dtype, copy=True) for k in keys]
        w1, b1, w2, b2 = tensors if self.cfg.mlp_bias else (tensors[0], None, tensors[1], None)
        if self.quantize is not None:
            from export.serve.kernels import quantized_weights

            q1, q2 = quantized_weights([w1, w2], self.quantize)
            return q1, b1, q2, b2
        return serving_weight(w1), b1, serving_weight(w2), b2

    def _stored_keys(self, keys: list[str]) -> list[str]:
        """The stored tensors of `keys`: a quantised package's weight is its values and its scales."""
        if not self.stored:
            return keys
        from pipeline.quantize import scale_name, values_name

        out = []
        for k in keys:
            if k.endswith(".weight"):
                out += [k if k in self._views else values_name(k, "int4"), scale_name(k)]
            else:
                out.append(k)
        return out

    def _stored(self, keys: list[str]) -> tuple:
        from export.serve.kernels import as_scheme, stored_weight

        stored, out = iter(self._stored_keys(keys)), []
        for k in keys:
            if k.endswith(".weight"):
                values, scale = self._views[next(stored)], self._views[next(stored)]
                out.append(as_scheme(stored_weight(values.clone(), scale.clone()), self.quantize or ""))
            else:
                out.append(self._views[next(stored)].to(dtype=self.dtype, copy=True))
        w1, b1, w2, b2 = out if self.cfg.mlp_bias else (out[0], None, out[1], None)
        return w1, b1, w2, b2

    def _to_gpu(self, keys: list[str]) -> list[torch.Tensor]:
        """The tensors of `keys` on the GPU: staged in pinned host memory (a copy from pageable memory is synchronous),
        copied on the store's own stream, so that a prefetch (`Residency`'s thread) overlaps the forwards running on
        the default stream; waited for here (the caller's thread), and marked as used by the default stream (whose
        kernels read them after this returns: their memory is not reused before those kernels are done)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        out, staged = [], []
        with torch.cuda.stream(self._stream):
            for k in keys:
                host = torch.empty(self._views[k].shape, dtype=self._views[k].dtype, pin_memory=True)
                host.copy_(self._views[k])
                staged.append(host)
                out.append(host.to(self.device, non_blocking=True).to(self.dtype))
        self._stream.synchronize()  # the pinned buffers may go; the tensors are whole for any stream
        default = torch.cuda.default_stream(self.device)
        for t in out:
            t.record_stream(default)
        return out

    def nbytes(self) -> int:
        """Bytes of one expert as it is held: in the serving dtype, or quantised (its values, scales and biases)."""
        h, f = self.cfg.hidden, self.cfg.expert_hidden
        up = 2 * f if self.cfg.activation == "swiglu" else f
        biases = ((up + h) if self.cfg.mlp_bias else 0) * torch.finfo(self.dtype).bits // 8
        if self.stored:  # a quantised package: its first expert's stored tensors (every expert is alike)
            parts = EXPERT_PARTS if self.cfg.mlp_bias else EXPERT_PARTS[::2]
            keys = self._stored_keys([self.key(0, 0, p) for p in parts])
            return sum(self._views[k].numel() * self._views[k].element_size() for k in keys if not k.endswith("bias")) \
                + biases
        if self.quantize is not None:  # quantised as it loads (kernels.quantized_weights)
            from export.serve.kernels import quantized_kind

            kind = quantized_kind(self.quantize, [h, f])
            return kind.held_bytes(up, h) + kind.held_bytes(h, f) + biases
        return (up * h + f * h) * torch.finfo(self.dtype).bits // 8 + biases


@dataclass(frozen=True)
class ResidencyStats:
    """One rank's experts since start: needed and resident or prefetched in time (hits), loaded on demand (misses),
    prefetched; and the bytes held now (native resident, replicas, and all natives were they resident)."""

    hits: int
    misses: int
    prefetched: int
    native_bytes: int
    replica_bytes: int
    native_bytes_all_resident: int
    expert_bytes: int  # one expert's


class Residency:
    """This rank's resident experts: natives up to `resident_fraction` of them (least recently used out first),
    the replicas the table in force gives it, and the prefetch of the experts a forward is expected to use."""

    def __init__(self, cfg: ModelConfig, store: ExpertStore, rank: int, ep: int, resident_fraction: float = 1.0):
        self.cfg, self.store, self.rank, self.ep = cfg, store, rank, ep
        self.native = [{e for e in range(n) if native_rank(e, n, ep) == rank} for n in cfg.experts]
        self.resident_fraction = resident_fraction
        natives = [(i, e) for i, s in enumerate(self.native) for e in sorted(s)]
        # room for native experts in memory: a fraction of them; the least recently used one leaves first
        self.capacity = max(1, round(resident_fraction * len(natives)))
        self.resident: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.cached: OrderedDict[tuple[int, int], None] = OrderedDict()  # resident natives, LRU first
        for key in natives[:self.capacity]:
            self._admit(key, store.load(*key))
        self.hits = 0  # experts needed by a forward that were resident (or prefetched in time)
        self.misses = 0  # experts needed and loaded on demand
        self.prefetched = 0
        self.lock = threading.Lock()
        self._prefetch: threading.Thread | None = None
        self._expect: list[set[int]] = [set() for _ in cfg.experts]

    def hold(self, table: Table) -> None:
        """Load the replicas `table` gives this rank, drop those it no longer does."""
        for i, layer in enumerate(table):
            for e, holders in enumerate(layer):
                key = (i, e)
                if e in self.native[i]:
                    continue
                if self.rank in holders and key not in self.resident:
                    self.resident[key] = self.store.load(i, e)
                elif self.rank not in holders and key in self.resident:
                    del self.resident[key]

    def prefetch(self, expect: list[list[int]]) -> None:
        """Load, in a loader thread, the native experts `expect`ed (per layer, most demanded first) that fit and are
        not resident; with every native resident there is nothing to do."""
        if self.resident_fraction >= 1.0:
            return
        ranked = sorted(((j, i, e) for i, es in enumerate(expect) for j, e in enumerate(es) if e in self.native[i]))
        ours = [(i, e) for _, i, e in ranked][:self.capacity]  # each layer's likeliest first, layers interleaved
        wanted = [key for key in ours if key not in self.resident]
        self._expect = [{e for (i, e) in ours if i == layer} for layer in range(len(expect))]
        with self.lock:
            for key in ours:  # expected ones already resident: most recently used, not evicted by the prefetch
                if key in self.cached:
                    self.cached.move_to_end(key)
        if wanted:
            self._prefetch = threading.Thread(target=self._load_all, args=(wanted,), name="prefetch", daemon=True)
            self._prefetch.start()

    def settle(self) -> None:
        """Wait for the prefetch under way, if any (before a forward's table and prefetch are applied)."""
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """Expert tensors for this forward: resident (a hit), being prefetched (wait: a hit if it was
        expected), or loaded now (a miss)."""
        key = (layer, expert)
        with self.lock:
            if key in self.resident:
                self.hits += 1
                if key in self.cached:
                    self.cached.move_to_end(key)
                return self.resident[key]
        if expert in self._expect[layer] and self._prefetch is not None:
            self.settle()
            with self.lock:
                if key in self.resident:
                    self.hits += 1
                    return self.resident[key]
        tensors = self.store.load(layer, expert)
        with self.lock:
            self.misses += 1
            if expert in self.native[layer]:
                self._admit(key, tensors)
        return tensors

    def stats(self) -> ResidencyStats:
        per = self.store.nbytes()
        replicas = sum(1 for (i, e) in self.resident if e not in self.native[i])
        natives = len(self.resident) - replicas
        return ResidencyStats(self.hits, self.misses, self.prefetched, natives * per, replicas * per,
                              sum(len(s) for s in self.native) * per, per)

    def _load_all(self, keys) -> None:
        for key in keys:
            tensors = self.store.load(*key)
            with self.lock:
                if key not in self.resident:
                    self._admit(key, tensors)
                    self.prefetched += 1

    def _admit(self, key, tensors) -> None:
        """A native expert becomes resident, evicting the least recently used one if full."""
        self.resident[key] = tensors
        self.cached[key] = None
        self.cached.move_to_end(key)
        while len(self.cached) > self.capacity:
            old, _ = self.cached.popitem(last=False)
            del self.resident[old]
