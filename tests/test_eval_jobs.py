"""`moe-pipeline eval`: batch jobs over a run's teacher and student, bundled and custom tasks, offline failures, resume,
2 ranks (eval/jobs.py, slow: real runs of the CLI); and the tables and plot made from the cells (eval/report.py, unit).

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_eval_jobs.py   # -m "not slow": unit only
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import cli

CUSTOM_TASK = """task: my_yes_no
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: ["no", "yes"]
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def custom_tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("my_tasks")
    rows = [{"question": f"Is {n} an even number? Answer:", "label": int(n % 2 == 0)} for n in range(12)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "my_yes_no.yaml").write_text(CUSTOM_TASK.format(data=folder / "data.jsonl"))
    return folder


@pytest.fixture(scope="module")
def job(small_run, custom_tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "job"
    proc = cli("eval", str(small_run), "--tasks", "tiny_lastword,tiny_nextline,tiny_heldout_ppl,my_yes_no,lambada_openai",
               "--include-path", str(custom_tasks), "--limit", "8", "--batch-size", "8", "--out", str(out))
    return out, proc


@pytest.mark.slow
def test_every_model_and_task_has_a_result_in_lm_evals_schema(job):
    out, _ = job
    results = json.loads((out / "results.json").read_text())
    assert {"small/teacher", "small/student"} <= set(results)
    for model in ("small/teacher", "small/student"):
        r = results[model]
        assert set(r["results"]) == {"tiny_lastword", "tiny_nextline", "tiny_heldout_ppl", "my_yes_no"}
        lastword = r["results"]["tiny_lastword"]
        assert 0 <= lastword["acc,none"] <= 1 and lastword["perplexity,none"] > 1
        assert "acc_stderr,none" in lastword
        assert 0 <= r["results"]["tiny_nextline"]["acc,none"] <= 1
        assert r["results"]["tiny_heldout_ppl"]["bits_per_byte,none"] > 0
        assert r["n-samples"]["tiny_lastword"]["effective"] == 8  # --limit
        assert r["higher_is_better"]["tiny_lastword"]["perplexity"] is False
        assert "versions" in r and "configs" in r


@pytest.mark.slow
def test_an_offline_task_without_data_is_reported_in_one_line_and_the_rest_runs(job):
    out, proc = job
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("[eval] lambada_openai: skipped:")]
    assert len(lines) == 1 and "offline" in lines[0]
    assert "lambada_openai" in json.loads((out / "results.json").read_text())["_failed"]


@pytest.mark.slow
def test_markdown_table_png_and_the_students_retention(job):
    out, _ = job
    md = (out / "results.md").read_text()
    assert "| small/teacher |" in md and "| small/student |" in md and "retention" in md
    results = json.loads((out / "results.json").read_text())
    keep = results["_retention"]["small/student"]
    t, s = (results[m]["results"]["tiny_lastword"]["acc,none"] for m in ("small/teacher", "small/student"))
    if t:
        assert keep["tiny_lastword"] == pytest.approx(100 * s / t)
    bpb_t, bpb_s = (results[m]["results"]["tiny_heldout_ppl"]["bits_per_byte,none"] for m in ("small/teacher", "small/student"))
    assert keep["tiny_heldout_ppl"] == pytest.approx(100 * bpb_t / bpb_s)  # lower is better: teacher / student
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.slow
def test_a_rerun_resumes_from_the_stored_cells(job, small_run, custom_tasks, tmp_path):
    out, _ = job
    cell_removed = out / "cells" / "small__teacher" / "my_yes_no.json"
    cell_removed.unlink()  # as if the job had been killed before this cell
    before = {cell: cell.stat().st_mtime_ns for cell in (out / "cells").glob("*/*.json")}
    assert len(before) == 7
    cli("eval", str(small_run), "--tasks", "tiny_lastword,tiny_nextline,tiny_heldout_ppl,my_yes_no",
        "--include-path", str(custom_tasks), "--limit", "8", "--batch-size", "8", "--out", str(out))
    assert {cell: cell.stat().st_mtime_ns for cell in before} == before and cell_removed.is_file()
    assert json.loads(cell_removed.read_text())["job"]["limit"] == 8
    # another --limit (on a copy: the job's own results stay for the other tests): the stored cells of that task are
    # not its results; they run again, saying why, and the rest stay
    shutil.copytree(out, tmp_path / "job", copy_function=shutil.copy2)
    out = tmp_path / "job"
    before = {cell: cell.stat().st_mtime_ns for cell in (out / "cells").glob("*/*.json")}
    proc = cli("eval", str(small_run), "--tasks", "tiny_lastword", "--limit", "4", "--batch-size", "8", "--out", str(out))
    again = sorted((out / "cells").glob("*/tiny_lastword.json"))
    assert len(again) == 2 and "the stored cell is run again: --limit was 8.0" in proc.stdout
    for cell in again:
        assert cell.stat().st_mtime_ns != before[cell]
        stored = json.loads(cell.read_text())
        assert stored["job"]["limit"] == 4 and stored["n-samples"]["tiny_lastword"]["effective"] == 4
    assert all(cell.stat().st_mtime_ns == t for cell, t in before.items() if cell.name != "tiny_lastword.json")


