"""pipeline/dist.py's collectives build their tensors on the process group's device and refuse others (NCCL takes
only tensors on the current GPU; a CPU tensor there fails at the first collective)."""

import json

import pytest
import torch

from pipeline import dist


def test_collective_helpers_build_their_tensors_on_the_given_device():
    meta = torch.device("meta")
    size, data = dist.json_tensors({"kind": "ping", "rows": [1, 2]}, meta)
    assert size.device == data.device == meta and size.dtype == torch.long and data.dtype == torch.uint8
    size, data = dist.json_tensors({"kind": "ping"}, torch.device("cpu"))
    assert json.loads(bytes(data.numpy()).decode()) == {"kind": "ping"} and int(size) == data.numel()


def test_a_tensor_on_another_device_is_refused_before_any_collective():
    with pytest.raises(ValueError, match="the process group's device is meta"):
        dist.all_reduce_(torch.ones(3), on=torch.device("meta"))
    dist.init()
    t = torch.ones(3)
    assert dist.all_reduce_(t) is t and t.tolist() == [1, 1, 1]  # one rank: the sum is itself
    rows = dist.gather_numbers([1.0, 2.5], on=torch.device("cpu"))
    assert rows == [[1.0, 2.5]]
    with pytest.raises(NotImplementedError):  # meta tensors cannot hold numbers: gather_numbers really builds there
        dist.gather_numbers([1.0], on=torch.device("meta"))


@pytest.mark.slow
def test_the_helpers_on_two_ranks(tmp_path):
    """Real ranks (DeepSpeed's launcher, gloo, DeepSpeed's shared-memory all-reduce): what each helper delivers."""
    import json

    from conftest import launch_ranks

    out = tmp_path / "checks.json"
    launch_ranks("tests/workers/dist_helpers.py", str(out))
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for checks in ranks:
        assert checks.pop("shared_memory") is True  # on this machine the fast path really is the kernel
        assert all(checks.values()), checks
