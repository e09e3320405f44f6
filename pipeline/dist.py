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


def tune_cpu_allocator() -> bool:
    """Keep freed tensor memory in the process heap instead of returning it to the OS (glibc only).

    PyTorch's CPU allocator calls malloc/free for every tensor, and glibc serves blocks above its
    mmap threshold (128 KiB to 32 MiB, adaptive) with fresh mmap()s, so every large activation or
    logits tensor of every step is page-faulted in anew: on the tiny recipe that was most of the KD
    divergence's time and a good part of a plain step's (benchmarks/kd_step_time.py). Raising the
    mmap and trim thresholds makes such blocks come from, and go back to, the heap, as jemalloc or
    tcmalloc (which Intel's PyTorch CPU guide preloads) would. The price: up to 1 GiB of freed memory
    stays resident. `init(tune_allocator=False)` (serve --no-malloc-tuning) leaves malloc alone. Returns True if
    applied.
    """
    if not sys.platform.startswith("linux"):
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


def init(tune_allocator: bool = True) -> Ranks:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU) and size the thread pool; on the CPU, with
    `tune_allocator`, glibc malloc tuned for large short-lived tensors (`tune_cpu_allocator`)."""
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
        if tune_allocator:
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

def all_reduce_(t: torch.Tensor, group=None, on: torch.device | None = None) -> torch.Tensor:
    """Sum `t` over the ranks of `group` (all ranks by default), in place; `t` must be on the group's device
    (checked whenever a collective runs, and whenever `on` names the device: one rank needs no collective)."""
    import torch.distributed as td

    several = td.is_initialized() and td.get_world_size(group) > 1
    if several or on is not None:
        check_device(t, on or device(), "all_reduce_")
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


def gather_json(obj, on: torch.device | None = None) -> list:
    """Every rank's JSON-serialisable `obj`, in rank order, on every rank (no pickle), through `gather_bytes`. For a
    stage's occasional exchanges (the serving ranks' per-step ones: export/serve/transport.py)."""
    import json

    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [obj]
    return [json.loads(b.decode()) for b in gather_bytes(json.dumps(obj).encode(), on)]


def gather_bytes(data: bytes, on: torch.device | None = None, sum_=None) -> list[bytes]:
    """Every rank's `data`, in rank order: the sizes, then the bytes (one float32 per byte, padded to the longest), each
    in a [ranks, n] table every rank fills its row of and `sum_` sums in place (default `all_reduce_`; the serving
    ranks pass their transport's faster sum). Exact for sizes below 2^24."""
    import torch.distributed as td

    sum_ = sum_ or all_reduce_
    dev, world, rank = on or device(), td.get_world_size(), td.get_rank()
    sizes = torch.zeros(world, 1, dtype=torch.float32, device=dev)
    sizes[rank] = len(data)
    sizes = [int(n) for n in sum_(sizes).flatten().tolist()]
    table = torch.zeros(world, max(sizes), dtype=torch.float32, device=dev)
    table[rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev, torch.float32)
    rows = sum_(table).to("cpu", torch.uint8)
    return [bytes(r[:n].numpy()) for r, n in zip(rows, sizes)]


def local_world() -> int:
    """The ranks on this machine (`init`'s count; 1 before it)."""
    return _LOCAL_WORLD or 1


def control_group():
    """`init`'s gloo group of every rank (None alone): control messages on the CPU, whatever the accelerator."""
    return _CONTROL


def check_device(t: torch.Tensor, dev: torch.device, what: str) -> None:
    if t.device != dev:
        raise ValueError(f"{what}: a tensor on {t.device}, but the process group's device is {dev}; build "
                         f"collective tensors with pipeline.dist.device()")


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