ON_RANK_1 = """import os


def process_docs(dataset):  # the task's data, read when the job checks its tasks
    if os.environ.get("RANK") == "1":
        raise RuntimeError("these documents do not load on rank 1")
    return dataset


def doc_to_text(doc):  # the prompts, made inside the cell (the check reads the first document's alone)
    if os.environ.get("RANK") == "1" and doc["question"].startswith("Is 5 "):
        raise RuntimeError("this prompt fails on rank 1 alone")
    return doc["question"]
"""


@pytest.mark.slow
def test_two_ranks_expert_parallel_give_the_same_scores_and_a_rank_s_failure_stops_the_job(small_run, job, tmp_path,
                                                                                        custom_tasks):
    """2 ranks: the scores of 1 rank. A task whose data fails to load on rank 1 alone is skipped on both ranks (they
    run the same cells); a cell that fails on rank 1 alone, while rank 0 goes on into the cell's collectives, stops
    the job, non-zero and promptly instead of hanging, the cells done before kept."""
    out1, _ = job
    out2 = tmp_path / "ep2"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "on_rank_1.py").write_text(ON_RANK_1)
    for name, hook in (("loads_badly_on_1", "process_docs: !function on_rank_1.process_docs"),
                       ("fails_on_1", "doc_to_text: !function on_rank_1.doc_to_text")):
        yaml = CUSTOM_TASK.format(data=custom_tasks / "data.jsonl").replace("task: my_yes_no", f"task: {name}")
        if hook.startswith("doc_to_text"):
            yaml = yaml.replace('doc_to_text: "{{question}}"\n', "")
        (tasks / f"{name}.yaml").write_text(yaml + hook + "\n")
    proc = cli("eval", str(small_run / "student"), "--tasks",
               "tiny_nextline,tiny_heldout_ppl,loads_badly_on_1,fails_on_1", "--include-path", str(tasks), "--limit",
               "8", "--batch-size", "8", "--nproc", "2", "--out", str(out2), timeout=900, check=False)
    assert "[eval] loads_badly_on_1: skipped: on rank 1: " in proc.stdout
    assert proc.returncode != 0
    assert "rank 1: small/student on fails_on_1 failed: RuntimeError: this prompt fails on rank 1 alone; " \
           "stopping every rank" in proc.stderr
    assert sorted(p.name for p in (out2 / "cells" / "small__student").iterdir()) == \
        ["tiny_heldout_ppl.json", "tiny_nextline.json"]
    one = json.loads((out1 / "results.json").read_text())["small/student"]["results"]
    two = json.loads((out2 / "results.json").read_text())["small/student"]["results"]
    assert two["tiny_nextline"]["acc,none"] == one["tiny_nextline"]["acc,none"]
    assert two["tiny_heldout_ppl"]["word_perplexity,none"] == pytest.approx(
        one["tiny_heldout_ppl"]["word_perplexity,none"], rel=1e-4)


