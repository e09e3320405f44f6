"""A request as the serving engine holds it: its sampling parameters, its tokens, its text, its place in the scheduler.

    from export.serve.request import Request, SamplingParams
    req = Request(0, prompt=[15496, 995], params=SamplingParams(max_tokens=8, ignore_eos=True))

No torch here: the scheduler (export/serve/scheduler.py) and the HTTP layer use these without a model; the
ranks sample with export/serve/sampling.py. `SamplingParams` holds what vLLM's clients send (OpenAI's
fields plus `ignore_eos` and `min_tokens`). A request's text grows by incremental detokenization
(`Detokenizer`: tokenizers' DecodeStream, as vLLM), not by decoding all its tokens again every step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

# below this temperature sampling is greedy: logits / 1e-38 overflow to inf, and far above that the
# distribution is already one-hot in fp32
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # None is taken as []
    logprobs: int | None = None  # top alternatives per token (OpenAI completions' `logprobs`)
    echo: bool = False  # also return the prompt (and its tokens' log-probs with `logprobs`)
    ignore_eos: bool = False  # the end token does not finish the request (vLLM's; benchmarks use it)
    min_tokens: int = 0  # neither the end token nor a stop string finishes it before this many tokens (vLLM's)
    # vLLM's sampling fields (export/serve/sampling.py applies them as vLLM does)
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list | None = None  # [[token, bias]]
    stop_token_ids: list[int] = field(default_factory=list)  # these tokens finish it as the end token does
    grammar: str | None = None  # structured output: llguidance's grammar text (export/serve/grammar.py)


@dataclass(eq=False)  # a request is itself, not its fields: the scheduler's `in`/`remove` on its queues compare
class Request:       # identities (field-by-field equality cost ~0.6 ms a step at 32 running, growing as their square)
    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)  # of each generated token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # echo: None for the first token
    prompt_top: list[dict[int, float] | None] = field(default_factory=list)
    # the scheduler's (export/serve/scheduler.py): the data-parallel rank whose KV blocks hold it (kept over a
    # preemption: its sampler lives there), and how many of its tokens (prompt, then generated) are in them
    rank: int | None = None
    num_computed: int = 0
    preemptions: int = 0
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""  # generated text so far, cut at a stop string when one matched
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    done_at: float | None = None
    stream: object = None  # its Detokenizer's state: a tokenizers DecodeStream and the text it gave so far
    on_token: object = None  # callback(request) after every new token (streaming), from the engine's thread
    on_finish: object = None

    @property
    def tokens(self) -> list[int]:
        """Prompt, then generated: what its KV cache holds once computed (all but the last generated token)."""
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def tokens_between(self, lo: int, hi: int) -> list[int]:
        """`tokens[lo:hi]` without building `tokens` (a decode step's one token of a long prompt's sequence)."""
        P = len(self.prompt)
        return self.prompt[lo:hi] + self.generated[max(lo - P, 0):max(hi - P, 0)]

    def seed(self) -> int | None:
        """The seed of its generator on the rank that samples it: its own, or one drawn now when it is sampled (so
        that each sampled request has a generator of its own); None when it is greedy (nothing is drawn)."""
        if self.params.temperature < GREEDY_BELOW:
            return None
        return self.params.seed if self.params.seed is not None else random.getrandbits(62)

    @property
    def scores_prompt(self) -> bool:
        """echo + logprobs: every prompt position's log-probabilities (the prefix cache cannot give them)."""
        return self.params.echo and self.params.logprobs is not None

    def add_prompt_scores(self, start: int, scores: list) -> None:
        """echo + logprobs, one chunk of prompt positions at a time: `scores` [[log-probability, top alternatives
        as [[id, logprob]]]] of the prompt tokens start+1.. (`score_positions` on the rank that ran them)."""
        if start == 0:
            self.prompt_logprobs, self.prompt_top = [None], [None]
        for lp, top in scores:
            self.prompt_logprobs.append(lp)
            self.prompt_top.append({int(i): v for i, v in top})

    def take(self, token: int, logprob: float | None, top, eos: int | None, decode) -> bool:
        """The token sampled for this request (by the rank that holds its row), unless max_tokens is already
        reached (max_tokens=0: nothing to sample). True if the token was taken."""
        if len(self.generated) >= self.params.max_tokens:
            self.finish(self.finish_reason or "length")
            return False
        self.append(token, logprob, None if top is None else {int(i): v for i, v in top}, eos, decode)
        return True

    def append(self, token: int, logprob: float | None, top: dict[int, float] | None, eos: int | None,
               decode: Detokenizer) -> None:
        """Take `token` (and its log-probability and top alternatives when asked for): the end token finishes
        (unless `ignore_eos`), a stop string cuts the text and finishes (not before `min_tokens`), max_tokens
        finishes; otherwise `on_token` hears of it."""
        if logprob is not None:
            self.token_logprobs.append(logprob)
            self.top_logprobs.append(top or {})
        self.first_token_at = self.first_token_at or time.perf_counter()
        self.generated.append(token)
        early = len(self.generated) < self.params.min_tokens
        if not early and ((token == eos and not self.params.ignore_eos) or token in (self.params.stop_token_ids or ())):
            self.generated.pop()
            if self.token_logprobs:
                self.token_logprobs.pop()
                self.top_logprobs.pop()
            self.text = decode.final(self)
            self.finish("stop")
            return
        before, self.text = len(self.text), decode(self)
        # a stop string is looked for where it could end in this token's text: not in text from before min_tokens
        stops = () if early else self.params.stop or ()
        found = [i for s in stops if s and (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.finish("stop")
            return
        if self.on_token is not None:
            self.on_token(self)
        if len(self.generated) >= self.params.max_tokens:
            self.text = decode.final(self)
            self.finish("length")

    def banned(self, eos: int | None) -> list[int] | None:
        """The tokens its next token may not be (None: any): before min_tokens, the end token (unless ignore_eos)
        and the stop tokens, as vLLM masks them."""
        if len(self.generated) >= self.params.min_tokens:
            return None
        out = ([eos] if eos is not None and not self.params.ignore_eos else []) + list(self.params.stop_token_ids or ())
        return out or None

    def stable_text(self) -> str:
        """The part of `text` no later token can change: for streaming. Held back: a tail the tokenizer could
        not decode yet ("\ufffd": a multibyte character split over tokens, which byte-level BPE decodes
        later) and a tail that begins a stop string (it is cut if the stop string completes)."""
        text = self.text
        if self.finished:
            return text
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        text = text[:end]
        hold = 0
        for s in self.params.stop or ():
            for k in range(min(len(s) - 1, len(text)), hold, -1):  # the longest tail that is a prefix of s
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason, self.done_at = True, reason, time.perf_counter()
        if self.on_finish is not None:
            self.on_finish(self)

    def end(self, reason: str) -> None:
        """Finish it, unless it is finished, never raising: where a request is ended from outside (aborted, failed,
        the engine stopping) its client may be gone, and nobody is left to tell."""
        if self.finished:
            return
        try:
            self.finish(reason)
        except Exception:  # noqa: BLE001 - its callback (its client's event loop) failed
            pass


class Detokenizer:
    """A request's text after each new token, equal to `tokenizer.decode(generated)`. Decoding every token again
    at each step costs O(length): ~340 us at 2,000 tokens with GPT-2's tokenizer, every step, for every running
    request. With a fast tokenizer, tokenizers' `DecodeStream` decodes only the tokens since the last whole
    character instead (~1 us; what vLLM does): a character split over tokens appears once whole. At the end
    (`final`) the whole text is decoded once, so a request's final text is exactly the tokenizer's decode. A
    tokenizer that cleans up spaces after decoding (transformers' clean_up_tokenization_spaces), which a stream
    cannot know, is decoded whole every time."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.tokenizer, self.backend = tokenizer, backend if backend is not None and not cleans else None

    def __call__(self, req: Request) -> str:
        if self.backend is None:
            return self.tokenizer.decode(req.generated)
        if req.stream is None:
            from tokenizers.decoders import DecodeStream

            req.stream = [DecodeStream(skip_special_tokens=False), ""]
        chunk = req.stream[0].step(self.backend, req.generated[-1])
        if chunk:
            req.stream[1] += chunk
        return req.stream[1]

    def final(self, req: Request) -> str:
        return self.tokenizer.decode(req.generated)
