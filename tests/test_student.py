"""The Mixture-of-Students' layer choice, config and initialisation from the teacher (distill/student.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import model_config

from distill.student import (block_importance, init_from_teacher, select_layers, student_config,
                             teacher_name)
from pipeline.model import GPT, init_weights
from pipeline.recipe import RecipeError
from pipeline.weights import save_weights

# the paper's teacher: 24 layers, MoE every other one (0-indexed 1, 3, ..., 23), pyramid 32/64
PAPER = model_config(layers=24, moe_layers=tuple(range(1, 24, 2)), experts=(32,) * 10 + (64,) * 2)
TINY = model_config(layers=6, moe_layers=(1, 3, 5), experts=(4, 4, 8))


def _dense(cfg):
    return [i for i in range(cfg.layers) if not cfg.is_moe(i)]


# -- select_layers ------------------------------------------------------------------------------

def test_paper_rule_drops_the_two_small_expert_layers_and_the_dense_between():
    kept = select_layers(PAPER, layers=21, moe_count=10, method="paper")
    assert kept == [0] + list(range(4, 24))  # 1-indexed layers 2, 3, 4 go
    cfg = student_config(PAPER, kept)
    assert cfg.layers == 21
    assert cfg.experts == (32,) * 8 + (64,) * 2
    assert cfg.moe_layers == tuple(range(2, 21, 2))  # teacher 5, 7, ..., 23 at student positions 2, 4, ..., 20


def test_paper_rule_tiny():
    kept = select_layers(TINY, layers=5, moe_count=2, method="paper")
    assert kept == [0, 2, 3, 4, 5]
    assert student_config(TINY, kept).experts == (4, 8)


@pytest.mark.parametrize("layers, moe_count", [(21, 10), (12, 6), (5, 1), (3, 3)])
def test_uniform_keeps_each_types_ends(layers, moe_count):
    kept = select_layers(PAPER, layers, moe_count, "uniform")
    assert kept == sorted(kept) and len(set(kept)) == layers
    moe = [i for i in kept if PAPER.is_moe(i)]
    dense = [i for i in kept if not PAPER.is_moe(i)]
    assert len(moe) == moe_count and len(dense) == layers - moe_count
    for picked, all_of_type in ((moe, list(PAPER.moe_layers)), (dense, _dense(PAPER))):
        if len(picked) >= 2:
            assert picked[0] == all_of_type[0] and picked[-1] == all_of_type[-1]


def test_uniform_spacing():
    # tiny: MoE [1, 3, 5] -> 2 of them: indices round(linspace(0, 2, 2)) = [0, 2]; dense [0, 2, 4] -> all
    assert select_layers(TINY, 5, 2, "uniform") == [0, 1, 2, 4, 5]
    # dense [0, 2, 4] -> 1 of them: index round(linspace(0, 2, 1)) = [0]
    assert select_layers(TINY, 4, 3, "uniform") == [0, 1, 3, 5]


def test_importance_picks_the_highest_scored_per_type():
    #         layer: 0    1    2    3    4    5   (MoE: 1, 3, 5)
    scores = [0.9, 0.1, 0.2, 0.8, 0.3, 0.5]
    # MoE 3 and 5 beat 1; dense 0 and 4 beat 2 although 2 outscores MoE 1 (chosen within each type)
    assert select_layers(TINY, 4, 2, "importance", scores) == [0, 3, 4, 5]
    # ties go to the deeper layer
    assert select_layers(TINY, 2, 1, "importance", [0.0] * 6) == [4, 5]
    kept = select_layers(PAPER, 21, 10, "importance", [float(i % 5) for i in range(24)])
    assert sum(PAPER.is_moe(i) for i in kept) == 10 and len(kept) == 21 and kept == sorted(kept)


def test_importance_needs_scores():
    with pytest.raises(ValueError, match="one score per teacher layer"):
        select_layers(TINY, 5, 2, "importance")
    with pytest.raises(ValueError, match="one score per teacher layer"):
        select_layers(TINY, 5, 2, "importance", [1.0] * 5)


def test_errors_name_the_key():
    with pytest.raises(RecipeError, match=r"student\.layers .*must be < teacher layers \(24\)") as err:
        select_layers(PAPER, 24, 12, "paper")
    assert err.value.path == "student.layers"
    with pytest.raises(RecipeError, match="the teacher has 3") as err:
        select_layers(TINY, 5, 4, "paper")  # more MoE layers than the teacher has
    assert err.value.path == "student.layers"
    with pytest.raises(RecipeError, match="dense layers") as err:
        select_layers(TINY, 5, 1, "paper")  # 4 dense layers, the teacher has 3
    assert err.value.path == "student.layers"
    with pytest.raises(RecipeError, match="'paper', 'uniform', 'importance'") as err:
        select_layers(TINY, 5, 2, "random")
    assert err.value.path == "student.layer_selection"


# -- student_config ------------------------------------------------------------------------------

def test_student_config_keeps_everything_but_the_layers():
    cfg = student_config(TINY, [0, 1, 4, 5])
    assert (cfg.layers, cfg.moe_layers, cfg.experts) == (4, (1, 3), (4, 8))
    assert {k: v for k, v in cfg.to_dict().items() if k not in ("layers", "moe_layers", "experts")} == \
        {k: v for k, v in TINY.to_dict().items() if k not in ("layers", "moe_layers", "experts")}
    model = GPT(cfg, moe_impl="reference")
    assert [b.is_moe for b in model.blocks] == [False, True, False, True]
    assert [m.num_experts for m in model.moe_layers()] == [4, 8]


def test_teacher_name():
    kept = [0, 2, 3, 4, 5]
    assert teacher_name("blocks.1.attn.q_proj.weight", kept) == "blocks.2.attn.q_proj.weight"
    assert teacher_name("blocks.4.mlp.moe.deepspeed_moe.experts.deepspeed_experts.7.fc1.bias", kept) == \
        "blocks.5.mlp.moe.deepspeed_moe.experts.deepspeed_experts.7.fc1.bias"
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "lm_head.weight"):
        assert teacher_name(name, kept) == name


# -- init_from_teacher ---------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_init_from_teacher_copies_every_tensor(tmp_path, tie):
    teacher_cfg = model_config(layers=6, experts=(2, 2, 4), moe_layers=(1, 3, 5), tie_embeddings=tie)
    teacher = GPT(teacher_cfg, moe_impl="reference")
    init_weights(teacher, seed=1)
    with torch.no_grad():  # biases and norms start at 0 and 1: make them tell teacher from random init too
        g = torch.Generator().manual_seed(3)
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    save_weights(teacher, tmp_path)
    kept = select_layers(teacher_cfg, 5, 2, "paper")
    assert kept == [0, 2, 3, 4, 5]
    cfg = student_config(teacher_cfg, kept)

    random_student = GPT(cfg, moe_impl="reference")
    init_weights(random_student, seed=2)
    student = GPT(cfg, moe_impl="reference")
    init_weights(student, seed=2)
    init_from_teacher(student, tmp_path, kept)

    want = teacher.state_dict()
    got = student.state_dict()
    assert any(".deepspeed_experts.3." in n for n in got)  # the 4-expert top layer is there
    for name, tensor in got.items():
        assert torch.equal(tensor, want[teacher_name(name, kept)]), name
        assert not torch.equal(random_student.state_dict()[name], tensor), name


def _saved_teacher(tmp_path):
    """A 6-layer teacher (experts 2, 2, 4) saved into `tmp_path`, and the 5 layers the paper rule keeps."""
    teacher_cfg = model_config(layers=6, experts=(2, 2, 4), moe_layers=(1, 3, 5))
    teacher = GPT(teacher_cfg, moe_impl="reference")
    init_weights(teacher, seed=1)
    save_weights(teacher, tmp_path)
    return teacher_cfg, teacher, [0, 2, 3, 4, 5]


def test_init_from_teacher_rejects_a_wrong_expert_count(tmp_path):
    teacher_cfg, teacher, kept = _saved_teacher(tmp_path)
    # a student whose top layer has 2 experts would otherwise take experts 0-1 of the teacher's 4
    wrong = model_config(layers=5, experts=(2, 2), moe_layers=(2, 4))
    with pytest.raises(ValueError, match="student layer 4 has 2 experts, its teacher layer 5"):
        init_from_teacher(GPT(wrong, moe_impl="reference"), tmp_path, kept)


# -- block_importance ----------------------------------------------------------------------------

def _batches(cfg, n=2, B=2, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
        mask = torch.ones(B, T)
        mask[0, 5] = 0.0  # an end-of-document position
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask})
    return out


def _make_identity(block):
    """Zero every residual-branch output, so the block returns its input unchanged."""
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("attn.out_proj.") or ".fc2." in name:  # dense MLP, experts, residual MLP
                p.zero_()


@pytest.mark.parametrize("identity", [2, 3])  # a dense block and a residual MoE block
def test_block_importance_identity_block_scores_zero(identity):
    cfg = model_config(layers=4, experts=(2, 4), moe_layers=(1, 3))
    model = GPT(cfg, moe_impl="reference")
    init_weights(model, seed=0)
    _make_identity(model.blocks[identity])
    model.train()
    scores = block_importance(model, _batches(cfg))
    assert model.training  # the previous mode comes back
    assert len(scores) == cfg.layers
    for i, s in enumerate(scores):
        if i == identity:
            assert abs(s) < 1e-6, scores
        else:
            assert s > 0, scores


def test_block_importance_counts_only_real_tokens():
    # causal: the first half's hidden states do not see the second half, so masking the second
    # half out must give the scores of the first half alone
    cfg = model_config()
    model = GPT(cfg, moe_impl="reference")
    init_weights(model, seed=0)
    full = _batches(cfg, n=1, T=16)[0]
    half = {k: v[:, :8] for k, v in full.items()}
    masked = dict(full, loss_mask=torch.cat([full["loss_mask"][:, :8], torch.zeros(2, 8)], dim=1))
    assert block_importance(model, [masked]) == pytest.approx(block_importance(model, [half]), rel=1e-5)
    with pytest.raises(ValueError, match="no real token"):
        block_importance(model, [dict(full, loss_mask=torch.zeros(2, 16))])


# -- expert pruning -----------------------------------------------------------------------------

def _by_hand(model: GPT, batches, layer: int) -> tuple[list[float], list[float]]:
    """Frequency and REAP saliency of `layer`'s experts, from the definitions: a forward that records the MoE
    layer's input, then each expert run on the tokens whose top-k chose it."""
    import torch.nn.functional as F

    seen = []
    h = model.blocks[layer].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for b in batches:
            model.eval()(b["input_ids"])
    h.remove()
    x = torch.cat(seen)
    moe = model.blocks[layer].mlp.moe.deepspeed_moe
    with torch.no_grad():
        probs = F.linear(x.float(), moe.gate.wg.weight.float()).softmax(-1)
    top_p, top_i = probs.topk(model.cfg.top_k, dim=-1)
    E = probs.shape[1]
    freq = [float((top_i == e).sum()) / top_i.numel() for e in range(E)]
    sal = []
    for e in range(E):
        rows = (top_i == e).any(-1)
        if not rows.any():
            sal.append(0.0)
            continue
        w = probs[rows, e] / (top_p[rows].sum(-1) if model.cfg.top_k > 1 else 1.0)
        with torch.no_grad():
            y = moe.experts.deepspeed_experts[e](x[rows])
        sal.append(float((w * y.norm(dim=-1)).mean()))
    return freq, sal


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("impl", ["reference", "deepspeed"])
def test_expert_scores_are_frequency_and_reap_saliency(impl, top_k):
    """Both MoE implementations score as the definitions say; DeepSpeed's zero-padded capacity slots (each
    expert gets the busiest one's capacity at eval) do not count as tokens."""
    from distill.student import expert_scores

    cfg = model_config(layers=4, experts=(2, 8), moe_layers=(1, 3), top_k=top_k)
    model = GPT(cfg, moe_impl=impl)
    init_weights(model, seed=0)
    batches = _batches(cfg, n=2)
    freq, sal = expert_scores(model, batches, "frequency"), expert_scores(model, batches, "saliency")
    assert sorted(freq) == sorted(sal) == [1, 3]
    for layer in (1, 3):
        want_freq, want_sal = _by_hand(model, batches, layer)
        assert freq[layer] == pytest.approx(want_freq, abs=1e-12) and sum(freq[layer]) == pytest.approx(1.0)
        assert sal[layer] == pytest.approx(want_sal, rel=1e-5)
    with pytest.raises(RecipeError, match="student.expert_selection"):
        expert_scores(model, batches, "random")


