"""Hugging Face teachers through the stages: `moe-pipeline distill` on a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
checkpoint, then `export --format hf` back into the family, loaded by plain transformers.

The checkpoints are made here, offline (tests/hf_checkpoints.py): small random models of transformers' own classes,
`save_pretrained`, with a byte-level BPE tokenizer trained on a few bundled documents saved beside them (the
checkpoint's tokenizer, which `data.tokenizer` defaults to). The corpus is those documents as .txt files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from conftest import cli, killed_at_checkpoint, sets
from hf_checkpoints import RECIPES, SMALL, VOCAB

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: checkpoint dir}, and the corpus glob, for the session."""
    from hf_checkpoints import make_checkpoints

    return make_checkpoints(tmp_path_factory.mktemp("hf_teachers"))


def family_sets(checkpoints, family, *more):
    return sets(f"teacher.load={checkpoints[family]}", f"data.train={checkpoints['corpus']}", *SMALL, *more)


def student_logits(stage, ids):
    from pipeline.build import load_stage_model

    with torch.no_grad():
        return load_stage_model(stage)(ids).logits


def main(*args: str) -> tuple[int, str]:
    """`moe-pipeline ARGS` in this process (the CLI's own entry point): (exit status, what it printed to stderr)."""
    import contextlib
    import io

    from cli.main import main as cli_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli_main(list(args))
    return rc, err.getvalue()