@pytest.mark.slow
def test_bad_model_path_is_one_line_and_exit_2(tmp_path):
    proc = cli("eval", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "no such run, stage or package directory" in proc.stderr


# -- eval/report.py on cells made by hand: the exact tables -------------------------------------------

def _cell(task: str, results: dict, higher: dict, n: int, name: str) -> dict:
    """One cell as eval.jobs.run_cell stores it."""
    return {"results": {task: {"alias": task, **results}}, "versions": {task: 1.0}, "n-shot": {task: 0},
            "higher_is_better": {task: higher}, "n-samples": {task: {"original": 100, "effective": n}},
            "configs": {task: {"task": task}}, "config": {"model": "moe-pipeline", "batch_size": 8},
            "wall_seconds": 1.5, "limit": n, "model": {"name": name, "path": f"/m/{name}"}}


REPORT_MD = """# Zero-shot evaluation (lm-evaluation-harness)

| model | t_acc (acc) | t_ppl (bits_per_byte) |
|---|---:|---:|
| r/teacher | 0.5000 ± 0.0500 | 1.2000 |
| r/student | 0.4000 ± 0.0500 | 1.5000 |
| other | 0.3000 ± 0.0500 | – |

Student's retention of its teacher's score (%; for lower-is-better metrics teacher / student):

| student | t_acc | t_ppl | mean |
|---|---:|---:|---:|
| r/student | 80.0 | 80.0 | 80.0 |

## All metrics

| model | task | metric | value | stderr | n |
|---|---|---|---:|---:|---:|
| r/teacher | t_acc | acc | 0.5000 | 0.0500 | 8 |
| r/teacher | t_acc | acc_norm | 0.5100 |  | 8 |
| r/teacher | t_ppl | bits_per_byte | 1.2000 |  | 20 |
| r/teacher | t_ppl | word_perplexity | 13.0000 |  | 20 |
| r/student | t_acc | acc | 0.4000 | 0.0500 | 8 |
| r/student | t_acc | acc_norm | 0.4100 |  | 8 |
| r/student | t_ppl | bits_per_byte | 1.5000 |  | 20 |
| r/student | t_ppl | word_perplexity | 17.5000 |  | 20 |
| other | t_acc | acc | 0.3000 | 0.0500 | 8 |
| other | t_acc | acc_norm | 0.3100 |  | 8 |

## Not evaluated

- `lambada_openai`: offline
- `other:t_ppl`: RuntimeError: boom
"""


def test_report_tables_retention_and_plot_from_cells(tmp_path):
    from eval.models import ModelRef
    from eval.report import write_reports

    scores = {"r/teacher": (0.5, 1.2, 13.0), "r/student": (0.4, 1.5, 17.5), "other": (0.3, None, None)}
    table = {}
    for name, (acc, bpb, wppl) in scores.items():
        table[name] = {"t_acc": _cell("t_acc", {"acc,none": acc, "acc_stderr,none": 0.05, "acc_norm,none": acc + 0.01,
                                                "acc_norm_stderr,none": float("nan")},  # NaN stderr: none shown
                                      {"acc": True, "acc_norm": True}, 8, name)}
        if bpb is not None:
            table[name]["t_ppl"] = _cell("t_ppl", {"bits_per_byte,none": bpb, "bits_per_byte_stderr,none": "N/A",
                                                   "word_perplexity,none": wppl},
                                         {"bits_per_byte": False, "word_perplexity": False}, 20, name)
    names = list(scores)
    refs = [ModelRef("r/teacher", Path("/m/t"), "teacher", "r"), ModelRef("r/student", Path("/m/s"), "student", "r"),
            ModelRef("other", Path("/m/o"))]  # no run: no retention row
    failed = {"lambada_openai": "offline", "other:t_ppl": "RuntimeError: boom"}
    summary = write_reports(tmp_path, table, names, refs, ["t_acc", "t_ppl", "t_never_ran"], failed)

    assert (tmp_path / "results.md").read_text() == REPORT_MD
    assert summary["_retention"] == {"r/student": {"t_acc": pytest.approx(80.0), "t_ppl": pytest.approx(80.0)}}
    assert json.loads((tmp_path / "results.json").read_text(), parse_constant=str) == json.loads(
        json.dumps(summary), parse_constant=str)
    assert set(summary) == {*names, "_retention", "_failed"} and summary["_failed"] == failed
    student = summary["r/student"]
    assert set(student["results"]) == {"t_acc", "t_ppl"} and student["n-samples"]["t_ppl"]["effective"] == 20
    assert student["config"]["model_args"] == "/m/r/student" and student["model"]["name"] == "r/student"
    png = (tmp_path / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert not list(tmp_path.glob("*.tmp*"))  # written under a temporary name, then renamed
