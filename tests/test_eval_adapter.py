"""The lm-eval adapter (eval/adapter.py): its model_args, and its answers against the model's own logits
(log-likelihoods, is_greedy, rolling windows, generation).

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_eval_adapter.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


@pytest.fixture(scope="module")
def lm(small_run):
    from eval.adapter import MoEPipelineLM

    return MoEPipelineLM(path=str(small_run), stage="student", batch_size=3, progress=False)


def test_an_unknown_model_arg_is_an_error_naming_it_before_any_model_is_loaded(tmp_path):
    from eval.adapter import MoEPipelineLM

    # the path does not exist: had the key check come after loading, this would be a FileNotFoundError
    with pytest.raises(ValueError) as err:
        MoEPipelineLM(path=str(tmp_path / "nope"), batchsize=8)
    msg = str(err.value)
    assert "'batchsize'" in msg and "moe-pipeline" in msg and "did you mean 'batch_size' for 'batchsize'?" in msg
    assert "accepted: path, stage, batch_size, max_length, dtype, ep_size" in msg
    with pytest.raises(ValueError, match="unknown keys 'pretrained', 'stages'"):
        MoEPipelineLM(path=str(tmp_path / "nope"), pretrained="gpt2", stages="teacher")
    with pytest.raises(ValueError, match="progress='no': true or false"):
        MoEPipelineLM(path=str(tmp_path / "nope"), progress="no")


def test_the_keys_lm_eval_itself_passes_are_accepted(small_run):
    """`lm-eval run` adds batch_size, max_batch_size and device (evaluator.simple_evaluate's additional_config,
    None values dropped) and, with --trust_remote_code, trust_remote_code=True to the model_args."""
    from eval.adapter import MoEPipelineLM, model_args

    lm = MoEPipelineLM.create_from_arg_string(
        f"path={small_run},stage=student,progress=false,trust_remote_code=True",
        {"batch_size": "auto:4", "max_batch_size": 64, "device": "cuda:0"})
    assert lm.batch_size == 32 and lm.progress is False and lm.ref.stage == "student"
    assert {"batch_size", "max_batch_size", "device", "trust_remote_code", "progress"} <= set(model_args())


def direct_score(lm, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """One request, one forward of exactly its tokens (no batch, no padding), left-truncated like HF's."""
    whole = (ctx + cont)[-(lm.max_length + 1):]
    inp = torch.tensor([whole[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(lm.model(inp).logits[0].float(), -1)
    n = len(cont)
    rows, target = logp[-n:], torch.tensor(whole[-n:])
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def test_run_directory_resolves_to_the_requested_stage(lm, small_run):
    assert lm.ref.stage == "student" and lm.ref.path == small_run / "student"
    assert lm.max_length == lm.model.cfg.seq_len == 64
    assert lm.eot_token_id == lm.tokenizer.eos_token_id


def test_batched_loglikelihood_equals_sums_of_the_models_log_probs(lm):
    texts = [("And God said,", " Let there be light"), ("In the beginning", " God created the heaven"),
             ("To be, or not to be,", " that is the question"), ("", "Hello"),
             # longer than the 64-token context: left-truncated with the continuation kept
             (" ".join(["and the earth was without form, and void;"] * 12), " and darkness was upon the face")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(texts)]
    got = lm.loglikelihood(requests, disable_tqdm=True)  # batch 3: mixed lengths, right padding
    assert len(got) == len(texts)
    for (ctx, cont), (score, greedy) in zip(texts, got):
        if ctx:
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        else:
            ctx_ids, cont_ids = [lm.prefix_token_id], lm.tok_encode(cont)
        ref_score, ref_greedy = direct_score(lm, ctx_ids, cont_ids)
        assert score == pytest.approx(ref_score, abs=1e-3, rel=1e-5)
        assert greedy == ref_greedy
        assert score < 0


def test_is_greedy_on_a_greedy_continuation_and_on_a_changed_one(lm):
    ctx = lm.tok_encode("And the LORD spake unto Moses, saying")
    cont = []
    with torch.no_grad():
        for _ in range(4):  # the model's own argmax continuation, by full forwards
            logits = lm.model(torch.tensor([ctx + cont])).logits[0, -1]
            cont.append(int(logits.argmax()))
        last = lm.model(torch.tensor([ctx + cont[:-1]])).logits[0, -1]
    worse = int(last.argsort(descending=True)[5])  # the 6th most likely token: not greedy
    (_, greedy), (_, changed) = lm._loglikelihood_tokens(
        [(None, ctx, cont), (None, ctx, cont[:-1] + [worse])], disable_tqdm=True)
    assert greedy is True
    assert changed is False


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(lm):
    text = " ".join(["In the beginning God created the heaven and the earth."] * 20)
    tokens = lm.tok_encode(text)
    assert len(tokens) > 3 * lm.max_length
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=tokens, prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)]
    assert [t for _, cont in windows for t in cont] == tokens  # every token scored exactly once
    expected = sum(direct_score(lm, ctx, cont)[0] for ctx, cont in windows)
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert got == pytest.approx(expected, rel=1e-5)


def test_generate_until_matches_a_cache_free_greedy_loop_and_cuts_at_the_stop_string(lm):
    prompt = "And God said"
    ids = lm.tok_encode(prompt)
    out = []
    with torch.no_grad():
        for _ in range(12):  # no KV cache: the whole sequence every step
            out.append(int(lm.model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    full = lm.tok_decode(out)
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\x00never"], "max_gen_toks": 12}),
                                          0)], disable_tqdm=True)
    if lm.eot_token_id in out:  # generation stops at the end-of-document token
        full = lm.tok_decode(out[:out.index(lm.eot_token_id)])
    assert text == full
    stop = text.strip()[:2]
    if stop:  # a stop string taken from the output itself: the result ends before its first occurrence
        (cut,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0)],
                                   disable_tqdm=True)
        assert cut == full[:full.index(stop)]
