"""pipeline/runs.py: the training plot drawn from metrics.jsonl (one panel per quantity, every stage)."""

import json

from pipeline.runs import plot_metrics, read_metrics


import pytest


@pytest.mark.parametrize("tokens", [True, False])  # runs before the token count was logged plot over steps
def test_training_plot_draws_every_stage_and_skips_torn_lines(tmp_path, tokens):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"stage": "teacher", "step": s, "loss": 5.0 - s / 10, "lm_loss": 4.9 - s / 10} for s in (2, 4)]
    rows += [{"stage": "teacher", "step": 4, "val_loss": 4.8},
             {"stage": "student", "step": 2, "loss": 4.5, "lm_loss": 4.4, "beta": 1.0},
             {"stage": "student", "step": 4, "loss": 4.3, "lm_loss": 4.2, "beta": 0.0},
             {"stage": "student", "step": 4, "val_loss": 4.6, "teacher_val_loss": 4.8}]
    if tokens:
        rows = [{**r, "tokens": r["step"] * 2048} for r in rows]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"stage": "stud')  # killed mid-write
    assert len(read_metrics(metrics)) == len(rows)
    out = plot_metrics(metrics, tmp_path / "metrics.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp*"))  # written under a temporary name, then renamed
    assert plot_metrics(tmp_path / "none.jsonl", tmp_path / "none.png") is None
