"""The server's processes: `serve --nproc N` relaunched under the DeepSpeed launcher, stopped gracefully.

    from export.serve.lifecycle import relaunch_server, parent_alive
    relaunch_server(2, "cli", ["serve", "runs/tiny/package", "--ep-size", "2"])   # the launching process
    parent_alive()                                                                             # rank 0, in a thread

SIGTERM/SIGINT sent to the launching process go to rank 0 alone, which drains and then stops the other
ranks itself, instead of to the launcher, which would kill every rank at once (a terminal's Ctrl-C
reaches the whole process group, the launcher included: that stops at once). Rank 0 watches the
launching process: if it is killed outright (SIGKILL), the server stops instead of living on.
"""

from __future__ import annotations

import os
import signal
import subprocess

from pipeline import dist

PARENT_ENV = "MOE_PIPELINE_PARENT_PID"


def relaunch_server(nproc: int, module: str, args: list[str]) -> int:
    """Run the server `python -m module args` on `nproc` local ranks through the DeepSpeed launcher; its exit status."""
    proc = subprocess.Popen(dist.launcher_command(nproc, module, args), env={**os.environ, PARENT_ENV: str(os.getpid())})

    def forward(sig, frame):
        target = _rank0_of(proc.pid)
        try:
            os.kill(target, sig) if target else proc.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return proc.wait()


def parent_alive() -> bool:
    """False once the process that relaunched us under the launcher (PARENT_ENV) has gone."""
    pid = os.environ.get(PARENT_ENV)
    if not pid:
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _rank0_of(launcher_pid: int) -> int | None:
    """The pid of rank 0 among the launcher's descendants (its environment says RANK=0), if it has started."""
    import psutil

    try:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                env = child.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("RANK") == "0" and "LOCAL_RANK" in env:
                return child.pid
    except psutil.Error:
        return None
    return None
