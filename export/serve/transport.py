"""The serving ranks' transport: rank 0's messages to the others, the per-step sums and gathers, shared regions.

    from export.serve import transport
    transport.broadcast_json(step_json)    # rank 0's message; the others pass None (export/serve/ranks.py)
    transport.gather_json(sync_json)       # every rank's part of a step (export/serve/coordinator.py)
    transport.fast_all_reduce_(t)          # a step's sum (the expert exchange: export/serve/placement/exchange.py)

On one machine the ranks talk through named pipes (rank 0's messages: a waiting rank sleeps) and shared memory (the
per-step sums and gathers: DeepSpeed's shared-memory all-reduce, or the kernels' own, which waits without spinning,
once `use_local_reduce` attaches it: export/serve/kernels); between machines through the process group (gloo's
control group for messages). No pickle: messages are JSON. Built on pipeline/dist.py's process group (`dist.init`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipeline.dist import check_device, control_group, device, gather_bytes, gather_numbers, local_world


BROADCAST_BYTES = 16384  # one broadcast carries a message of up to this many bytes (with its length); more: a second


def broadcast_json(obj=None, on: torch.device | None = None):
    """Rank 0's JSON-serialisable `obj` on every rank (the others pass None). Every rank on this machine: through a
    named pipe from rank 0 to each other rank (`_Pipes`: a write and a read, where gloo's broadcast is a round of its
    sockets). Else
    one broadcast of BROADCAST_BYTES (an 8-byte length, then UTF-8 bytes), a second for the rest of a longer message,
    through a gloo group of every rank (`init`), whatever the accelerator. Either way a rank waiting for the message
    sleeps (no spinning). `on`: through the process group on that device instead. For control messages between our
    own ranks (the serving plan); no pickle involved.
    """
    import json

    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return obj
    if on is None and local_world() == td.get_world_size():
        return _pipes().broadcast(obj)
    group = control_group() if on is None else None
    dev = torch.device("cpu") if group is not None else on or device()
    head = torch.zeros(BROADCAST_BYTES, dtype=torch.uint8, device=dev)
    if td.get_rank() == 0:
        data = json.dumps(obj).encode()
        size = len(data)
        head[:8] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
        first = data[:BROADCAST_BYTES - 8]
        if first:
            head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    td.broadcast(head, src=0, group=group)
    head = head.cpu()
    size = int.from_bytes(bytes(head[:8].numpy()), "little")
    payload = bytes(head[8:8 + min(size, BROADCAST_BYTES - 8)].numpy())
    if size > BROADCAST_BYTES - 8:
        rest = torch.zeros(size - (BROADCAST_BYTES - 8), dtype=torch.uint8, device=dev)
        if td.get_rank() == 0:
            rest.copy_(torch.frombuffer(bytearray(data[BROADCAST_BYTES - 8:]), dtype=torch.uint8))
        td.broadcast(rest, src=0, group=group)
        payload += bytes(rest.cpu().numpy())
    return json.loads(payload.decode())


class _Pipes:
    """Rank 0's messages to the other ranks of this machine: a named pipe (FIFO, in /dev/shm, named by the group's
    rendezvous address and port) to each, opened at the first message (an open waits for the other end), unlinked
    once both ends hold it. A message is an 8-byte length, then its UTF-8 JSON. A reader whose writer is gone (rank 0
    died) gets end-of-file: an error, where gloo would have timed out."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.fds: dict[int, int] = {}

    @staticmethod
    def path(rank: int) -> Path:
        return Path("/dev/shm") / (f"moe_pipeline_msgs_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                                   f"{os.environ.get('MASTER_PORT', '')}_{rank}")

    def _open(self, rank: int, flags: int) -> int:
        import stat

        path = self.path(rank)
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            if not stat.S_ISFIFO(path.stat().st_mode):  # not ours to read: refuse rather than read a stranger's file
                raise RuntimeError(f"{path} exists and is not a named pipe; remove it") from None
        return os.open(path, flags)

    def broadcast(self, obj):
        import json

        if self.rank == 0:
            data = json.dumps(obj).encode()
            message = len(data).to_bytes(8, "little") + data
            for r in range(1, self.world):
                if r not in self.fds:
                    self.fds[r] = self._open(r, os.O_WRONLY)  # returns once rank r has it open too
                    self.path(r).unlink(missing_ok=True)
                view = memoryview(message)
                while view:
                    view = view[os.write(self.fds[r], view):]
            return obj
        if self.rank not in self.fds:
            self.fds[self.rank] = self._open(self.rank, os.O_RDONLY)
        size = int.from_bytes(self._read(8), "little")
        return json.loads(self._read(size).decode())

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = os.read(self.fds[self.rank], min(left, 1 << 20))
            if not chunk:
                raise RuntimeError(f"rank {self.rank}: rank 0 closed its messages (it has exited)")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


_PIPES: _Pipes | None = None


def _pipes() -> _Pipes:
    import torch.distributed as td

    global _PIPES
    if _PIPES is None:
        _PIPES = _Pipes(td.get_rank(), td.get_world_size())
    return _PIPES


FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the types DeepSpeed's shared-memory kernel reduces

_LOCAL_REDUCE = None  # `use_local_reduce`'s sum, or None (DeepSpeed's kernel)
_LOCAL_GATHER = None  # `use_local_reduce`'s gather, or None (`gather_json` through two sums)


def use_local_reduce(fn, gather=None) -> None:
    """`fast_all_reduce_` between the ranks of this machine through `fn(t)` (t summed in place) instead of DeepSpeed's
    shared-memory kernel, or through DeepSpeed's again with None. Every rank alike, between collectives. The serving
    runtime's sum waits without holding a core (export/serve/kernels `attach_local_reduce`). `gather(bytes)`:
    (every rank's length, every rank's bytes, empty where they did not fit), for `gather_json` in one wait."""
    global _LOCAL_REDUCE, _LOCAL_GATHER
    _LOCAL_REDUCE, _LOCAL_GATHER = fn, gather if fn is not None else None


def region_prefix() -> str:
    """How the /dev/shm files of `shared_region` start for this user and this launch (its rendezvous address and
    port); rank 0's pid ends each name."""
    return f"moe_pipeline_region_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_"


def shared_region(nbytes: int) -> torch.Tensor:
    """A region of `nbytes` bytes of zeros every rank of this machine maps (uint8, MAP_SHARED): rank 0 makes a file in
    /dev/shm (named by the group's rendezvous address and port), the others map it once its name reaches them, and it
    is unlinked once every rank holds it, before any rank returns. Collective; every rank on this machine."""
    import torch.distributed as td

    path = Path("/dev/shm") / f"{region_prefix()}{os.getpid()}"
    if td.get_rank() == 0:
        tmp = path.with_name(path.name + ".partial")
        with open(tmp, "wb") as f:
            f.truncate(nbytes)  # zeros
        tmp.rename(path)
    name = broadcast_json(str(path) if td.get_rank() == 0 else None)
    region = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
    gather_numbers([1.0])  # every rank holds it
    if td.get_rank() == 0:
        Path(name).unlink(missing_ok=True)
    gather_numbers([1.0])  # and no rank returns before it is gone (nothing is left behind if a rank dies later)
    return region


def fast_all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over all ranks in place with DeepSpeed's low-latency inference all-reduce: through shared memory
    between the ranks of one machine on its CPU accelerator (microseconds, where gloo takes a round of its sockets), the
    process group's all-reduce otherwise (NCCL on GPUs). For the serving ranks' per-step data, while every rank
    is inside the step: the shared-memory kernel waits by spinning, so an idle rank must wait in gloo instead
    (`broadcast_json`). `t` on the group's device, float32/bf16/fp16 (the kernel's types)."""
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return t
    check_device(t, device(), "fast_all_reduce_")
    if t.dtype not in FAST_DTYPES:  # the shared-memory kernel would leave other types unreduced
        raise ValueError(f"fast_all_reduce_: {t.dtype}; use float32, bfloat16 or float16 (or all_reduce_)")
    if os.environ.get("LOCAL_SIZE") != str(td.get_world_size()):  # what DeepSpeed's kernel checks
        td.all_reduce(t)  # ranks on several machines: no shared memory between them
        return t
    if _LOCAL_REDUCE is not None:
        _LOCAL_REDUCE(t)
        return t
    import deepspeed.comm as dc

    dc.inference_all_reduce(t)
    return t


def gather_rows(values: list[float], on: torch.device | None = None) -> list[list[float]]:
    """Every rank's `values` (the same count on each) through one `fast_all_reduce_` of a [ranks, n] float32 table
    (each rank fills its row): exact for integers below 2^24. In-step data of the serving ranks."""
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [list(values)]
    table = torch.zeros(td.get_world_size(), len(values), dtype=torch.float32, device=on or device())
    table[td.get_rank()] = torch.tensor(values, dtype=torch.float32, device=table.device)
    return fast_all_reduce_(table).tolist()


def gather_json(obj, on: torch.device | None = None) -> list:
    """Every rank's JSON-serialisable `obj`, in rank order, on every rank (no pickle): the UTF-8 bytes through the
    serving runtime's shared-memory gather where it is attached (`use_local_reduce`: one wait, where two sums wait
    twice), else pipeline/dist.py `gather_bytes` through `fast_all_reduce_`. For the serving ranks' per-step results."""
    import json

    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [obj]
    dev = on or device()
    data = json.dumps(obj).encode()
    if _LOCAL_GATHER is not None and dev.type == "cpu":  # one wait for the other ranks, no sums
        lengths, rows = _LOCAL_GATHER(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if all(r.numel() == n for r, n in zip(rows, lengths)):  # every rank's fitted its slot (so says every rank)
            return [json.loads(bytes(r.numpy()).decode()) for r in rows]
    return [json.loads(b.decode()) for b in gather_bytes(data, dev, fast_all_reduce_)]


def shared_memory_reduce(dtype: torch.dtype | None = None) -> bool:
    """Whether `fast_all_reduce_` goes through DeepSpeed's shared-memory kernel (its CPU accelerator, every rank on
    this machine, the kernel built) rather than the process group; with `dtype`, for tensors of that type too
    (DeepSpeed reduces bf16 and fp16 there only on a CPU with AVX-512BW, fp32 with AVX2: its `vector_kernel_level`)."""
    import torch.distributed as td
    from deepspeed.accelerator import get_accelerator

    if not (get_accelerator().device_name() == "cpu" and td.is_initialized()
            and os.environ.get("LOCAL_SIZE") == str(td.get_world_size())
            and hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
        return False
    if dtype is None:
        return True
    import deepspeed.comm as dc

    level = getattr(dc.comm.cdb, "shm_vector_kernel_level", 0)
    return dtype in FAST_DTYPES and level >= (1 if dtype == torch.float32 else 2)


def all_to_all_(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group=None) -> torch.Tensor:
    """DeepSpeed's `all_to_all_single` with variable splits: rows `inp[sum(in_splits[:r]):][:in_splits[r]]` go to
    rank r, and `out` receives rank r's rows at `sum(out_splits[:r])`. Both tensors on the group's device
    (checked). Alone: `out` is `inp`'s copy. The serving runtime's expert exchange (export/serve/placement/exchange.py)."""
    import torch.distributed as td

    check_device(inp, device(), "all_to_all_")
    check_device(out, device(), "all_to_all_")
    if not td.is_initialized() or td.get_world_size(group) == 1:
        return out.copy_(inp)
    import deepspeed.comm as dc

    dc.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


REDUCE_SLOT_BYTES = 4 << 20  # a rank's slot in the shared region (two a rank): larger tensors go a slot at a time


def attach_local_reduce() -> bool:
    """Between the ranks of one machine on the CPU accelerator (`shared_memory_reduce`), the serving ranks' sums
    (`fast_all_reduce_`: the expert exchange, the step results; the decode kernel's gathered layers) through the
    kernels' `local_reduce_` (export/serve/kernels), which waits for the other ranks without holding a core, instead of DeepSpeed's
    kernel, which spins. Collective (every rank, once, before the first forward); False where it does not apply
    (1 rank, several machines, no kernel here, or `serve --no-local-reduce`; every rank agrees first)."""
    import torch.distributed as td

    import export.serve.kernels.options as options
    from export.serve.kernels.extension import kernel
    from pipeline import dist

    if not (td.is_initialized() and td.get_world_size() > 1 and shared_memory_reduce()):
        return False
    k = kernel()
    wanted = options.current().local_reduce and k is not None and hasattr(k, "local_reduce_")
    if not all(row[0] for row in dist.gather_numbers([float(wanted)])):
        return False
    world = td.get_world_size()
    region = shared_region(world * 64 + 2 * world * REDUCE_SLOT_BYTES)
    k.local_reduce_attach(region, td.get_rank(), world, REDUCE_SLOT_BYTES)
    use_local_reduce(k.local_reduce_, getattr(k, "local_gather", None))
    return True

