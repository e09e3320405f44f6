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
tensors the config implies, with the right shapes and dtypes; `read_package` verifies (sizes always,
checksums unless `checksums=False`) and returns the model config and manifest. This module is the
format only: loading a package into a model for a layout is export/inference.py (`load_package`).
Weights are read only from safetensors, never pickle.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.artifacts import (CONFIG, DONE, DTYPE_ALIASES, DTYPE_NAMES, DTYPE_OF_NAME, DTYPES, INDEX, MANIFEST,
                                 RECIPE_FILE, TOKENIZER, WEIGHTS, read_json, read_manifest, read_model_config,
                                 sha256_file)
from pipeline.build import meta_counts, meta_model
from pipeline.data import TOKENIZER_FILES
from pipeline.model import ModelConfig
from pipeline.weights import SAFETENSORS_DTYPES, weight_files

FORMAT_VERSION = 1
GENERATION_CONFIG = "generation_config.json"
CARD = "README.md"
HF_DIR = Path(__file__).resolve().parent / "hf"
MODEL_SOURCE = Path(__file__).resolve().parents[1] / "pipeline" / "model.py"
CODE_FILES = {"configuration_moe_pipeline.py": HF_DIR / "configuration_moe_pipeline.py",
              "modeling_moe_pipeline.py": HF_DIR / "modeling_moe_pipeline.py",
              "moe_model.py": MODEL_SOURCE}
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

