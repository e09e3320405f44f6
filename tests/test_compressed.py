"""`moe-pipeline export RUN --format hf --quantize int8|int4|w8a8` (export/compressed.py): a quantised student in its
family's checkpoint as compressed-tensors, which transformers loads (weight-only) and vLLM's CPU server runs (W8A8:
benchmarks/peer_bench.py --quantize int8 serves it and compares its greedy tokens with ours; vLLM is not part of the
test environment)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

# experts 128 wide on a hidden size of 128: every weight divides into int4 groups of 64 and 128
WIDE = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 128, "decoder_sparse_step": 1}


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """{family: (checkpoint, imported teacher stage)}: Qwen3-MoE (an MoE in every layer) and Qwen2-MoE (layer 0 dense,
    a shared expert with its gate)."""
    from hf_checkpoints import imported_stage

    return {family: imported_stage(tmp_path_factory.mktemp(family), family, **WIDE, **more)
            for family, more in (("qwen3_moe", {}), ("qwen2_moe", {"shared_expert_intermediate_size": 128}))}


def tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def rounded_twin(stage, scheme: str, group: int):
    """The stage's model with every weight a `scheme` package quantises replaced by what its round-to-nearest stored
    form stands for (what the quantised checkpoint holds), fp32."""
    from pipeline.build import load_stage_model
    from pipeline.quantize import stored_dequantized, stored_form, weight_kinds

    model = load_stage_model(stage, torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, kind in weight_kinds(model, scheme, False, group).items():
            params[name].copy_(stored_dequantized(*stored_form(params[name], kind, group), group))
    return model


@pytest.mark.parametrize("family, scheme", [("qwen3_moe", "int4"), ("qwen3_moe", "int8"), ("qwen2_moe", "int4")])
def test_weight_only_checkpoints_load_in_transformers_as_our_quantised_weights(stages, tmp_path, family, scheme):
    """W4A16 / W8A16 (pack-quantized): config.json's quantization_config as llm-compressor writes it (every Linear but
    the routers, the shared-expert gate and the output layer), each quantised linear as int32-packed values, their
    shape and fp32 scales; `AutoModelForCausalLM.from_pretrained` with compressed-tensors gives the logits of our model
    on the same quantised weights (fp32 export: exactly; the default bf16 one loads too)."""
    ckpt, stage = stages[family]
    out = tmp_path / "hf"
    proc = cli("export", str(stage), "--format", "hf", "--quantize", scheme, "--quantize-method", "rtn",
               "--group-size", "64", "--dtype", "fp32", "--out", str(out))
    assert f"{'W4A16' if scheme == 'int4' else 'W8A16'} (compressed-tensors, rtn)" in proc.stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["symmetric"]) == \
        ((4, "group", True) if scheme == "int4" else (8, "channel", True))
    assert weights["group_size"] == (64 if scheme == "int4" else None)
    assert set(qc["ignore"]) == {"lm_head", "re:.*mlp.gate$"} | \
        ({"re:.*mlp.shared_expert_gate$"} if family == "qwen2_moe" else set())
    t = tensors(out)
    layer = 1  # an MoE layer in both families
    expert = f"model.layers.{layer}.mlp.experts.3.down_proj"
    assert t[f"{expert}.weight_packed"].dtype == torch.int32 and f"{expert}.weight" not in t
    assert t[f"{expert}.weight_packed"].shape == (128, 128 * (4 if scheme == "int4" else 8) // 32)
    assert t[f"{expert}.weight_shape"].tolist() == [128, 128]
    assert t[f"{expert}.weight_scale"].dtype == torch.float32
    assert t[f"{expert}.weight_scale"].shape == ((128, 2) if scheme == "int4" else (128, 1))
    for kept in (f"model.layers.{layer}.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert t[kept].dtype == torch.float32, kept  # not quantised: the family's own tensor
    if family == "qwen2_moe":
        assert f"model.layers.{layer}.mlp.shared_expert.up_proj.weight_packed" in t
        assert t[f"model.layers.{layer}.mlp.shared_expert_gate.weight"].shape == (1, 128)
        assert "model.layers.0.mlp.gate_proj.weight_packed" in t  # the dense layer's MLP is quantised too
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == scheme and manifest["quantization"]["method"] == "rtn"

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    from pipeline.build import load_stage_model

    with torch.no_grad():
        theirs, ours = loaded(ids).logits, rounded_twin(stage, scheme, 64)(ids).logits
        unquantised = load_stage_model(stage, torch.float32)(ids).logits
    assert (theirs - ours).abs().max().item() < 1e-4
    assert (theirs - unquantised).abs().max().item() > 1e-3  # the quantisation is there to see
    if scheme == "int4" and family == "qwen3_moe":  # the default dtype (bf16) loads as well
        cli("export", str(stage), "--format", "hf", "--quantize", scheme, "--quantize-method", "rtn",
            "--group-size", "64", "--out", str(tmp_path / "hf-bf16"))
        bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-bf16", dtype=torch.float32).eval()
        with torch.no_grad():
            assert (bf16(ids).logits - ours).abs().max().item() < 0.1


@pytest.mark.parametrize("family, scheme", [("mixtral", "int4"), ("olmoe", "int8")])
def test_mixtral_and_olmoe_load_in_transformers_too(family, scheme, tmp_path):
    """The other two families (Mixtral's experts as w1/w2/w3, its router ignored under block_sparse_moe): the logits of
    our model on the same quantised weights."""
    from hf_checkpoints import imported_stage

    _, stage = imported_stage(tmp_path / "ckpt", family, hidden_size=128, intermediate_size=128)
    cli("export", str(stage), "--format", "hf", "--quantize", scheme, "--quantize-method", "rtn", "--group-size", "64",
        "--dtype", "fp32", "--out", str(tmp_path / "hf"))
    qc = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert "re:.*block_sparse_moe.gate$" in qc["ignore"] if family == "mixtral" else "re:.*mlp.gate$" in qc["ignore"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (loaded(ids).logits - rounded_twin(stage, scheme, 64)(ids).logits).abs().max().item() < 1e-4


def test_w8a8_holds_the_int8_weights_of_our_package(stages, tmp_path):
    """W8A8 (int-quantized, what vLLM's x86 CPU backend runs for MoE): int8 weights per output channel and per-token
    dynamic int8 inputs in the config; its int8 values and scales are those of our `export --quantize int8` package of
    the same stage (a SwiGLU fc1 split into gate and up); compressed-tensors' own decompression gives q x scale."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    _, stage = stages["qwen3_moe"]
    cli("export", str(stage), "--format", "hf", "--quantize", "w8a8", "--quantize-method", "rtn",
        "--out", str(tmp_path / "hf"))
    cli("export", str(stage), "--quantize", "int8", "--quantize-method", "rtn", "--out", str(tmp_path / "pkg"))
    qc = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized"
    acts = qc["config_groups"]["group_0"]["input_activations"]
    assert (acts["num_bits"], acts["type"], acts["strategy"], acts["dynamic"], acts["symmetric"]) == \
        (8, "int", "token", True, True)
    hf, pkg = tensors(tmp_path / "hf"), {}
    from safetensors.torch import load_file

    for f in (tmp_path / "pkg").glob("*.safetensors"):
        pkg.update(load_file(str(f)))
    ours = "blocks.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.2"
    gate, up = pkg[f"{ours}.fc1.weight"].chunk(2)
    gate_s, up_s = pkg[f"{ours}.fc1.weight_scale"].chunk(2)
    theirs = "model.layers.1.mlp.experts.2"
    assert hf[f"{theirs}.gate_proj.weight"].dtype == torch.int8
    assert torch.equal(hf[f"{theirs}.gate_proj.weight"], gate) and torch.equal(hf[f"{theirs}.up_proj.weight"], up)
    assert torch.equal(hf[f"{theirs}.up_proj.weight_scale"], up_s[:, None])
    assert torch.equal(hf[f"{theirs}.down_proj.weight"], pkg[f"{ours}.fc2.weight"])
    assert torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], pkg["blocks.0.attn.q_proj.weight"])
    config = QuantizationConfig.model_validate(qc)
    scheme = config.config_groups["group_0"]
    module = {k: hf[f"{theirs}.gate_proj.{k}"] for k in ("weight", "weight_scale")}
    weight = BaseCompressor.get_value_from_registry(config.format).decompress(module, scheme)["weight"]
    assert torch.equal(weight.float(), gate.float() * gate_s[:, None])


def test_compressed_tensors_refusals_name_the_fix(stages, tmp_path):
    """int4 rows that do not divide into the groups, w8a8 for our package, --quantize-head alone: exit 2 before
    anything is written, naming the flag."""
    _, stage = stages["qwen3_moe"]
    proc = cli("export", str(stage), "--format", "hf", "--quantize", "int4", "--group-size", "192",
               "--quantize-method", "rtn", "--out", str(tmp_path / "hf"), check=False)
    assert proc.returncode == 2 and "do not divide into groups of 192 (--group-size)" in proc.stderr
    assert "--quantize int8|w8a8" in proc.stderr and not (tmp_path / "hf").exists()
    proc = cli("export", str(stage), "--quantize", "w8a8", "--out", str(tmp_path / "pkg"), check=False)
    assert proc.returncode == 2 and "--quantize w8a8 with --format package: one of int8, int4" in proc.stderr
    proc = cli("export", str(stage), "--format", "hf", "--quantize-head", "--out", str(tmp_path / "hf"), check=False)
    assert proc.returncode == 2 and "--quantize-head needs --quantize" in proc.stderr
