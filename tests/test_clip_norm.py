"""The gradient norm DeepSpeed clips by includes the expert gradients, for every precision and ZeRO stage the project
generates (2 ranks, expert parallel 2, real DeepSpeed on gloo; tests/workers/clip_norm.py), and bf16 accumulates its
gradients in fp32."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env
from pipeline.dist import free_port


def test_bf16_accumulates_in_fp32_and_needs_zero():
    from pipeline.recipe import RecipeError, load_recipe
    from pipeline.train import deepspeed_config

    for stage in (1, 2):
        r = load_recipe(ROOT / "recipes" / "tiny.yaml", ["teacher.train.precision=bf16", f"teacher.train.zero_stage={stage}"])
        ds = deepspeed_config(r.teacher.train, 1)
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["gradient_accumulation_steps"] == 2
    assert "data_types" not in deepspeed_config(load_recipe(ROOT / "recipes" / "tiny.yaml").teacher.train, 1)
    with pytest.raises(RecipeError, match=r"teacher.train.zero_stage = 0: 1 or 2 with teacher.train.precision bf16"):
        load_recipe(ROOT / "recipes" / "tiny.yaml", ["teacher.train.precision=bf16"])


@pytest.mark.slow
def test_the_clip_norm_includes_the_experts_in_every_precision_and_zero_stage(tmp_path):
    out = tmp_path / "norms.json"
    proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                           str(free_port()), "--no_local_rank", "tests/workers/clip_norm.py", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cases = {(c["precision"], c["zero_stage"], c["optimizer"]): c for c in res["cases"]}
    expected = {("fp32", 0), ("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)}
    if res["fp16_supported"]:  # DeepSpeed's CPU accelerator has fp16 where oneDNN has (AVX512-FP16, AMX-FP16)
        expected |= {("fp16", 1), ("fp16", 2)}
    assert {(p, s) for p, s, o in cases if o == "project"} == expected
    for (p, s, o), c in cases.items():
        assert c["with_experts"] > 2 * c["without_experts"]  # the references differ: the experts matter
        assert c["norm_per_rank"][0] == pytest.approx(c["norm_per_rank"][1], rel=1e-6), c  # one clip for all ranks
        if o != "project":
            continue
        if (p, s) == ("fp32", 0):  # DeepSpeed's clip_grad_norm_: each rank's norm (its experts in), averaged
            assert c["norm"] == pytest.approx(c["mean_of_rank_norms"], rel=1e-5), c
        else:  # ZeRO's (and its BF16) optimizer: the norm of every gradient, each expert once
            assert c["norm"] == pytest.approx(c["with_experts"], rel=1e-5), c
    if res["fp16_supported"]:  # without ZeRO (refused by the recipe): what DeepSpeed 0.19 does
        unfused, fused = cases[("fp16", 0, "torch-adamw")], cases[("fp16", 0, "fused-adam")]
        assert unfused["wrapper"] == "FP16_UnfusedOptimizer" and fused["wrapper"] == "FP16_Optimizer"
        # torch's AdamW, as the project passed before: FP16_UnfusedOptimizer leaves the experts out
        assert unfused["norm"] == pytest.approx(unfused["without_experts"], rel=1e-3)
        # FusedAdam: experts in, but the engine scaled no loss, so the norm (and the update) is 1/scale of the truth
        assert fused["norm"] * fused["loss_scale"] == pytest.approx(fused["with_experts"], rel=1e-3)
