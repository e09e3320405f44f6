"""Real multi-rank runs through the DeepSpeed launcher: 2 ranks on gloo, expert parallel degree 2."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import SMALL, cli, launch_ranks, model_config, sets
from pipeline.model import GPT, init_weights
from pipeline.artifacts import read_model_config
from pipeline.weights import load_weights

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mlp_type, top_k", [("residual", 1), ("standard", 2)])
def test_same_weights_same_logits_at_ep1_and_ep2(tmp_path, mlp_type, top_k):
    out = tmp_path / "logits.pt"
    launch_ranks("tests/workers/ep_parity.py", str(out), mlp_type, str(top_k))
    ep2 = torch.load(out, weights_only=True)
    cfg = model_config(mlp_type=mlp_type, top_k=top_k)
    model = GPT(cfg, moe_impl="reference")
    init_weights(model, 11)
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ep1 = model.eval()(ids).logits
    torch.testing.assert_close(ep2, ep1, atol=1e-5, rtol=1e-5)


def test_teacher_on_two_ranks_is_expert_parallel_and_loads_on_one(tmp_path):
    run = tmp_path / "run"
    cli("teacher", "recipes/tiny.yaml", "--nproc", "2", "--run-dir", str(run),
        *sets(*SMALL, "teacher.train.steps=6", "teacher.train.eval_every=6", "teacher.train.checkpoint_every=3"))
    stage = run / "teacher"
    done = json.loads((stage / "DONE.json").read_text())
    assert done["world_size"] == 2
    # each rank wrote its own experts (ranks 0 and 1 hold experts 0-1 and 2-3 of the 4-expert layer)
    index = json.loads((stage / "model.safetensors.index.json").read_text())["weight_map"]
    expert_keys = [k for k in index if ".deepspeed_experts." in k and k.startswith("blocks.3.")]
    assert {index[k] for k in expert_keys} == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    ckpt = stage / "checkpoints" / "global_step3"
    assert (ckpt / "expp_rank_1_mp_rank_00_optim_states.pt").is_file()
    assert (ckpt / "layer_1_expert_3_mp_rank_00_model_states.pt").is_file()
    # the consolidated weights (global expert ids) give the same held-out loss in a 1-process reference model
    from pipeline.data import PackedTokens, prepare_data
    from pipeline.recipe import load_recipe
    from pipeline.dist import Ranks
    from pipeline.train import evaluate

    recipe = load_recipe(run / "recipe.yaml")
    model = GPT(read_model_config(stage), moe_impl="reference")
    load_weights(model, stage)
    data = prepare_data(recipe.data, __import__("pathlib").Path(os.environ["MOE_PIPELINE_CACHE"]))
    val = PackedTokens(data.val, recipe.data.seq_len, data.eod_id)
    # validation covers the same blocks at any world size: 1 rank gets the 2 ranks' number
    loss = evaluate(model, val, batches=2, micro=4, ranks=Ranks(0, 1, 0, 1))
    assert loss == pytest.approx(done["val_loss"], rel=1e-4)
