"""eval/lm_eval_plugin.py: lm-eval's own CLI/API sees "moe-pipeline" and the bundled tasks.

Every check runs in a fresh interpreter of this venv (the hook is installed at interpreter start
by `moe_pipeline_lm_eval.pth`, which `pip install -e .` / scripts/setup.sh put in site-packages),
from a scratch directory so that `eval` comes from the install, not from the current directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from conftest import child_env

ROOT = Path(__file__).resolve().parent.parent
TARGET = "eval.adapter:MoEPipelineLM"


def run_py(code: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last stdout line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=child_env(**(env or {})))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def test_pth_is_installed_and_current():
    from eval import lm_eval_plugin

    pth = Path(sysconfig.get_paths()["purelib"]) / lm_eval_plugin.PTH_NAME
    assert pth.is_file(), f"{pth} missing: re-run scripts/setup.sh (pip install -e .)"
    assert pth.read_text(encoding="utf-8") == lm_eval_plugin.PTH_LINE, f"{pth} is stale: re-run scripts/setup.sh"


def test_startup_imports_neither_lm_eval_nor_torch(tmp_path):
    out = run_py("""
        import json, sys
        print(json.dumps({"mods": sorted(m for m in ("lm_eval", "torch", "eval", "_moe_pipeline_lm_eval_plugin")
                                         if m in sys.modules),
                          "hooked": any(getattr(f, "_moe_pipeline_plugin", False) for f in sys.meta_path)}))
    """, tmp_path)
    assert out["mods"] == ["_moe_pipeline_lm_eval_plugin"]  # not even our `eval` package
    assert out["hooked"]


def test_registry_import_registers_lazy_placeholder(tmp_path):
    out = run_py("""
        import json, sys
        import lm_eval.api.registry as r
        entries = dict(r.model_registry.items())
        print(json.dumps({"ours": entries.get("moe-pipeline"), "builtins": "hf" in entries and "dummy" in entries,
                          "imported": [m for m in ("eval.adapter", "eval", "torch") if m in sys.modules],
                          "dummy": r.get_model("dummy").__name__}))
    """, tmp_path)
    assert out["ours"] == TARGET  # a string: materialised only by get_model("moe-pipeline")
    assert out["imported"] == []
    assert out["builtins"] and out["dummy"] == "DummyLM"  # a non-empty registry still has lm-eval's own models


def test_switch_off_then_explicit_register(tmp_path):
    out = run_py("""
        import json, sys
        import lm_eval.api.registry as r
        before = "moe-pipeline" in r.model_registry
        from eval.lm_eval_plugin import register
        register(); register()  # idempotent
        print(json.dumps({"before": before, "after": dict(r.model_registry.items()).get("moe-pipeline"),
                          "adapter": "eval.adapter" in sys.modules}))
    """, tmp_path, env={"MOE_PIPELINE_LM_EVAL_PLUGIN": "0"})
    assert (out["before"], out["after"], out["adapter"]) == (False, TARGET, False)


def test_task_manager_failure_is_a_warning(tmp_path):
    out = run_py("""
        import json, sys, types, warnings
        def broken():
            raise RuntimeError("no corpus")
        sys.modules["eval.tasks"] = types.SimpleNamespace(bundled_task_dir=broken)
        from lm_eval.tasks import TaskManager
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tm = TaskManager(include_defaults=False)
        print(json.dumps({"tasks": tm.all_tasks, "warnings": [str(w.message) for w in caught]}))
    """, tmp_path)
    assert out["tasks"] == []
    assert any("no corpus" in w and "bundled" in w for w in out["warnings"]), out["warnings"]


def test_task_manager_sees_bundled_tasks_and_model_materialises(tmp_path, data_cache):
    out = run_py("""
        import json
        from lm_eval.api.registry import get_model
        from lm_eval.tasks import TaskManager
        from eval.tasks import bundled_task_dir
        tm = TaskManager(include_defaults=False)  # no include_path: the bundled dir comes from the plugin
        explicit = TaskManager(include_defaults=False, include_path=str(bundled_task_dir()))  # not added twice
        import eval.adapter
        print(json.dumps({"tasks": tm.all_tasks, "include_path": tm.include_path,
                          "explicit": explicit.include_path, "bundled": str(bundled_task_dir()),
                          "model": get_model("moe-pipeline") is eval.adapter.MoEPipelineLM}))
    """, tmp_path)
    assert "tiny_lastword" in out["tasks"]
    assert out["include_path"] == [out["bundled"]]
    assert out["explicit"] == out["bundled"]
    assert out["model"]


@pytest.mark.slow
def test_lm_eval_cli_evaluates_our_model_on_a_bundled_task(tmp_path, small_run):
    """The harness's own CLI, no extra flags: `lm-eval run --model moe-pipeline --tasks tiny_lastword` evaluates
    the run's student and writes lm-eval's results file (indexing all of lm-eval's tasks takes ~15 s)."""
    lm_eval_cli = Path(sys.executable).parent / "lm-eval"
    proc = subprocess.run([str(lm_eval_cli), "run", "--model", "moe-pipeline", "--model_args",
                           f"path={small_run},stage=student", "--tasks", "tiny_lastword", "--limit", "6",
                           "--output_path", str(tmp_path / "out")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result_file,) = (tmp_path / "out").rglob("results_*.json")
    res = json.loads(result_file.read_text())["results"]["tiny_lastword"]
    assert 0 <= res["acc,none"] <= 1 and res["perplexity,none"] > 1
    assert "Tasks not found" not in proc.stderr
