"""`moe-pipeline export RUN --format gguf` (export/gguf.py): a Qwen3-MoE model as the GGUF file llama.cpp loads, read
back with gguf-py's own reader (what llama.cpp's Python tools read GGUF with). That llama.cpp's llama-server runs it
and decodes what the file of llama.cpp's own converter decodes is benchmarks/gguf_interop.py's (llama.cpp is not part
of the test environment)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import cli


@pytest.fixture(scope="module")
def qwen3_stage(tmp_path_factory):
    """A random Qwen3-MoE checkpoint with an MoE in every layer (3 layers, 4 experts top-2, hidden 64, per-head q/k
    norms, a 512-entry BPE tokenizer) imported as a finished teacher stage, as peer_bench.py imports its checkpoint."""
    from hf_checkpoints import imported_stage

    return imported_stage(tmp_path_factory.mktemp("gguf"), "qwen3_moe", decoder_sparse_step=1)


def read(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}, \
        {t.name: t for t in r.tensors}


@pytest.mark.parametrize("qtype", ["q8_0", "bf16"])
def test_a_qwen3_moe_teacher_exports_as_gguf(qwen3_stage, tmp_path, qtype):
    """The file holds llama.cpp's qwen3moe hyper-parameters, the tokenizer as GPT-2 style BPE (every token in id
    order, its merges, eos), each layer's experts stacked per projection, routers and norms in F32 and every other
    weight in the requested type, whose values (gguf-py's dequantisation) are the checkpoint's weights: BF16 exactly
    as bf16 rounds them, Q8_0 within half a step of each block of 32 (its scale in fp16)."""
    import gguf
    from safetensors.torch import load_file

    from pipeline import data as data_lib

    ckpt, stage = qwen3_stage
    out = tmp_path / f"model-{qtype}.gguf"
    proc = cli("export", str(stage), "--format", "gguf", "--quantize", qtype, "--out", str(out))
    assert f"GGUF {qtype.upper()}" in proc.stdout and out.is_file()
    kv, tensors = read(out)
    assert kv["general.architecture"] == "qwen3moe" and kv["qwen3moe.block_count"] == 3
    assert (kv["qwen3moe.expert_count"], kv["qwen3moe.expert_used_count"], kv["qwen3moe.embedding_length"]) == (4, 2, 64)
    assert kv["qwen3moe.expert_feed_forward_length"] == 32 and kv["qwen3moe.attention.key_length"] == 32
    tok = data_lib.load_tokenizer(ckpt)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.tokens"] == [t for t, _ in vocab] and kv["tokenizer.ggml.eos_token_id"] == 0
    assert len(kv["tokenizer.ggml.merges"]) == len(json.loads(tok.backend_tokenizer.to_str())["model"]["merges"])
    T = gguf.GGMLQuantizationType
    want = T.Q8_0 if qtype == "q8_0" else T.BF16
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == T.F32
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type == T.F32 and tensors["output_norm.weight"].tensor_type == T.F32
    for name in ("token_embd.weight", "output.weight", "blk.1.attn_q.weight", "blk.2.ffn_down_exps.weight"):
        assert tensors[name].tensor_type == want, name
    hf = load_file(str(ckpt / "model.safetensors"))
    down = torch.stack([hf[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] for e in range(4)])
    t = tensors["blk.2.ffn_down_exps.weight"]
    got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(down.shape)
    if qtype == "bf16":
        assert torch.equal(got, down.bfloat16().float())
    else:
        blocks = down.reshape(-1, 32)
        step = blocks.abs().amax(1, keepdim=True) / 127
        # half a step, plus the fp16 rounding of the block's scale (2^-11 of it) at up to 127 steps
        assert ((got.reshape(-1, 32) - blocks).abs() <= step * (0.5 + 127 * 2 ** -11) * (1 + 1e-6)).all()


def test_gguf_export_refuses_what_llama_cpp_cannot_run(small_run, tmp_path):
    """Exit 2, naming what works and writing nothing: our PR-MoE model (no llama.cpp architecture), a package scheme
    asked of a GGUF (and a GGUF type of our package)."""
    out = tmp_path / "x.gguf"
    proc = cli("export", str(small_run), "--format", "gguf", "--out", str(out), check=False)
    assert proc.returncode == 2 and "has no llama.cpp architecture" in proc.stderr and "our package" in proc.stderr
    proc = cli("export", str(small_run), "--format", "gguf", "--quantize", "int8", "--out", str(out), check=False)
    assert proc.returncode == 2 and "--quantize int8 with --format gguf: one of q8_0, q4_0, bf16" in proc.stderr
    proc = cli("export", str(small_run), "--quantize", "q8_0", "--out", str(tmp_path / "p"), check=False)
    assert proc.returncode == 2 and "--quantize q8_0 with --format package: one of int8, int4" in proc.stderr
    assert not out.exists() and not (tmp_path / "p").exists()


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_mixtral_and_olmoe_export_as_llama_cpp_names_them(family, tmp_path):
    """Mixtral as llama.cpp's `llama` with experts (its vocabulary size and rotary dimensions in the metadata; q and k
    rows permuted as the converter permutes llama's: each head's halves interleaved), OLMoE as `olmoe` (its q/k norms
    over the whole projection); each layer's experts stacked (Mixtral's w1/w2/w3 as gate/down/up), BF16 values the
    checkpoint's."""
    import gguf
    from safetensors.torch import load_file

    from hf_checkpoints import imported_stage

    out = tmp_path / "model.gguf"
    if family == "olmoe":  # llama.cpp's olmoe is multi-head (its k norm spans the hidden size): GQA is refused
        _, gqa = imported_stage(tmp_path / "gqa", family)
        proc = cli("export", str(gqa), "--format", "gguf", "--out", str(out), check=False)
        assert proc.returncode == 2 and "2 key/value heads of 4" in proc.stderr and not out.exists()
    ckpt, stage = imported_stage(tmp_path / "ckpt", family, **({"num_key_value_heads": 4} if family == "olmoe" else {}))
    cli("export", str(stage), "--format", "gguf", "--quantize", "bf16", "--out", str(out))
    kv, tensors = read(out)
    arch = "llama" if family == "mixtral" else "olmoe"
    assert kv["general.architecture"] == arch and kv[f"{arch}.expert_count"] == 4
    assert kv[f"{arch}.expert_used_count"] == 2 and kv[f"{arch}.block_count"] == 3
    hf = load_file(str(ckpt / "model.safetensors"))

    def values(name, shape):
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(shape)

    q = hf["model.layers.1.self_attn.q_proj.weight"]
    if family == "mixtral":
        assert kv["llama.vocab_size"] == 512 and kv["llama.rope.dimension_count"] == 16
        heads, half = 4, 8
        permuted = q.reshape(heads, 2, half, -1).transpose(1, 2).reshape(q.shape)  # row h*16 + 2i + j <- h*16 + j*8 + i
        assert torch.equal(values("blk.1.attn_q.weight", q.shape), permuted.bfloat16().float())
        assert not torch.equal(permuted, q)
        gate = torch.stack([hf[f"model.layers.2.block_sparse_moe.experts.{e}.w1.weight"] for e in range(4)])
    else:
        assert tensors["blk.1.attn_q_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(values("blk.1.attn_q.weight", q.shape), q.bfloat16().float())
        gate = torch.stack([hf[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
    assert torch.equal(values("blk.2.ffn_gate_exps.weight", gate.shape), gate.bfloat16().float())
    assert tensors["blk.2.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
