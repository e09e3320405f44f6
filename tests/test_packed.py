"""export/serve/packed.py: oneDNN-prepacked linears for CPU serving give the model's own outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import model_config


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_packed_linear_is_the_linear(dtype, tol):
    from export.serve.packed import PackedLinear

    layer = nn.Linear(256, 512).to(dtype).eval()
    packed = PackedLinear(layer)
    for shape in [(1, 256), (3, 256), (2, 9, 256), (0, 1, 256), (40, 256)]:  # few rows take the kept plain weight
        x = torch.randn(*shape).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(packed(x).float(), layer(x).float(), atol=tol, rtol=tol)


def test_packing_a_model_keeps_its_logits_and_its_gates(monkeypatch):
    from export.serve.packed import ENV, PackedLinear, pack_linears
    from pipeline.model import GPT, init_weights

    cfg = model_config(hidden=128, heads=4)
    model = GPT(cfg).eval()
    init_weights(model, 2)
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    with torch.no_grad():
        ref = model(ids).logits
    monkeypatch.setenv(ENV, "0")
    assert pack_linears(model) == 0  # switched off: nothing changes
    monkeypatch.delenv(ENV)
    assert pack_linears(model) > 0
    assert all(b.attn.__dict__.get("fused") is not None for b in model.blocks)  # q, k, v as one projection
    assert all(type(m.moe.deepspeed_moe.gate.wg) is nn.Linear for m in model.moe_layers())  # the router reads it
    assert isinstance(model.lm_head, PackedLinear)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)
