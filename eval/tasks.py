"""Bundled zero-shot tasks for lm-evaluation-harness, generated offline from the held-out text.

Three small lm-eval tasks (tag `tiny_bundled`) built by code from the *validation* documents of
a data spec (by default `DataSpec()`: the bundled KJV + Shakespeare corpus), i.e. exactly the
whole books and plays that `pipeline.data.split_documents` holds out from training. No text of
the training split is used, and every line a task scores is checked not to occur in the training
text. Each task is a YAML file plus a local `.jsonl` (`dataset_path: json`), so lm-eval needs no
network:

    python -m eval.tasks                      # generate (once) into the cache; print dir and counts
    python -m eval.tasks --out /tmp/tasks     # or into a directory of your choice
    moe-pipeline lm-eval run --model moe-pipeline --model_args path=runs/tiny/student --tasks tiny_bundled
    lm-eval run --model hf ... --include_path "$(python -m eval.tasks --print-dir)" --tasks tiny_bundled

    from eval.tasks import bundled_task_dir
    tm = lm_eval.tasks.TaskManager(include_path=str(bundled_task_dir()))

How the text is prepared: each document is cut into *blocks* (runs of consecutive text lines:
a Bible chapter, one speech of a play); markdown that is not text is dropped (headings `#`,
speaker lines `**ROSALIND**`, stage directions `_Exit_`/`*Exeunt.*`, even over several lines,
and any other line holding markup characters); whitespace inside a line is collapsed to single
spaces. A document's *clean text* is its blocks, lines joined by "\\n", blocks by "\\n\\n"; every
passage below is a substring of one document's clean text (never crossing documents).

  * `tiny_lastword` (LAMBADA-style, `loglikelihood`): a passage of 2 to 6 consecutive lines of
    one block, at least `LASTWORD_MIN_CHARS` long, whose last line ends in an alphabetic word of
    at least `LASTWORD_MIN_LETTERS` letters (then at most one punctuation mark, dropped); no two
    passages overlap. Context = the passage without that word, target = " " + word. Metrics as
    lm-eval's `lambada_openai`: `perplexity` (of the target) and `acc` (target = greedy output).
  * `tiny_nextline` (`multiple_choice`): context = `NEXTLINE_CONTEXT_LINES` consecutive lines of a
    block; choices = the block's true next line and 3 distractor lines from elsewhere in the same
    document (at least `DISTRACTOR_MIN_DISTANCE` lines away, `CHOICE_MIN_CHARS` long), shuffled;
    each choice is scored as "\\n" + line. Metrics `acc` and `acc_norm`.
  * `tiny_heldout_ppl` (`loglikelihood_rolling`, like lm-eval's `wikitext`): whole passages of at
    least `PPL_MIN_CHARS` characters (consecutive blocks, cut at a line end). Metrics
    `word_perplexity`, `byte_perplexity`, `bits_per_byte`.

Leakage: the line holding a tiny_lastword target, the tiny_nextline context and each choice,
and each tiny_heldout_ppl passage are checked against the training split's clean text; a
candidate found there is skipped.

Deterministic: documents in sorted id order, one `random.Random` per task seeded from `SEED`,
JSON with sorted keys, so the same data spec gives byte-identical `.jsonl` files everywhere. Files
are written under a temporary name and renamed; the cache directory is built beside its final
name and renamed into place (of two racing processes one wins). Sizes are kept small so the tiny
model evaluates all three in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.data import Document, cache_key_inputs, load_documents, split_documents
from pipeline.recipe import DataSpec
from pipeline.artifacts import cache_root

BUNDLED_TASKS: tuple[str, ...] = ("tiny_lastword", "tiny_nextline", "tiny_heldout_ppl")
TAG = "tiny_bundled"

# Bump when generation changes, so cached task directories are not reused.
GENERATOR_VERSION = 1
SEED = 1234

# Sizes: a few hundred items keep the standard error of acc near 2-3 points, and the tiny
# model scores all three tasks in well under a minute on 2 CPU cores.
LASTWORD_DOCS = 300
NEXTLINE_DOCS = 300
PPL_DOCS = 20

LASTWORD_MIN_LETTERS = 4  # shorter final words are mostly function words ("the", "him")
LASTWORD_MIN_CHARS = 150  # passage length: enough context to make the word guessable
LASTWORD_TARGET_CHARS = 300  # lines are added (up to LASTWORD_MAX_LINES) until this long
LASTWORD_MAX_LINES = 6
LASTWORD_MAX_CHARS = 1200

NEXTLINE_CONTEXT_LINES = 3
NEXTLINE_CHOICES = 4  # the true line and 3 distractors
CHOICE_MIN_CHARS = 25  # shorter lines ("My lord?") recur everywhere, in training text too
CHOICE_MAX_CHARS = 400
DISTRACTOR_MIN_DISTANCE = 20  # lines: far enough not to be a near-paraphrase of the context

PPL_MIN_CHARS = 3000

MANIFEST = "tasks.json"

# Lines holding any of these are markdown or stage business, not text.
_MARKUP = re.compile(r"[_*#\[\]\\|<>`]")
# The last line of a tiny_lastword passage: "<head> <word>" plus at most one punctuation mark.
_LAST_WORD = re.compile(rf"^(?P<head>.*\S)\s(?P<word>[A-Za-z]{{{LASTWORD_MIN_LETTERS},}})[.,;:!?]?$")


# --------------------------------------------------------------------------- text


def text_blocks(text: str) -> list[list[str]]:
    """A document as blocks of consecutive text lines (whitespace collapsed), markup dropped."""
    blocks: list[list[str]] = []
    current: list[str] = []
    direction_end = ""  # inside a stage direction spanning lines: the mark that closes it
    for raw in text.splitlines():
        line = " ".join(raw.split())
        if direction_end:
            if not line or line.endswith(direction_end):
                direction_end = ""
            continue
        if not line or _MARKUP.search(line):
            # "_Enter KING HENRY VI, GLOUCESTER," continues until a line ending in "_".
            if len(line) > 1 and line[0] in "_*" and not line.endswith(line[0]):
                direction_end = line[0]
            if current:
                blocks.append(current)
                current = []
            continue
        current.append(line)
    if current:
        blocks.append(current)
    return blocks


def clean_text(text: str) -> str:
    """A document's clean text: its blocks, lines joined by newlines, blocks by blank lines."""
    return "\n\n".join("\n".join(block) for block in text_blocks(text))


