"""Process set-up: one rank or many, always through DeepSpeed.

`init()` joins the ranks a launcher started (or makes a 1-rank group when run directly), and `relaunch()`
restarts the current command under the DeepSpeed launcher when more ranks are asked for than are running, as
`accelerate launch` / `torchrun` users expect. Every launcher DeepSpeed's runner drives is recognised:
its own (`deepspeed --num_gpus N`, or a hostfile over pdsh: RANK, LOCAL_RANK, WORLD_SIZE are set) and
`--launcher openmpi | mvapich | mpich | impi | slurm` (mpirun or srun start the ranks and set only their own
variables). `launch_env()` reads them; `python -m pipeline.dist` prints what it sees, e.g.

    deepspeed --hostfile HOSTS --launcher openmpi --launcher_args "--allow-run-as-root" --module pipeline.dist
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


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher told this process: which launcher, and this rank's place (before any process group)."""
    launcher: str
    rank: int
    world: int
    local_rank: int
    local_world: int


# (rank, world size, local rank, local world size) as each launcher names them, tried in this order. DeepSpeed's
# own launcher (its local and pdsh runners) and torchrun set the first; mpirun and srun only their own. DeepSpeed
# finds the MPI ones itself (`mpi_discovery` in `deepspeed.init_distributed`) but only when it is asked to set up
# the group from scratch; SLURM's are what srun sets per job step (SLURM_STEP_*: a batch script's own SLURM_NTASKS
# counts the allocation's tasks, not running ranks).
LAUNCHER_VARS = {
    "deepspeed": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mvapich": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
}
# every variable by which a process may take itself for a rank: a child process (a test, a benchmark) drops them
LAUNCH_VARS = tuple(sorted({v for names in LAUNCHER_VARS.values() for v in names}
                           | {"LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE"}))


