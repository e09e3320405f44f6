"""The HTTP front end of `moe-pipeline serve`: an OpenAI-compatible API (FastAPI) over the engine.

    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny-student", "prompt": "And God said", "max_tokens": 32, "stream": true}'
    lm-eval run --model local-completions --tasks tiny_lastword \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=tiny-student,max_length=127

Endpoints: `POST /v1/completions` (prompt as a string, token ids, or a list of either; max_tokens,
temperature, top_p, seed, stop, stream (SSE), logprobs, echo), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text, export/serve/metrics.py), and vLLM's `GET /tokenizer_info`,
`POST /tokenize`, `POST /detokenize`, so that lm-eval's `local-completions` model evaluates
log-likelihood tasks against the server.

Bad requests get a 4xx with an OpenAI-style error body naming the field; bodies above
`--max-body-bytes` get 413. With an API key every endpoint but /health needs `Authorization:
Bearer KEY`. The app submits work to the engine loop (export/serve/server.py) and awaits it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

from fastapi import Request  # at module level: FastAPI resolves the handlers' (string) annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from export.serve.engine import Request as EngineRequest
from export.serve.engine import SamplingParams
from export.serve.metrics import CONTENT_TYPE, ServeMetrics


class CompletionRequest(BaseModel):
    """The fields of OpenAI's legacy /v1/completions we implement; other fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: str | None = None
    # text, several texts, or token ids (one list, or one list per prompt) as OpenAI's API allows;
    # lm-eval's local-completions sends token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    n: Literal[1] = 1

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        items = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not items or any(len(p) == 0 for p in items):
            raise ValueError("must be a non-empty string, token-id list, or list of them (none empty)")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        return items

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, stop=list(self.stop or []), logprobs=self.logprobs, echo=self.echo)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class BadRequest(Exception):
    """A request the server refuses: the HTTP status and the OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.body = status, error_body(message, param, kind)


def parse_completion(raw, engine, model_name: str) -> tuple[CompletionRequest, list[list[int]], list[str]]:
    """(the request, each prompt's token ids, each prompt's text) of a /v1/completions body, or BadRequest."""
    if not isinstance(raw, dict):
        raise BadRequest(400, "the body must be a JSON object")
    try:
        req = CompletionRequest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None  # the request's field ('prompt', not 'prompt.str')
        raise BadRequest(400, f"{param}: {first['msg']}", param) from None
    if req.model not in (None, model_name):
        raise BadRequest(404, f"model {req.model!r} is not served here; this server serves {model_name!r}", "model",
                         "not_found_error")
    prompts = req.prompts()
    if req.stream and len(prompts) > 1:
        raise BadRequest(400, "stream supports one prompt per request", "prompt")
    encoded = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    vocab, context = engine.cfg.vocab_size, engine.cfg.seq_len
    if any(not 0 <= t < vocab for p in encoded for t in p):
        raise BadRequest(400, f"prompt: token ids must lie in [0, {vocab})", "prompt")
    for p in encoded:
        if len(p) + req.max_tokens > context:
            param = "prompt" if len(p) >= context else "max_tokens"
            raise BadRequest(400, f"{param}: the prompt's {len(p)} tokens + max_tokens {req.max_tokens} exceed the "
                             f"model's context of {context} tokens", param)
    texts = [p if isinstance(p, str) else engine.decode(p) for p in prompts]  # for echo
    return req, encoded, texts


def logprobs_body(engine, req: EngineRequest, echo: bool) -> dict:
    """OpenAI's completions `logprobs` object: tokens, their log-probs, the top alternatives, text offsets."""
    toks, lps, tops = [], [], []
    ids = (req.prompt if echo else []) + req.generated
    if echo:
        lps += req.prompt_logprobs
        tops += req.prompt_top
    lps += req.token_logprobs[:len(req.generated)]
    tops += req.top_logprobs[:len(req.generated)]
    offsets, pos = [], 0
    for t in ids:
        s = engine.decode([t])
        toks.append(s)
        offsets.append(pos)
        pos += len(s)
    top = [None if d is None else {engine.decode([k]): v for k, v in d.items()} for d in tops]
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def _sse(rid: str, created: int, model: str, text: str, finish: str | None) -> str:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n"


def _error(err: BadRequest, metrics: ServeMetrics) -> JSONResponse:
    metrics.request(err.status)
    return JSONResponse(err.body, status_code=err.status)


