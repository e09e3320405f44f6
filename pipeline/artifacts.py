"""What the stages hand each other: artifact file names, how to recognise and read an artifact
directory, and how to write one safely.

Every stage writes a directory that describes itself: a stage directory
(`runs/<name>/teacher/`, `.../student/`) holds `config.json` (the ModelConfig), `model.safetensors`
(or shards and an index), `tokenizer/` and `DONE.json`; an exported package (export/package.py)
holds `manifest.json` and Hugging Face's files. This module knows those names and nothing about
training, evaluation or serving, so every floor can import it.

Writes are atomic (a temporary name, then a rename): a reader sees the old file or the whole new
one, never a part.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.model import ModelConfig

# -- file names -----------------------------------------------------------------------------------
CONFIG = "config.json"  # the model: every ModelConfig field (a package's is Hugging Face-style, the same fields)
TOKENIZER = "tokenizer"  # a stage directory's tokenizer folder (a package keeps the files at its top level)
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # Hugging Face's sharded layout
SOURCE = "source.json"  # a stage whose weights are another checkpoint's (a Hugging Face teacher): path, sha256, name map
DONE = "DONE.json"  # a finished stage: inputs' hashes, outputs, wall time
MANIFEST = "manifest.json"  # a package: format version, sha256 of every file, provenance
RECIPE_FILE = "recipe.yaml"  # a run directory's resolved recipe
METRICS = "metrics.jsonl"  # a run directory's log: one JSON object per logged step, every stage
METRICS_PLOT = "metrics.png"  # its training curves

# -- dtypes: one table for every name a dtype goes by -------------------------------------------------
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # recipes and CLI flags
DTYPE_ALIASES = {**DTYPES, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}  # config/manifest
DTYPE_OF_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def cache_root() -> Path:
    """Where prepared (tokenized) data is cached: $MOE_PIPELINE_CACHE, else ~/.cache/moe-pipeline."""
    return Path(os.environ.get("MOE_PIPELINE_CACHE", Path.home() / ".cache" / "moe-pipeline"))


# -- recognising artifact directories ------------------------------------------------------------------

def is_package(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def is_model_dir(path: Path) -> bool:
    """A stage directory (or any directory with a config and consolidated weights)."""
    path = Path(path)
    return (path / CONFIG).is_file() and any((path / f).is_file() for f in (WEIGHTS, INDEX, SOURCE))


def is_run_dir(path: Path) -> bool:
    return (Path(path) / RECIPE_FILE).is_file()


def read_model_config(stage_dir: Path) -> ModelConfig:
    """The ModelConfig of a stage directory; FileNotFoundError says which file and which command makes it."""
    path = Path(stage_dir) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: make it with `moe-pipeline teacher RECIPE`")
    return ModelConfig(**json.loads(path.read_text()))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_manifest(pkg: Path) -> dict:
    path = Path(pkg) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a package (make one with `moe-pipeline export RUN`)")
    return read_json(path)


# -- writing ------------------------------------------------------------------------------------------

def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- files a reader checked: a loader reads exactly what was verified ----------------------------------

class FileChangedError(ValueError):
    """A file that changed (its size, modification time or identity) after it was verified."""


@dataclass(frozen=True)
class FileFacts:
    """What a verifier saw of one file; a loader compares them with the file it has open before reading it."""

    size: int
    mtime_ns: int
    dev: int
    ino: int  # with dev: the same file, not another one renamed over it
    ctime_ns: int  # changes on every write, and unlike mtime no one can set it back (cp -p, touch -r, rsync -t)

    @classmethod
    def of(cls, st: os.stat_result) -> "FileFacts":
        return cls(st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns)


def check_unchanged(fd: int, path: Path, facts: FileFacts) -> None:
    """FileChangedError unless the open file `fd` is the file `facts` describe, unchanged."""
    now = FileFacts.of(os.fstat(fd))
    if now == facts:
        return
    if now.size != facts.size:
        what = f"{facts.size} bytes when verified, {now.size} now"
    elif (now.dev, now.ino) != (facts.dev, facts.ino):
        what = "another file now has its name"
    else:
        what = "written to since"
    raise FileChangedError(f"{path}: changed since it was verified ({what}): re-run "
                           f"`moe-pipeline verify {Path(path).parent}` and load it again")


def file_name_problem(name) -> str | None:
    """Why `name` cannot name a file at the top level of an artifact directory (None: it can)."""
    if not isinstance(name, str) or name in ("", ".") or "\0" in name:
        return f"{name!r} is not a file name"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return f"{name!r} is an absolute path"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return f"{name!r} leads out of the directory ('..')"
    if len(parts) > 1:
        return f"{name!r} is a path, not a file at the directory's top level"
    return None


def open_regular(path: Path, follow_links: bool = True):
    """`path` opened for binary reading; OSError unless it is a regular file (a FIFO does not block the open)
    or, with `follow_links=False`, if it is a symbolic link."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
