"""Worker for tests/test_dist.py: pipeline/dist.py's and the serving transport's (export/serve/transport.py) collective
helpers on the launcher's ranks.

    deepspeed --num_gpus 2 tests/workers/dist_helpers.py OUT.json

Each rank checks what it received and rank 0 writes every check's outcome: broadcast_json (a small
message and one past BROADCAST_BYTES, through the named pipes and through gloo), gather_json of different sizes (the
stages' and the serving transport's), gather_rows, the
low-latency all-reduce (fp32, bf16; float64 refused), all_to_all_ with uneven and empty splits, and the serving
runtime's own shared-memory sum (export/serve/transport.py `attach_local_reduce`) against DeepSpeed's, and
gather_json through its slots.
"""

import json
import sys
from pathlib import Path

import torch

from export.serve import transport
from pipeline import dist

ranks = dist.init()
r, w = ranks.rank, ranks.world
checks = {}
small = {"step": [1, 2, 3], "text": "é"}
checks["broadcast_small"] = transport.broadcast_json(small if r == 0 else None) == small
big = {"rows": list(range(6000))}  # ~30 KB of JSON: two broadcasts
checks["broadcast_big"] = transport.broadcast_json(big if r == 0 else None) == big
cpu = torch.device("cpu")  # through the process group (gloo), as between machines
checks["broadcast_small_gloo"] = transport.broadcast_json(small if r == 0 else None, on=cpu) == small
checks["broadcast_big_gloo"] = transport.broadcast_json(big if r == 0 else None, on=cpu) == big
mine = {"rank": r, "tokens": list(range(r * 500))}
checks["gather_json_stage"] = dist.gather_json(mine) == [{"rank": i, "tokens": list(range(i * 500))} for i in range(w)]
checks["gather_json"] = transport.gather_json(mine) == [{"rank": i, "tokens": list(range(i * 500))} for i in range(w)]
checks["gather_rows"] = transport.gather_rows([r, 7, 2 ** 20 + r]) == [[i, 7, 2 ** 20 + i] for i in range(w)]
for dtype in (torch.float32, torch.bfloat16):
    t = torch.full((33, 5), float(r + 1), dtype=dtype)
    checks[f"fast_all_reduce_{dtype}"] = bool((transport.fast_all_reduce_(t) == w * (w + 1) / 2).all())
try:
    transport.fast_all_reduce_(torch.zeros(3, dtype=torch.float64))
    checks["float64_refused"] = False
except ValueError:
    checks["float64_refused"] = True
# rank r sends r + 1 + d rows to rank d (rank 0 sends nothing to itself when d == 0 and r == 0 is 1 row: uneven)
send = [0 if (r == 0 and d == 1) else r + 1 + d for d in range(w)]
recv = [0 if (s == 0 and r == 1) else s + 1 + r for s in range(w)]
x = torch.cat([torch.full((n, 4), float(10 * r + d)) for d, n in enumerate(send)])
y = torch.empty(sum(recv), 4)
transport.all_to_all_(y, x, recv, send)
want = torch.cat([torch.full((n, 4), float(10 * s + r)) for s, n in enumerate(recv)])
checks["all_to_all_uneven"] = bool(torch.equal(y, want))
empty = torch.empty(0, 4)
transport.all_to_all_(torch.empty(0, 4), empty, [0] * w, [0] * w)
checks["all_to_all_empty"] = True
checks["shared_memory"] = transport.shared_memory_reduce()
checks["shared_memory_fp32"] = transport.shared_memory_reduce(torch.float32)
checks["shared_memory_float64_never"] = not transport.shared_memory_reduce(torch.float64)
checks["pipes_unlinked"] = not any(transport._Pipes.path(i).exists() for i in range(w))
# the serving runtime's sum that waits without spinning (csrc/transport.cpp `local_reduce_`), against DeepSpeed's
# kernel: the same bits (2 ranks: one addition, either order); a tensor of several slots; a late rank; the gather
# through it
import time  # noqa: E402

from export.serve import kernels  # noqa: E402

torch.manual_seed(r)
samples = [torch.randn(33, 7), torch.randn(4, 1000).bfloat16(), torch.randn(3 * transport.REDUCE_SLOT_BYTES // 4 // 2 + 5)]
by_deepspeed = [transport.fast_all_reduce_(t.clone()) for t in samples]
checks["local_reduce_attached"] = transport.attach_local_reduce()
checks["local_reduce_region_unlinked"] = not any(p.name.startswith(transport.region_prefix())  # this launch's only
                                                 for p in Path("/dev/shm").iterdir())
for i, (t, want) in enumerate(zip(samples, by_deepspeed)):
    checks[f"local_reduce_as_deepspeed_{i}"] = bool(torch.equal(transport.fast_all_reduce_(t.clone()), want))
if r == 1:
    time.sleep(0.3)  # rank 0 waits past its spin, yielding
t0 = time.perf_counter()
late = transport.fast_all_reduce_(torch.full((5,), float(r + 1)))
checks["local_reduce_waits_for_a_late_rank"] = bool((late == w * (w + 1) / 2).all()) and (
    r == 1 or time.perf_counter() - t0 > 0.2)
checks["gather_json_local"] = transport.gather_json(mine) == [{"rank": i, "tokens": list(range(i * 500))} for i in range(w)]
# one wait through the slots (csrc/transport.cpp `local_gather`); a message past its slot on one rank: every rank takes
# the sums' path for that gather, and the calls after it still pair up
checks["gather_json_local_one_wait"] = transport._LOCAL_GATHER is not None
long = {"rank": r, "pad": "x" * (transport.REDUCE_SLOT_BYTES if r == 1 else 3)}
checks["gather_json_local_past_a_slot"] = transport.gather_json(long) == [
    {"rank": i, "pad": "x" * (transport.REDUCE_SLOT_BYTES if i == 1 else 3)} for i in range(w)]
checks["gather_json_local_after"] = transport.gather_json([r]) == [[i] for i in range(w)] and bool(
    (transport.fast_all_reduce_(torch.full((3,), float(r + 1))) == w * (w + 1) / 2).all())
transport.use_local_reduce(None)
everyone = transport.gather_json(checks)
if r == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump(everyone, fh)
dist.barrier()