async def _read_json(request: Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest(400, "the body is not valid JSON") from None


def build_app(worker, model_name: str, api_key: str | None, max_body: int, metrics: ServeMetrics | None = None):
    """The FastAPI app over `worker` (an EngineLoop: `worker.engine`, `worker.submit`, `alive`, `error`)."""
    from fastapi import FastAPI

    engine = worker.engine
    metrics = metrics or ServeMetrics()
    app = FastAPI(title="moe-pipeline", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            return _error(BadRequest(413, f"request body of {length} bytes exceeds the limit of {max_body}"), metrics)
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                               kind="authentication_error"), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        alive = worker.alive and worker.error is None
        heard = engine.rank_status_at
        body = {"status": "ok" if alive else "unhealthy", "ranks": engine.ranks.world if engine.ranks else 1,
                "running": len(engine.running), "waiting": len(engine.waiting),
                "error": None if worker.error is None else repr(worker.error),
                "layout": engine.model.layout.describe() if getattr(engine.model, "layout", None) else None,
                # every rank's answer to the engine's last ping (once a second, busy or idle)
                "rank_status": list(engine.rank_status),
                "rank_status_age_s": None if heard is None else round(time.time() - heard, 2)}
        return JSONResponse(body, status_code=200 if alive else 503)

    # vLLM's tokenizer endpoints: lm-eval's local-completions uses them (tokenizer_backend "remote"/"auto")
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "model_max_length": engine.cfg.seq_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            text = (await _read_json(request))["prompt"]
            if not isinstance(text, str):
                raise TypeError
        except (BadRequest, KeyError, TypeError):
            return JSONResponse(error_body("prompt: send {\"prompt\": \"text\"}", "prompt"), status_code=400)
        tokens = engine.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.cfg.seq_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        vocab = engine.cfg.vocab_size
        try:
            tokens = (await _read_json(request))["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
                raise TypeError
        except (BadRequest, KeyError, TypeError):
            return JSONResponse(error_body(f"tokens: send {{\"tokens\": [ids in [0, {vocab})]}}", "tokens"),
                                status_code=400)
        return {"prompt": engine.decode(tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "moe-pipeline",
                                            "max_model_len": engine.cfg.seq_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        try:
            req, encoded, texts = parse_completion(await _read_json(request), engine, model_name)
        except BadRequest as err:
            return _error(err, metrics)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if req.stream:
            return StreamingResponse(_stream(req, encoded[0], texts[0], rid, created), media_type="text/event-stream")
        seqs = await _complete_all(req, encoded)
        failed = [s for s in seqs if s.finish_reason == "error"]
        if failed:
            return _error(BadRequest(500, f"the engine failed: {failed[0].text}", kind="server_error"), metrics)
        choices = []
        for i, (seq, text) in enumerate(zip(seqs, texts)):
            lp = logprobs_body(engine, seq, req.echo) if req.logprobs is not None else None
            choices.append({"text": (text if req.echo else "") + seq.text, "index": i, "logprobs": lp,
                            "finish_reason": seq.finish_reason})
            metrics.finished(seq)
        usage_in, usage_out = sum(len(p) for p in encoded), sum(len(s.generated) for s in seqs)
        metrics.latency.observe(time.perf_counter() - t0)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out,
                          "total_tokens": usage_in + usage_out}}

    async def _complete_all(req: CompletionRequest, encoded: list[list[int]]) -> list[EngineRequest]:
        """Submit every prompt; the finished engine requests, in order."""
        loop = asyncio.get_running_loop()
        futures = []
        for p in encoded:
            fut = loop.create_future()
            worker.submit(p, req.sampling(), on_finish=lambda seq, fut=fut: loop.call_soon_threadsafe(fut.set_result, seq))
            futures.append(fut)
        return await asyncio.gather(*futures)

    def _stream(req: CompletionRequest, prompt: list[int], text: str, rid: str, created: int):
        """Submit the prompt now; server-sent events: the echoed prompt, each new piece of text, the finish reason."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        worker.submit(prompt, req.sampling(),
                      on_token=lambda seq: loop.call_soon_threadsafe(queue.put_nowait, ("token", seq.text)),
                      on_finish=lambda seq: loop.call_soon_threadsafe(queue.put_nowait, ("done", seq)))

        async def events():
            if req.echo and text:
                yield _sse(rid, created, model_name, text, None)
            emitted = ""
            while True:
                kind, value = await queue.get()
                if kind == "token":
                    delta, emitted = value[len(emitted):], value
                    if delta:
                        yield _sse(rid, created, model_name, delta, None)
                    continue
                if len(value.text) > len(emitted):
                    yield _sse(rid, created, model_name, value.text[len(emitted):], None)
                yield _sse(rid, created, model_name, "", value.finish_reason)
                yield "data: [DONE]\n\n"
                metrics.finished(value)
                return

        return events()

    return app
