"""eval/lm_eval_cli.py: `moe-pipeline lm-eval` is lm-eval's command line with our model and the bundled tasks;
nothing of ours runs at interpreter start.

The checks run in fresh interpreters of this venv, from a scratch directory, so that `eval` comes from the
install, not from the current directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from conftest import child_env

TARGET = "eval.adapter:MoEPipelineLM"


def run_py(code: str, cwd: Path, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last stdout line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nothing_of_ours_runs_at_interpreter_start(tmp_path):
    site = Path(sysconfig.get_paths()["purelib"])
    hooks = [p.name for p in site.glob("*.pth") if "lm_eval" in p.read_text(encoding="utf-8", errors="replace")]
    assert hooks == [], f"{hooks} in {site}: an interpreter-start hook (re-run scripts/setup.sh, which removes it)"
    out = run_py("""
        import json, sys
        print(json.dumps(sorted(m for m in sys.modules if "lm_eval" in m or "moe" in m or m.split(".")[0] == "eval")))
    """, tmp_path)
    out = [m for m in out if not m.startswith("__editable__")]  # setuptools' finder of an editable install
    assert out == []


def test_register_adds_a_lazy_model_and_keeps_lm_evals_own(tmp_path):
    out = run_py("""
        import json, sys
        from eval.lm_eval_cli import register
        register(); register()  # idempotent
        import lm_eval.api.registry as r
        entries = dict(r.model_registry.items())
        print(json.dumps({"ours": entries.get("moe-pipeline"), "builtins": "hf" in entries and "dummy" in entries,
                          "dummy": r.get_model("dummy").__name__,
                          "imported": [m for m in ("eval.adapter", "torch") if m in sys.modules]}))
    """, tmp_path)
    assert out["ours"] == TARGET  # a string: materialised only by get_model("moe-pipeline")
    assert out["imported"] == []
    assert out["builtins"] and out["dummy"] == "DummyLM"


def test_bundled_tasks_come_first_on_the_include_path(tmp_path, data_cache):
    out = run_py(f"""
        import json
        from eval.lm_eval_cli import include_paths, register
        from eval.tasks import bundled_task_dir
        from lm_eval.api.registry import get_model
        from lm_eval.tasks import TaskManager
        bundled = str(bundled_task_dir().resolve())
        config = {str(tmp_path / 'config.yaml')!r}
        open(config, "w").write("include_path: {tmp_path / 'from_yaml'}\\n")
        register()
        import eval.adapter
        print(json.dumps({{"bundled": bundled, "none": include_paths(None), "mine": include_paths("{tmp_path}"),
                          "again": include_paths([bundled, "{tmp_path}"]), "yaml": include_paths(None, config),
                          "tasks": TaskManager(include_defaults=False, include_path=include_paths(None)).all_tasks,
                          "model": get_model("moe-pipeline") is eval.adapter.MoEPipelineLM}}))
    """, tmp_path)
    b = out["bundled"]
    assert out["none"] == [b]
    assert out["mine"] == out["again"] == [b, str(tmp_path)]  # the user's path after ours: theirs override
    assert out["yaml"] == [b, str(tmp_path / "from_yaml")]
    assert "tiny_lastword" in out["tasks"]
    assert out["model"]


@pytest.mark.slow
def test_moe_pipeline_lm_eval_evaluates_our_model_on_a_bundled_task(tmp_path, small_run):
    """lm-eval's own CLI through `moe-pipeline lm-eval run --model moe-pipeline --tasks tiny_lastword`: it evaluates
    the run's student and writes lm-eval's results file (indexing all of lm-eval's tasks takes ~15 s)."""
    cli = Path(sys.executable).parent / "moe-pipeline"
    proc = subprocess.run([str(cli), "lm-eval", "run", "--model", "moe-pipeline", "--model_args",
                           f"path={small_run},stage=student", "--tasks", "tiny_lastword", "--limit", "6",
                           "--output_path", str(tmp_path / "out")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result_file,) = (tmp_path / "out").rglob("results_*.json")
    res = json.loads(result_file.read_text())["results"]["tiny_lastword"]
    assert 0 <= res["acc,none"] <= 1 and res["perplexity,none"] > 1
    assert "Tasks not found" not in proc.stderr
