"""Worker for tests/test_multirank.py: the same weights at expert-parallel degree 2 (run by the DeepSpeed launcher).

Builds the model with DeepSpeed's MoE over 2 ranks (each holds half of every layer's experts),
initialises it from the layout-independent seed, runs a fixed batch and writes rank 0's logits.
"""

import sys

import torch

from pipeline import dist
from pipeline.model import GPT, init_weights
from pipeline.weights import ep_rank_of

ranks = dist.init()
sys.path.insert(0, "tests")
from conftest import model_config  # noqa: E402  (the tests' tiny config, shared with the 1-rank side)

cfg = model_config(mlp_type=sys.argv[2], top_k=int(sys.argv[3]))
model = GPT(cfg, moe_impl="deepspeed", world_size=ranks.world)
for moe in model.moe_layers():
    moe.moe.set_deepspeed_parallelism()
    assert moe.num_local_experts == moe.num_experts // 2
init_weights(model, 11, ep_rank_of)
ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(5))
mine = ids[ranks.rank * 2:(ranks.rank + 1) * 2]  # data parallel: each rank its own sequences
with torch.no_grad():
    logits = model.eval()(mine).logits
gathered = [torch.zeros_like(logits) for _ in range(ranks.world)]
torch.distributed.all_gather(gathered, logits)
if ranks.rank == 0:
    torch.save(torch.cat(gathered), sys.argv[1])
