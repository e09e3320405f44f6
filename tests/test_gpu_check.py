"""benchmarks/gpu_check.py's contract, without running a part: --only, the output folder, the carried CPU values."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_only_takes_repeated_and_comma_separated_parts_in_running_order():
    assert gpu_check.parse_parts(None) == ["train", "resume", "norm", "kd", "serve", "serve2", "bench"]
    assert gpu_check.parse_parts(["bench,kd", "kd", "norm"]) == ["norm", "kd", "bench"]
    with pytest.raises(ValueError, match="--only gpu: parts are train, resume, norm, kd, serve, serve2, bench"):
        gpu_check.parse_parts(["kd,gpu"])
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["out", "--only", "nope"])
    assert exit_.value.code == 2


def test_summary_counts_earlier_parts_in_the_folder_and_fails_if_any_failed(tmp_path):
    (tmp_path / "kd.json").write_text(json.dumps({"part": "kd", "ok": True, "seconds": 3.0, "failures": []}))
    env = {"device": "cpu", "python": "3.12"}
    bench = {"part": "bench", "ok": False, "seconds": 1.0, "failures": ["16 of 16 requests failed"]}
    assert not gpu_check.write_summary(tmp_path, env, {"bench": bench}, ["out", "--only", "bench"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False and list(summary["parts"]) == ["kd", "bench"]
    assert summary["parts"]["bench"]["failures"] == ["16 of 16 requests failed"]
    text = (tmp_path / "summary.txt").read_text()
    assert text.startswith("GPU check on cpu: FAILED") and "FAILED: 16 of 16 requests failed" in text


def test_the_carried_cpu_values_match_the_check_settings():
    """The GPU run compares with benchmarks/gpu_check_cpu.json: it must hold values for the settings the check uses
    (change STEPS or REF_PACKAGE, and refresh it with --device cpu --write-reference)."""
    ref = json.loads(gpu_check.REFERENCE.read_text())
    assert ref["train"]["recipe"] == gpu_check.RECIPE and ref["train"]["steps"] == gpu_check.STEPS
    assert set(ref["train"]["fp32"]) == {"teacher", "student"}
    carried = ref["serve"]["reference_package"]
    assert {k: carried[k] for k in gpu_check.REF_PACKAGE} == gpu_check.REF_PACKAGE
    assert carried["prompt"] == gpu_check.PROMPT and 0 < len(carried["tokens"]) <= gpu_check.NEW_TOKENS