def test_select_experts_keeps_the_best_in_id_order():
    from distill.student import select_experts

    assert select_experts([0.1, 0.5, 0.3, 0.5], 2) == [1, 3]
    assert select_experts([0.2, 0.2, 0.2, 0.1], 2) == [0, 1]  # ties: the lower id
    assert select_experts([0.1, 0.5, 0.3, 0.5], 4) == [0, 1, 2, 3]


def test_student_config_prunes_per_layer_and_refuses_more_than_the_teacher():
    kept = select_layers(TINY, layers=5, moe_count=2, method="paper")  # MoE layers with 4 and 8 experts
    assert student_config(TINY, kept, [2, 6]).experts == (2, 6)  # per layer, a pyramid still
    with pytest.raises(RecipeError, match=r"student.experts.1 = 9: between model.top_k \(1\) and the experts of its "
                                          r"teacher layer 5 \(8\)"):
        student_config(TINY, kept, [4, 9])
    with pytest.raises(RecipeError, match="student.experts.0 = 0"):
        student_config(TINY, kept, [0, 8])


def test_a_pruned_student_starts_from_the_kept_experts_and_their_router_rows(tmp_path):
    from distill.student import expert_scores, select_experts

    teacher_cfg, teacher, kept = _saved_teacher(tmp_path)
    ids = select_experts(expert_scores(teacher, _batches(teacher_cfg), "saliency")[5], 3)
    student = GPT(student_config(teacher_cfg, kept, [2, 3]), moe_impl="reference")
    init_from_teacher(student, tmp_path, kept, {5: ids})
    t, s = teacher.state_dict(), student.state_dict()
    gate = "mlp.moe.deepspeed_moe.gate.wg.weight"
    assert torch.equal(s[f"blocks.4.{gate}"], t[f"blocks.5.{gate}"][ids])
    for j, e in enumerate(ids):
        for suffix in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            name = f"blocks.4.mlp.moe.deepspeed_moe.experts.deepspeed_experts.{j}.{suffix}"
            assert torch.equal(s[name], t[f"blocks.5.mlp.moe.deepspeed_moe.experts.deepspeed_experts.{e}.{suffix}"])
    for name in ("blocks.4.mlp.moe.mlp.fc1.weight", "blocks.4.mlp.moe.coefficient.weight"):  # never pruned
        assert torch.equal(s[name], t[name.replace("blocks.4.", "blocks.5.")])
    assert not hasattr(student.blocks[4].mlp.moe.deepspeed_moe.gate.wg.weight, "pick")
    with pytest.raises(ValueError, match=r"kept experts of teacher layer 5 \(\[0, 0, 1\]\) must be 3 distinct"):
        init_from_teacher(student, tmp_path, kept, {5: [0, 0, 1]})
