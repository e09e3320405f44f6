"""pipeline/hf_import.py: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints as our model.

Each family's checkpoint is made here, offline: a small random model of transformers' own config and model
classes, `save_pretrained` (the Hub's per-expert tensor names). The imported model must give the Hugging Face
model's logits (fp32, max |diff| < 1e-4) and its greedy tokens, with grouped-query attention, q/k norms, shared
experts, dense layers between MoE ones, a head width that is not hidden/heads, and sharded files.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_checkpoints import family_model  # noqa: E402  (small random checkpoints of each family)


def imported(src):
    from pipeline.hf_import import load_hf_weights, model_config, read_hf_config
    from pipeline.model import GPT

    cfg = model_config(read_hf_config(src))
    model = GPT(cfg).eval()
    load_hf_weights(model, src)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_an_imported_teacher_gives_the_hugging_face_models_logits_and_tokens(family, tmp_path):
    hf = family_model(family)
    hf.save_pretrained(tmp_path)
    ours = imported(tmp_path)
    cfg = ours.cfg
    assert cfg.family == family and cfg.kv_heads == 2 and cfg.positions == "rope" and cfg.norm == "rmsnorm"
    assert cfg.moe_layers == {"mixtral": (0, 1, 2), "olmoe": (0, 1, 2), "qwen2_moe": (1, 2), "qwen3_moe": (1,)}[family]
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).logits
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"{family}: max |logit diff| {diff}"
    # greedy: our KV-cache decode against transformers' generate
    from pipeline.model import KVCache

    prompt = ids[:1, :8]
    want_tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 8:]
    cache = KVCache(cfg, batch=1, max_len=20)
    tok = ours(prompt, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
    tokens = [tok]
    for _ in range(11):
        tok = ours(tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(tok)
    assert torch.cat(tokens, 1)[0].tolist() == want_tokens.tolist()


def test_a_sharded_checkpoint_with_a_tied_head_is_read_through_its_index(tmp_path):
    hf = family_model("qwen3_moe", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    ours = imported(tmp_path)
    assert ours.cfg.tie_embeddings and ours.lm_head.weight is ours.wte.weight
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4


def test_bad_checkpoints_are_refused_naming_the_fault(tmp_path):
    from pipeline.hf_import import HFImportError, read_hf_config

    with pytest.raises(HFImportError, match="nothing is downloaded"):
        read_hf_config("mistralai/Mixtral-8x7B-v0.1")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HFImportError, match="model_type 'llama' is not supported; supported families: mixtral, "
                                            "qwen2_moe, qwen3_moe, olmoe"):
        read_hf_config(tmp_path)
    hf = family_model("mixtral")
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(64)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(HFImportError, match=r"1 tensor\(s\) that config.json does not account for, e.g. model.layers.0.self_attn.q_norm.weight"):
        imported(tmp_path)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensor.*experts.2.w3.weight: not a complete mixtral checkpoint"):
        imported(tmp_path)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "qwen3_moe"])
def test_an_imported_teacher_serves_with_its_logits_on_the_placed_path(family, tmp_path, monkeypatch):
    """The serving runtime's MoE layer (export/serve/placement/exchange.py: experts from the store, the exchange, SwiGLU
    experts without biases, a shared expert, unnormalised top-k) and its CPU linears on every weight (q, k, v fused
    into one product even where k and v are narrower), from our weights' files."""
    from export.serve import kernels
    from export.serve.kernels import FusedAttention
    from export.serve.served import placed_model

    monkeypatch.setattr(kernels.weights, "SERVE_FROM", 0)  # these small weights too: the fused q, k, v and the kernel
    from pipeline import dist
    from pipeline.weights import save_weights

    hf = family_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours = imported(tmp_path / "hf")
    (tmp_path / "ours").mkdir()
    save_weights(ours, tmp_path / "ours")
    served = placed_model(ours.cfg, tmp_path / "ours", dist.init(), torch.float32).model
    assert isinstance(served.blocks[0].attn, FusedAttention) and not hasattr(served.blocks[0].attn, "q_proj")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (served(ids).logits - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, f"{family}: max |logit diff| {diff}"


PUBLISHED = {  # total and active parameters, billions, as each model's card states them
    "mixtral": (46.7, 12.9), "qwen2_moe": (14.3, 2.7), "qwen3_moe": (30.5, 3.3), "olmoe": (6.9, 1.3)}


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_the_published_configurations_count_as_transformers_counts_them(family, tmp_path):
    """recipes/hf/<family>.json (Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, OLMoE-1B-7B): our model on the meta
    device has, to the parameter, the total of the family's own transformers model built from the same config.json,
    and its total and active counts (every non-expert parameter, embedding and head included, plus top_k experts
    per MoE layer) are the published sizes to their one decimal."""
    import shutil

    from pipeline.build import meta_counts
    from pipeline.hf_import import model_config, read_hf_config

    shutil.copy(f"recipes/hf/{family}.json", tmp_path / "config.json")
    counts = meta_counts(model_config(read_hf_config(tmp_path)))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    total, active = PUBLISHED[family]
    # within the cards' one decimal (Qwen3-30B-A3B's 3.353B active is published as 3.3B: cut, not rounded)
    assert abs(counts["total"] / 1e9 - total) < 0.06 and abs(counts["active_per_token"] / 1e9 - active) < 0.06


@pytest.mark.slow
def test_every_family_gives_the_same_logits_at_ep2_in_one_launch(tmp_path):
    """DeepSpeed's MoE layer over 2 ranks (gloo), each rank reading only its experts; Qwen2-MoE and OLMoE's
    unnormalised top-k through our gate inside DeepSpeed's layer."""
    from conftest import launch_ranks

    families = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
    models = {}
    for f in families:
        models[f] = family_model(f)
        models[f].save_pretrained(tmp_path / f)
    launch_ranks("tests/workers/hf_ep_parity.py", str(tmp_path / "logits.pt"), *(str(tmp_path / f) for f in families))
    ep2 = torch.load(tmp_path / "logits.pt", weights_only=True)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    for f in families:
        with torch.no_grad():
            want = models[f](ids).logits
        diff = (ep2[f] - want).abs().max().item()
        assert diff < 1e-4, f"{f} at EP 2: max |logit diff| {diff}"


def student_of(teacher, kept):
    """A Mixture-of-Students made by hand: the teacher's `kept` layers (as distill/student.py keeps them)."""
    from distill.student import student_config
    from pipeline.model import GPT

    student = GPT(student_config(teacher.cfg, kept)).eval()
    for s, t in enumerate(kept):
        student.blocks[s].load_state_dict(teacher.blocks[t].state_dict())
    for name in ("wte", "ln_f", "lm_head"):
        getattr(student, name).load_state_dict(getattr(teacher, name).state_dict())
    return student


@pytest.mark.parametrize("family, kept", [("mixtral", [0, 2]), ("qwen2_moe", [0, 2]), ("qwen3_moe", [0, 1]),
                                          ("olmoe", [1, 2])])
def test_a_student_exported_in_its_family_loads_in_plain_transformers(family, kept, tmp_path):
    """--format hf: the family's own class with the student's layer count (dense layers remapped), no remote code,
    the student's logits."""
    from export.native import write_native

    family_model(family).save_pretrained(tmp_path / "teacher")
    student = student_of(imported(tmp_path / "teacher"), kept)
    write_native(student, tmp_path / "native", dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32).eval()
    assert type(loaded).__name__ == type(family_model(family)).__name__
    assert loaded.config.num_hidden_layers == 2
    manifest = json.loads((tmp_path / "native" / "manifest.json").read_text())
    assert set(manifest["files"]) >= {"config.json", "model.safetensors"}
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        diff = (loaded(ids).logits - student(ids).logits).abs().max().item()
    assert diff < 1e-4, f"{family} student: max |logit diff| {diff}"


def test_what_a_family_cannot_express_is_refused_with_the_format_that_can(tmp_path):
    import dataclasses

    from conftest import model_config
    from export.native import NativeExportError, write_native
    from pipeline.model import GPT

    family_model("qwen2_moe").save_pretrained(tmp_path / "teacher")
    teacher = imported(tmp_path / "teacher")
    pruned = GPT(dataclasses.replace(teacher.cfg, experts=(4, 2)))
    with pytest.raises(NativeExportError, match=r"different expert counts \[4, 2\].*our package"):
        write_native(pruned, tmp_path / "out")
    with pytest.raises(NativeExportError, match="pr-moe model.*our package"):
        write_native(GPT(model_config()), tmp_path / "out")
    olmoe_with_dense = GPT(dataclasses.replace(imported_config("olmoe", tmp_path), experts=(4, 4), moe_layers=(0, 2)))
    with pytest.raises(NativeExportError, match=r"layers \[1\] are dense; every olmoe layer"):
        write_native(olmoe_with_dense, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def imported_config(family, tmp_path):
    from pipeline.hf_import import model_config, read_hf_config

    family_model(family).save_pretrained(tmp_path / family)
    return model_config(read_hf_config(tmp_path / family))


def test_load_hf_teacher_builds_in_the_checkpoints_dtype_with_fp32_gates(tmp_path):
    from pipeline.build import load_hf_teacher

    hf = family_model("olmoe").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = load_hf_teacher(tmp_path)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if not n.endswith("gate.wg.weight")} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if n.endswith("gate.wg.weight")} == {torch.float32}
    ref = imported(tmp_path)  # fp32
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert (model(ids).logits.float() - ref(ids).logits).abs().max().item() < 0.1