def check_native_export(run, family):
    """`export RUN --format hf`: the family's class with the student's 2 layers and its logits (fp32 here; bf16 by
    default, as these families ship)."""
    assert main("export", str(run), "--format", "hf", "--out", str(run / "hf-bf16"))[0] == 0
    assert json.loads((run / "hf-bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert main("export", str(run), "--format", "hf", "--dtype", "fp32")[0] == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    assert type(loaded).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                     "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[family]
    assert loaded.config.num_hidden_layers == 2
    experts = getattr(loaded.config, "num_local_experts", None) or loaded.config.num_experts
    assert experts == (2 if family == "mixtral" else 4)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (loaded(ids).logits - student_logits(run / "student", ids)).abs().max().item()
    assert diff < 1e-4, f"{family}: max |logit diff| of the native export {diff}"
    tok = transformers.AutoTokenizer.from_pretrained(run / "hf")
    assert tok.eos_token == "<|endoftext|>" and len(tok) == VOCAB
    manifest = json.loads((run / "hf" / "manifest.json").read_text())
    assert manifest["format"] == f"hf-{family}" and "model.safetensors" in manifest["files"]


@pytest.mark.slow
@pytest.mark.parametrize("family, nproc", [("mixtral", 1), ("qwen3_moe", 1), ("olmoe", 2)])
def test_distill_on_a_hugging_face_teacher_then_export_it_in_its_family(family, nproc, checkpoints, tmp_path):
    """OLMoE at 2 ranks: teacher and student expert parallel (EP 2), its unnormalised top-k inside DeepSpeed's MoE.
    Mixtral's student is chosen by block importance and pruned to 2 of 4 experts by saliency: one expert count in
    every layer still, so its family expresses it."""
    run = tmp_path / family
    more = ["distributed.nproc=2", "distributed.ep_size=2"] if nproc == 2 else []
    if family == "mixtral":
        more = ["student.layer_selection=importance", "student.experts=[2,2]", "student.expert_selection=saliency"]
    cli("distill", RECIPES[family], "--run-dir", str(run), *family_sets(checkpoints, family, *more))
    teacher = run / "teacher"
    # nothing copied: the teacher stage records the checkpoint, its files' sha256 and the name map
    assert not list(teacher.glob("*.safetensors"))
    source = json.loads((teacher / "source.json").read_text())
    assert source["path"] == str(checkpoints[family]) and source["model_type"] == family
    for name, facts in source["files"].items():
        assert facts["sha256"] == hashlib.sha256((checkpoints[family] / name).read_bytes()).hexdigest()
    assert "model.embed_tokens.weight" in source["name_map"]["wte.weight"]
    recipe = (run / "recipe.yaml").read_text()
    assert f"tokenizer: {checkpoints[family]}" in recipe  # data.tokenizer defaulted to the teacher's
    done = json.loads((run / "student" / "DONE.json").read_text())
    assert len(done["kept_teacher_layers"]) == 2 and done["world_size"] == nproc
    if family == "mixtral":
        selection = json.loads((run / "student" / "selection.json").read_text())
        assert selection["experts"] == [2, 2] and all(len(ids) == 2 for ids in selection["kept_experts"].values())
        assert selection["scores"] is not None  # importance scored every teacher block
    check_native_export(run, family)
    if family == "qwen3_moe":  # the teacher itself exports from the checkpoint, until a recorded file changes
        assert main("export", str(run), "--stage", "teacher", "--out", str(tmp_path / "teacher-pkg"))[0] == 0
        shard = checkpoints[family] / "model.safetensors"
        st = shard.stat()
        # the same bytes with another modification time (a node's own copy of the checkpoint): hashed, then read
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        try:
            assert main("export", str(run), "--stage", "teacher", "--out", str(tmp_path / "copy"))[0] == 0
            with open(shard, "r+b") as f:  # one byte of the last tensor changed, the size kept
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
            try:
                rc, err = main("export", str(run), "--stage", "teacher", "--out", str(tmp_path / "again"))
            finally:
                with open(shard, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    f.write(last)
        finally:
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert rc == 2 and "modified since it was recorded (its sha256 differs)" in err and "teacher RECIPE --redo" in err


@pytest.mark.slow
def test_a_qwen2_moe_distill_resumes_after_sigkill_to_the_same_weights(checkpoints, tmp_path):
    """A shared expert, a dense layer and unnormalised top-k: killed mid-student, resumed, the same weights as an
    uninterrupted run; exported in its family."""
    from safetensors.torch import load_file

    more = family_sets(checkpoints, "qwen2_moe")
    straight = tmp_path / "straight"
    cli("distill", RECIPES["qwen2_moe"], "--run-dir", str(straight), *more)
    killed = tmp_path / "killed"
    killed_at_checkpoint("distill", RECIPES["qwen2_moe"], "--run-dir", str(killed), *more,
                         latest=killed / "student.partial" / "checkpoints" / "latest")
    assert not (killed / "student").exists()
    cli("distill", RECIPES["qwen2_moe"], "--run-dir", str(killed), *more)
    assert json.loads((killed / "student" / "DONE.json").read_text())["resumed_from_step"] > 0
    resumed, uninterrupted = load_file(killed / "student" / "model.safetensors"), load_file(straight / "student" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for k in uninterrupted:
        assert torch.equal(resumed[k], uninterrupted[k]), f"{k} differs after resume"
    check_native_export(straight, "qwen2_moe")


def _corrupt(checkpoints, tmp_path, name, change):
    """A copy of the mixtral checkpoint with `change(dir)` applied."""
    bad = tmp_path / name
    shutil.copytree(checkpoints["mixtral"], bad)
    change(bad)
    return bad


def _refused(checkpoints, src, tmp_path, *more):
    run = tmp_path / f"run-{getattr(src, 'name', 'hub')}"
    rc, err = main("teacher", RECIPES["mixtral"], "--run-dir", str(run),
                   *sets(f"teacher.load={src}", f"data.train={checkpoints['corpus']}", *SMALL, *more))
    assert rc == 2, err[-2000:]
    assert not run.exists(), "a refused teacher wrote its run directory"
    return err


def test_bad_hugging_face_teachers_exit_2_naming_the_fault_and_write_nothing(checkpoints, tmp_path):
    from hf_checkpoints import family_model

    def llama(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))

    err = _refused(checkpoints, _corrupt(checkpoints, tmp_path, "llama", llama), tmp_path)
    assert "model_type 'llama' is not supported; supported families: mixtral, qwen2_moe, qwen3_moe, olmoe" in err

    def sharded_minus_one(d):
        (d / "model.safetensors").unlink()
        family_model("mixtral", vocab_size=VOCAB).save_pretrained(d, max_shard_size="100KB")
        index = json.loads((d / "model.safetensors.index.json").read_text())
        (d / sorted(set(index["weight_map"].values()))[-1]).unlink()

    err = _refused(checkpoints, _corrupt(checkpoints, tmp_path, "shard", sharded_minus_one), tmp_path)
    assert "missing: the index names this shard" in err and "teacher.load" in err

    def wider(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))

    err = _refused(checkpoints, _corrupt(checkpoints, tmp_path, "shape", wider), tmp_path)
    assert "has shape (96, 64); config.json makes it (128, 64)" in err

    err = _refused(checkpoints, "mistralai/Mixtral-8x7B-v0.1", tmp_path)
    assert "nothing is downloaded here" in err and "huggingface-cli download" in err

    for tokenizer in ("bpe", "gpt2"):  # trained on the data, or another vocabulary: refused before any data is made
        err = _refused(checkpoints, checkpoints["mixtral"], tmp_path, f"data.tokenizer={tokenizer}")
        assert f"data.tokenizer = '{tokenizer}': the teacher's own tokenizer" in err

    def without_tokenizer(d):
        (d / "tokenizer.json").unlink()

    err = _refused(checkpoints, _corrupt(checkpoints, tmp_path, "notok", without_tokenizer), tmp_path)
    assert "data.tokenizer = 'bpe': the teacher's own tokenizer, not one trained on the data" in err

    def quantized(d):
        from safetensors.torch import load_file, save_file

        tensors = load_file(d / "model.safetensors")
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(torch.int8)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    err = _refused(checkpoints, _corrupt(checkpoints, tmp_path, "int8", quantized), tmp_path)
    assert "q_proj.weight is I8; these are read as F32, BF16 or F16" in err


def test_export_format_hf_of_a_pr_moe_run_exits_2_naming_our_package(small_run, tmp_path):
    rc, err = main("export", str(small_run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert rc == 2 and "our package" in err and "pr-moe" in err
    assert not (tmp_path / "hf").exists()
