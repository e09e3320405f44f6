"""Recipes: every shipped YAML loads, builds its DeepSpeed config and plans; bad input stops with exit 2
and one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest
import yaml

from conftest import ROOT, cli, sets
from cli.main import main
from pipeline.recipe import KDSpec, Recipe, RecipeError, diff_recipes, dump_recipe, load_recipe, validate
from pipeline.train import deepspeed_config

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny.yaml"
PAPER_WORLD = 128  # the README's `moe-pipeline plan recipes/1.3b.yaml --world-size 128`


def _worlds(path):
    """World sizes a shipped recipe is run at: its distributed.nproc; the paper recipes also at PAPER_WORLD."""
    nproc = load_recipe(path).distributed.nproc
    return [nproc] if path.stem in ("tiny", "small") else [nproc, PAPER_WORLD]  # the laptop-sized ones: 1 node


SHIPPED = [(path, world) for path in RECIPES for world in _worlds(path)]


def test_recipes_folder_has_the_three_recipes():
    assert {p.stem for p in RECIPES} >= {"tiny", "350m", "1.3b"}


@pytest.mark.parametrize("path, world", SHIPPED, ids=[f"{p.stem}-world{w}" for p, w in SHIPPED])
def test_every_shipped_recipe_loads_builds_its_deepspeed_config_and_plans(path, world, capsys, monkeypatch):
    recipe = load_recipe(path, world_size=world)
    assert recipe.name == path.stem
    layers, moe_layers, experts, _ = recipe.teacher_layout()
    assert len(experts) == len(moe_layers) and (recipe.model is None) == (recipe.hf_teacher() is not None)
    assert (recipe.teacher.train is not None) == recipe.teacher.trained() == (recipe.model is not None)
    for _, train in recipe.trainings():
        ds = json.loads(json.dumps(deepspeed_config(train, world)))  # plain JSON, as DeepSpeed reads it
        assert ds["train_batch_size"] == train.global_batch_size
        assert ds["gradient_accumulation_steps"] >= 1
        assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world == train.global_batch_size
        assert ds["fp16"]["enabled"] == (train.precision == "fp16") and ds["bf16"]["enabled"] == (train.precision == "bf16")

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # main() may set it; restored after the test
    assert main(["plan", str(path), "--world-size", str(world), "--json"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out)  # exactly one JSON object on stdout
    teacher, student = plan["teacher"], plan["student"]
    assert 0 < student["params_total"] < teacher["params_total"]
    assert 0 < student["params_active_per_token"] <= teacher["params_active_per_token"]
    assert (teacher["layers"], student["layers"]) == (layers, recipe.student.layers)
    assert student["experts"] == recipe.student_experts()


FAMILY_RECIPES = {"mixtral-8x7b-mos": ("mixtral", 32, 28), "qwen1.5-moe-a2.7b-mos": ("qwen2_moe", 24, 21),
                  "qwen3-30b-a3b-mos": ("qwen3_moe", 48, 42), "olmoe-1b-7b-mos": ("olmoe", 16, 14)}


def test_a_recipe_per_hugging_face_family_drops_an_eighth_of_the_layers_and_takes_the_teachers_tokenizer(tmp_path):
    """Each names its published architecture (plan and these checks, no weights), leaves data.tokenizer to default
    to the checkpoint's once teacher.load is set, and keeps 7/8 of the layers (the paper's 24 -> 21)."""
    import shutil

    from pipeline.recipe import load_stored_recipe

    for name, (family, teacher_layers, student_layers) in FAMILY_RECIPES.items():
        r = load_recipe(ROOT / "recipes" / f"{name}.yaml", world_size=64)
        assert r.teacher.architecture == f"recipes/hf/{family}.json" and r.teacher.load is None and r.model is None
        assert r.hf_teacher()["model_type"] == family
        assert (r.teacher_layout()[0], r.student.layers) == (teacher_layers, student_layers)
        assert r.data.tokenizer == "bpe" and r.student.train.precision == "bf16"
    # teacher.load set: its tokenizer is the data's; a recipe stored by a run still loads once the checkpoint is gone
    ckpt = tmp_path / "olmoe"
    ckpt.mkdir()
    shutil.copy(ROOT / "recipes" / "hf" / "olmoe.json", ckpt / "config.json")
    (ckpt / "tokenizer.json").write_text("{}")
    r = load_recipe(ROOT / "recipes" / "olmoe-1b-7b-mos.yaml", [f"teacher.load={ckpt}"], world_size=64)
    assert r.data.tokenizer == str(ckpt) and r.hf_teacher()["model_type"] == "olmoe"
    assert load_recipe(ROOT / "recipes" / "olmoe-1b-7b-mos.yaml", [f"teacher.load={ckpt}", "data.tokenizer=gpt2"],
                       world_size=64).data.tokenizer == "gpt2"
    (tmp_path / "recipe.yaml").write_text(dump_recipe(r))
    shutil.rmtree(ckpt)
    assert load_stored_recipe(tmp_path / "recipe.yaml").data.tokenizer == str(ckpt)
    with pytest.raises(RecipeError, match="data.tokenizer = .*a directory with a Hugging Face tokenizer.json"):
        load_recipe(ROOT / "recipes" / "tiny.yaml", [f"data.tokenizer={ckpt}"])


def test_a_loaded_teacher_is_scored_by_teacher_eval_and_needs_no_train_section(tmp_path, monkeypatch):
    """A Hugging Face family recipe has teacher.eval, not a train section; a PR-MoE recipe needs teacher.train (the
    error names it) and keeps it, unused, once teacher.load names a teacher; validators read no file (the teacher's
    config.json is read once, before); a recipe stored with a loaded teacher's train section (as runs were) reads
    back with its eval settings taken from it."""
    import shutil

    from pipeline import recipe as recipe_mod

    r = load_recipe(ROOT / "recipes" / "qwen3-30b-a3b-mos.yaml", world_size=8)
    assert r.teacher.train is None and not r.teacher.trained() and [n for n, _ in r.trainings()] == ["student.train"]
    assert (r.teacher.eval.micro_batch_size, r.teacher.eval.eval_batches, r.teacher.eval.precision) == (1, 10, "bf16")
    with pytest.raises(RecipeError, match=r"^teacher.train = None: required: how to train the teacher"):
        load_recipe(ROOT / "recipes" / "tiny.yaml", ["teacher.train=null"])
    loaded = load_recipe(ROOT / "recipes" / "tiny.yaml", [f"teacher.load={tmp_path}"])
    assert loaded.teacher.train is not None and not loaded.teacher.trained()
    assert (loaded.teacher.eval.micro_batch_size, loaded.teacher.eval.eval_batches) == (8, None)  # as tiny's train
    # the teacher's file is read once, before validation: a validator that opened a file would fail here
    ckpt = tmp_path / "qwen"
    ckpt.mkdir()
    shutil.copy(ROOT / "recipes" / "hf" / "qwen3_moe.json", ckpt / "config.json")
    real_open, opened = Path.read_text, []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: opened.append(self) or real_open(self, *a, **k))
    r = load_recipe(ROOT / "recipes" / "qwen3-30b-a3b-mos.yaml", [f"teacher.load={ckpt}"], world_size=8)
    assert r.hf_teacher()["model_type"] == "qwen3_moe" and opened.count(ckpt / "config.json") == 1
    monkeypatch.undo()
    # stored with the dummy train section of before: eval from it, and the same run as the recipe of today
    raw = yaml.safe_load(dump_recipe(r))
    del raw["teacher"]["eval"]
    raw["teacher"]["train"] = {"steps": 1, "micro_batch_size": 1, "global_batch_size": 128, "lr": 1e-5,
                               "precision": "bf16", "eval_batches": 10}
    stored = recipe_mod.validate_stored(raw)
    assert stored.teacher.eval == r.teacher.eval and recipe_mod.diff_recipes(stored, r) == []


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
    ("model.moe_every=7", "model.moe_every", "must be <= model.layers (6) so some layer is MoE"),
    ("model.experts=[4, 0, 8]", "model.experts.1", "at least model.top_k (1) experts"),
    ("student.layers=1", "student.layers", "at least model.moe_every (2) so the student keeps an MoE layer"),
    ("student.experts=[4, 8, 8]", "student.experts", "one entry per student MoE layer: 2 entries"),
    ("teacher.train.min_lr=0.5", "teacher.train.min_lr", "<= teacher.train.lr (0.002)"),
    ("student.train.warmup_steps=301", "student.train.warmup_steps", "<= student.train.steps (300)"),
    ("student.train.betas=[0.9, 1.0]", "student.train.betas", "two numbers in [0, 1)"),
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


def _tiny_raw() -> dict:
    return yaml.safe_load(TINY.read_text())


def test_kd_stop_at_is_a_step_or_a_percentage():
    steps = ["student.train.steps=300"]
    assert load_recipe(TINY, ["kd.stop_at=60%", *steps]).kd_stop_step() == 180
    assert load_recipe(TINY, ["kd.stop_at=12.5%", *steps]).kd_stop_step() == 38  # 37.5 rounded to even
    assert load_recipe(TINY, ["kd.stop_at=100%", *steps]).kd_stop_step() == 300
    assert load_recipe(TINY, ["kd.stop_at=1", *steps]).kd_stop_step() == 1  # a step, not the whole run
    assert load_recipe(TINY, ["kd.stop_at=0", *steps]).kd_stop_step() == 0  # no KD at all
    assert load_recipe(TINY, ["kd.stop_at=120"]).kd_stop_step() == 120
    assert load_recipe(TINY, ["kd.stop_at=null"]).kd_stop_step() is None
    raw = _tiny_raw()
    del raw["kd"]["stop_at"]
    raw["student"]["train"]["steps"] = 300
    assert validate(raw).kd.stop_at == "60%" and validate(raw).kd_stop_step() == 180  # the default


SHARE_RANGE = 'a share of student.train.steps in (0%, 100%], e.g. "60%"'
BOTH_FORMS = 'a step (an integer, e.g. 180) or a share of student.train.steps as a percentage string (e.g. "60%")'


@pytest.mark.parametrize("value, message", [
    ("0.6", f'kd.stop_at = 0.6: {BOTH_FORMS}; write "60%" if it meant a share'),
    ("1.0", f'kd.stop_at = 1.0: {BOTH_FORMS}; write "100%" if it meant a share or 1 if it meant a step'),
    ("180.0", f"kd.stop_at = 180.0: {BOTH_FORMS}; write 180 if it meant a step"),
    ("1.5", f"kd.stop_at = 1.5: {BOTH_FORMS}"),
    ("sixty", f"kd.stop_at = 'sixty': {BOTH_FORMS}"),
    ("60 %", f"kd.stop_at = '60 %': {BOTH_FORMS}"),
    ("'180'", f"kd.stop_at = '180': {BOTH_FORMS}"),
    ("true", f"kd.stop_at = True: {BOTH_FORMS}"),
    ("0%", f"kd.stop_at = '0%': {SHARE_RANGE}"),
    ("150%", f"kd.stop_at = '150%': {SHARE_RANGE}"),
    ("301", "kd.stop_at = 301: a step between 0 and student.train.steps (300)"),
    ("-1", "kd.stop_at = -1: a step between 0 and student.train.steps (300)"),
])
def test_kd_stop_at_refuses_other_forms(value, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, [f"kd.stop_at={value}", "student.train.steps=300"])
    assert err.value.path == "kd.stop_at" and str(err.value) == message


def test_kd_decay_steps_needs_a_stop_before_which_it_fits():
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, ["kd.stop_at=null", "kd.decay_steps=20"])
    assert err.value.path == "kd.decay_steps"
    assert str(err.value) == ('kd.decay_steps = 20: a ramp down to kd.stop_at, which is null (KD all the way): '
                              'set kd.stop_at (a step, or a share such as "60%") or kd.decay_steps to 0')
    with pytest.raises(RecipeError, match=r"^kd.decay_steps = 20: <= the kd.stop_at step \(10\)$"):
        load_recipe(TINY, ["kd.stop_at=10", "kd.decay_steps=20"])
    with pytest.raises(RecipeError, match=r"^kd.decay_steps = 200: <= the kd.stop_at step \(180\)$"):
        load_recipe(TINY, ["kd.stop_at=60%", "kd.decay_steps=200", "student.train.steps=300"])
    assert load_recipe(TINY, ["kd.stop_at=10", "kd.decay_steps=10"]).kd.decay_steps == 10


def test_section_rules_hold_for_a_section_built_alone():
    with pytest.raises(pydantic.ValidationError, match=r"kd.stop_at = 0.6: a step"):
        KDSpec(stop_at=0.6)
    with pytest.raises(pydantic.ValidationError, match=r"kd.decay_steps = 4: a ramp down"):
        KDSpec(stop_at=None, decay_steps=4)
    assert KDSpec(stop_at=6, decay_steps=4).stop_at == 6


def test_world_size_checks_read_the_validation_context():
    raw = _tiny_raw()
    assert Recipe.model_validate(raw, context={"world_size": 2}).distributed.nproc == 1
    with pytest.raises(pydantic.ValidationError, match=r"experts split evenly over 3 ranks"):
        Recipe.model_validate(raw, context={"world_size": 3})
    with pytest.raises(RecipeError) as err:  # no world size given: distributed.nproc is the world
        validate({**raw, "distributed": {"nproc": 3}})
    assert err.value.path == "model.experts.0"
    with pytest.raises(RecipeError) as err:
        validate(raw, world_size=4)  # 16 sequences a step do not split into 8 per rank x 4 ranks
    assert str(err.value) == ("teacher.train.global_batch_size = 16: a multiple of micro_batch_size x world size "
                              "(8 x 4 = 32)")
    with pytest.raises(RecipeError, match=r"^distributed.ep_size = 2: must divide the world size \(3\)$"):
        load_recipe(TINY, ["distributed.ep_size=2", "teacher.train.global_batch_size=24",
                           "student.train.global_batch_size=24"], world_size=3)


def test_a_dumped_recipe_validates_back_to_itself():
    """A run directory stores dump_recipe's YAML and re-validates it on resume (pipeline.runs)."""
    for path in RECIPES:
        recipe = load_recipe(path)
        assert validate(yaml.safe_load(dump_recipe(recipe))) == recipe


