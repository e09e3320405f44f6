"""The recipe's `monitor:` section as DeepSpeed's own monitors (TensorBoard, CSV, Weights & Biases).

    monitor:
      tensorboard: true        # tensorboard --logdir runs/tiny/monitor
      csv: true                # runs/tiny/monitor/tiny-teacher/Train_teacher_loss.csv, ...
      wandb: true              # offline unless WANDB_MODE says otherwise (wandb sync later)

`deepspeed_sections` turns the section into the `tensorboard`, `csv_monitor` and `wandb` entries of the
DeepSpeed config, so `deepspeed.initialize` builds the monitors (DeepSpeed itself writes the learning rate
and the fp16 loss scale there); `write_record` adds what metrics.jsonl records (losses, beta, tokens/s,
held-out loss), named `Train/<stage>/<key>` and `Val/<stage>/<key>`, against the samples trained on.
DeepSpeed's monitors write on rank 0 only.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.recipe import MonitorSpec


def deepspeed_sections(monitor: MonitorSpec | None, run_root: Path, job: str) -> dict:
    """The DeepSpeed config entries for `monitor` (none when every monitor is off); `job` names this stage's
    folder under the output path."""
    if monitor is None or not (monitor.tensorboard or monitor.csv or monitor.wandb):
        return {}
    path = str(Path(monitor.output_path) if monitor.output_path else Path(run_root) / "monitor")
    out: dict = {}
    if monitor.tensorboard:
        out["tensorboard"] = {"enabled": True, "output_path": path, "job_name": job}
    if monitor.csv:
        out["csv_monitor"] = {"enabled": True, "output_path": path, "job_name": job}
    if monitor.wandb:
        os.environ.setdefault("WANDB_MODE", "offline")  # no network unless asked for
        os.environ.setdefault("WANDB_DIR", path)
        out["wandb"] = {"enabled": True, "project": monitor.wandb_project, "group": job}
    return out


def write_record(engine, record: dict, prefix: str) -> None:
    """The numbers of a metrics.jsonl record to the engine's monitors, as `prefix/<key>` against the samples
    trained on (DeepSpeed's own x axis for its lr and loss-scale events)."""
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not monitor.enabled:
        return
    skip = {"stage", "step"}
    events = [(f"{prefix}/{k}", float(v), engine.global_samples) for k, v in record.items()
              if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)]
    monitor.write_events(events)
