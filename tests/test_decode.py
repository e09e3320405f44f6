"""export/serve/decode.py's decode forward against the model's own (pipeline/model.py `GPT.forward`): the same hidden
states to the bit, in fp32 and bf16, for every family's layers (per-head and whole-projection q/k norms, RoPE,
grouped-query heads, q/k/v biases, a shared expert, dense layers) and for our PR-MoE GPT (learned positions,
LayerNorm, residual MoE), rows of different lengths decoding together; and the csrc kernel `qkv_heads` against
the module's operators."""

from __future__ import annotations

import pytest
import torch

from conftest import model_config
from hf_checkpoints import family_model


def served(model, tmp_path, dtype, monkeypatch, resident=1.0, quantize=None):
    """`model`'s weights through the serving runtime's loader (placed MoE layers, the CPU linears on every weight,
    q/k/v fused, the norms' kernel; `quantize`: int8 or int4 weights, as `serve --quantize`): what the engine decodes
    with."""
    from export.serve import kernels
    from export.serve.served import placed_model
    from pipeline import dist
    from pipeline.weights import save_weights

    monkeypatch.setattr(kernels.weights, "SERVE_FROM", 0)  # these small weights too
    (tmp_path / "w").mkdir()
    save_weights(model, tmp_path / "w")
    return placed_model(model.cfg, tmp_path / "w", dist.init(), dtype, resident_fraction=resident,
                        quantize=quantize).model


def imported(family, tmp_path):
    from pipeline.hf_import import load_hf_weights, model_config as hf_model_config, read_hf_config
    from pipeline.model import GPT

    family_model(family).save_pretrained(tmp_path / "hf")
    model = GPT(hf_model_config(read_hf_config(tmp_path / "hf"))).eval()
    load_hf_weights(model, tmp_path / "hf")
    return model


def pr_moe():
    from pipeline.model import GPT, init_weights

    cfg = model_config(vocab_size=128, seq_len=64, hidden=64, heads=4, experts=(2, 4), moe_layers=(1, 3))
    torch.manual_seed(0)
    model = GPT(cfg)
    init_weights(model, seed=0)
    return model.eval()


def check_decodes_alike(model, lens=(3, 9, 6), experts_native=True):
    """Prompts of `lens` tokens prefilled by the model, then 5 decode steps of all the rows: the model's forward and the
    Decoder's from the same cache state, equal hidden states and expert counts; each step's keys then written once
    more by the Decoder. Its steps alternate between every layer in one kernel call (csrc/decode_model.cpp
    `DecodeModel`) and the layer-by-layer loop. `experts_native`: the kernel runs the MoE layers' experts itself, else
    it calls the layers' modules back."""
    from export.serve.decode import Decoder
    from export.serve.kv_cache import PagedCache, served_kv

    n = len(lens)
    heads, dtype, _ = served_kv(model)
    cache = PagedCache(model.cfg, blocks=8 * n, block_size=4, heads=heads, dtype=dtype)
    decoder = Decoder.of(model, cache)
    assert decoder is not None and decoder.native is not None and decoder.native_rows >= n
    assert (decoder.native_experts == "local") == experts_native
    rows = decoder.native_rows
    gen = torch.Generator().manual_seed(1)
    lens = list(lens)
    for seq, length in enumerate(lens):
        cache.extend(seq, [seq + n * j for j in range(8)])  # the rows' blocks interleaved in the pool
        cache.select([seq], [0], [length])
        with torch.no_grad():
            model(torch.randint(0, model.cfg.vocab_size, (1, length), generator=gen), cache=cache, hidden_only=True)
    seqs = list(range(n))
    for step in range(5):
        decoder.native_rows = rows if step % 2 == 0 else 0
        tokens = torch.randint(0, model.cfg.vocab_size, (n, 1), generator=gen)
        with torch.no_grad():
            want = model(tokens, cache=cache.select(seqs, lens, [1] * n), hidden_only=True)
        exchange = decoder._exchange
        used = (lambda r: r.hits + r.misses) if exchange else None  # experts a forward ran, resident or loaded
        before = (exchange.meter.forwards, used(exchange.residency), exchange.expert_s) if exchange else None
        got = decoder(tokens, cache.select(seqs, lens, [1] * n))
        if exchange is not None:  # the one call keeps the exchange's books as the layers' own calls do
            ran = sum(int((c > 0).sum()) for c in got.expert_counts)
            assert exchange.meter.forwards == before[0] + 1 and used(exchange.residency) == before[1] + ran
            assert exchange.expert_s > before[2]
        assert got.hidden.dtype == want.hidden.dtype and torch.equal(got.hidden, want.hidden), \
            (got.hidden.float() - want.hidden.float()).abs().max()
        assert len(got.expert_counts) == len(want.expert_counts)
        assert all(torch.equal(a, b) for a, b in zip(got.expert_counts, want.expert_counts))
        lens = [length + 1 for length in lens]


