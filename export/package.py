"""Deployable model packages: export a finished stage, verify a package, load it on a rank.

    moe-pipeline export runs/tiny                                   # the student -> runs/tiny/package
    moe-pipeline export runs/tiny --stage teacher --dtype bf16 --out packages/tiny-teacher
    moe-pipeline verify runs/tiny/package                           # exit 0, or 1 and a list of problems

A package is a Hugging Face-style model directory (`AutoModelForCausalLM.from_pretrained(pkg,
trust_remote_code=True)` loads it; see export/hf/) that our runtime loads at any expert-parallel
degree, each rank reading only its own experts:

  config.json                 model_type "moe_pipeline", architectures, auto_map, every ModelConfig
                              field (expert lists, MoE layers, mlp type, gating settings), dtype
  model.safetensors           the weights under global expert ids; above --max-shard-size
  (model-0000i-of-0000n.safetensors + model.safetensors.index.json)   sharded, HF's index layout.
                              Provenance (run, stage, recipe hash, teacher) in each file's metadata.
  tokenizer.json, tokenizer_config.json, special_tokens_map.json      AutoTokenizer's files
  generation_config.json      greedy by default, eos, the context length
  configuration_moe_pipeline.py, modeling_moe_pipeline.py, moe_model.py   the remote code (moe_model.py
                              is pipeline/model.py: the same model code as training)
  README.md                   the model card: the manifest's facts as a table
  manifest.json               format version, sha256 and size of every other file, parameter
                              counts (total, active per token), dtype, source run and stage, the
                              teacher, the resolved recipe, the KD schedule, eval results if any

Export writes everything into a temporary sibling directory and renames it when complete; an
existing package is replaced only with `force`. `--dtype fp32|bf16|fp16` converts every floating
tensor except the MoE gates (`*.gate.wg.weight`), which stay fp32 as DeepSpeed's gating computes in
fp32. `verify_package` recomputes every checksum and checks that the safetensors hold exactly the
tensors the config implies, with the right shapes and dtypes, and that the shard index maps exactly
those tensors to the files that hold them; a package is untrusted input, so a name that is not a file
at its top level, a listed file that is a link, and a malformed manifest, config.json or index are
listed problems, found before anything they name is opened. `read_package` verifies (sizes always,
checksums unless `checksums=False`) and returns the model config and manifest; `verified_package`
also returns what it saw of each file, which the loaders compare with every file they open
(`pipeline.weights.load_weights(files=...)`, the serving `ExpertStore`): what is loaded is what was
verified, or a FileChangedError names the file that changed. This module is the
format only: loading a package into a model for a layout is export/inference.py (`load_package`).
Weights are read only from safetensors, never pickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import hashlib
import json
import os
import shutil
import stat
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from safetensors.torch import save_file

from pipeline.artifacts import (CONFIG, DONE, DTYPE_ALIASES, DTYPE_NAMES, DTYPE_OF_NAME, DTYPES, INDEX, MANIFEST,
                                 RECIPE_FILE, TOKENIZER, WEIGHTS, FileChangedError, FileFacts, check_unchanged,
                                 file_name_problem, open_regular, read_json, read_model_config, sha256_file)
from pipeline.build import load_stage_model, meta_counts, meta_model
from pipeline.data import TOKENIZER_FILES
from pipeline.model import ModelConfig
from pipeline.schemes import STORED, named
from pipeline.weights import SAFETENSORS_DTYPES, index_weight_map, read_header

FORMAT_VERSION = 1
GENERATION_CONFIG = "generation_config.json"
CARD = "README.md"
HF_DIR = Path(__file__).resolve().parent / "hf"
MODEL_SOURCE = Path(__file__).resolve().parents[1] / "pipeline" / "model.py"
QUANTIZE_SOURCE = Path(__file__).resolve().parents[1] / "pipeline" / "quantize.py"
CODE_FILES = {"configuration_moe_pipeline.py": HF_DIR / "configuration_moe_pipeline.py",
              "modeling_moe_pipeline.py": HF_DIR / "modeling_moe_pipeline.py",
              "moe_model.py": MODEL_SOURCE,
              "moe_quantize.py": QUANTIZE_SOURCE}
QUANTIZED_ONLY = ("moe_quantize.py",)  # required of a quantised package only (packages before it lack it)
DEFAULT_SHARD_BYTES = 2 * 1024 ** 3


class PackageError(RuntimeError):
    """A package that is incomplete, corrupted or not a package; `problems` names each file at fault."""

    def __init__(self, pkg: Path, problems: list[str]):
        self.problems = problems
        super().__init__(f"{pkg}: {len(problems)} problem(s): " + "; ".join(problems[:5])
                         + (" ..." if len(problems) > 5 else "") + f" (run `moe-pipeline verify {pkg}`)")


def is_gate(name: str) -> bool:
    return name.endswith(".gate.wg.weight")


def parse_size(text: str | int) -> int:
    """'2GB', '500MB', '100KB' or a byte count."""
    if isinstance(text, int):
        return text
    units = {"KB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit) and t[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[:-len(unit)]) * mult)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size {text!r}: a size such as 2GB, 500MB or 1048576")


# -- what a config implies --------------------------------------------------------------------------

def expected_tensors(cfg: ModelConfig, dtype: torch.dtype,
                     quantization: dict | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{global tensor name: (shape, dtype)} a package of `cfg` must hold, from the model code (meta device). With
    `quantization` (a manifest's: scheme, group, head), each weight it quantises (pipeline/quantize.py `weight_kinds`)
    as its values and scales instead."""
    from pipeline.quantize import scale_name, values_name, weight_kinds

    model = meta_model(cfg)
    kinds = {} if quantization is None else weight_kinds(model, quantization["scheme"], quantization["head"],
                                                         quantization["group"])
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # the tied lm_head is the embedding: stored once
            continue
        seen.add(id(p))
        kind = kinds.get(name)
        if kind is None:
            out[name] = (tuple(p.shape), torch.float32 if is_gate(name) else dtype)
            continue
        rows, inputs = p.shape
        out[values_name(name, kind)] = ((rows, inputs), torch.int8) if kind == "int8" else \
            ((rows, inputs // 2), torch.uint8)
        out[scale_name(name)] = ((rows,) if kind == "int8" else (rows, inputs // quantization["group"]), torch.float32)
    return out


def model_config_of(pkg: Path) -> ModelConfig:
    """Our ModelConfig from a package's config.json (HF-style, every ModelConfig field at top level)."""
    try:
        raw = json.loads((Path(pkg) / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PackageError(pkg, [f"{CONFIG}: not JSON ({err})"]) from None
    return model_config_from(raw, pkg)


def model_config_from(raw, pkg: Path) -> ModelConfig:
    """The ModelConfig of a package's parsed config.json; a PackageError names each missing or ill-typed field."""
    _refuse_schema(pkg, _ConfigSchema, raw, CONFIG)
    try:
        return ModelConfig(**{f: raw[f] for f in ModelConfig.__dataclass_fields__ if f in raw})
    except ValueError as err:
        raise PackageError(pkg, [f"{CONFIG}: inconsistent fields ({err})"]) from None


# -- the schemas of manifest.json and config.json: pydantic, strict (JSON's types as written, no coercion) --------

_STRICT = ConfigDict(strict=True, extra="allow")


class _FileEntry(BaseModel):
    model_config = _STRICT
    sha256: str = Field(pattern="^[0-9a-f]{64}$", description="64 hex digits")
    size: int = Field(ge=0, description="a byte count")


class _QuantizationSchema(BaseModel):
    """A quantised package's scheme (export --quantize): what verification needs to know which tensors it holds."""

    model_config = _STRICT
    scheme: Literal[STORED] = Field(description=" or ".join(f'"{s}"' for s in STORED))
    group: int = Field(ge=64, multiple_of=64, description="a multiple of 64 (inputs per int4 scale)")
    head: bool = Field(description="true or false (the output layer quantised)")
    method: Literal["gptq", "rtn"] = Field(description='"gptq" or "rtn"')


class _ManifestSchema(BaseModel):
    """The manifest keys that verification and the CLI read."""

    model_config = _STRICT
    files: dict[str, _FileEntry] = Field(description="an object {file name: {sha256, size}}")
    weights: list[str] = Field(min_length=1, description="a list of file names")
    format_version: Literal[FORMAT_VERSION] = Field(description=f"{FORMAT_VERSION}, the format this code reads")
    dtype: Literal[tuple(DTYPE_OF_NAME)] = Field(description=f"one of {', '.join(DTYPE_OF_NAME)}")
    tensors: int = Field(description="a count")
    quantization: _QuantizationSchema | None = Field(None, description="an object {scheme, group, head, method}")


def _config_field(name: str, hint, default):
    """A ModelConfig field's JSON form: counts are integers >= 1 (>= 0 where zero means none), numbers finite."""
    least = 0 if name in ("min_capacity", "moe_layers", "shared_expert_hidden") else 1
    optional = type(None) in typing.get_args(hint)
    base = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
    if name == "mlp_type":
        forms = (Literal["standard", "residual"], '"standard" or "residual"', {})
    elif base is int:
        forms = (int, f"an integer >= {least}", {"ge": least})
    elif base == tuple[int, ...]:
        forms = (list[Annotated[int, Field(ge=least)]], f"a list of integers >= {least}", {})
    elif base is float:
        forms = (float, "a number >= 0", {"ge": 0, "allow_inf_nan": False})
    elif base is bool:
        forms = (bool, "true or false", {})
    elif base is str:
        forms = (str, "a string", {})  # which strings: ModelConfig's own checks
    else:
        raise TypeError(f"ModelConfig.{name}: a field of type {hint} needs a JSON form here")
    annotation, description, constraints = forms
    if optional:
        annotation, description = annotation | None, f"{description} or null"
    return annotation, Field(... if default is dataclasses.MISSING else default, description=description,
                             **constraints)


_HINTS = typing.get_type_hints(ModelConfig)
# every ModelConfig field; the family fields have defaults (the PR-MoE GPT's): a package written before them lacks them
_ConfigSchema = create_model("_ConfigSchema", __config__=_STRICT, **{
    f.name: _config_field(f.name, _HINTS[f.name], f.default) for f in dataclasses.fields(ModelConfig)})


def _schema_problems(schema: type[BaseModel], raw, file: str) -> list[str]:
    """Each problem of `raw` against `schema`, as "FILE: KEY must be WHAT, got VALUE" (the field's description)."""
    if not isinstance(raw, dict):
        return [f"{file}: {_kind(raw)}, not a JSON object"]
    try:
        schema.model_validate(raw)
        return []
    except ValidationError as err:
        problems = {}
        for e in err.errors(include_url=False):
            where, expected, value = _located(schema, raw, e["loc"])
            problems.setdefault(where, f"{file}: {where} must be {expected}, got {value}")
        return list(problems.values())


def _located(schema: type[BaseModel], raw, loc: tuple) -> tuple[str, str, str]:
    """(the key path as written in messages, its field's description, what was found) for an error at `loc`; the
    path stops at the field that failed (a union's member names after it are pydantic's, not the file's)."""
    node, where, expected, value = schema, "", "", raw
    for part in loc:
        if typing.get_origin(node) in (typing.Union, types.UnionType):  # an optional object: the object's fields
            node = next((a for a in typing.get_args(node) if a is not type(None)), node)
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            field = node.model_fields[part]
            node, expected, where = field.annotation, field.description, f"{where}.{part}" if where else part
        elif typing.get_origin(node) is dict and isinstance(part, str):
            node = typing.get_args(node)[1]
            expected, where = f"an object {{{', '.join(node.model_fields)}}}", f"{where}[{part!r}]"
        else:
            break
        value = value.get(part, ...) if isinstance(value, dict) else ...
    return where, expected, "nothing" if value is ... else _kind(value)


def _refuse_schema(pkg: Path, schema: type[BaseModel], raw, file: str) -> None:
    problems = _schema_problems(schema, raw, file)
    if problems:
        raise PackageError(pkg, problems)


def _kind(v) -> str:
    """A JSON value described for a message: its type and (shortened) value."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if v is None else f"{kinds.get(type(v), type(v).__name__)} {json.dumps(v)[:60]}"


# -- export -----------------------------------------------------------------------------------------

def _provenance(stage_dir: Path) -> dict:
    """Facts about the exported stage and its run (for the manifest and the safetensors metadata)."""
    from pipeline.recipe import load_stored_recipe

    stage_dir = Path(stage_dir).resolve()
    run = stage_dir.parent
    done = read_json(stage_dir / DONE) if (stage_dir / DONE).is_file() else {}
    out = {"run": str(run), "run_name": run.name, "stage": stage_dir.name, "stage_path": str(stage_dir),
           "finished_at": done.get("finished_at"), "steps": done.get("steps"), "val_loss": done.get("val_loss"),
           "recipe_sha256": done.get("inputs", {}).get("recipe_sha256")}
    recipe_path = run / RECIPE_FILE
    if recipe_path.is_file():
        import yaml

        out["recipe"] = yaml.safe_load(recipe_path.read_text())
        try:
            recipe = load_stored_recipe(recipe_path)
            if stage_dir.name == "student":
                out["kd"] = {**recipe.kd.model_dump(), "stop_step": recipe.kd_stop_step(),
                             "student_steps": recipe.student.train.steps}
        except Exception as err:  # noqa: BLE001 - provenance is best effort; the weights are what matter
            out["recipe_error"] = str(err).splitlines()[0]
    teacher_dir = run / "teacher"
    if stage_dir.name == "student" and (teacher_dir / DONE).is_file():
        t_done = read_json(teacher_dir / DONE)
        t_cfg = read_json(teacher_dir / CONFIG)
        out["teacher"] = {"path": str(teacher_dir), "layers": t_cfg["layers"], "experts": t_cfg["experts"],
                          "params": t_done.get("params"), "val_loss": t_done.get("val_loss")}
        selection = stage_dir / "selection.json"
        if selection.is_file():
            out["teacher"]["kept_layers"] = json.loads(selection.read_text()).get("kept_teacher_layers")
    out["eval"] = _eval_results(run, stage_dir.name)
    return out


def _eval_results(run: Path, stage: str) -> dict | None:
    """This stage's scores from the run's `moe-pipeline eval` results, when there are any."""
    path = run / "eval" / "results.json"
    if not path.is_file():
        return None
    results = json.loads(path.read_text())
    entry = results.get(f"{run.name}/{stage}")
    if not entry:
        return None
    scores = {task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in entry["results"].items()}
    retention = results.get("_retention", {}).get(f"{run.name}/{stage}")
    return {"source": str(path), "results": scores, "retention_pct": retention}


def _write_shards(tensors: dict[str, torch.Tensor], tmp: Path, max_bytes: int, meta: dict[str, str]) -> list[str]:
    names = sorted(tensors)
    groups, current, size = [], [], 0
    for name in names:
        n = tensors[name].numel() * tensors[name].element_size()
        if current and size + n > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    groups.append(current)
    if len(groups) == 1:
        save_file({k: tensors[k] for k in names}, str(tmp / WEIGHTS), metadata=meta)
        return [WEIGHTS]
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for f, group in zip(files, groups):
        save_file({k: tensors[k] for k in group}, str(tmp / f), metadata=meta)
        weight_map.update({k: f for k in group})
        total += sum(tensors[k].numel() * tensors[k].element_size() for k in group)
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total, **meta}, "weight_map": weight_map},
                                        indent=1, sort_keys=True) + "\n")
    return [*files, INDEX]


@contextlib.contextmanager
def staged(out: Path, force: bool = False) -> Iterator[Path]:
    """A temporary sibling directory of `out` to write an export into. When the block ends, it is renamed to `out`
    (an old `out`, with `force`, moved aside first, then removed); when the block raises, it is removed and `out` is
    as it was. FileExistsError, before anything is written, if `out` exists and not `force`."""
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it, or --out another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Quantize:
    """`export --quantize`: weight-only quantisation of the package (pipeline/quantize.py, export/gptq.py)."""

    scheme: str  # "int8" (one scale per output row) or "int4" (one per `group` inputs of a row)
    head: bool = False  # the output layer too (a tied one stays: it is the embedding)
    method: str = "gptq"  # or "rtn": round to nearest, no calibration
    group: int = 128
    calibration_blocks: int = 128  # blocks of the training split GPTQ calibrates on

    def __post_init__(self):
        from export.gptq import METHODS
        named(self.scheme, among=STORED)
        if self.method not in METHODS:
            raise ValueError(f"--quantize-method {self.method!r}: one of {', '.join(METHODS)}")
        if self.group < 64 or self.group % 64:
            raise ValueError(f"--group-size {self.group}: a multiple of 64 (the int4 kernels read 64 inputs a step)")
        if self.calibration_blocks < 1:
            raise ValueError(f"--calibration-blocks {self.calibration_blocks}: at least 1 (or --quantize-method rtn)")


def export_package(stage_dir: Path, out: Path, dtype: str = "fp32", force: bool = False,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, quantize: Quantize | None = None,
                   progress: bool = False) -> Path:
    """Write the package of a finished stage to `out` (atomically: temporary directory, then rename). `quantize`: its
    linear weights quantised (int8 or int4 values and fp32 scales, calibrated on the run's training split by GPTQ, or
    rounded to nearest), the rest in `dtype`."""
    from export.hf.configuration_moe_pipeline import hf_config_dict
    from pipeline import data as data_lib

    stage_dir, out = Path(stage_dir), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if not (stage_dir / DONE).is_file():
        raise FileNotFoundError(f"{stage_dir / DONE} is missing: the stage is not finished "
                                f"(run `moe-pipeline distill RECIPE` first)")
    cfg = read_model_config(stage_dir)
    torch_dtype = DTYPES[dtype]
    prov = _provenance(stage_dir)
    meta = {"format": "pt", "moe_pipeline_format": str(FORMAT_VERSION), "source_run": prov["run"],
            "source_stage": prov["stage"], "recipe_sha256": str(prov.get("recipe_sha256")),
            "teacher": str((prov.get("teacher") or {}).get("path", "")), "dtype": DTYPE_NAMES[torch_dtype]}

    with staged(out, force) as tmp:
        # weights: every tensor the config implies, read from the stage (any layout), converted
        expected = expected_tensors(cfg, torch_dtype)
        # the stage's model, whatever its layout (shards of several ranks, or a Hugging Face teacher's checkpoint
        # read in place through its source.json), in the package's dtypes: its tensors are the package's
        from pipeline.weights import unique_params

        report = None
        if quantize is None:
            tensors = {k: p for k, p in unique_params(load_stage_model(stage_dir, torch_dtype)) if k in expected}
        else:
            tensors, report = _quantized_tensors(stage_dir, cfg, quantize, torch_dtype, progress)
            expected = expected_tensors(cfg, torch_dtype, _quantization_entry(quantize))
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise ValueError(f"{stage_dir}: {len(missing)} tensor(s) missing, e.g. {missing[0]}")
        weight_names = _write_shards(tensors, tmp, max_shard_bytes, meta)
        del tensors

        tok = data_lib.load_tokenizer(stage_dir / TOKENIZER, seq_len=cfg.seq_len)
        tok.save_pretrained(str(tmp))
        eos = tok.eos_token_id
        config = hf_config_dict(cfg, DTYPE_NAMES[torch_dtype], bos_token_id=eos, eos_token_id=eos)
        if quantize is not None:  # read by the remote code (not `quantization_config`: that names HF's quantizers)
            config["moe_pipeline_quantization"] = _quantization_entry(quantize)
        (tmp / CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        import transformers

        (tmp / GENERATION_CONFIG).write_text(json.dumps(
            {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False,
             "max_length": cfg.seq_len, "transformers_version": transformers.__version__}, indent=1) + "\n")
        for name, src in CODE_FILES.items():
            shutil.copyfile(src, tmp / name)

        counts = meta_counts(cfg)
        manifest = {
            "format": "moe-pipeline-package", "format_version": FORMAT_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "name": f"{prov['run_name']}-{prov['stage']}", "dtype": DTYPE_NAMES[torch_dtype], "gate_dtype": "float32",
            "architecture": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "experts": list(cfg.experts),
                             "moe_layers": list(cfg.moe_layers), "mlp_type": cfg.mlp_type, "top_k": cfg.top_k,
                             "context": cfg.seq_len, "vocab_size": cfg.vocab_size},
            "params": counts, "weights": weight_names, "tensors": len(expected),
            "quantization": None if quantize is None else {**_quantization_entry(quantize), **report},
            "source": {k: prov.get(k) for k in ("run", "stage", "stage_path", "finished_at", "steps", "val_loss",
                                                "recipe_sha256")},
            "teacher": prov.get("teacher"), "kd": prov.get("kd"), "recipe": prov.get("recipe"),
            "eval": prov.get("eval"),
        }
        (tmp / CARD).write_text(model_card(manifest))
        manifest["files"] = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
                             for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        problems = verify_package(tmp)
        if problems:
            raise PackageError(tmp, problems)
    return out


def _quantization_entry(q: Quantize) -> dict:
    return {"scheme": q.scheme, "group": q.group, "head": q.head, "method": q.method}


def quantize_stage(stage_dir: Path, cfg: ModelConfig, quantize: Quantize,
                   progress: bool) -> tuple[torch.nn.Module, dict[str, str], dict[str, torch.Tensor], dict]:
    """A finished stage's model quantised as `quantize` says (GPTQ on `calibration_blocks` blocks of the run's training
    split, or round to nearest): (the fp32 model, {weight: "int8" | "int4"} (pipeline/quantize.py `weight_kinds`),
    {stored name: values or scales} (`values_name`, `scale_name`), the quantisation's report). Our package and the
    compressed-tensors checkpoint (export/compressed.py) store the same values and scales."""
    from export.gptq import quantize_model
    from pipeline.quantize import weight_kinds

    model = load_stage_model(stage_dir, torch.float32)
    kinds = weight_kinds(model, quantize.scheme, quantize.head, quantize.group)
    batches = _calibration_blocks(stage_dir, cfg, quantize.calibration_blocks) if quantize.method == "gptq" else None
    say = bar = None
    if progress and batches is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.layers, desc=f"GPTQ {quantize.scheme}", unit="block")
        say = lambda _: bar.update(1)  # noqa: E731
    stored, report = quantize_model(model, kinds, batches, quantize.method, quantize.group, progress=say)
    if bar is not None:
        bar.close()
    report = {**report, "weights": len(kinds), "int4_weights": sum(k == "int4" for k in kinds.values()),
              "int8_weights": sum(k == "int8" for k in kinds.values())}
    return model, kinds, stored, report


def _quantized_tensors(stage_dir: Path, cfg: ModelConfig, quantize: Quantize, dtype: torch.dtype,
                       progress: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """The package's tensors with `quantize`'s weights as their values and scales (`quantize_stage`), the rest in
    `dtype` (MoE gates fp32), and the quantisation's report."""
    from pipeline.weights import unique_params

    model, kinds, stored, report = quantize_stage(stage_dir, cfg, quantize, progress)
    tensors = {k: (p.float() if is_gate(k) else p.to(dtype)) for k, p in unique_params(model) if k not in kinds}
    tensors.update(stored)
    return tensors, report


def _calibration_blocks(stage_dir: Path, cfg: ModelConfig, count: int, batch: int = 8) -> list[torch.Tensor]:
    """input_ids [<= batch, seq_len] of `count` blocks spread evenly over the run's training split (its recipe's
    data, tokenised in the data cache as the stages read it)."""
    from pipeline import data as data_lib
    from pipeline.artifacts import cache_root
    from pipeline.recipe import load_stored_recipe

    run = Path(stage_dir).resolve().parent
    if not (run / RECIPE_FILE).is_file():
        raise FileNotFoundError(f"{run / RECIPE_FILE} is missing: GPTQ calibrates on the run's training split; "
                                f"export a run directory, or pass --quantize-method rtn")
    recipe = load_stored_recipe(run / RECIPE_FILE)
    prepared = data_lib.prepare_data(recipe.data, cache_root())
    train = data_lib.PackedTokens(prepared.train, cfg.seq_len, prepared.eod_id)
    picks = sorted({int(i * train.num_blocks / count) for i in range(count)})
    return [train.batch(picks[i:i + batch])["input_ids"] for i in range(0, len(picks), batch)]


def model_card(m: dict) -> str:
    p = m["params"]
    a = m["architecture"]
    rows = [("model", m["name"]), ("format", f"{m['format']} v{m['format_version']}"),
            ("dtype", f"{m['dtype']} (MoE gates float32)"),
            *([("quantization", f"{m['quantization']['scheme']} weights ({m['quantization']['method']}"
                                + (f", groups of {m['quantization']['group']}" if m['quantization']['scheme'] == "int4"
                                   else ", one scale per output row")
                                + (", the output layer included" if m['quantization']['head'] else "") + ")")]
              if m.get("quantization") else []),
            ("parameters", f"{p['total']:,} total, {p['active_per_token']:,} active per token"),
            ("architecture", f"PR-MoE GPT, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, "
                             f"context {a['context']}, vocabulary {a['vocab_size']}"),
            ("experts", f"{a['experts']} in layers {a['moe_layers']} ({a['mlp_type']} MLP, top-{a['top_k']})"),
            ("source", f"{m['source']['run']} ({m['source']['stage']}, {m['source']['steps']} steps, "
                       f"held-out loss {m['source']['val_loss']})")]
    if m.get("teacher"):
        t = m["teacher"]
        rows.append(("teacher", f"{t['path']}: {t['layers']} layers, experts {t['experts']}, "
                                f"{(t.get('params') or {}).get('total', '?'):,} parameters, held-out loss {t.get('val_loss')}"
                                + (f", kept layers {t['kept_layers']}" if t.get("kept_layers") else "")))
    if m.get("kd"):
        k = m["kd"]
        rows.append(("KD schedule", f"alpha {k['alpha']}, beta {k['beta']}, T {k['temperature']}, {k['divergence']}, "
                                    f"stops at step {k['stop_step']} of {k['student_steps']}"))
    if m.get("eval"):
        for task, metrics in m["eval"]["results"].items():
            shown = ", ".join(f"{k.split(',')[0]} {v:.4g}" for k, v in metrics.items()
                              if isinstance(v, (int, float)) and "stderr" not in k)
            rows.append((f"eval: {task}", shown))
        if m["eval"].get("retention_pct"):
            rows.append(("retention of the teacher", ", ".join(f"{t} {v:.1f}%" for t, v in m["eval"]["retention_pct"].items())))
    lines = [f"# {m['name']}", "", "A Mixture-of-Experts GPT exported by moe-pipeline (DeepSpeed-MoE PR-MoE / "
             "Mixture-of-Students).", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    lines += ["", "Load it:", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)",
              "tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=False)  # alone: asks nothing",
              "```", "",
              "or `moe-pipeline eval PATH`, `moe-pipeline verify PATH`. Checksums of every file are in manifest.json.", ""]
    return "\n".join(lines)


# -- verify and load -------------------------------------------------------------------------------
# A package is untrusted input: verification reads nothing a name in it points at until every name is
# a plain file at the package's top level and no listed file is a link; a malformed manifest, config
# or index is a listed problem. What it saw of each file (size, modification time, identity) goes
# to the loaders, which compare it with every file they open before reading: what is loaded is what
# was verified, or a FileChangedError says which file changed.

MAX_JSON_BYTES = 64 * 1024 ** 2  # a manifest, config.json or index this large is not one of ours


@dataclass(frozen=True)
class VerifiedPackage:
    """A package that passed `verify_package`: its model config and manifest as verified, and what was seen of
    each listed file, for `pipeline.weights.load_weights(files=...)` and `ExpertStore(files=...)` to check."""

    path: Path
    cfg: ModelConfig
    manifest: dict
    files: dict[str, FileFacts]


def verify_package(pkg: Path, checksums: bool = True) -> list[str]:
    """Problems found (empty: the package is whole): file names, files, sizes, checksums, config.json, the shard
    index, tensor names, shapes, dtypes."""
    return _verify(Path(pkg), checksums)[0]


def verified_package(pkg: Path, checksums: bool = True) -> VerifiedPackage:
    """The package verified (sizes always, checksums unless `checksums=False`); else a PackageError naming each
    problem."""
    problems, verified = _verify(Path(pkg), checksums)
    if problems:
        raise PackageError(pkg, problems)
    return verified


def read_package(pkg: Path, checksums: bool = True) -> tuple[ModelConfig, dict]:
    """(model config, manifest) of a package that passes `verify_package`; else a PackageError naming each problem."""
    verified = verified_package(pkg, checksums)
    return verified.cfg, verified.manifest


class _Refused(Exception):
    """The problems that stop verification at one step (the later steps need what this one checks)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def _refuse_if(problems: list[str]) -> None:
    if problems:
        raise _Refused(problems)


def _verify(pkg: Path, checksums: bool) -> tuple[list[str], VerifiedPackage | None]:
    """Each step refuses (with every problem it found) before the next one opens anything more."""
    try:
        manifest = _checked_manifest(pkg)
        listed, weights = manifest["files"], manifest["weights"]
        _check_names(listed, weights, quantized=manifest.get("quantization") is not None)
        _check_files(pkg, listed)
        facts, kept = _checksum_files(pkg, listed, checksums)
        cfg = _checked_config(pkg, kept)
        found, stored = _read_headers(pkg, weights, facts)
        expected = _expected_of(cfg, found, manifest)
        _check_index(listed, kept, found, stored)
        _check_tensors(expected, found, manifest)
    except _Refused as refused:
        return refused.problems, None
    return [], VerifiedPackage(pkg, cfg, manifest, facts)


def _checked_manifest(pkg: Path) -> dict:
    """The manifest, read without following a link, of the types verification and the CLI read."""
    if not pkg.is_dir():
        raise _Refused([f"{pkg}: not a directory"])
    try:
        with open_regular(pkg / MANIFEST, follow_links=False) as fh:
            manifest = json.loads(_read_json_bytes(fh))
    except FileNotFoundError:
        raise _Refused([f"{MANIFEST}: missing (not a package made by `moe-pipeline export`)"]) from None
    except OSError as err:  # a link (ELOOP), a directory, a FIFO
        raise _Refused([f"{MANIFEST}: {_os_problem(err)}"]) from None
    except ValueError as err:  # not JSON, not UTF-8, too large
        raise _Refused([f"{MANIFEST}: unreadable ({err})"]) from None
    _refuse_if(_manifest_problems(manifest))
    return manifest


def _check_names(listed: dict, weights: list[str], quantized: bool = False) -> None:
    """1. names: each a file at the package's top level, before any is opened; the required ones listed."""
    problems = []
    for name in dict.fromkeys([*listed, *weights]):
        problem = file_name_problem(name)
        if problem is not None:
            problems.append(f"{MANIFEST}: file name {problem}: a package lists only the files at its top level")
    _refuse_if(problems)
    for name in [CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES, *CODE_FILES, *weights]:
        if name not in listed and (quantized or name not in QUANTIZED_ONLY):
            problems.append(f"{name}: not listed in {MANIFEST}")
    _refuse_if(problems)


def _check_files(pkg: Path, listed: dict) -> None:
    """2. each listed name a regular file inside the package, not a link (to a file elsewhere, or here); no extras."""
    problems = []
    root = os.path.realpath(pkg)
    for name in listed:
        path = pkg / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        except OSError as err:  # a name too long, say
            problems.append(f"{name[:80]}: {_os_problem(err)}")
            continue
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            inside = os.path.commonpath([root, os.path.realpath(path)]) == root
            problems.append(f"{name}: a symbolic link to {target}, outside the package" if not inside else
                            f"{name}: a symbolic link (to {target}): a package holds its files, not links")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{name}: not a regular file")
    extra = sorted(p.name for p in pkg.iterdir() if p.name not in listed and p.name != MANIFEST)
    problems += [f"{name}: not listed in {MANIFEST} (an unexpected file)" for name in extra]
    _refuse_if(problems)


def _checksum_files(pkg: Path, listed: dict, checksums: bool) -> tuple[dict[str, FileFacts], dict[str, bytes]]:
    """3. sizes and checksums, each file read through one handle: (what was seen of each, config.json and the
    index as they were read)."""
    problems = []
    facts: dict[str, FileFacts] = {}
    kept: dict[str, bytes] = {}
    for name, entry in listed.items():
        try:
            with open_regular(pkg / name, follow_links=False) as fh:
                seen = FileFacts.of(os.fstat(fh.fileno()))
                if seen.size != entry["size"]:
                    problems.append(f"{name}: {seen.size} bytes, the manifest says {entry['size']} (truncated or changed)")
                    continue
                if name in (CONFIG, INDEX):
                    kept[name] = _read_json_bytes(fh)
                    digest = hashlib.sha256(kept[name]).hexdigest()
                else:
                    digest = hashlib.file_digest(fh, "sha256").hexdigest() if checksums else None
                if checksums and digest != entry["sha256"]:
                    problems.append(f"{name}: sha256 differs from the manifest (corrupted or changed)")
                    continue
                check_unchanged(fh.fileno(), pkg / name, seen)
                facts[name] = seen
        except FileChangedError:
            problems.append(f"{name}: changed while it was being verified")
        except (OSError, ValueError) as err:
            problems.append(f"{name}: {_os_problem(err) if isinstance(err, OSError) else err}")
    _refuse_if(problems)
    return facts, kept


def _checked_config(pkg: Path, kept: dict[str, bytes]) -> ModelConfig:
    """4. config.json: every ModelConfig field, each of its type."""
    try:
        return model_config_from(json.loads(kept[CONFIG]), pkg)
    except PackageError as err:
        raise _Refused(err.problems) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _Refused([f"{CONFIG}: not JSON ({err})"]) from None


def _read_headers(pkg: Path, weights: list[str], facts: dict[str, FileFacts]):
    """5. safetensors headers (not tensors), from the files as verified: ({tensor: (file, shape, dtype)}, files)."""
    problems = []
    found: dict[str, tuple[str, tuple[int, ...], torch.dtype | None]] = {}
    stored = sorted(f for f in weights if f.endswith(".safetensors"))
    for f in stored:
        try:
            with open_regular(pkg / f, follow_links=False) as fh:
                check_unchanged(fh.fileno(), pkg / f, facts[f])
                header, _ = read_header(fh, Path(f))
        except FileChangedError:
            problems.append(f"{f}: changed while it was being verified")
            continue
        except OSError as err:
            problems.append(f"{f}: {_os_problem(err)}")
            continue
        except ValueError as err:  # a damaged header; the message names the file
            problems.append(str(err))
            continue
        for key, info in header.items():
            if key in found:
                problems.append(f"{f}: tensor {key} is also in {found[key][0]}")
            found[key] = (f, tuple(info["shape"]), SAFETENSORS_DTYPES.get(info["dtype"]))
    _refuse_if(problems)
    return found, stored


def _expected_of(cfg: ModelConfig, found: dict, manifest: dict) -> dict:
    """The tensors the model config.json describes (on the meta device). Each layer and expert has at least one
    tensor, so a config of more than the files hold is refused before it is built."""
    if max(cfg.layers, sum(cfg.experts)) > len(found):
        raise _Refused([f"{CONFIG}: {cfg.layers} layers and {sum(cfg.experts)} experts, more than the {len(found)} "
                        f"tensors the weights hold"])
    try:
        return expected_tensors(cfg, DTYPE_OF_NAME[manifest["dtype"]], manifest.get("quantization"))
    except (ValueError, TypeError, RuntimeError) as err:  # a model torch refuses to build
        raise _Refused([f"{CONFIG}: describes no model this code builds ({type(err).__name__}: "
                        f"{str(err)[:160]})"]) from None


def _check_index(listed: dict, kept: dict[str, bytes], found: dict, stored: list[str]) -> None:
    """6. the index: what the loaders will read, exactly the files and tensors verified."""
    problems = []
    if INDEX in listed:
        try:
            weight_map = index_weight_map(kept[INDEX], Path(INDEX), listed)
        except ValueError as err:
            raise _Refused([str(err)]) from None
        for f in sorted(set(weight_map.values()) - set(stored)):
            problems.append(f"{INDEX}: maps tensors to {f}, which the manifest's weights do not list")
        for key, f in sorted(weight_map.items()):
            if key not in found:
                problems.append(f"{INDEX}: maps tensor {key} to {f}, which does not hold it")
            elif found[key][0] != f:
                problems.append(f"{INDEX}: maps tensor {key} to {f}, but {found[key][0]} holds it")
        for key in sorted(set(found) - set(weight_map)):
            problems.append(f"{found[key][0]}: tensor {key} is not in {INDEX}")
    elif stored != [WEIGHTS]:
        problems.append(f"{MANIFEST}: weights {stored} without {INDEX}: an unsharded package holds {WEIGHTS} alone")
    _refuse_if(problems)


def _check_tensors(expected: dict, found: dict, manifest: dict) -> None:
    """7. tensors: exactly those the config implies, with their shapes and dtypes."""
    problems = []
    for key in sorted(set(expected) - set(found)):
        problems.append(f"tensor {key}: missing (config.json implies it)")
    for key in sorted(set(found) - set(expected)):
        problems.append(f"{found[key][0]}: tensor {key} is not part of the model config.json describes")
    for key in sorted(set(expected) & set(found)):
        shape, dt = expected[key]
        f, got_shape, got_dt = found[key]
        if got_shape != shape:
            problems.append(f"{f}: tensor {key} has shape {list(got_shape)}, config.json implies {list(shape)}")
        elif got_dt != dt:
            problems.append(f"{f}: tensor {key} is {got_dt}, the package's dtype implies {dt}")
    if manifest["tensors"] != len(expected):
        problems.append(f"{MANIFEST}: tensors {manifest['tensors']}, config.json implies {len(expected)}")
    _refuse_if(problems)


def _manifest_problems(manifest) -> list[str]:
    """What is missing or of the wrong type in a parsed manifest (the keys verification and the CLI read)."""
    return _schema_problems(_ManifestSchema, manifest, MANIFEST)


def _read_json_bytes(fh) -> bytes:
    data = fh.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"larger than {MAX_JSON_BYTES // 1024 ** 2} MiB: not a file this package format writes")
    return data


def _os_problem(err: OSError) -> str:
    if err.errno == errno.ELOOP:
        return "a symbolic link: a package holds its files, not links"
    return f"cannot be read ({err.strerror or err})"


def package_dtype(manifest: dict, override: str | None = None) -> torch.dtype:
    """The dtype a package's model runs in: `override` (fp32|bf16|fp16|float32|bfloat16|float16) or the package's."""
    if override is not None and override not in DTYPE_ALIASES:
        raise ValueError(f"dtype {override!r}: one of {', '.join(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[override] if override else DTYPE_OF_NAME[manifest["dtype"]]


def read_tokenizer(pkg: Path, files: dict[str, FileFacts] | None = None):
    """The package's tokenizer (Hugging Face's files at the package's top level). `files`: a verified
    package's; a tokenizer file changed since verification is refused (FileChangedError)."""
    from transformers import PreTrainedTokenizerFast

    for name in TOKENIZER_FILES if files is not None else ():
        with open_regular(Path(pkg) / name) as fh:
            check_unchanged(fh.fileno(), Path(pkg) / name, files[name])

    # not AutoTokenizer: it reads config.json through AutoConfig, which asks whether to trust remote code
    return PreTrainedTokenizerFast.from_pretrained(str(pkg))