def _slurm_tasks_on_node(tasks_per_node: str, node: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of 3 nodes, then 1) at node index `node`."""
    counts = []
    for part in tasks_per_node.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts[node]


def launch_env(environ=None) -> LaunchEnv | None:
    """The launcher that started this process as one of several ranks, and this rank's place; None when this
    process runs alone (no launcher, or a launcher of one rank other than DeepSpeed's). Reads only variables."""
    env = os.environ if environ is None else environ
    for launcher, (rank, world, local_rank, local_world) in LAUNCHER_VARS.items():
        if launcher == "deepspeed":
            if "LOCAL_RANK" not in env or "WORLD_SIZE" not in env:
                continue
        elif world not in env:
            continue
        try:
            size = int(env[world])
            if launcher == "deepspeed":
                local = int(env.get(local_world, env.get("LOCAL_SIZE", "1")))
            elif launcher == "slurm":
                local = _slurm_tasks_on_node(env[local_world], int(env.get("SLURM_NODEID", "0")))
            else:
                local = int(env[local_world])
            place = LaunchEnv(launcher, int(env.get(rank, "0")), size, int(env[local_rank]), local)
        except (KeyError, ValueError, IndexError) as err:
            raise RuntimeError(f"started by {launcher} but its variables are incomplete or malformed ({err}): "
                               f"{', '.join(f'{v}={env.get(v)!r}' for v in LAUNCHER_VARS[launcher])}") from None
        if launcher != "deepspeed" and size == 1:
            return None  # `mpirun -n 1`, a 1-task srun step: alone
        return place
    return None


def under_launcher() -> bool:
    """Started by a launcher as one of its ranks (DeepSpeed's, torchrun, mpirun, srun)."""
    return launch_env() is not None


def launched_world() -> int | None:
    """The number of ranks the launcher started, or None outside a launcher."""
    place = launch_env()
    return None if place is None else place.world


def _adopt_launcher_env(place: LaunchEnv) -> None:
    """Give ranks started by mpirun or srun the variables DeepSpeed's own launcher sets (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_SIZE, MASTER_ADDR, MASTER_PORT), so that the process group and DeepSpeed's shared-memory all-reduce
    (which reads LOCAL_SIZE) form as under `deepspeed --num_gpus`. Rank 0's address: MASTER_ADDR if the job
    exported it (mpirun -x, srun --export), else DeepSpeed's own MPI discovery through mpi4py, which also checks
    the ranks' numbering against MPI's."""
    os.environ.setdefault("LOCAL_SIZE", str(place.local_world))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(place.local_world))
    if "MASTER_ADDR" in os.environ:
        os.environ.update(RANK=str(place.rank), WORLD_SIZE=str(place.world), LOCAL_RANK=str(place.local_rank))
        os.environ.setdefault("MASTER_PORT", "29500")  # DeepSpeed's and torch's default
        return
    from deepspeed.comm.comm import mpi_discovery

    try:
        mpi_discovery(distributed_port=int(os.environ.get("MASTER_PORT", "29500")), verbose=False)
    except ImportError as err:  # mpi4py is not installed
        raise RuntimeError(f"started by {place.launcher} ({place.world} ranks) without MASTER_ADDR: rank 0's address "
                           f"comes from DeepSpeed's MPI discovery, which needs mpi4py ({err}): pip install mpi4py, "
                           f"or export MASTER_ADDR (and MASTER_PORT) to every rank") from None
    if (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) != (place.rank, place.world):
        raise RuntimeError(f"{place.launcher} says rank {place.rank} of {place.world}, MPI says "
                           f"{os.environ['RANK']} of {os.environ['WORLD_SIZE']}: mpi4py is built against another MPI "
                           f"than the one that launched this job")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_cpu_accelerator() -> None:
    """Name DeepSpeed's CPU accelerator on a machine without GPUs, instead of a warning per rank."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


_FAILED = False  # an exception reached the top of this rank (`_note_failure`): its exit must not wait for a peer


def _note_failure() -> None:
    """Mark this rank as failing when an exception ends it (sys.excepthook runs before the atexit handlers), so that
    `_shutdown` skips the exit barrier: the other ranks may be inside a collective this rank never joins, and a
    barrier or destroy_process_group against them hung the exit (then the launcher, waiting for a rank to exit,
    never stopped the others)."""
    hook = sys.excepthook

    def excepthook(kind, value, tb):
        global _FAILED
        _FAILED = True
        hook(kind, value, tb)

    sys.excepthook = excepthook


def _shutdown() -> None:
    """At exit: leave the process group cleanly. A rank that exits with gloo's threads still up can die
    in std::terminate ('terminate called without an active exception', SIGABRT) after its work is done.
    A failing rank (`_note_failure`) leaves at once, non-zero: DeepSpeed's launcher then stops every rank."""
    import torch.distributed as td

    if _FAILED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
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


_LOCAL_WORLD: int | None = None  # init()'s count of the ranks on this machine
# every rank in a gloo group, for `broadcast_json`'s control messages on the CPU: a rank waiting for the next one waits
# in gloo's socket read; through NCCL it would wait in the device-to-host copy after the broadcast, which spins a core
_CONTROL = None


