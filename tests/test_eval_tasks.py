"""The bundled zero-shot tasks (eval/tasks.py): held-out text only, deterministic, loadable by lm-eval offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import tasks
from eval.tasks import BUNDLED_TASKS, bundled_task_dir, clean_text, text_blocks, write_bundled_tasks
from pipeline.data import load_documents, split_documents
from pipeline.recipe import DataSpec


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task_dir(data_cache) -> Path:
    """The tasks for the default data spec, generated once into the session's test cache."""
    return bundled_task_dir()


@pytest.fixture(scope="module")
def splits() -> tuple[list, list]:
    data = DataSpec()
    return split_documents(load_documents(data), data.validation_fraction)


@pytest.fixture(scope="module")
def items(task_dir) -> dict[str, list[dict]]:
    return {name: read_jsonl(task_dir / f"{name}.jsonl") for name in BUNDLED_TASKS}


def test_text_blocks_drop_markup_and_split_at_blank_lines():
    play = ("# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter ORLANDO and ADAM_\n\n"
            "**ORLANDO**  \nAs I   remember, Adam,  \n_\\[Aside]_  \nit was upon this fashion  \n\n"
            "_Enter KING, GLOUCESTER,\nand others attending\nin state_\n\n**ADAM**  \nYonder comes my master.\n"
            "*Exeunt.*\n")
    assert text_blocks(play) == [["As I remember, Adam,"], ["it was upon this fashion"],
                                 ["Yonder comes my master."]]
    assert clean_text(play) == "As I remember, Adam,\n\nit was upon this fashion\n\nYonder comes my master."


def test_cache_dir_is_reused_and_cli_regenerates_identical_files(task_dir, tmp_path, capsys):
    assert task_dir.parent.parent == Path(tasks.cache_root()).resolve()
    stamp = {p.name: p.stat().st_mtime_ns for p in task_dir.iterdir()}
    assert bundled_task_dir() == task_dir  # reused, not regenerated
    assert {p.name: p.stat().st_mtime_ns for p in task_dir.iterdir()} == stamp

    out = tmp_path / "again"
    assert tasks.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "tiny_lastword" in printed
    expected = {*(f"{n}.jsonl" for n in BUNDLED_TASKS), *(f"{n}.yaml" for n in BUNDLED_TASKS), tasks.MANIFEST}
    assert {p.name for p in out.iterdir()} == {p.name for p in task_dir.iterdir()} == expected
    for name in BUNDLED_TASKS:
        assert (out / f"{name}.jsonl").read_bytes() == (task_dir / f"{name}.jsonl").read_bytes()
        # The YAMLs differ only in the directory they read the data from.
        yaml_text = (task_dir / f"{name}.yaml").read_text(encoding="utf-8")
        assert f"test: {task_dir / name}.jsonl" in yaml_text
        assert (out / f"{name}.yaml").read_text(encoding="utf-8") == yaml_text.replace(str(task_dir), str(out))
    assert tasks.task_counts(out) == tasks.task_counts(task_dir)


def test_task_shapes(items):
    assert {n: len(v) for n, v in items.items()} == {
        "tiny_lastword": tasks.LASTWORD_DOCS, "tiny_nextline": tasks.NEXTLINE_DOCS,
        "tiny_heldout_ppl": tasks.PPL_DOCS}
    for item in items["tiny_lastword"]:
        assert item["text"] == f"{item['context']} {item['target']}"
        assert item["target"].isalpha() and item["target"].isascii()
        assert len(item["target"]) >= tasks.LASTWORD_MIN_LETTERS
        assert tasks.LASTWORD_MIN_CHARS <= len(item["text"]) <= tasks.LASTWORD_MAX_CHARS
    for item in items["tiny_nextline"]:
        assert item["context"].count("\n") == tasks.NEXTLINE_CONTEXT_LINES - 1
        assert len(set(item["choices"])) == len(item["choices"]) == tasks.NEXTLINE_CHOICES
        assert 0 <= item["label"] < tasks.NEXTLINE_CHOICES
        assert all(len(c) >= tasks.CHOICE_MIN_CHARS and "\n" not in c for c in item["choices"])
    labels = {item["label"] for item in items["tiny_nextline"]}
    assert labels == set(range(tasks.NEXTLINE_CHOICES))  # shuffled, not always first
    for item in items["tiny_heldout_ppl"]:
        assert len(item["text"]) >= tasks.PPL_MIN_CHARS
    ids = [item["id"] for v in items.values() for item in v]
    assert len(set(ids)) == len(ids)


def test_tasks_use_held_out_text_only(items, splits):
    train_docs, val_docs = splits
    held_out_raw = {d.id: d.text for d in val_docs}
    held_out_clean = {d.id: clean_text(d.text) for d in val_docs}
    train_clean = "\0".join(clean_text(d.text) for d in train_docs)
    train_raw = "\0".join(d.text for d in train_docs)

    def from_held_out(source: str, passage: str) -> None:
        # From one held-out document, not crossing documents; each line is the document's own text.
        assert passage in held_out_clean[source], (source, passage[:200])
        assert all(line in held_out_raw[source] for line in passage.split("\n") if line)

    for item in items["tiny_lastword"]:
        from_held_out(item["source"], item["text"])
        assert item["text"] not in train_clean, item["text"]
        # The line holding the target is not in the training text, not even in its raw markdown.
        assert item["text"].rsplit("\n", 1)[-1] not in train_raw, item["text"]
    for item in items["tiny_nextline"]:
        from_held_out(item["source"], item["context"])
        assert item["context"] not in train_clean, item["context"]
        for choice in item["choices"]:
            from_held_out(item["source"], choice)
            assert choice not in train_raw, choice
        # The gold choice is the line that follows the context.
        assert f"{item['context']}\n{item['choices'][item['label']]}" in held_out_clean[item["source"]]
    for item in items["tiny_heldout_ppl"]:
        from_held_out(item["source"], item["text"])
        assert item["text"] not in train_clean, item["text"][:200]
    sources = {item["source"] for v in items.values() for item in v}
    assert sources <= set(held_out_raw) and len(sources) > 1


def test_lm_eval_loads_builds_requests_and_runs_offline(task_dir, items):
    import lm_eval
    from lm_eval.tasks import TaskManager, get_task_dict

    tm = TaskManager(include_path=str(task_dir))
    assert set(BUNDLED_TASKS) <= set(tm.all_tasks)
    assert tasks.TAG in tm.all_tags

    # The requests a model would get, from the first docs of each task.
    task_dict = get_task_dict(list(BUNDLED_TASKS), tm)
    for name, task in task_dict.items():
        task.build_all_requests(limit=2)
        first = items[name][0]
        args = [inst.arguments for inst in task.instances if inst.doc_id == 0]
        if name == "tiny_lastword":
            assert args == [(first["context"], " " + first["target"])]
        elif name == "tiny_nextline":
            assert args == [(first["context"], "\n" + c) for c in first["choices"]]
        else:
            assert args == [(first["text"],)]

    results = lm_eval.simple_evaluate(model="dummy", tasks=list(BUNDLED_TASKS), task_manager=tm, limit=5,
                                      bootstrap_iters=0)
    metrics = {
        "tiny_lastword": ["perplexity,none", "acc,none"],
        "tiny_nextline": ["acc,none", "acc_norm,none"],
        "tiny_heldout_ppl": ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"],
    }
    for name, keys in metrics.items():
        row = results["results"][name]
        assert all(isinstance(row[k], float) for k in keys), row
        assert results["n-samples"][name] == {"original": len(items[name]), "effective": 5}