@dataclass(frozen=True)
class _Doc:
    id: str
    blocks: list[list[str]]


class _TrainingText:
    """Membership test against the training split's clean text (memoised)."""

    def __init__(self, docs: Sequence[Document]) -> None:
        # NUL between documents: nothing matches across a document boundary.
        self.text = "\0".join(clean_text(d.text) for d in docs)
        self._seen: dict[str, bool] = {}

    def __contains__(self, snippet: str) -> bool:
        if snippet not in self._seen:
            self._seen[snippet] = snippet in self.text
        return self._seen[snippet]


# --------------------------------------------------------------------------- tasks


def _lastword_docs(docs: Sequence[_Doc], train: _TrainingText) -> list[dict[str, Any]]:
    candidates: list[tuple[str, str, str, set[tuple[int, int, int]]]] = []  # (source, context, word, lines)
    for d, doc in enumerate(docs):
        for b, block in enumerate(doc.blocks):
            for i in range(1, len(block)):
                match = _LAST_WORD.match(block[i])
                if match is None:
                    continue
                start = i - 1  # at least one whole line of context before the last
                while (start > 0 and i - start + 1 < LASTWORD_MAX_LINES
                       and sum(len(line) + 1 for line in block[start:i + 1]) < LASTWORD_TARGET_CHARS):
                    start -= 1
                context = "\n".join(block[start:i] + [match["head"]])
                text = f"{context} {match['word']}"
                if LASTWORD_MIN_CHARS <= len(text) <= LASTWORD_MAX_CHARS:
                    lines = {(d, b, j) for j in range(start, i + 1)}
                    candidates.append((doc.id, context, match["word"], lines))
    rng = random.Random(f"{SEED}:tiny_lastword")
    chosen, used = [], set()
    for index in rng.sample(range(len(candidates)), len(candidates)):
        source, context, word, lines = candidates[index]
        # Passages do not overlap; the line holding the target must be new to the model, not
        # memorised from training.
        if not lines & used and context.rsplit("\n", 1)[-1] + " " + word not in train:
            chosen.append(index)
            used |= lines
            if len(chosen) == LASTWORD_DOCS:
                break
    out = []
    for n, index in enumerate(sorted(chosen)):
        source, context, word, _ = candidates[index]
        out.append({"id": f"tiny_lastword-{n:04d}", "source": source, "context": context,
                    "target": word, "text": f"{context} {word}"})
    return out