def init() -> Ranks:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU) and size the thread pool."""
    quiet_cpu_accelerator()
    import deepspeed
    import torch.distributed as td

    place = launch_env()
    alone = place is None
    if place is not None and place.launcher != "deepspeed":  # mpirun, srun: their variables, then DeepSpeed's
        _adopt_launcher_env(place)
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
            import atexit

            atexit.register(_shutdown)  # first, so that it runs last (atexit's order): after the buffer's unlink
            _note_failure()
            _own_shm_buffer()
            deepspeed.init_distributed(verbose=False)
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per local rank
    global _CONTROL
    if not alone and _CONTROL is None:  # every rank, in the same order: a collective
        _CONTROL = td.new_group(backend="gloo")
    # the ranks sharing this machine's cores and memory, counted (once, when the group forms), not taken from the
    # launcher: a hostfile's two "nodes" can be one machine
    global _LOCAL_WORLD
    if _LOCAL_WORLD is None or alone:
        _LOCAL_WORLD = 1 if alone else _ranks_on_this_machine()
    local_world = _LOCAL_WORLD
    if get_accelerator().device_name() == "cpu":
        # without core binding every rank would use all cores: split them between the local ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        tune_cpu_allocator()
    return Ranks(td.get_rank(), td.get_world_size(), int(os.environ["LOCAL_RANK"]), local_world)


def _ranks_on_this_machine() -> int:
    """The group's ranks on this machine, by host name (as DeepSpeed's MPI discovery numbers local ranks). Collective."""
    import hashlib

    key = int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:6], "big")  # 48 bits: exact in float64
    return sum(int(row[0]) == key for row in gather_numbers([float(key)]))


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
    """Rank 0's JSON-serialisable `obj` on every rank (the others pass None). Every rank on this machine: through a
    named pipe from rank 0 to each other rank (`_Pipes`: ~30 us, where gloo's broadcast takes ~0.4 ms here). Else
    one broadcast of BROADCAST_BYTES (an 8-byte length, then UTF-8 bytes), a second for the rest of a longer message,
    through a gloo group of every rank (`init`), whatever the accelerator. Either way a rank waiting for the message
    sleeps (no spinning). `on`: through the process group on that device instead. For control messages between our
    own ranks (the serving plan); no pickle involved.
    """
    import json

    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return obj
    if on is None and _LOCAL_WORLD == td.get_world_size():
        return _pipes().broadcast(obj)
    group = _CONTROL if on is None else None
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
    runtime's sum waits without holding a core (export/serve/kernels/transport.py `attach_local_reduce`).
    `gather(bytes)`: (every rank's length, every rank's bytes, empty where they did not fit), for `gather_json` in
    one wait."""
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
    serving runtime's shared-memory gather where it is attached (`use_local_reduce`: one wait, where two sums took
    ~0.3 ms a step of 2 ranks here), else the sizes, then the bytes (one float32 per byte, padded to the longest)
    through `fast_all_reduce_`. For the serving ranks' per-step results."""
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
    sizes = [int(n[0]) for n in gather_rows([len(data)], dev)]
    table = torch.zeros(len(sizes), max(sizes), dtype=torch.float32, device=dev)
    table[td.get_rank(), :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev, torch.float32)
    rows = fast_all_reduce_(table).to("cpu", torch.uint8)
    return [json.loads(bytes(r[:n].numpy()).decode()) for r, n in zip(rows, sizes)]


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
    # --hostfile: none. Without it DeepSpeed's runner reads /job/hostfile where one exists (a cluster's job
    # file) and would spread these ranks over every host in it; a missing hostfile means this machine alone
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", os.devnull, "--num_gpus", str(nproc),
            "--master_port", str(free_port()), "--no_local_rank", "--module", module, *args]


def relaunch(nproc: int, module: str, args: list[str]) -> int:
    """Run `python -m module args` on `nproc` local ranks through the DeepSpeed launcher; its exit status. (A server
    relaunches itself with export/serve/lifecycle.py instead: signals to rank 0, a watch on this process.)"""
    return subprocess.call(launcher_command(nproc, module, args))


def main() -> int:
    """Print what this rank's launcher said and the process group it joined (one JSON line per rank)."""
    import json

    import torch.distributed as td

    place = launch_env()
    ranks = init()
    t = all_reduce_(torch.ones(1, device=device()))  # every rank really is in the group
    print(json.dumps({"launcher": place.launcher if place else None, "rank": ranks.rank, "world": ranks.world,
                      "local_rank": ranks.local_rank, "local_world": ranks.local_world, "backend": td.get_backend(),
                      "all_reduce": t.item(), "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
