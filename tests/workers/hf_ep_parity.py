"""Worker for tests/test_hf_import.py: imported Hugging Face teachers at expert-parallel degree 2 (DeepSpeed launcher).

For each checkpoint directory given (one per family): the model built with DeepSpeed's MoE over 2 ranks (each
holding half of every layer's experts and reading only those from the files), a fixed batch split between the
ranks (data parallel), rank 0 writing every family's gathered logits.
"""

import sys

import torch

from pipeline import dist
from pipeline.hf_import import load_hf_weights, model_config, read_hf_config
from pipeline.model import GPT
from pipeline.weights import ep_rank_of

ranks = dist.init()
out, dirs = sys.argv[1], sys.argv[2:]
result = {}
for d in dirs:
    cfg = model_config(read_hf_config(d))
    model = GPT(cfg, moe_impl="deepspeed", world_size=ranks.world)
    for moe in model.moe_layers():
        moe.moe.set_deepspeed_parallelism()
        assert moe.num_local_experts == moe.num_experts // 2
    load_hf_weights(model, d, ep_rank_of)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    mine = ids[ranks.rank * 2:(ranks.rank + 1) * 2]
    with torch.no_grad():
        logits = model.eval()(mine).logits
    gathered = [torch.zeros_like(logits) for _ in range(ranks.world)]
    torch.distributed.all_gather(gathered, logits)
    result[cfg.family] = torch.cat(gathered)
if ranks.rank == 0:
    torch.save(result, out)