def _nextline_docs(docs: Sequence[_Doc], train: _TrainingText) -> list[dict[str, Any]]:
    def usable(line: str) -> bool:
        return CHOICE_MIN_CHARS <= len(line) <= CHOICE_MAX_CHARS and line not in train

    candidates: list[tuple[int, int]] = []  # (document index, line index within the document)
    lines_of: list[list[str]] = []
    for d, doc in enumerate(docs):
        lines: list[str] = []
        for block in doc.blocks:
            for i in range(len(block)):
                if i >= NEXTLINE_CONTEXT_LINES and CHOICE_MIN_CHARS <= len(block[i]) <= CHOICE_MAX_CHARS:
                    candidates.append((d, len(lines)))
                lines.append(block[i])
        lines_of.append(lines)
    rng = random.Random(f"{SEED}:tiny_nextline")
    chosen: list[tuple[int, int, list[str], int]] = []
    for index in rng.sample(range(len(candidates)), len(candidates)):
        d, g = candidates[index]
        lines = lines_of[d]
        context_lines, answer = lines[g - NEXTLINE_CONTEXT_LINES:g], lines[g]
        context = "\n".join(context_lines)
        if not usable(answer) or context in train:
            continue
        far = [j for j in range(len(lines)) if abs(j - g) >= DISTRACTOR_MIN_DISTANCE]
        distractors: list[str] = []
        for j in rng.sample(far, len(far)):
            line = lines[j]
            if line != answer and line not in distractors and line not in context_lines and usable(line):
                distractors.append(line)
                if len(distractors) == NEXTLINE_CHOICES - 1:
                    break
        if len(distractors) < NEXTLINE_CHOICES - 1:
            continue  # a document too short for distractors far from the context
        choices = [answer, *distractors]
        rng.shuffle(choices)
        chosen.append((index, d, choices, choices.index(answer)))
        if len(chosen) == NEXTLINE_DOCS:
            break
    out = []
    for n, (index, d, choices, label) in enumerate(sorted(chosen)):
        g = candidates[index][1]
        out.append({"id": f"tiny_nextline-{n:04d}", "source": docs[d].id,
                    "context": "\n".join(lines_of[d][g - NEXTLINE_CONTEXT_LINES:g]),
                    "choices": choices, "label": label})
    return out


def _ppl_docs(docs: Sequence[_Doc], train: _TrainingText) -> list[dict[str, Any]]:
    candidates: list[tuple[str, str]] = []  # (source, passage)
    for doc in docs:
        passage = ""
        for block in doc.blocks:
            separator = "\n\n"  # a new block
            for line in block:
                passage = f"{passage}{separator}{line}" if passage else line
                separator = "\n"
                if len(passage) >= PPL_MIN_CHARS:
                    candidates.append((doc.id, passage))
                    passage = ""
        # The tail of a document (shorter than PPL_MIN_CHARS) is not used.
    rng = random.Random(f"{SEED}:tiny_heldout_ppl")
    chosen = [i for i in rng.sample(range(len(candidates)), len(candidates))
              if candidates[i][1] not in train][:PPL_DOCS]
    return [{"id": f"tiny_heldout_ppl-{n:04d}", "source": candidates[i][0], "text": candidates[i][1]}
            for n, i in enumerate(sorted(chosen))]


def _task_configs(data_dir: Path) -> dict[str, dict[str, Any]]:
    """lm-eval task configs (YAML) reading `<data_dir>/<task>.jsonl`."""
    common = lambda name: {  # noqa: E731
        "task": name, "tag": [TAG], "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_dir / f"{name}.jsonl")}},
        "test_split": "test", "metadata": {"version": float(GENERATOR_VERSION)},
    }
    return {
        # As lm-eval's lambada_openai.yaml.
        "tiny_lastword": common("tiny_lastword") | {
            "output_type": "loglikelihood", "doc_to_text": "context", "doc_to_target": "{{' ' + target}}",
            "metric_list": [
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            ]},
        # As lm-eval's piqa.yaml / hellaswag.yaml; a choice continues the context on a new line.
        "tiny_nextline": common("tiny_nextline") | {
            "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
            "doc_to_target": "label", "target_delimiter": "\n",
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ]},
        # As lm-eval's wikitext.yaml (its default process_results counts words and bytes of the text).
        "tiny_heldout_ppl": common("tiny_heldout_ppl") | {
            "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text",
            "metric_list": [
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            ]},
    }


# --------------------------------------------------------------------------- files


