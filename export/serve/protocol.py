"""The OpenAI-compatible request bodies `moe-pipeline serve` takes, validated into the engine's `SamplingParams`.

    from export.serve.protocol import BadRequest, parse_completion
    req, encoded, texts = parse_completion(body, engine, "tiny-student", max_prompts=64)   # or BadRequest (4xx)
    params = req.sampling()                                  # export/serve/request.py SamplingParams

As vLLM's `entrypoints/openai/protocol.py`: OpenAI's fields (max_tokens, temperature, top_p, n, seed, stop,
logprobs, echo, presence_penalty, frequency_penalty, logit_bias, response_format; chat's logprobs and top_logprobs)
and vLLM's (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, structured_outputs and the
older guided_json / guided_regex / guided_choice / guided_grammar). Every field the server takes changes what it
does; a field it does not take is refused with a 400 naming it, unless it cannot change the output (`IGNORED`:
user, metadata, ...) or holds the value that means what the server does anyway (`NEUTRAL`: echo false,
skip_special_tokens true, ...). A silently ignored field would give a client text it did not ask for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from export.serve.grammar import grammar_of
from export.serve.request import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# fields that cannot change what is generated: taken and ignored, as OpenAI and vLLM take them
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     "request_id", "priority", "cache_salt", "parallel_tool_calls", "kv_transfer_params",
                     "vllm_xargs", "documents", "chat_template_kwargs"})
# fields taken where they hold a value that asks for nothing more than the server does anyway
NEUTRAL = {"best_of": (None, 1), "suffix": (None, ""), "include_stop_str_in_output": (False,),
           "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "tools": (None, []),
           "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
           "use_beam_search": (False,), "length_penalty": (1, 1.0), "bad_words": (None, []),
           "allowed_token_ids": (None,), "prompt_logprobs": (None,), "add_generation_prompt": (True,),
           "continue_final_message": (False,), "add_special_tokens": (None,), "truncate_prompt_tokens": (None,),
           "return_tokens_as_token_ids": (None, False), "guided_decoding_backend": (None,),
           "structured_outputs_backend": (None,), "echo": (False,)}


class BadRequest(Exception):
    """A request the server refuses: the HTTP status and the OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.body = status, error_body(message, param, kind)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def check_text(text) -> None:
    """JSON can carry a lone surrogate ("\\ud800") that no UTF-8 tokenizer can encode: refuse it here."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (it holds a lone surrogate such as \\ud800)") from None


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`; other keys (vLLM's `continuous_usage_stats`) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=False)

    include_usage: bool = False


class JsonSchema(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema and its name (`strict` is what the server does anyway)."""

    model_config = ConfigDict(extra="forbid", strict=False)

    name: str | None = None
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(extra="forbid", strict=False)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of them): a JSON schema, any JSON object, a regular expression, a choice of
    strings, or a Lark grammar."""

    model_config = ConfigDict(extra="forbid", strict=False, populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class Sampled(BaseModel):
    """The sampling fields both endpoints take (OpenAI's and vLLM's, with vLLM's ranges)."""

    model_config = ConfigDict(extra="allow", strict=False)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: every token
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}, OpenAI's
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's
    min_tokens: int = Field(0, ge=0)  # vLLM's
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None  # vLLM's older names of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        for item in items:
            check_text(item)
        return items

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys are token ids as strings, not {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases lie in [-100, 100], not {bias}")
        return v

    def constraint(self) -> tuple[str, str, object] | None:
        """(the field that asks for it, the grammar kind, its value) of the one output constraint asked for; None
        for none; BadRequest when two are asked for."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", "json_object", None))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise BadRequest(400, "response_format: type json_schema needs a json_schema: {\"name\": ..., "
                                 "\"schema\": {...}}", "response_format")
            asked.append(("response_format", "json_schema", rf.json_schema.schema_))
        so = self.structured_outputs
        if so is not None:
            for kind, value in (("json_schema", so.json_), ("json_object", so.json_object or None),
                                ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
                if value is not None:
                    asked.append((f"structured_outputs.{'json' if kind == 'json_schema' else kind}", kind, value))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, kind, getattr(self, name)))
        if len(asked) > 1:
            names = ", ".join(a[0] for a in asked)
            raise BadRequest(400, f"{asked[1][0]}: one output constraint a request, not {len(asked)} ({names})",
                             asked[1][0])
        return asked[0] if asked else None

    def common(self, vocab: int) -> dict:
        """SamplingParams' fields these settings give, checked against the model's vocabulary; BadRequest naming
        the field."""
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        for name, ids in (("logit_bias", list(bias)), ("stop_token_ids", self.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise BadRequest(400, f"{name}: token ids lie in [0, {vocab}), not {bad[0]}", name)
        grammar = None
        asked = self.constraint()
        if asked is not None:
            field, kind, value = asked
            try:
                grammar = grammar_of(kind, value)
            except ValueError as err:
                raise BadRequest(400, f"{field}: {err}", field.split(".")[0]) from None
        return dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=list(self.stop or []),
                    ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, top_k=self.top_k, min_p=self.min_p,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty,
                    logit_bias=[[t, b] for t, b in bias.items()] or None,
                    stop_token_ids=list(self.stop_token_ids or []), grammar=grammar)

    def refuse_unknown(self) -> None:
        """400 naming the first field the server does not take and that could change the output."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED or (name in NEUTRAL and value in NEUTRAL[name]):
                continue
            why = f"only {' or '.join(repr(v) for v in NEUTRAL[name])} is supported" if name in NEUTRAL else \
                "not supported by this server"
            raise BadRequest(400, f"{name}: {why}; remove it (ignoring it would change what you asked for)", name)


class CompletionRequest(Sampled):
    """OpenAI's legacy /v1/completions."""

    # text, several texts, or token ids (one list, or one list per prompt) as OpenAI's API allows;
    # lm-eval's local-completions sends token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        items = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not items or any(len(p) == 0 for p in items):
            raise ValueError("must be a non-empty string, token-id list, or list of them (none empty)")
        for p in items:
            check_text(p)
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def sampling(self, vocab: int | None = None) -> SamplingParams:
        common = self.common(vocab) if vocab is not None else {}
        return SamplingParams(**{**dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                                        stop=list(self.stop or []), ignore_eos=self.ignore_eos,
                                        min_tokens=self.min_tokens), **common},
                              max_tokens=self.max_tokens, logprobs=self.logprobs, echo=self.echo)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        check_text(v)
        return v