def test_cli_kd_stop_at_forms(capsys, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # main() may set it; restored after the test
    assert main(["plan", str(TINY), "--set", "kd.stop_at=0.6"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f'recipe error: kd.stop_at = 0.6: {BOTH_FORMS}; write "60%" if it meant a share']
    assert main(["plan", str(TINY), "--set", "kd.stop_at=60%", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["student"]["params_total"] > 0


def test_a_stored_recipe_from_before_percentages_reads_its_float_as_the_share_it_meant(tmp_path):
    """Run directories and packages written when kd.stop_at took a fraction hold `stop_at: 0.6`: they still load
    (as "60%"), while a recipe a user writes with a bare float is refused."""
    import yaml

    from pipeline.recipe import RecipeError, load_recipe, load_stored_recipe, validate, validate_stored

    raw = yaml.safe_load(TINY.read_text())
    raw["kd"] = {**raw.get("kd", {}), "stop_at": 0.6}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    stored = load_stored_recipe(tmp_path / "recipe.yaml")
    assert stored.kd.stop_at == "60%" and stored.kd_stop_step() == round(0.6 * stored.student.train.steps)
    assert validate_stored(raw) == stored
    with pytest.raises(RecipeError, match="kd.stop_at"):
        validate(raw)
    with pytest.raises(RecipeError, match="kd.stop_at"):
        load_recipe(tmp_path / "recipe.yaml")


def test_monitor_section_maps_to_deepspeeds_monitor_config(tmp_path):
    import importlib.util

    from pipeline.monitor import deepspeed_sections

    recipe = load_recipe(TINY, ["monitor.csv=true"])
    sections = deepspeed_sections(recipe.monitor, tmp_path, "tiny-teacher")
    assert sections == {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "monitor"),
                                        "job_name": "tiny-teacher"}}
    assert deepspeed_sections(load_recipe(TINY).monitor, tmp_path, "x") == {}  # all off: nothing added
    ds = deepspeed_config(recipe.teacher.train, 1, sections)
    assert ds["csv_monitor"]["enabled"] and ds["train_batch_size"] == recipe.teacher.train.global_batch_size
    for name in ("tensorboard", "wandb"):
        if importlib.util.find_spec(name) is None:  # not installed here: the recipe says so, naming the key
            with pytest.raises(RecipeError, match=rf"monitor.{name} = True: the {name} package installed"):
                load_recipe(TINY, [f"monitor.{name}=true"])
    # watching a run differently is not another recipe
    assert diff_recipes(load_recipe(TINY), recipe) == []
    assert diff_recipes(load_recipe(TINY), load_recipe(TINY, ["data.workers=3"])) == []