def _write_file(path: Path, text: str) -> None:
    # A unique temporary name, then rename: readers see the old file or the whole new one.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(text.encode("utf-8"))
    os.replace(tmp, path)


def task_key_inputs(data: DataSpec) -> dict[str, Any]:
    """Everything that changes the generated tasks (not the tokenizer or seq_len)."""
    inputs = cache_key_inputs(data)
    return {
        "generator_version": GENERATOR_VERSION, "seed": SEED,
        "sources": inputs["sources"], "text_field": data.text_field,
        "validation_fraction": data.validation_fraction,
        "sizes": {"tiny_lastword": LASTWORD_DOCS, "tiny_nextline": NEXTLINE_DOCS,
                  "tiny_heldout_ppl": PPL_DOCS},
    }


def _write_tasks(directory: Path, data: DataSpec, data_dir: Path) -> dict[str, int]:
    """Write the jsonl files and YAMLs into `directory`, the YAMLs naming `data_dir` (where the
    jsonl files will be read from); the manifest last. Returns the doc count per task."""
    train_docs, val_docs = split_documents(load_documents(data), data.validation_fraction)
    docs = [_Doc(d.id, text_blocks(d.text)) for d in sorted(val_docs, key=lambda d: d.id)]
    train = _TrainingText(train_docs)
    rows = {"tiny_lastword": _lastword_docs(docs, train), "tiny_nextline": _nextline_docs(docs, train),
            "tiny_heldout_ppl": _ppl_docs(docs, train)}
    empty = [name for name, items in rows.items() if not items]
    if empty:
        raise ValueError(
            f"data: the validation split ({len(val_docs)} documents: "
            f"{', '.join(d.id for d in val_docs[:5])}) is too small for the tasks {empty}; "
            "raise data.validation_fraction or add text")
    directory.mkdir(parents=True, exist_ok=True)
    for name, items in rows.items():
        _write_file(directory / f"{name}.jsonl",
                    "".join(json.dumps(item, sort_keys=True, ensure_ascii=False) + "\n" for item in items))
    for name, config in _task_configs(data_dir).items():
        _write_file(directory / f"{name}.yaml", yaml.safe_dump(config, sort_keys=True, allow_unicode=True))
    counts = {name: len(items) for name, items in rows.items()}
    manifest = {"tasks": counts, "tag": TAG, "validation_documents": sorted(d.id for d in val_docs),
                "key_inputs": task_key_inputs(data)}
    _write_file(directory / MANIFEST, json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    return counts


def write_bundled_tasks(directory: Path, data: DataSpec | None = None) -> Path:
    """Generate the three tasks (YAML + jsonl) for `data` (default `DataSpec()`) into `directory`."""
    directory = Path(directory).resolve()
    _write_tasks(directory, data or DataSpec(), directory)
    return directory


def bundled_task_dir(data: DataSpec | None = None) -> Path:
    """The tasks for `data` in the cache (`$MOE_PIPELINE_CACHE/eval-tasks/<key>`), generated on first use."""
    data = data or DataSpec()
    blob = json.dumps(task_key_inputs(data), sort_keys=True, separators=(",", ":"))
    key = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
    root = (cache_root() / "eval-tasks").resolve()
    target = root / key
    if not (target / MANIFEST).is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            _write_tasks(tmp, data, target)  # the YAMLs name the final directory
            try:
                os.rename(tmp, target)
            except OSError:  # another process renamed its copy first
                if not (target / MANIFEST).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def task_counts(directory: Path) -> dict[str, int]:
    """Docs per task of a generated task directory (from its manifest)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; make it with `python -m eval.tasks --out {directory}`")
    return json.loads(path.read_text(encoding="utf-8"))["tasks"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval.tasks",
        description="Generate the bundled zero-shot tasks (tag tiny_bundled) from the held-out text.")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the tasks here (default: the cache, $MOE_PIPELINE_CACHE/eval-tasks/)")
    parser.add_argument("--print-dir", action="store_true", help="print only the directory")
    args = parser.parse_args(argv)
    directory = write_bundled_tasks(args.out) if args.out else bundled_task_dir()
    if args.print_dir:
        print(directory)
        return 0
    print(directory)
    counts = task_counts(directory)
    for name in BUNDLED_TASKS:
        print(f"  {name:<18}{counts[name]:>5} docs")
    print(f"use: moe-pipeline lm-eval run --tasks {TAG} ... (or lm-eval run --include_path {directory} ...)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
