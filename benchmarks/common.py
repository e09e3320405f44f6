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