def test_the_serving_engine_decodes_an_imported_gqa_teacher_as_our_model_does(tmp_path):
    """export/serve/engine.py's per-row key/value cache holds the kv heads (2 of 4 query heads here) with rotary
    positions per row: rows of different lengths decoding together give the model's own greedy tokens."""
    from export.serve.engine import Engine, generate
    from export.serve.request import SamplingParams
    from export.serve.served import placed_model
    from pipeline import dist
    from pipeline.data import gpt2_tokenizer
    from pipeline.model import KVCache
    from pipeline.weights import save_weights

    family_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    ours = imported(tmp_path / "hf")
    (tmp_path / "ours").mkdir()
    save_weights(ours, tmp_path / "ours")
    placed = placed_model(ours.cfg, tmp_path / "ours", dist.init(), torch.float32)
    engine = Engine(placed.model, gpt2_tokenizer(128), max_batch=3, exchange=placed.exchange, layout=placed.layout)
    engine.eos = None
    prompts = [[5, 9, 17], [3] * 11, [100, 2, 7, 7, 40, 1]]
    got = generate(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, req in zip(prompts, got):
        cache = KVCache(ours.cfg, batch=1, max_len=len(p) + 10)
        with torch.no_grad():
            tok = ours(torch.tensor([p]), cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            want = [tok.item()]
            for _ in range(9):
                tok = ours(tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
                want.append(tok.item())
        assert req.generated == want


def test_slicing_layouts_built_for_the_pr_moe_refuse_these_families_naming_expert_parallel(tmp_path):
    """Tensor and expert slicing split fc1 by rows and heads evenly: wrong for SwiGLU's [gate; up] and grouped-query
    attention, so `serve`/`eval` refuse them (exit 2 from the CLI) and name the layouts that work."""
    from export.inference import plan_layout

    cfg = imported_config("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match=r"--tp-size 2: tensor slicing is built for the PR-MoE GPT; this qwen3_moe "
                                         r"model .* serves expert parallel: --ep-size 2 .*--format hf"):
        plan_layout(cfg, 2, tp_size=2)
    with pytest.raises(ValueError, match=r"--ep-size 1 on 2 ranks would slice each expert 2 ways"):
        plan_layout(cfg, 2, ep_size=1)
    assert plan_layout(cfg, 2).ep == (2,) and plan_layout(cfg, 1).tp == 1
