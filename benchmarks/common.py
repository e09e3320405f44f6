"""Shared by the benchmark scripts: how to start our own CLI as a user would, in a clean environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# set by a launcher or by pipeline.dist.init(); a child that inherits them thinks it is a rank already
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE")


def cli_command() -> list[str]:
    """`moe-pipeline` from this interpreter's environment (or `python -m pipeline.cli`)."""
    script = Path(sys.executable).parent / "moe-pipeline"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pipeline.cli"]


def child_env() -> dict[str, str]:
    """This environment without rank variables, offline for the hubs, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def start_server(pkg: Path, extra: list[str] = (), threads: int | None = None):
    """`moe-pipeline serve PKG --port P EXTRA` as a separate process, once /health answers: (process, url)."""
    import subprocess
    import time

    import requests

    from pipeline.dist import free_port

    port = free_port()
    env = child_env()
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen([*cli_command(), "serve", str(pkg), "--port", str(port), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited {proc.returncode}: moe-pipeline serve {pkg} {' '.join(extra)}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up")


def stop_server(proc) -> None:
    """SIGTERM (the server drains, then exits) and wait."""
    proc.terminate()
    proc.wait(timeout=120)


def run_logged(cmd: list[str], log: Path, timeout: float | None, append: bool = True) -> float:
    """Run a CLI command with its output in `log`; the wall seconds, or RuntimeError with the log's tail."""
    import subprocess
    import time

    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "a" if append else "w") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-25:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({rc}); last lines of {log}:\n" + "\n".join(tail))
    return wall
