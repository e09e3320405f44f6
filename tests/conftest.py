"""Shared test set-up: offline hubs, one data cache per session, helpers to run the real CLI."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A small teacher for stage tests: same code paths as recipes/tiny.yaml, seconds instead of minutes.
SMALL = [
    "model.layers=4", "model.hidden=64", "model.heads=4", "model.experts=[2,4]", "data.seq_len=64",
    "teacher.train.micro_batch_size=4", "teacher.train.global_batch_size=8", "teacher.train.warmup_steps=2",
    "teacher.train.log_every=2", "teacher.train.eval_batches=2", "teacher.eval.micro_batch_size=4",
    "teacher.eval.eval_batches=2", "student.layers=3",
    "student.train.micro_batch_size=4", "student.train.global_batch_size=8",
]

# SMALL plus a few steps of each stage: a finished run (teacher and student) in about half a minute
SMALL_RUN = SMALL + ["teacher.train.steps=8", "teacher.train.checkpoint_every=4", "teacher.train.eval_every=8",
                     "student.train.steps=12", "student.train.warmup_steps=2", "student.train.log_every=2",
                     "student.train.checkpoint_every=4", "student.train.eval_every=6", "student.train.eval_batches=2",
                     "kd.stop_at=50%", "monitor.csv=true"]


def model_config(**kw):
    """A tiny ModelConfig (hidden 32, 4 layers, experts 2 and 4), with any field overridden."""
    from pipeline.model import ModelConfig

    base = dict(vocab_size=256, seq_len=32, layers=4, hidden=32, heads=4, experts=(2, 4), moe_layers=(1, 3),
                mlp_type="residual", top_k=1, capacity_factor=1.0, eval_capacity_factor=None, min_capacity=4,
                aux_loss_coef=0.01, ffn_mult=4, dropout=0.0, tie_embeddings=True, init_std=0.02)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """Tokenize the bundled corpus once per session, shared by every test and subprocess."""
    path = os.environ.get("MOE_PIPELINE_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["MOE_PIPELINE_CACHE"] = path
    return Path(path)


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> Path:
    """`moe-pipeline distill recipes/tiny.yaml --set SMALL_RUN...`: a finished run shared by the session's tests."""
    run = tmp_path_factory.mktemp("runs") / "small"
    cli("distill", "recipes/tiny.yaml", "--run-dir", str(run), *sets(*SMALL_RUN))
    return run


# set in this process by in-process dist.init() (adapter, load_package), or by a launcher (mpirun, srun) that started
# the tests: a child that inherited them would believe it is one of a launcher's ranks
from pipeline.dist import LAUNCH_VARS as RANK_VARS  # noqa: E402


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this one without rank variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(extra)
    return env


def launch_ranks(script: str, *args: str, timeout: float = 300) -> None:
    """Run `script ARGS` as 2 ranks through DeepSpeed's launcher (gloo on this machine), from the repository root."""
    from pipeline.dist import free_port

    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "--no_local_rank", script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def cli(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run `moe-pipeline ARGS` as a user would (a real process, from the repository root)."""
    proc = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=child_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"moe-pipeline {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def killed_at_checkpoint(*args: str, latest: Path) -> None:
    """Run `moe-pipeline ARGS` and SIGKILL it (the launcher and every rank) once DeepSpeed's `latest` file shows a
    checkpoint: a run killed mid-stage, for the resume tests."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=child_env(), start_new_session=True)
    deadline = time.time() + 300
    while not latest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


def sets(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


def reference_greedy(package: Path, prompt: str, n: int) -> tuple[list[int], list[int], object]:
    """(prompt ids, the package's greedy tokens by full forwards, no cache, no batching, (model, tokenizer)): the
    serving tests' reference."""
    import torch

    from export.inference import load_package

    model, tok = load_package(package)
    ids = tok.encode(prompt)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            if t == tok.eos_token_id:
                break
            seq.append(t)
    return ids, seq[len(ids):], (model, tok)