def expected_tensors(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{global tensor name: (shape, dtype)} a package of `cfg` must hold, from the model code (meta device)."""
    model = meta_model(cfg)
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # the tied lm_head is the embedding: stored once
            continue
        seen.add(id(p))
        out[name] = (tuple(p.shape), torch.float32 if is_gate(name) else dtype)
    return out


def model_config_of(pkg: Path) -> ModelConfig:
    """Our ModelConfig from a package's config.json (HF-style, every ModelConfig field at top level)."""
    raw = json.loads((Path(pkg) / CONFIG).read_text())
    fields = ModelConfig.__dataclass_fields__
    missing = [f for f in fields if f not in raw]
    if missing:
        raise PackageError(pkg, [f"{CONFIG}: missing field(s) {', '.join(missing)}"])
    return ModelConfig(**{f: raw[f] for f in fields})


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


def export_package(stage_dir: Path, out: Path, dtype: str = "fp32", force: bool = False,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the package of a finished stage to `out` (atomically: temporary directory, then rename)."""
    from export.hf.configuration_moe_pipeline import hf_config_dict
    from pipeline import data as data_lib

    stage_dir, out = Path(stage_dir), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if not (stage_dir / DONE).is_file():
        raise FileNotFoundError(f"{stage_dir / DONE} is missing: the stage is not finished "
                                f"(run `moe-pipeline distill RECIPE` first)")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it, or --out another directory")
    cfg = read_model_config(stage_dir)
    torch_dtype = DTYPES[dtype]
    prov = _provenance(stage_dir)
    meta = {"format": "pt", "moe_pipeline_format": str(FORMAT_VERSION), "source_run": prov["run"],
            "source_stage": prov["stage"], "recipe_sha256": str(prov.get("recipe_sha256")),
            "teacher": str((prov.get("teacher") or {}).get("path", "")), "dtype": DTYPE_NAMES[torch_dtype]}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # weights: every tensor the config implies, read from the stage (any layout), converted
        expected = expected_tensors(cfg, torch_dtype)
        where = weight_files(stage_dir)
        missing = sorted(set(expected) - set(where))
        if missing:
            raise ValueError(f"{stage_dir}: {len(missing)} tensor(s) missing, e.g. {missing[0]}")
        tensors = {}
        for f in sorted(set(where[k] for k in expected)):
            with safe_open(stage_dir / f, framework="pt") as sf:
                for key in sf.keys():
                    if key in expected:
                        tensors[key] = sf.get_tensor(key).to(expected[key][1]).contiguous()
        weight_names = _write_shards(tensors, tmp, max_shard_bytes, meta)
        del tensors

        tok = data_lib.load_tokenizer(stage_dir / TOKENIZER, seq_len=cfg.seq_len)
        tok.save_pretrained(str(tmp))
        eos = tok.eos_token_id
        config = hf_config_dict(cfg, DTYPE_NAMES[torch_dtype], bos_token_id=eos, eos_token_id=eos)
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
        # publish: the old package (with --force) is moved aside first, then removed
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
    return out


def model_card(m: dict) -> str:
    p = m["params"]
    a = m["architecture"]
    rows = [("model", m["name"]), ("format", f"{m['format']} v{m['format_version']}"),
            ("dtype", f"{m['dtype']} (MoE gates float32)"),
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
              "tokenizer = AutoTokenizer.from_pretrained(PATH)", "```", "",
              "or `moe-pipeline eval PATH`, `moe-pipeline verify PATH`. Checksums of every file are in manifest.json.", ""]
    return "\n".join(lines)


# -- verify and load -------------------------------------------------------------------------------

def verify_package(pkg: Path, checksums: bool = True) -> list[str]:
    """Problems found (empty: the package is whole): files, sizes, checksums, tensor names, shapes, dtypes."""
    pkg = Path(pkg)
    if not pkg.is_dir():
        return [f"{pkg}: not a directory"]
    try:
        manifest = json.loads((pkg / MANIFEST).read_text())
        listed = manifest["files"]
    except FileNotFoundError:
        return [f"{MANIFEST}: missing (not a package made by `moe-pipeline export`)"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return [f"{MANIFEST}: unreadable ({type(err).__name__}: {err})"]
    problems = []
    if manifest.get("format_version") != FORMAT_VERSION:
        problems.append(f"{MANIFEST}: format_version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}")
    required = [CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES, *CODE_FILES, *manifest.get("weights", [WEIGHTS])]
    for name in required:
        if name not in listed:
            problems.append(f"{name}: not listed in {MANIFEST}")
    for name, facts in listed.items():
        path = pkg / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != facts["size"]:
            problems.append(f"{name}: {size} bytes, the manifest says {facts['size']} (truncated or changed)")
        elif checksums and sha256_file(path) != facts["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest (corrupted or changed)")
    extra = sorted(p.name for p in pkg.iterdir() if p.name not in listed and p.name != MANIFEST)
    problems += [f"{name}: not listed in {MANIFEST} (an unexpected file)" for name in extra]
    if problems:
        return problems
    # tensors: exactly those the config implies, with their shapes and dtypes
    try:
        cfg = model_config_of(pkg)
    except (PackageError, TypeError, AssertionError, json.JSONDecodeError) as err:
        return [f"{CONFIG}: {getattr(err, 'problems', [err])[0]}"]
    dtype = DTYPE_OF_NAME.get(manifest.get("dtype"), torch.float32)
    expected = expected_tensors(cfg, dtype)
    found: dict[str, tuple[str, tuple[int, ...], torch.dtype | None]] = {}
    for f in manifest.get("weights", []):
        if not f.endswith(".safetensors"):
            continue
        try:
            with safe_open(pkg / f, framework="pt") as sf:
                for key in sf.keys():
                    sl = sf.get_slice(key)
                    found[key] = (f, tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype()))
        except Exception as err:  # noqa: BLE001 - a damaged header: name the file
            problems.append(f"{f}: unreadable safetensors ({type(err).__name__}: {str(err)[:120]})")
    if problems:
        return problems
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
    return problems


def read_package(pkg: Path, checksums: bool = True) -> tuple[ModelConfig, dict]:
    """(model config, manifest) of a package that passes `verify_package`; else a PackageError naming each problem."""
    pkg = Path(pkg)
    problems = verify_package(pkg, checksums=checksums)
    if problems:
        raise PackageError(pkg, problems)
    return model_config_of(pkg), read_manifest(pkg)


def package_dtype(manifest: dict, override: str | None = None) -> torch.dtype:
    """The dtype a package's model runs in: `override` (fp32|bf16|fp16|float32|bfloat16|float16) or the package's."""
    if override is not None and override not in DTYPE_ALIASES:
        raise ValueError(f"dtype {override!r}: one of {', '.join(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[override] if override else DTYPE_OF_NAME[manifest["dtype"]]


def read_tokenizer(pkg: Path):
    """The package's tokenizer (Hugging Face's files at the package's top level)."""
    from transformers import PreTrainedTokenizerFast

    # not AutoTokenizer: it reads config.json through AutoConfig, which asks whether to trust remote code
    return PreTrainedTokenizerFast.from_pretrained(str(pkg))
