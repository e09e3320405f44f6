"""Process set-up: one rank or many, always through DeepSpeed.

`init()` joins the ranks started by the DeepSpeed launcher (or makes a 1-rank group when run
directly), and `relaunch()` restarts the current command under the launcher when more ranks are
asked for than are running, as `accelerate launch` / `torchrun` users expect.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    local_world: int


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_cpu_accelerator() -> None:
    """Name DeepSpeed's CPU accelerator on a machine without GPUs, instead of a warning per rank."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _shutdown() -> None:
    """At exit: leave the process group cleanly. A rank that exits with gloo's threads still up can die
    in std::terminate ('terminate called without an active exception', SIGABRT) after its work is done."""
    import torch.distributed as td

    try:
        if td.is_initialized():
            if td.get_backend() == "gloo":  # bounded: a peer stuck elsewhere must not hang our exit
                import datetime

                td.monitored_barrier(timeout=datetime.timedelta(seconds=10))
            td.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer already gone: nothing left to coordinate
        pass


def _own_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce keeps a ~66 MB shared-memory buffer per rank in /dev/shm, named by
    user, master address, port and rank, and never unlinks it: every multi-rank CPU run leaked its
    buffers (RAM) until reboot, and a stale buffer left on a reused port could be opened by a peer
    before its owner rewrote it. Each rank removes a stale file of its own name before DeepSpeed
    creates it, and its file at exit (peers that mapped it keep their mapping)."""
    import atexit

    name = Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                                f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    name.unlink(missing_ok=True)
    atexit.register(name.unlink, missing_ok=True)


MALLOC_TUNING_ENV = "MOE_PIPELINE_MALLOC_TUNING"


def tune_cpu_allocator() -> bool:
    """Keep freed tensor memory in the process heap instead of returning it to the OS (glibc only).

    PyTorch's CPU allocator calls malloc/free for every tensor, and glibc serves blocks above its
    mmap threshold (128 KiB to 32 MiB, adaptive) with fresh mmap()s, so every large activation or
    logits tensor of every step is page-faulted in anew: on the tiny recipe that was most of the KD
    divergence's time and a good part of a plain step's (benchmarks/kd_step_time.py). Raising the
    mmap and trim thresholds makes such blocks come from, and go back to, the heap, as jemalloc or
    tcmalloc (which Intel's PyTorch CPU guide preloads) would. The price: up to 1 GiB of freed memory
    stays resident. Set MOE_PIPELINE_MALLOC_TUNING=0 to leave malloc alone. Returns True if applied.
    """
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(mallopt(k, v) == 1 for k, v in ((m_mmap_threshold, 1 << 30), (m_trim_threshold, 1 << 30),
                                               (m_top_pad, 64 << 20)))


def init() -> Ranks:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU) and size the thread pool."""
    quiet_cpu_accelerator()
    import deepspeed
    import torch.distributed as td

    alone = not under_launcher()
    if alone:  # a 1-rank group
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not td.is_initialized():
        if alone:
            # rendezvous through a fresh file, not a TCP port: a port picked as free can be taken
            # (by gloo's own connections, say) before the store listens on it (EADDRINUSE)
            import atexit
            import shutil
            import tempfile

            store = Path(tempfile.mkdtemp(prefix="moe-pipeline-pg-")) / "store"
            atexit.register(shutil.rmtree, store.parent, True)
            deepspeed.init_distributed(verbose=False, init_method=f"file://{store}", rank=0, world_size=1)
        else:
            _own_shm_buffer()
            deepspeed.init_distributed(verbose=False)
            import atexit

            atexit.register(_shutdown)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per local rank
    else:
        # without core binding every rank would use all cores: split them between the local ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        tune_cpu_allocator()
    return Ranks(td.get_rank(), td.get_world_size(), int(os.environ["LOCAL_RANK"]), local_world)


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's random state: CPU, and the accelerator's (dropout and the gate's draws run there)."""
    from deepspeed.accelerator import get_accelerator

    state = {"cpu": torch.get_rng_state()}
    if get_accelerator().device_name() != "cpu":
        state["accelerator"] = get_accelerator().get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    from deepspeed.accelerator import get_accelerator

    torch.set_rng_state(state["cpu"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


# -- collectives: every torch.distributed call of ours is here, each on the accelerator's device -------------
# NCCL (DeepSpeed's CUDA accelerator) rejects CPU tensors; gloo takes CPU ones, and `device()` is the CPU
# there. Each helper builds its tensors on `on` (default: `device()`) and refuses a tensor elsewhere, so
# a call that would fail at the first collective on a GPU fails the same way on this machine's tests.

def _check_device(t: torch.Tensor, dev: torch.device, what: str) -> None:
    if t.device != dev:
        raise ValueError(f"{what}: a tensor on {t.device}, but the process group's device is {dev}; build "
                         f"collective tensors with pipeline.dist.device()")


def all_reduce_(t: torch.Tensor, group=None, on: torch.device | None = None) -> torch.Tensor:
    """Sum `t` over the ranks of `group` (all ranks by default), in place; `t` must be on the group's device
    (checked whenever a collective runs, and whenever `on` names the device: one rank needs no collective)."""
    import torch.distributed as td

    several = td.is_initialized() and td.get_world_size(group) > 1
    if several or on is not None:
        _check_device(t, on or device(), "all_reduce_")
    if several:
        td.all_reduce(t, group=group)
    return t


def gather_numbers(values: list[float], on: torch.device | None = None) -> list[list[float]]:
    """Every rank's `values` (the same count on each), gathered as one float64 row per rank (no pickle)."""
    import torch.distributed as td

    mine = torch.tensor(values, dtype=torch.float64, device=on or device())
    if not td.is_initialized() or td.get_world_size() == 1:
        return [mine.tolist()]
    rows = [torch.zeros_like(mine) for _ in range(td.get_world_size())]
    td.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def json_tensors(obj, on: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(length [1] int64, UTF-8 bytes uint8) of `obj` as JSON, on `on`: what broadcast_json sends."""
    import json

    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=on)
    return torch.tensor([data.numel()], dtype=torch.long, device=on), data


BROADCAST_BYTES = 16384  # one broadcast carries a message of up to this many bytes (with its length); more: a second


def broadcast_json(obj=None, on: torch.device | None = None):
    """Rank 0's JSON-serialisable `obj` on every rank (the others pass None): one broadcast of BROADCAST_BYTES
    (an 8-byte length, then UTF-8 bytes), a second for the rest of a longer message. Through the process group
    (gloo, NCCL): an idle rank waits here without spinning. For small control messages between our own ranks
    (the serving plan); no pickle involved.
    """
    import json

    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return obj
    dev = on or device()
    head = torch.zeros(BROADCAST_BYTES, dtype=torch.uint8, device=dev)
    if td.get_rank() == 0:
        data = json.dumps(obj).encode()
        size = len(data)
        head[:8] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
        first = data[:BROADCAST_BYTES - 8]
        if first:
            head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    td.broadcast(head, src=0)
    head = head.cpu()
    size = int.from_bytes(bytes(head[:8].numpy()), "little")
    payload = bytes(head[8:8 + min(size, BROADCAST_BYTES - 8)].numpy())
    if size > BROADCAST_BYTES - 8:
        rest = torch.zeros(size - (BROADCAST_BYTES - 8), dtype=torch.uint8, device=dev)
        if td.get_rank() == 0:
            rest.copy_(torch.frombuffer(bytearray(data[BROADCAST_BYTES - 8:]), dtype=torch.uint8))
        td.broadcast(rest, src=0)
        payload += bytes(rest.cpu().numpy())
    return json.loads(payload.decode())


FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the types DeepSpeed's shared-memory kernel reduces


def fast_all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over all ranks in place with DeepSpeed's low-latency inference all-reduce: through shared memory
    between the ranks of one machine on its CPU accelerator (microseconds, where gloo takes ~0.3-1 ms here), the
    process group's all-reduce otherwise (NCCL on GPUs). For the serving ranks' per-step data, while every rank
    is inside the step: the shared-memory kernel waits by spinning, so an idle rank must wait in gloo instead
    (`broadcast_json`). `t` on the group's device, float32/bf16/fp16 (the kernel's types)."""
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return t
    _check_device(t, device(), "fast_all_reduce_")
    if t.dtype not in FAST_DTYPES:  # the shared-memory kernel would leave other types unreduced
        raise ValueError(f"fast_all_reduce_: {t.dtype}; use float32, bfloat16 or float16 (or all_reduce_)")
    if os.environ.get("LOCAL_SIZE") != str(td.get_world_size()):  # what DeepSpeed's kernel checks
        td.all_reduce(t)  # ranks on several machines: no shared memory between them
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
    """Every rank's JSON-serialisable `obj`, in rank order, on every rank: the sizes, then the UTF-8 bytes (one
    float32 per byte, padded to the longest) through `fast_all_reduce_` (no pickle). For the serving ranks'
    per-step results."""
    import json

    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [obj]
    dev = on or device()
    data = json.dumps(obj).encode()
    sizes = [int(n[0]) for n in gather_rows([len(data)], dev)]
    table = torch.zeros(len(sizes), max(sizes), dtype=torch.float32, device=dev)
    table[td.get_rank(), :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev, torch.float32)
    rows = fast_all_reduce_(table).to("cpu", torch.uint8)
    return [json.loads(bytes(r[:n].numpy()).decode()) for r, n in zip(rows, sizes)]


def shared_memory_reduce() -> bool:
    """Whether `fast_all_reduce_` goes through DeepSpeed's shared-memory kernel (its CPU accelerator, every rank on
    this machine, the kernel built) rather than the process group."""
    import torch.distributed as td
    from deepspeed.accelerator import get_accelerator

    return (get_accelerator().device_name() == "cpu" and td.is_initialized()
            and os.environ.get("LOCAL_SIZE") == str(td.get_world_size())
            and hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_"))


def all_to_all_(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group=None) -> torch.Tensor:
    """DeepSpeed's `all_to_all_single` with variable splits: rows `inp[sum(in_splits[:r]):][:in_splits[r]]` go to
    rank r, and `out` receives rank r's rows at `sum(out_splits[:r])`. Both tensors on the group's device
    (checked). Alone: `out` is `inp`'s copy. The serving runtime's expert exchange (export/serve/placement/exchange.py)."""
    import torch.distributed as td

    _check_device(inp, device(), "all_to_all_")
    _check_device(out, device(), "all_to_all_")
    if not td.is_initialized() or td.get_world_size(group) == 1:
        return out.copy_(inp)
    import deepspeed.comm as dc

    dc.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


def world_size() -> int:
    """Ranks in the process group (1 before `init` or alone)."""
    import torch.distributed as td

    return td.get_world_size() if td.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (DeepSpeed's comm: on NCCL it synchronises on the current device)."""
    import torch.distributed as td

    if td.is_initialized() and td.get_world_size() > 1:
        td.barrier()


def launcher_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """`python -m module args` on `nproc` local ranks through the DeepSpeed launcher, as a command (printed)."""
    print(f"launching {nproc} ranks: deepspeed --num_gpus {nproc} --module {module} {' '.join(args)}",
          file=sys.stderr, flush=True)
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
            "--master_port", str(free_port()), "--no_local_rank", "--module", module, *args]


def relaunch(nproc: int, module: str, args: list[str]) -> int:
    """Run `python -m module args` on `nproc` local ranks through the DeepSpeed launcher; its exit status. (A server
    relaunches itself with export/serve/lifecycle.py instead: signals to rank 0, a watch on this process.)"""
    return subprocess.call(launcher_command(nproc, module, args))
