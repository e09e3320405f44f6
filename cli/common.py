"""What the commands share: a positive-integer flag, --nproc, and the restart under the DeepSpeed launcher."""

from __future__ import annotations

import argparse

LAUNCH_MODULE = "cli"  # `python -m cli`: what the launcher starts on each rank (cli/__main__.py)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_nproc(p: argparse.ArgumentParser, more_help: str) -> None:
    """--nproc N, the one flag of that name for teacher, distill, eval and serve: N ranks on this machine (the
    command restarts itself under the DeepSpeed launcher); `more_help` ends its help line."""
    p.add_argument("--nproc", type=positive_int, default=None, help=f"ranks on this machine{more_help}")


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without --nproc N (or --nproc=N): what each relaunched rank runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def relaunch_if_asked(args, argv: list[str], relaunch=None) -> int | None:
    """With --nproc N > 1 outside a launcher: this command again under the DeepSpeed launcher (its exit
    status; `relaunch`: how, default `dist.relaunch`); otherwise None (go on in this process)."""
    from pipeline import dist

    if not dist.under_launcher() and (args.nproc or 1) > 1:
        return (relaunch or dist.relaunch)(args.nproc, LAUNCH_MODULE, strip_nproc(argv))
    return None
