"""Which models an eval job means, and loading one for inference on this rank.

A model argument of `moe-pipeline eval` (or `path=` of the lm-eval adapter) is one of:

  * a run directory (`runs/tiny`: holds `recipe.yaml` and stage directories): its finished
    `teacher` and `student` stages, in that order;
  * a stage directory (`runs/tiny/student`: `config.json`, `model.safetensors` or a sharded index,
    `tokenizer/`), finished (`DONE.json`) or a loaded teacher;
  * an exported package (`runs/tiny/package`: `manifest.json`, see export/package.py), verified
    before it is loaded.

    from eval.models import resolve, load_model
    refs = resolve("runs/tiny")              # [ModelRef('tiny/teacher', ...), ModelRef('tiny/student', ...)]
    model, tokenizer = load_model(refs[0].path)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline import dist
from pipeline.artifacts import (CONFIG, DONE, RECIPE_FILE, TOKENIZER, WEIGHTS, is_model_dir, is_package, is_run_dir,
                                read_json, read_manifest, read_model_config)
from pipeline.model import GPT

STAGES = ("teacher", "student")


@dataclass(frozen=True)
class ModelRef:
    name: str   # row label in tables: '<run>/<stage>' or the directory's name
    path: Path  # a loadable directory (config.json, weights, tokenizer/)
    stage: str | None = None  # 'teacher' | 'student' | None (a package or a foreign directory)
    run: str | None = None


def resolve(spec: str | Path, stages: tuple[str, ...] = STAGES) -> list[ModelRef]:
    """The models a command-line argument names; FileNotFoundError says what is missing and how to make it."""
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"{spec}: no such run, stage or package directory")
    if is_package(path):
        manifest = read_manifest(path)
        return [ModelRef(manifest.get("name") or path.name, path, manifest.get("source", {}).get("stage"))]
    if is_model_dir(path):
        stage = path.name if path.name in STAGES else None
        run = path.parent.name if stage and is_run_dir(path.parent) else None
        return [ModelRef(f"{run}/{stage}" if run else path.name, path, stage, run)]
    if is_run_dir(path):
        refs = [ModelRef(f"{path.name}/{s}", path / s, s, path.name) for s in stages
                if (path / s / DONE).is_file() and is_model_dir(path / s)]
        if not refs:
            raise FileNotFoundError(f"{spec}: a run directory without a finished {' or '.join(stages)} stage: "
                                    f"run `moe-pipeline distill {path / RECIPE_FILE}` first")
        return refs
    raise FileNotFoundError(f"{spec}: not a run directory ({RECIPE_FILE}), a stage directory ({CONFIG} and "
                            f"{WEIGHTS}) or a package")


def load_model(path: Path, ranks: dist.Ranks | None = None, ep_size: int | None = None,
               dtype: str | None = None) -> tuple[GPT, object]:
    """(model in eval mode on this rank's device, tokenizer). Collective when the world has several ranks.

    The model is expert parallel over the world (each rank holds, and reads from the safetensors,
    only its own experts: `pipeline.weights.load_weights`); every rank must then run the same batches.
    `dtype` None: the model's own (fp32 for a stage directory, the package's dtype for a package).
    A package is verified first (`export.inference.load_package`).
    """
    from export.inference import inference_model, load_package
    from pipeline import data as data_lib
    from pipeline.artifacts import DTYPE_ALIASES

    if dtype is not None and dtype not in DTYPE_ALIASES:
        raise ValueError(f"dtype={dtype!r}: one of {', '.join(DTYPE_ALIASES)}")
    ranks = ranks or dist.init()
    path = Path(path)
    if is_package(path):
        return load_package(path, ranks, ep_size=ep_size, dtype=dtype)
    cfg = read_model_config(path)
    model = inference_model(cfg, path, ranks, ep_size, DTYPE_ALIASES[dtype or "float32"])
    tokenizer = data_lib.load_tokenizer(path / TOKENIZER, seq_len=cfg.seq_len)
    return model, tokenizer


def fingerprint(path: Path) -> str:
    """What a model directory's scores depend on, in 16 hex digits: a package's manifest checksums (its files'
    sha256), else the name, size and modification time of its config and weight files (a stage retrained in place,
    or another model moved to the same path, gives another fingerprint)."""
    import hashlib
    import json

    path = Path(path)
    if is_package(path):
        blob = json.dumps(sorted((n, f.get("sha256"), f.get("size")) for n, f in read_manifest(path)["files"].items()))
    else:
        files = sorted(f for f in path.iterdir() if f.is_file() and (
            f.name in (CONFIG, "source.json") or f.name.endswith((".safetensors", ".safetensors.index.json"))))
        blob = json.dumps([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def describe(path: Path) -> dict:
    """Facts about a model directory for result files: its config and, when present, its DONE.json."""
    out = {"path": str(Path(path).resolve()), "config": read_json(Path(path) / CONFIG)}
    if is_package(path):
        manifest = read_manifest(path)
        out["package"] = {k: manifest.get(k) for k in ("name", "dtype", "params", "source", "format_version")}
    done = Path(path) / DONE
    if done.is_file():
        d = read_json(done)
        out["done"] = {k: d[k] for k in ("val_loss", "teacher_val_loss", "steps", "params") if k in d}
    return out
