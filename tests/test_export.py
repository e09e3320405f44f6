"""`moe-pipeline export` / `verify`: the package format, integrity checks, dtypes, and loading at EP 1 and 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT, child_env, cli

pytestmark = pytest.mark.slow


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from pipeline.weights import weight_files

    out = {}
    for key, f in weight_files(path).items():
        with safe_open(path / f, framework="pt") as sf:
            out[key] = sf.get_tensor(key)
    return out


@pytest.fixture(scope="module")
def package(small_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pkg") / "student"
    cli("export", str(small_run), "--out", str(out))
    return out


@pytest.fixture(scope="module")
def sharded(small_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pkg") / "sharded"
    cli("export", str(small_run), "--stage", "teacher", "--out", str(out), "--max-shard-size", "200KB")
    return out


def test_package_has_every_file_and_a_manifest_that_describes_them(package, small_run):
    names = {p.name for p in package.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "manifest.json", "README.md", "configuration_moe_pipeline.py", "modeling_moe_pipeline.py",
            "moe_model.py"} <= names
    manifest = json.loads((package / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert manifest["source"]["stage"] == "student" and manifest["teacher"]["layers"] == 4
    assert manifest["params"]["total"] > manifest["params"]["active_per_token"] > 0
    assert manifest["kd"]["stop_step"] == 6 and manifest["recipe"]["student"]["layers"] == 3
    config = json.loads((package / "config.json").read_text())
    assert config["model_type"] == "moe_pipeline" and config["experts"] == [4] and "AutoModelForCausalLM" in config["auto_map"]
    with safe_open(package / "model.safetensors", framework="pt") as sf:
        assert sf.metadata()["source_stage"] == "student" and sf.metadata()["source_run"] == str(small_run.resolve())
    card = (package / "README.md").read_text()
    assert "active per token" in card and "KD schedule" in card


def test_round_trip_reproduces_every_tensor_bit_for_bit(package, small_run):
    src, dst = tensors(small_run / "student"), tensors(package)
    assert set(dst) == set(src) - {"lm_head.weight"}  # the tied head is the embedding
    for key, t in dst.items():
        assert t.dtype == src[key].dtype and torch.equal(t, src[key]), key


def test_verify_passes_on_a_fresh_package_and_sharded_packages_have_an_index(package, sharded):
    assert "ok" in cli("verify", str(package)).stdout
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("model-*.safetensors"))) > 1
    assert "ok" in cli("verify", str(sharded)).stdout


def corrupted(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    if how == "flip":
        f = dst / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif how == "truncate":
        f = sorted(dst.glob("model-*.safetensors"))[-1]
        f.write_bytes(f.read_bytes()[:-1000])
    elif how == "missing":
        (dst / "tokenizer.json").unlink()
    return dst


@pytest.mark.parametrize("how, names", [("flip", "model.safetensors: sha256 differs"),
                                        ("truncate", "truncated or changed"), ("missing", "tokenizer.json: missing")])
def test_damage_is_reported_by_verify_and_refused_at_load(package, sharded, tmp_path, how, names):
    from export.inference import load_package
    from export.package import PackageError

    bad = corrupted(sharded if how == "truncate" else package, tmp_path / how, how)
    proc = cli("verify", str(bad), check=False)
    assert proc.returncode == 1 and names in proc.stderr, proc.stderr
    with pytest.raises(PackageError, match=names.split(":")[0].replace(".", r"\.")):
        load_package(bad)


def test_bf16_keeps_the_gates_fp32_and_halves_the_weights(small_run, package, tmp_path):
    out = tmp_path / "bf16"
    cli("export", str(small_run), "--dtype", "bf16", "--out", str(out))
    t = tensors(out)
    gates = [k for k in t if k.endswith(".gate.wg.weight")]
    assert gates and all(t[k].dtype == torch.float32 for k in gates)
    assert all(v.dtype == torch.bfloat16 for k, v in t.items() if k not in gates)
    ratio = (out / "model.safetensors").stat().st_size / (package / "model.safetensors").stat().st_size
    assert 0.45 < ratio < 0.6
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16"


def test_existing_package_is_replaced_only_with_force(small_run, package):
    before = json.loads((package / "manifest.json").read_text())["created"]
    proc = cli("export", str(small_run), "--out", str(package), check=False)
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert json.loads((package / "manifest.json").read_text())["created"] == before
    cli("export", str(small_run), "--out", str(package), "--force")
    assert not list(package.parent.glob(".*partial*")) and not list(package.parent.glob(".*old*"))
    assert "ok" in cli("verify", str(package)).stdout


def test_expert_parallel_degree_1_and_2_give_identical_logits(package, tmp_path):
    from pipeline.dist import free_port

    env = child_env()
    one, two = tmp_path / "ep1.pt", tmp_path / "ep2.pt"
    subprocess.run([sys.executable, "tests/workers/package_logits.py", str(package), str(one)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=300)
    proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                           str(free_port()), "--no_local_rank", "tests/workers/package_logits.py", str(package), str(two)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert b["world"] == 2 and b["local_expert_tensors"] * 2 == a["local_expert_tensors"]  # half the experts each
    torch.testing.assert_close(a["logits"], b["logits"], rtol=1e-5, atol=1e-5)


def test_hf_auto_classes_load_the_package_and_generate_our_greedy_tokens(package, tmp_path):
    """In a fresh interpreter outside the repository: no launcher, no distributed set-up, only the package's code."""
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained({str(package)!r}, trust_remote_code=True)
t = AutoTokenizer.from_pretrained({str(package)!r})
ids = torch.tensor([t.encode("And God said")])
out = m.generate(ids, max_new_tokens=10, do_sample=False)
print(json.dumps({{"ids": ids[0].tolist(), "tokens": out[0, ids.shape[1]:].tolist()}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHONPATH=""), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]  # AutoTokenizer without trust_remote_code asks first (stdin closed: no)
    got = json.loads(last[last.index("{"):])
    from export.inference import load_package

    model, tok = load_package(package)
    assert got["ids"] == tok.encode("And God said")
    seq = list(got["ids"])
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    ours = seq[len(got["ids"]):]
    if tok.eos_token_id in ours:  # HF's generate stops after the end-of-document token
        ours = ours[:ours.index(tok.eos_token_id) + 1]
    assert got["tokens"] == ours


def test_eval_accepts_a_package_and_scores_it_like_its_stage(package, small_run, tmp_path):
    for name, model in (("pkg", package), ("stage", small_run / "student")):
        cli("eval", str(model), "--tasks", "tiny_heldout_ppl", "--limit", "3", "--out", str(tmp_path / name))
    pkg = json.loads((tmp_path / "pkg" / "results.json").read_text())
    stage = json.loads((tmp_path / "stage" / "results.json").read_text())
    (pkg_name,) = [k for k in pkg if not k.startswith("_")]
    assert pkg_name == "small-student" and pkg[pkg_name]["model"]["package"]["dtype"] == "float32"
    a = pkg[pkg_name]["results"]["tiny_heldout_ppl"]["bits_per_byte,none"]
    b = stage["small/student"]["results"]["tiny_heldout_ppl"]["bits_per_byte,none"]
    assert a == pytest.approx(b, rel=1e-6)


def test_parallel_layouts_are_checked_before_loading():
    from conftest import model_config
    from export.inference import plan_layout

    cfg = model_config(hidden=32, heads=4, experts=(2, 4))
    assert plan_layout(cfg, 4, ep_size=2).slices(0) == 2  # 4 ranks, experts in pairs: each expert sliced in 2
    assert plan_layout(cfg, 2, tp_size=2).ep == (2, 2)
    with pytest.raises(ValueError, match="--tp-size 2 with 4 rank"):
        plan_layout(cfg, 4, tp_size=2)
    with pytest.raises(ValueError, match="--ep-size 3"):
        plan_layout(cfg, 3, ep_size=3)
    with pytest.raises(ValueError, match="model heads"):
        plan_layout(model_config(hidden=48, heads=3), 2, tp_size=2)
