"""pipeline/families/: one module per Hugging Face MoE family, each a typed `Family` record.

    .venv/bin/python -m pytest tests/test_families.py -q

Unit tests, no weights: every registered family is its own module with its published config.json in recipes/hf/,
its config.json reads into a ModelConfig that export/native.py writes back to the same ModelConfig, and the package
docstring names every field a new family sets.
"""

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_registry_holds_one_module_per_model_type_in_the_order_messages_list_them():
    from pipeline.families import FAMILIES, Family, family
    from pipeline.hf_import import SUPPORTED

    assert list(FAMILIES) == ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"] == list(SUPPORTED)
    for name, fam in FAMILIES.items():
        assert isinstance(fam, Family) and fam.model_type == name
        assert importlib.import_module(f"pipeline.families.{name}").FAMILY is fam  # the module named by model_type
    with pytest.raises(KeyError, match="model_type 'llama' is not supported; supported families: mixtral, qwen2_moe"):
        family("llama")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_a_family_reads_its_published_config_and_writes_back_the_same_model(name, tmp_path):
    """recipes/hf/<model_type>.json -> ModelConfig -> the family's config.json (export/native.py) -> the same
    ModelConfig; for a family with dense layers, a student keeping only some MoE layers too."""
    from export.native import native_config
    from pipeline.families import FAMILIES
    from pipeline.hf_import import model_config

    fam = FAMILIES[name]
    published = json.loads((ROOT / "recipes" / "hf" / f"{name}.json").read_text())
    assert published["model_type"] == name and published["architectures"] == [fam.architecture]
    cfg = model_config(published)
    assert (cfg.family, cfg.qk_norm) == (name, fam.qk_norm)
    students = [cfg]
    if fam.dense_layers:
        students.append(dataclasses.replace(cfg, layers=4, experts=cfg.experts[:2], moe_layers=(1, 3)))
    for student in students:
        written = native_config(student, torch.bfloat16)
        assert written["architectures"] == [fam.architecture]
        assert model_config(json.loads(json.dumps(written))) == student


def test_the_package_docstring_names_every_field_a_new_family_sets():
    import pipeline.families
    from pipeline.families import Family

    doc = pipeline.families.__doc__
    for field in dataclasses.fields(Family):
        assert field.name in doc, f"pipeline/families/__init__.py's docstring does not name Family.{field.name}"
    for method in ("read_hf", "write_hf", "gguf_refusal", "gguf_metadata"):
        assert method in doc
