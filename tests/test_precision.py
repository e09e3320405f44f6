"""Training in fp16 and bf16: the gradient norm DeepSpeed clips by includes the expert gradients, for every precision
and ZeRO stage the project generates (2 ranks, expert parallel 2, real DeepSpeed on gloo; tests/workers/clip_norm.py);
bf16 accumulates its gradients in fp32; a stage publishes the fp32 master weights, not their bf16 roundings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ROOT, SMALL, cli, launch_ranks, sets


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
    launch_ranks("tests/workers/clip_norm.py", str(out), timeout=600)
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
        # ZeRO's (and its BF16) optimizer, and without ZeRO make_engine's clip in place of DeepSpeed's (which averages
        # each rank's norm, its experts in): the norm of every gradient, each expert once
        assert c["norm"] == pytest.approx(c["with_experts"], rel=1e-5), c
        assert abs(c["with_experts"] - c["mean_of_rank_norms"]) > 1e-3 * c["with_experts"]  # the two differ here
    # bf16 at ZeRO 1 with data_types.grad_accum_dtype fp32: DeepSpeed's BF16_Optimizer, whose gradients accumulate
    # and reduce in fp32 buffers (without it, ZeRO 1 sums them in bf16)
    assert cases[("bf16", 1, "project")]["wrapper"] == "BF16_Optimizer"
    if res["fp16_supported"]:  # without ZeRO (refused by the recipe), torch's AdamW as the project passed it before:
        unfused = cases[("fp16", 0, "torch-adamw")]  # DeepSpeed's FP16_UnfusedOptimizer leaves the experts out
        assert unfused["wrapper"] == "FP16_UnfusedOptimizer"
        assert unfused["norm"] == pytest.approx(unfused["without_experts"], rel=1e-3)

@pytest.mark.slow
def test_a_bf16_teacher_publishes_its_fp32_master_weights(tmp_path):
    """2 ranks, expert parallel 2, bf16 at ZeRO 1 (DeepSpeed's BF16 optimizer): the stage's safetensors are fp32 and
    not bf16-rounded (bf16 is the upper half of an fp32: rounded weights have a zero lower half), gates included,
    and a 1-process model loaded from them scores the held-out loss the run reported (in bf16)."""
    import torch
    from safetensors.torch import load_file

    from pipeline.artifacts import read_model_config
    from pipeline.data import PackedTokens, prepare_data
    from pipeline.dist import Ranks
    from pipeline.model import GPT
    from pipeline.recipe import load_recipe
    from pipeline.train import evaluate
    from pipeline.weights import load_weights

    run = tmp_path / "run"
    cli("teacher", "recipes/tiny.yaml", "--nproc", "2", "--run-dir", str(run),
        *sets(*SMALL, "teacher.train.steps=4", "teacher.train.eval_every=4", "teacher.train.checkpoint_every=4",
              "teacher.train.precision=bf16", "teacher.train.zero_stage=1"))
    stage = run / "teacher"
    tensors = {}
    for f in stage.glob("model-*.safetensors"):
        tensors.update(load_file(f))
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())
    low_bits = {k: bool((t.view(torch.int32) & 0xFFFF).any()) for k, t in tensors.items() if t.numel() >= 16}
    assert all(low_bits.values()), [k for k, v in low_bits.items() if not v]
    assert any(".gate.wg." in k for k in low_bits) and any(".deepspeed_experts." in k for k in low_bits)
    recipe = load_recipe(run / "recipe.yaml")
    model = GPT(read_model_config(stage), moe_impl="reference")
    load_weights(model, stage)
    data = prepare_data(recipe.data, Path(os.environ["MOE_PIPELINE_CACHE"]))
    val = PackedTokens(data.val, recipe.data.seq_len, data.eod_id)
    done = json.loads((stage / "DONE.json").read_text())
    loss = evaluate(model, val, batches=2, micro=4, ranks=Ranks(0, 1, 0, 1))
    assert loss == pytest.approx(done["val_loss"], rel=2e-2)