def check_packs_alike(model, experts_native=True):
    """Packed forwards as a serving step mixes them, the model's and the Decoder's `packed` from the same cache state:
    decode tokens beside new prompts and a prompt's later chunk, a prompt alone, prompts alone of one length; equal
    hidden states and expert counts. Each forward's keys are written by the model, then once more by the Decoder."""
    from unittest import mock

    from export.serve import kernels
    from export.serve.decode import Decoder
    from export.serve.kv_cache import PagedCache, served_kv

    heads, dtype, _ = served_kv(model)
    cache = PagedCache(model.cfg, blocks=64, block_size=4, heads=heads, dtype=dtype)
    decoder = Decoder.of(model, cache)
    assert decoder is not None and decoder.native is not None
    assert (decoder.native_experts == "local") == experts_native
    gen = torch.Generator().manual_seed(2)
    done: dict[int, int] = {}  # sequence -> tokens in the cache
    free = iter(range(64))
    # (sequence, new tokens) rows of each forward: 0-2 prompts, then 0-2 decoding beside prompt 3 and prompt 4's first
    # chunk, 4's second chunk beside 0-3 decoding, a lone prompt, two prompts of one length (no row shorter)
    forwards = [[(0, 5), (1, 9), (2, 3)], [(0, 1), (1, 1), (2, 1), (3, 7), (4, 6)],
                [(0, 1), (1, 1), (2, 1), (3, 1), (4, 8)], [(5, 11)], [(6, 4), (7, 4)]]
    # then as many tokens as it packs: decode rows beside a long prompt (past native_rows, where the model's forward
    # would send the experts to oneDNN: it is given the grouped kernel the Decoder runs, so the bits compare)
    most = min(decoder.PACKED_TOKENS, 64 if decoder.quantized else 1 << 30)
    forwards.append([(0, 1), (1, 1), (2, 1), (8, min(most, model.cfg.seq_len - 16, 100) - 3)])
    for rows in forwards:
        assert decoder.packs([n for _, n in rows])
        for seq, n in rows:
            have = len(cache.tables.get(seq, [])) * 4
            need = done.get(seq, 0) + n
            cache.extend(seq, [next(free) for _ in range(max(0, -(-(need - have) // 4)))])
        seqs, starts, counts = [r[0] for r in rows], [done.get(r[0], 0) for r in rows], [r[1] for r in rows]
        tokens = torch.randint(0, model.cfg.vocab_size, (1, sum(counts)), generator=gen)
        with torch.no_grad(), mock.patch.object(kernels.experts, "GROUPED_MAX_ROWS", 1 << 30):
            want = model(tokens, cache=cache.select(seqs, starts, counts, packed=True), hidden_only=True)
        got = decoder.packed(tokens, cache.select(seqs, starts, counts, packed=True))
        assert got.hidden.shape == want.hidden.shape and got.hidden.dtype == want.hidden.dtype
        assert torch.equal(got.hidden, want.hidden), (got.hidden.float() - want.hidden.float()).abs().max()
        assert len(got.expert_counts) == len(want.expert_counts)
        assert all(torch.equal(a, b) for a, b in zip(got.expert_counts, want.expert_counts))
        for seq, n in rows:
            done[seq] = done.get(seq, 0) + n
    assert not decoder.packs([most + 1]) and not decoder.packs([])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen2_moe", "mixtral"])
def test_the_decoder_gives_the_model_s_hidden_states_for_every_family(family, dtype, tmp_path, monkeypatch):
    model = served(imported(family, tmp_path), tmp_path, dtype, monkeypatch)
    check_decodes_alike(model)
    check_packs_alike(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_gives_the_model_s_hidden_states_for_the_pr_moe(dtype, tmp_path, monkeypatch):
    model = served(pr_moe(), tmp_path, dtype, monkeypatch)
    check_decodes_alike(model)
    check_packs_alike(model)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_the_decoder_gives_the_model_s_hidden_states_with_quantised_weights(quantize, tmp_path, monkeypatch):
    """`serve --quantize`: the quantised linears and experts in one kernel call as in the model's forward, decode steps
    and packed forwards alike (up to PACKED_TOKENS rows, where the model's quantised linears run their kernels too)."""
    from export.serve import kernels
    from export.serve.decode import Decoder
    from export.serve.kv_cache import PagedCache, served_kv

    if not hasattr(kernels.kernel(), "int4_linear"):
        pytest.skip("the CPU GEMV kernel is not built here")
    model = served(imported("qwen3_moe", tmp_path), tmp_path, torch.bfloat16, monkeypatch, quantize=quantize)
    assert any(isinstance(m.served, kernels.QuantizedWeight) for m in model.modules()
               if isinstance(m, kernels.ServingLinear))
    check_decodes_alike(model)
    check_packs_alike(model)
    decoder = Decoder.of(model, PagedCache(model.cfg, blocks=8, block_size=4, heads=served_kv(model)[0],
                                           dtype=torch.bfloat16))
    assert decoder.quantized and decoder.packs([kernels.DEQUANTIZE_ABOVE])
    assert not decoder.packs([kernels.DEQUANTIZE_ABOVE + 1])


@pytest.mark.parametrize("family", ["qwen2_moe", "pr_moe"])
def test_the_decoder_calls_back_moe_layers_whose_experts_are_not_all_here(family, tmp_path, monkeypatch):
    """Half the experts resident (the others loaded as the exchange needs them): the kernel calls each MoE layer's
    module back, and the hidden states are still the model's."""
    model = served(pr_moe() if family == "pr_moe" else imported(family, tmp_path), tmp_path, torch.bfloat16,
                   monkeypatch, resident=0.5)
    check_decodes_alike(model, experts_native=False)
    check_packs_alike(model, experts_native=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "pr_moe"])
@pytest.mark.parametrize("more, dtype", [("onednn", torch.float32), ("onednn", torch.bfloat16),
                                         ("chunks", torch.bfloat16), ("aten", torch.float32)])
def test_the_decoder_beyond_the_kernel_s_rows(family, more, dtype, tmp_path, monkeypatch):
    """12 rows, more than the few-row kernel takes: each linear as ServingWeight.linear runs it then, oneDNN on its
    packed weight (rows bucketed), the kernel 8 rows at a time (bf16 where oneDNN has no bf16 GEMM), or F.linear (a
    weight too small for oneDNN)."""
    from export.serve import kernels

    if more == "onednn" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16 GEMM (AVX-512 BF16 or AMX): bf16 takes the chunks path, tested here")
    if more != "aten":
        monkeypatch.setattr(kernels.weights, "ONEDNN_FROM", 0)
    if more == "chunks":
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    model = served(pr_moe() if family == "pr_moe" else imported(family, tmp_path), tmp_path, dtype, monkeypatch)
    weights = [block.attn.qkv_proj.weight for block in model.blocks] + \
        [m.served for m in model.modules() if isinstance(m, kernels.ServingLinear)]
    for w in weights:
        w.amx = None  # AMX would take these rows (bf16 on a CPU with it): the paths after it are the ones under test
    assert all(w.onednn == (more == "onednn") for w in weights)
    check_decodes_alike(model, lens=(3, 9, 6, 4, 11, 5, 7, 3, 8, 10, 6, 4))


def test_a_model_the_decoder_does_not_know_is_left_to_its_own_forward(tmp_path, monkeypatch):
    """A q/k norm the kernel has no call for (an RMSNorm left as the module, here: its dtype differs from the
    activations') and a cache on no kernel: no Decoder."""
    from export.serve.decode import Decoder
    from export.serve.kv_cache import PagedCache

    model = served(imported("qwen3_moe", tmp_path), tmp_path, torch.float32, monkeypatch)
    cache = PagedCache(model.cfg, blocks=4, block_size=4, heads=model.cfg.kv_heads)
    assert Decoder.of(model, cache) is not None
    monkeypatch.setattr(cache, "_kernel", None)
    assert Decoder.of(model, cache) is None
    monkeypatch.undo()
    from pipeline.model import RMSNorm

    block = model.blocks[0]
    block.attn.q_norm = RMSNorm(block.attn.q_norm.weight.shape[0], 1e-6)
    assert Decoder.of(model, PagedCache(model.cfg, blocks=4, block_size=4, heads=model.cfg.kv_heads)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["none", "head", "full"])
def test_qkv_heads_is_the_attention_s_operators(norm, dtype):
    """The kernel's split, q/k norm and RoPE against the serving norm (`rms_norm`) and pipeline/model.py's
    `apply_rope` on the fused projection's output (strided views): equal to the bit, 5 rows at their own positions,
    head size 48 (not a vector's multiple)."""
    from export.serve import kernels
    from pipeline.model import apply_rope, rope_tables

    k = kernels.kernel()
    B, H, Hkv, D = 5, 4, 2, 48
    cfg = model_config(hidden=96, heads=H, kv_heads=Hkv, head_dim=D, positions="rope", norm="rmsnorm")
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(B, (H + 2 * Hkv) * D, generator=gen) * 3).to(dtype)
    q, kk, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    cos, sin = rope_tables(cfg, torch.tensor([0, 3, 17, 5, 40]), dtype)  # [B, D]
    qw = kw = None
    if norm != "none":
        qw, kw = (torch.randn(D if norm == "head" else n, generator=gen).to(dtype) for n in (H * D, Hkv * D))
    wq, wk = q.contiguous(), kk.contiguous()
    if norm == "full":
        wq, wk = k.rms_norm(wq, qw, 1e-6), k.rms_norm(wk, kw, 1e-6)
    wq, wk, wv = wq.reshape(B, H, D), wk.reshape(B, Hkv, D), v.reshape(B, Hkv, D)
    if norm == "head":
        wq, wk = k.rms_norm(wq, qw, 1e-6), k.rms_norm(wk, kw, 1e-6)
    wq, wk = (apply_rope(t[:, :, None], cos[:, None], sin[:, None])[:, :, 0] for t in (wq, wk))
    got = k.qkv_heads(q, kk, v, D, qw, kw, 1e-6, cos, sin)
    for a, b in zip(got, (wq, wk, wv)):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a, b), (a.float() - b.float()).abs().max()
    unrotated = k.qkv_heads(q, kk, v, D, qw, kw, 1e-6, None, None)
    assert torch.equal(unrotated[2], wv) and not torch.equal(unrotated[0], wq)
    with pytest.raises(RuntimeError, match="q_w, k_w"):
        k.qkv_heads(q, kk, v, D, torch.ones(7, dtype=dtype), torch.ones(7, dtype=dtype), 1e-6, cos, sin)
