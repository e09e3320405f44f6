"""export/serve/kv_cache.py through the engine: a paged KV cache sized by a memory budget gives every request what it
would get alone, through preemption and recomputation and through prefix-cache hits; the budget and the model
length it serves; the request fields vLLM's clients send (ignore_eos, min_tokens)."""

from __future__ import annotations

import pytest
import torch

from conftest import model_config


@pytest.fixture(scope="module")
def model():
    from pipeline.model import GPT, init_weights

    cfg = model_config(vocab_size=50304, seq_len=64)
    m = GPT(cfg, moe_impl="reference")
    init_weights(m, 5)
    return m.eval()


@pytest.fixture(scope="module")
def tokenizer(model):
    from pipeline.data import gpt2_tokenizer

    return gpt2_tokenizer(model.cfg.seq_len)


def engine_with_blocks(model, tokenizer, blocks: int, block_size: int = 4, **kw):
    from export.serve.engine import Engine
    from export.serve.kv_cache import block_bytes

    per_block = block_bytes(model.cfg, model.cfg.kv_heads, block_size, torch.float32)
    return Engine(model, tokenizer, kv_cache_memory=blocks * per_block / 2**30, block_size=block_size, **kw)


def alone(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """Greedy tokens by full forwards without any cache: the reference."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            if t == eos:
                break
            seq.append(t)
    return seq[len(prompt):]


PROMPTS = ["And God said, Let there be light", "To be, or not to be, that is the question", "The LORD is my shepherd",
           "O Romeo, Romeo, wherefore art thou Romeo", "Now the serpent was more subtil"]


def test_preempted_sequences_are_recomputed_and_give_the_uninterrupted_greedy_tokens(model, tokenizer):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    # 10 blocks of 4 tokens: one sequence of 40 tokens fits, five of ~30 do not: the newest are preempted
    engine = engine_with_blocks(model, tokenizer, blocks=10)
    assert engine.max_model_len == 40 and "lowered from 64" in engine.kv.describe()
    prompts = [engine.encode(p) for p in PROMPTS]
    seqs = generate(engine, prompts, SamplingParams(max_tokens=20, temperature=0))
    assert engine.scheduler.stats["preemptions"] > 0 and sum(s.preemptions for s in seqs) > 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.generated == alone(model, prompt, 20, engine.eos)
    assert engine.scheduler.pools[0].used() == 0 and not engine.scheduler.tables  # the ranks hear with the next step


def test_a_prefix_cache_hit_gives_the_tokens_and_logprobs_of_a_miss(model, tokenizer):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    engine = engine_with_blocks(model, tokenizer, blocks=64)
    prompt = engine.encode("In the beginning God created the heaven and the earth. And the earth was without form")
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    (miss,) = generate(engine, [prompt], params)
    assert engine.scheduler.stats["prefix_hits"] == 0
    (hit,) = generate(engine, [prompt], params)
    assert engine.scheduler.stats["prefix_hits"] == (len(prompt) - 1) // 4 * 4  # every full block but the last token
    assert hit.generated == miss.generated == alone(model, prompt, 8, engine.eos)
    assert hit.token_logprobs == pytest.approx(miss.token_logprobs, abs=1e-5)
    # a prompt that shares the first blocks only, then goes its own way
    other = prompt[:9] + engine.encode(" and void; and darkness was upon the face")
    (branch,) = generate(engine, [other], params)
    assert branch.generated == alone(model, other, 8, engine.eos)


def test_several_prompts_share_one_prefix_in_one_step_and_each_gets_its_own_tokens(model, tokenizer):
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    engine = engine_with_blocks(model, tokenizer, blocks=64)
    system = engine.encode("You are a helpful assistant who answers in the words of the King James Bible.")
    generate(engine, [system + engine.encode(" Hello")], SamplingParams(max_tokens=1, temperature=0))
    prompts = [system + engine.encode(q) for q in (" Who made the light?", " What is man?", " Where is Eden?")]
    seqs = generate(engine, prompts, SamplingParams(max_tokens=6, temperature=0))
    assert engine.scheduler.stats["prefix_hits"] >= 3 * (len(system) // 4 * 4)
    for prompt, seq in zip(prompts, seqs):
        assert seq.generated == alone(model, prompt, 6, engine.eos)


def test_the_model_length_and_the_budget_are_checked_with_the_flags_named(model, tokenizer):
    from export.serve.engine import Engine
    from export.serve.kv_cache import plan_kv
    from export.serve.request import SamplingParams

    engine = Engine(model, tokenizer, max_model_len=32, kv_cache_memory=0.01)
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="maximum model length of 32"):
        engine.submit(engine.encode("And God said"), SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="--max-model-len 65: the model's context is 64"):
        Engine(model, tokenizer, max_model_len=65)
    with pytest.raises(ValueError, match="--kv-cache-memory: .* holds no KV block"):
        Engine(model, tokenizer, kv_cache_memory=1e-9)
    # by default: no more blocks than --max-batch sequences of the model length fill
    default = plan_kv(model.cfg, model.cfg.kv_heads, torch.float32, torch.device("cpu"), max_batch=3)
    assert default.blocks == 3 * 64 // 16 and default.max_model_len == 64 and "default" in default.budget


def test_ignore_eos_and_min_tokens(model, tokenizer):
    """The end token finishes a request unless ignore_eos; before min_tokens it cannot be sampled at all."""
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    engine = engine_with_blocks(model, tokenizer, blocks=64)
    prompt = engine.encode("And God said")
    first = alone(model, prompt, 1, None)[0]
    engine.eos = first  # the model's first greedy token plays the end token
    (stopped,) = generate(engine, [prompt], SamplingParams(max_tokens=6, temperature=0))
    assert stopped.generated == [] and stopped.finish_reason == "stop"
    (ignored,) = generate(engine, [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(ignored.generated) == 6 and ignored.generated[0] == first and ignored.finish_reason == "length"
    (held,) = generate(engine, [prompt], SamplingParams(max_tokens=6, temperature=0, min_tokens=3))
    assert len(held.generated) >= 3 and first not in held.generated[:3]


def test_a_stop_string_counts_only_from_min_tokens_on():
    """Text generated before min_tokens may hold the stop string: it is not cut there, only at a later one."""
    from export.serve.request import Request, SamplingParams

    class Decode:  # each token id is one character of text
        def __call__(self, req):
            return "".join(chr(t) for t in req.generated)

        final = __call__

    req = Request(0, [1], SamplingParams(max_tokens=10, min_tokens=4, stop=["\n"]))
    for ch in "a\nbc":  # a newline before min_tokens: kept
        req.append(ord(ch), None, None, None, Decode())
    assert not req.finished and req.text == "a\nbc"
    for ch in "d\ne":
        req.append(ord(ch), None, None, None, Decode())
    assert req.finished and req.finish_reason == "stop" and req.text == "a\nbcd"


def qwen_like(dtype, seq_len: int = 64):
    """A tiny model with rotary positions, grouped-query attention with per-head q/k norms, SwiGLU top-2 experts."""
    from pipeline.model import GPT, init_weights

    cfg = model_config(vocab_size=256, seq_len=seq_len, hidden=64, heads=4, kv_heads=2, positions="rope",
                       norm="rmsnorm", qk_norm="head", activation="swiglu", mlp_type="standard", experts=(4, 4),
                       top_k=2, tie_embeddings=False)
    model = GPT(cfg, moe_impl="reference")
    init_weights(model, 3)
    return model.eval().to(dtype)


@pytest.mark.parametrize("kernel_rows", [1, 3, 64])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_a_packed_forward_of_decode_tokens_and_prompt_chunks_equals_each_row_alone(dtype, tol, kernel_rows,
                                                                                    monkeypatch):
    """Rows of different lengths packed one after another ([1, N], no padding: how decode tokens and prompt chunks
    share a forward) give each row the hidden states, and write the keys, that it gets in a forward of its own: a
    decode token after 5 cached, a prompt from position 0, a chunk after a 4-token prefix, a second decode token;
    rotary positions, grouped-query attention with per-head q/k norms, as Qwen3-MoE. The rows longer than
    `--attention-kernel-rows` attend in scaled_dot_product_attention, the others in the kernel, a token a row: all of them in
    SDPA (1), the 3-token chunk in the kernel and the 7-token prompt in SDPA (3), every row in the kernel (64)."""
    from export.serve.kernels import options
    from export.serve.kv_cache import PagedCache

    monkeypatch.setattr(options, "_current", options.KernelOptions(attention_kernel_rows=kernel_rows))
    model = qwen_like(dtype)
    cfg = model.cfg

    def cache():
        c = PagedCache(cfg, blocks=16, block_size=4, heads=2, dtype=dtype)
        if not c.packs:
            pytest.skip("the CPU attention kernel is not available here")
        for seq, blocks in {0: [3, 9], 1: [1, 5], 2: [7, 2, 11], 3: [4, 8]}.items():
            c.extend(seq, blocks)
        return c

    gen = torch.Generator().manual_seed(0)
    history = {0: 5, 1: 0, 2: 4, 3: 6}  # tokens cached before the forward
    new = {0: 1, 1: 7, 2: 3, 3: 1}
    tokens = {s: torch.randint(0, 256, (history[s] + new[s],), generator=gen) for s in history}
    with torch.no_grad():
        alone, packed = cache(), cache()
        for c in (alone, packed):  # each row's history, row by row
            for s, n in history.items():
                if n:
                    model(tokens[s][None, :n], cache=c.select([s], [0], [n]), hidden_only=True)
        want = {s: model(tokens[s][None, history[s]:], cache=alone.select([s], [history[s]], [new[s]]),
                         hidden_only=True).hidden[0] for s in history}
        seqs = list(history)
        flat = torch.cat([tokens[s][history[s]:] for s in seqs])[None]
        got = model(flat, cache=packed.select(seqs, [history[s] for s in seqs], [new[s] for s in seqs], packed=True),
                    hidden_only=True).hidden[0]
    off = 0
    for s in seqs:
        torch.testing.assert_close(got[off:off + new[s]].float(), want[s].float(), atol=tol, rtol=tol)
        off += new[s]
    for layer in range(cfg.layers):
        torch.testing.assert_close(packed.k[layer], alone.k[layer], atol=tol, rtol=tol)
        torch.testing.assert_close(packed.v[layer], alone.v[layer], atol=tol, rtol=tol)


def test_a_packed_forward_may_reach_the_context_end_and_not_past_it():
    """The context check of a packed forward is each row's own end: rows of 15 + 1 and 10 + 6 tokens in a context of
    16 run (16 new tokens in all), one row past it is refused with the context named."""
    from export.serve.kv_cache import PagedCache

    model = qwen_like(torch.float32, seq_len=16)
    cache = PagedCache(model.cfg, blocks=16, block_size=4, heads=2)
    if not cache.packs:
        pytest.skip("the CPU attention kernel is not available here")
    cache.extend(0, [0, 1, 2, 3])
    cache.extend(1, [4, 5, 6, 7])
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 10)), cache=cache.select([0, 1], [0, 0], [10, 10]), hidden_only=True)
        model(torch.randint(0, 256, (1, 5)), cache=cache.select([0], [10], [5]), hidden_only=True)
        out = model(torch.randint(0, 256, (1, 7)), cache=cache.select([0, 1], [15, 10], [1, 6], packed=True),
                    hidden_only=True)
        assert out.hidden.shape == (1, 7, model.cfg.hidden)
        cache.extend(0, [8])  # room in the cache: the model refuses it
        with pytest.raises(ValueError, match="17 tokens exceed the model's context of 16"):
            model(torch.randint(0, 256, (1, 2)), cache=cache.select([0, 1], [16, 14], [1, 1], packed=True),
                  hidden_only=True)