class ChatRequest(Sampled):
    """OpenAI's /v1/chat/completions (text messages)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def sampling(self, vocab: int | None = None) -> SamplingParams:
        common = self.common(vocab) if vocab is not None else {}
        return SamplingParams(**{**dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                                        stop=list(self.stop or []), ignore_eos=self.ignore_eos,
                                        min_tokens=self.min_tokens), **common},
                              max_tokens=self.max_completion_tokens or self.max_tokens or 16,
                              logprobs=(self.top_logprobs or 0) if self.logprobs else None)


def check_options(req: CompletionRequest | ChatRequest) -> None:
    """What a field alone cannot check: min_tokens within max_tokens, stream_options only with stream (as vLLM),
    chat's top_logprobs only with logprobs, and no field the server would ignore."""
    req.refuse_unknown()
    max_tokens = req.sampling().max_tokens
    if req.min_tokens > max_tokens:
        raise BadRequest(400, f"min_tokens: must be less than or equal to max_tokens ({req.min_tokens} > "
                         f"{max_tokens})", "min_tokens")
    if req.stream_options is not None and not req.stream:
        raise BadRequest(400, "stream_options: can only be defined when `stream` is true", "stream_options")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise BadRequest(400, "top_logprobs: needs \"logprobs\": true", "top_logprobs")


def validated(schema: type[BaseModel], raw, model_name: str):
    """A request body checked against `schema` and the served model's name, or BadRequest naming the field."""
    if not isinstance(raw, dict):
        raise BadRequest(400, "the body must be a JSON object")
    try:
        req = schema.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None  # the request's field ('prompt', not 'prompt.str')
        raise BadRequest(400, f"{param}: {first['msg']}", param) from None
    if req.model not in (None, model_name):
        raise BadRequest(404, f"model {req.model!r} is not served here; this server serves {model_name!r}", "model",
                         "not_found_error")
    return req


def parse_chat(raw, engine, model_name: str, max_prompts: int = 64) -> tuple[ChatRequest, list[int], SamplingParams]:
    """(the request, the rendered conversation's token ids, its sampling) of a /v1/chat/completions body, or
    BadRequest."""
    req = validated(ChatRequest, raw, model_name)
    check_options(req)
    if req.n > max_prompts:
        raise BadRequest(400, f"n: {req.n} choices in one request; at most {max_prompts} (--max-prompts)", "n")
    params = req.sampling(engine.cfg.vocab_size)
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise BadRequest(400, "messages: this model's tokenizer has no chat template (a base model); send a prompt "
                         "to /v1/completions instead", "messages")
    try:
        ids = tok.apply_chat_template([m.model_dump() for m in req.messages], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    except Exception as err:  # noqa: BLE001 - a template that rejects these messages (roles out of order, say)
        raise BadRequest(400, f"messages: the chat template refused them ({type(err).__name__}: {err})",
                         "messages") from None
    ids = list(ids)
    max_tokens = params.max_tokens
    if len(ids) + max_tokens > engine.max_model_len:
        param = "messages" if len(ids) >= engine.max_model_len else "max_tokens"
        raise BadRequest(400, f"{param}: the conversation's {len(ids)} tokens + max_tokens {max_tokens} exceed the "
                         f"maximum model length of {engine.max_model_len} tokens (--max-model-len)", param)
    return req, ids, params


def parse_completion(raw, engine, model_name: str,
                     max_prompts: int) -> tuple[CompletionRequest, list[list[int]], list[str], SamplingParams]:
    """(the request, each prompt's token ids, each prompt's text, the sampling) of a /v1/completions body, or
    BadRequest."""
    req = validated(CompletionRequest, raw, model_name)
    check_options(req)
    prompts = req.prompts()
    if req.stream and len(prompts) > 1:
        raise BadRequest(400, "stream supports one prompt per request", "prompt")
    if len(prompts) * req.n > max_prompts:
        param = "n" if req.n > 1 else "prompt"
        raise BadRequest(400, f"{param}: {len(prompts)} prompts x n {req.n} in one request; at most {max_prompts} "
                         "(--max-prompts)", param)
    params = req.sampling(engine.cfg.vocab_size)
    encoded = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    vocab, context = engine.cfg.vocab_size, engine.max_model_len
    if any(not 0 <= t < vocab for p in encoded for t in p):
        raise BadRequest(400, f"prompt: token ids must lie in [0, {vocab})", "prompt")
    for p in encoded:
        if len(p) + req.max_tokens > context:
            param = "prompt" if len(p) >= context else "max_tokens"
            raise BadRequest(400, f"{param}: the prompt's {len(p)} tokens + max_tokens {req.max_tokens} exceed the "
                             f"maximum model length of {context} tokens (--max-model-len)", param)
    texts = [p if isinstance(p, str) else engine.decode(p) for p in prompts]  # for echo
    return req, encoded, texts, params
