"""Worker for tests/test_export.py: load a package at the launcher's world size (expert parallel) and save logits.

    python tests/workers/package_logits.py PKG OUT.pt                       # 1 rank
    deepspeed --num_gpus 2 tests/workers/package_logits.py PKG OUT.pt       # expert-parallel degree 2

Every rank runs the same batch (expert parallelism needs all ranks in every forward); rank 0 saves
the logits and how many expert tensors its model holds.
"""

import sys

import torch

from export.inference import load_package
from pipeline import dist

ranks = dist.init()
model, tok = load_package(sys.argv[1], ranks)
prompts = ["And God said, Let there be light: and there was light.", "To be, or not to be, that is the question:"]
ids = torch.tensor([tok.encode(p)[:10] for p in prompts])
with torch.no_grad():
    logits = model(ids).logits
local_experts = sum(1 for n, _ in model.named_parameters() if ".deepspeed_experts." in n)
if ranks.rank == 0:
    torch.save({"logits": logits, "local_expert_tensors": local_experts, "world": ranks.world}, sys.argv[2])
dist.barrier()
