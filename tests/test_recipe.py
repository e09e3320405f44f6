"""Recipes: every shipped YAML loads; bad input stops with exit 2 and one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from conftest import ROOT, cli, sets
from pipeline.recipe import RecipeError, load_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_recipes_folder_has_the_three_recipes():
    assert {p.stem for p in RECIPES} >= {"tiny", "350m", "1.3b"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    assert len(recipe.model.experts) == recipe.model.layers // recipe.model.moe_every


def test_paper_recipes_follow_the_paper():
    r = load_recipe(ROOT / "recipes" / "1.3b.yaml")
    assert (r.model.layers, r.model.hidden, r.model.heads) == (24, 2048, 16)
    assert r.model.experts == [64] * 10 + [128] * 2 and r.model.mlp_type == "residual"
    assert (r.teacher.train.lr, r.teacher.train.min_lr, r.teacher.train.global_batch_size) == (1.2e-4, 1e-6, 512)
    assert r.student.layers == 21 and r.student_experts() == [64] * 8 + [128] * 2
    assert r.vocab_size() == 50304
    s = load_recipe(ROOT / "recipes" / "350m.yaml")
    assert s.model.experts == [32] * 10 + [64] * 2 and s.teacher.train.lr == 3e-4
    assert s.student_experts() == [32] * 8 + [64] * 2


def test_overrides_parse_yaml_values():
    r = load_recipe(ROOT / "recipes" / "tiny.yaml", ["teacher.train.steps=50", "data.seq_len=128",
                                                     "model.experts=[2, 2, 4]", "teacher.train.lr=3e-4"])
    assert r.teacher.train.steps == 50 and r.model.experts == [2, 2, 4] and r.teacher.train.lr == 3e-4


def test_recipe_is_frozen():
    r = load_recipe(ROOT / "recipes" / "tiny.yaml")
    with pytest.raises(pydantic.ValidationError):
        r.seed = 3


@pytest.mark.parametrize("override, key, words", [
    ("teacher.train.stepz=3", "teacher.train.stepz", "unknown key"),
    ("teacher.train.lr=abc", "teacher.train.lr", "valid number"),
    ("teacher.train.steps=1.5", "teacher.train.steps", "valid integer"),
    ("data.validation_fraction=0.7", "data.validation_fraction", "less than 0.5"),
    ("model.experts=[4, 4]", "model.experts", "one entry per MoE layer"),
    ("model.heads=5", "model.heads", "must divide model.hidden"),
    ("student.layers=6", "student.layers", "must be < teacher layers"),
    ("model.mlp_type=dense", "model.mlp_type", "residual"),
])
def test_bad_values_name_the_key(override, key, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(ROOT / "recipes" / "tiny.yaml", [override])
    assert err.value.path == key
    assert words in str(err.value)


def test_ep_size_must_divide_expert_counts():
    with pytest.raises(RecipeError, match=r"model.experts.0 = 4: divisible by distributed.ep_size \(3\)"):
        load_recipe(ROOT / "recipes" / "tiny.yaml", ["distributed.ep_size=3", "distributed.nproc=3"])


def test_cli_recipe_error_exits_2_with_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli("teacher", "recipes/tiny.yaml", *sets("model.experts=[4, 4]"), "--run-dir", str(run_dir), check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["recipe error: model.experts = [4, 4]: one entry per MoE layer: 3 entries (6 layers, MoE every 2)"]
    assert not run_dir.exists()


def test_cli_missing_recipe_file(tmp_path):
    proc = cli("plan", str(tmp_path / "nope.yaml"), check=False)
    assert proc.returncode == 2 and "recipe = " in proc.stderr


def test_cli_data_error_exits_2_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli("teacher", "recipes/tiny.yaml", *sets(f"data.train={tmp_path}/missing/*.txt"), "--run-dir", str(run_dir),
               check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("recipe error: data.train: the pattern")
    assert not run_dir.exists()


def test_kd_stop_at_is_a_step_or_a_fraction():
    tiny = ROOT / "recipes" / "tiny.yaml"
    assert load_recipe(tiny, ["kd.stop_at=0.6", "student.train.steps=300"]).kd_stop_step() == 180
    assert load_recipe(tiny, ["kd.stop_at=120"]).kd_stop_step() == 120
    assert load_recipe(tiny, ["kd.stop_at=null"]).kd_stop_step() is None
    with pytest.raises(RecipeError, match="kd.stop_at = 1.5"):
        load_recipe(tiny, ["kd.stop_at=1.5"])
    with pytest.raises(RecipeError, match="kd.decay_steps"):
        load_recipe(tiny, ["kd.stop_at=10", "kd.decay_steps=20"])
