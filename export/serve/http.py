"""The HTTP front end of `moe-pipeline serve`: an OpenAI-compatible API (FastAPI) over the engine.

    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny-student", "prompt": "And God said", "max_tokens": 32, "stream": true}'
    moe-pipeline lm-eval run --model local-completions --tasks tiny_lastword \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=tiny-student,max_length=127

Endpoints: `POST /v1/completions` (prompt as a string, token ids, or a list of either; stream (SSE), logprobs,
echo) and `POST /v1/chat/completions` (messages rendered by the tokenizer's chat template, 400 naming `messages`
when the tokenizer has none; logprobs and top_logprobs), both with the sampling fields of OpenAI and vLLM and
structured output (export/serve/protocol.py: every field taken is applied, a field that would be ignored is
refused by name), `n` choices a prompt (streamed too, each chunk naming its choice) and OpenAI's
`stream_options: {"include_usage": true}` (400 without `stream`): one more chunk before `data: [DONE]`,
`choices` [] and the request's `usage`, as OpenAI and vLLM send it, so that
`vllm bench serve` and the OpenAI SDK count tokens as the server did. Every answer that is not streamed
carries `usage` (the prompt's tokens, the generated tokens). `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text, export/serve/metrics.py), and vLLM's `GET /tokenizer_info`,
`POST /tokenize`, `POST /detokenize`, so that lm-eval's `local-completions` model evaluates
log-likelihood tasks against the server.

Limits (export/serve/config.py): bodies above `--max-body-bytes` get 413, counted on the bytes read
(a chunked body too); more than `--max-prompts` prompts in a request get 400; when `--max-waiting`
sequences already wait, 429 with `Retry-After`. Bad requests get a 4xx with an OpenAI-style error
body naming the field (hostile JSON included: nested too deeply, lone surrogates, seeds past 64
bits). With an API key ($MOE_PIPELINE_API_KEY or `--api-key-file`, compared in constant time)
every endpoint needs `Authorization: Bearer KEY`, except that /health answers strangers with its
status alone. POSTs must be `Content-Type: application/json`; bound to loopback, only a Host of
127.0.0.1, localhost or [::1] is served (no DNS rebinding). A client that hangs up has its
sequences aborted at the next step. Tokenization runs off the event loop. The app submits work to
the engine loop (export/serve/server.py) and awaits it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import time
import uuid

from fastapi import Request  # at module level: FastAPI resolves the handlers' (string) annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from export.serve.metrics import CONTENT_TYPE, ServeMetrics
from export.serve.protocol import (BadRequest, ChatRequest, CompletionRequest, check_text, error_body, parse_chat,
                                   parse_completion)
from export.serve.request import Request as EngineRequest
from export.serve.request import SamplingParams


def include_usage(req: CompletionRequest | ChatRequest) -> bool:
    return req.stream and req.stream_options is not None and req.stream_options.include_usage


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _encodable(text: str) -> bool:
    try:
        check_text(text)
    except ValueError:
        return False
    return True


async def _json_field(request: Request, max_body: int, key: str, valid, expected: str):
    """One field of a JSON object body, if `valid(value)`; else 400 naming the field and what to send."""
    raw = await _read_json(request, max_body)
    value = raw.get(key) if isinstance(raw, dict) else None
    if not valid(value):
        raise BadRequest(400, f"{key}: send {expected}", key)
    return value


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


def chat_logprobs_body(engine, req: EngineRequest, lo: int = 0, hi: int | None = None) -> dict:
    """OpenAI's chat `logprobs` object of generated tokens lo..hi: each token's text, log-probability and bytes,
    with its top alternatives."""
    def entry(token: int, lp: float) -> dict:
        text = engine.decode([token])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    hi = len(req.token_logprobs) if hi is None else min(hi, len(req.token_logprobs))
    return {"content": [{**entry(req.generated[i], req.token_logprobs[i]),
                         "top_logprobs": [entry(t, v) for t, v in req.top_logprobs[i].items()]}
                        for i in range(lo, hi)]}


def _sse(rid: str, created: int, model: str, text: str, finish: str | None, index: int = 0,
         logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]}


def _chat_sse(rid: str, created: int, model: str, text: str | None, finish: str | None, index: int = 0,
              logprobs: dict | None = None) -> dict:
    """A chat.completion.chunk: text None is the opening delta (the role)."""
    delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def choices_of(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of a prompt's n choices: with a seed, choice j draws with seed + j (as vLLM's parallel
    sampling), so the choices differ and each is reproducible; they share the prompt's KV blocks by prefix."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=None if params.seed is None else params.seed + j) for j in range(n)]


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up: once the body is read, the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(err: BadRequest, metrics: ServeMetrics) -> JSONResponse:
    metrics.request(err.status)
    return JSONResponse(err.body, status_code=err.status)


def check_room(engine, prompts: int, config) -> None:
    """429 when sequences already wait and `prompts` more would pass --max-waiting."""
    queued = engine.queue_lengths()[1]
    if queued and queued + prompts > config.max_waiting:
        raise BadRequest(429, f"the server is busy: {queued} sequences are waiting (--max-waiting "
                         f"{config.max_waiting}); retry shortly", kind="rate_limit_error")


def refused(err: BadRequest, metrics: ServeMetrics) -> JSONResponse:
    """The error response of a refused completion request (a 429 says when to retry)."""
    response = _error(err, metrics)
    if err.status == 429:
        response.headers["Retry-After"] = "1"
    return response


async def _read_json(request: Request, max_body: int):
    """The body as JSON, reading at most `max_body` bytes whatever the headers say (a chunked body has no
    Content-Length): past that, 413 without buffering the rest."""
    body, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise BadRequest(413, f"request body exceeds the limit of {max_body} bytes (--max-body-bytes)")
        body.append(chunk)
    try:
        return json.loads(b"".join(body))
    except RecursionError:
        raise BadRequest(400, "the body is not valid JSON: nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest(400, "the body is not valid JSON") from None


LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


def _host_allowed(host_header: str) -> bool:
    """A Host of 127.0.0.1, localhost or [::1], with or without :PORT (DNS rebinding sends another name)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[:host.index("]") + 1] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host in LOOPBACK


def authorized(request: Request, api_key: str | None) -> bool:
    """No key set, or the request's bearer token is the key (compared in constant time)."""
    if not api_key:
        return True
    return hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode())


class Guard:
    """Plain ASGI middleware in front of every route (not Starlette's BaseHTTPMiddleware, whose wrapped `receive`
    hides a client's disconnect from the handlers): turns a request away before any handler runs when its Host,
    size, key or content type is wrong."""

    def __init__(self, app, config, metrics: ServeMetrics):
        self.app, self.config, self.metrics = app, config, metrics
        self.loopback = config.host in LOOPBACK

    def refuse(self, request: Request) -> JSONResponse | None:
        """The answer to a request turned away, or None to let it in."""
        max_body = self.config.max_body_bytes
        if self.loopback and not _host_allowed(request.headers.get("host", "")):
            # bound to this machine: a page elsewhere that resolves its name to 127.0.0.1 must not read answers
            return _error(BadRequest(400, "Host: this server answers only to 127.0.0.1, localhost or [::1]",
                                     "Host"), self.metrics)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            return _error(BadRequest(413, f"request body of {length} bytes exceeds the limit of {max_body} "
                                     "(--max-body-bytes)"), self.metrics)
        if request.url.path != "/health" and not authorized(request, self.config.api_key):
            return _error(BadRequest(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                     kind="authentication_error"), self.metrics)
        if request.method == "POST" and request.headers.get("content-type", "").split(";")[0].strip().lower() \
                != "application/json":
            # a browser's cross-site form or no-cors fetch cannot send this content type without a preflight
            return _error(BadRequest(415, "Content-Type: send 'Content-Type: application/json'", "Content-Type"),
                          self.metrics)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            answer = self.refuse(Request(scope))
            if answer is not None:
                return await answer(scope, receive, send)
        await self.app(scope, receive, send)


def _from_engine(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn(*args)` on the event loop, from the engine's thread; nothing if the loop has closed (shutdown)."""
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed between the check and the call
            pass


async def complete_all(worker, request: Request, work: list[tuple[list[int], SamplingParams]]) -> list[EngineRequest] | None:
    """Submit every (prompt, sampling); the finished engine requests, in order; None if the client disconnected
    first (then each is aborted: a waiting one never runs, a running one frees its slot at the next step)."""
    loop = asyncio.get_running_loop()
    futures, submitted = [], []
    for prompt, params in work:
        fut = loop.create_future()
        submitted.append(worker.submit(prompt, params, on_finish=lambda seq, fut=fut: _from_engine(
            loop, lambda: fut.done() or fut.set_result(seq))))
        futures.append(fut)
    everything = asyncio.gather(*futures)
    hung_up = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({everything, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    if everything.done():
        hung_up.cancel()
        return everything.result()
    for seq in submitted:
        worker.engine.abort(seq)
    worker.wake.set()
    return None


def stream_events(worker, metrics: ServeMetrics, model_name: str, req, prompt: list[int], params: SamplingParams,
                  text: str, rid: str, created: int, chat: bool = False):
    """Submit the prompt's n choices now; server-sent events: the echoed prompt (for chat: the assistant role), each
    new piece of a choice's text no later token can change (`Request.stable_text`) with the log-probabilities of its
    new tokens where asked, each choice's finish reason, and with stream_options.include_usage a last chunk with no
    choices and the request's usage (every other chunk then has `"usage": null`, as OpenAI's). A client that hangs
    up aborts the request."""
    chunk_of = _chat_sse if chat else _sse
    with_usage = include_usage(req)
    engine = worker.engine
    wants_logprobs = params.logprobs is not None

    def sse(*args, **kw) -> str:
        chunk = chunk_of(*args, **kw)
        if with_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk)}\n\n"

    def logprobs(seq: EngineRequest, lo: int, hi: int) -> dict | None:
        if not wants_logprobs or hi <= lo:
            return None
        if chat:
            return chat_logprobs_body(engine, seq, lo, hi)
        whole = logprobs_body(engine, seq, False)
        return {key: value[lo:hi] for key, value in whole.items()}
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    seqs = [worker.submit(prompt, p,
                          on_token=lambda s, j=j: _from_engine(loop, queue.put_nowait,
                                                               ("token", j, s.stable_text(), len(s.generated))),
                          on_finish=lambda s, j=j: _from_engine(loop, queue.put_nowait, ("done", j, s, None)))
            for j, p in enumerate(choices_of(params, req.n))]

    async def events():
        done = 0
        emitted, tokens = [""] * len(seqs), [0] * len(seqs)
        try:
            for j in range(len(seqs)):
                if chat:
                    yield sse(rid, created, model_name, None, None, j)
                elif req.echo and text:
                    yield sse(rid, created, model_name, text, None, j)
            while done < len(seqs):
                kind, j, value, count = await queue.get()
                seq = seqs[j]
                if kind == "token":
                    if len(value) > len(emitted[j]):
                        yield sse(rid, created, model_name, value[len(emitted[j]):], None, j,
                                  logprobs(seq, tokens[j], count))
                        emitted[j], tokens[j] = value, count
                    continue
                done += 1
                final = value.text if value.finish_reason != "error" else emitted[j]
                if len(final) > len(emitted[j]) or len(value.generated) > tokens[j]:
                    yield sse(rid, created, model_name, final[len(emitted[j]):], None, j,
                              logprobs(value, tokens[j], len(value.generated)))
                yield sse(rid, created, model_name, "", value.finish_reason, j)
                metrics.finished(value)
            if with_usage:  # the chunk's own id, object, created and model, no choices
                last = {**chunk_of(rid, created, model_name, "", None), "choices": [],
                        "usage": usage(len(prompt), sum(len(s.generated) for s in seqs))}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if done < len(seqs):  # the client went away (the response was cancelled): stop generating for it
                for seq in seqs:
                    worker.engine.abort(seq)
                worker.wake.set()

    return events()


def _unanswered(seqs, metrics: ServeMetrics) -> JSONResponse | None:
    """The answer where a request's sequences did not all complete: the client hung up (499; they were aborted), or
    the engine failed one (500); None where they did."""
    if seqs is None:
        metrics.request(499)
        return JSONResponse(error_body("client closed the request"), status_code=499)
    failed = [s for s in seqs if s.finish_reason == "error"]
    if failed:
        return _error(BadRequest(500, f"the engine failed: {failed[0].text}", kind="server_error"), metrics)
    return None


def build_app(worker, model_name: str, config, metrics: ServeMetrics | None = None):
    """The FastAPI app over `worker` (an EngineLoop: `worker.engine`, `worker.submit`, `alive`, `error`) with the
    limits of `config` (a ServeConfig)."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi import FastAPI

    engine = worker.engine
    metrics = metrics or ServeMetrics()
    engine.on_decode = metrics.batch.observe
    max_body = config.max_body_bytes
    # tokenizing a long prompt takes a while: off the event loop, in one thread (a fast tokenizer is not
    # reentrant when its settings change)
    tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    app = FastAPI(title="moe-pipeline", docs_url=None, redoc_url=None)

    app.add_middleware(Guard, config=config, metrics=metrics)

    @functools.cache
    def info() -> dict:
        return engine.server_info()

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, fn, *args)

    @app.get("/health")
    async def health(request: Request):
        alive = worker.alive and worker.error is None
        if not authorized(request, config.api_key):  # with a key set, strangers learn only whether it is up
            return JSONResponse({"status": "ok" if alive else "unhealthy"}, status_code=200 if alive else 503)
        heard = engine.rank_status_at
        body = {"status": "ok" if alive else "unhealthy", "ranks": engine.ranks.world if engine.ranks else 1,
                **dict(zip(("running", "waiting"), engine.queue_lengths())),
                "error": None if worker.error is None else repr(worker.error),
                "layout": engine.layout.describe() if engine.layout is not None else None,
                "data_parallel": engine.dp,
                # every rank's answer to the engine's last ping (once a second, busy or idle)
                "rank_status": list(engine.rank_status),
                "rank_status_age_s": None if heard is None else round(time.time() - heard, 2),
                # the options, kernel build and choices, thresholds in force (Engine.server_info), computed once
                "server": info()}
        return JSONResponse(body, status_code=200 if alive else 503)

    # vLLM's tokenizer endpoints: lm-eval's local-completions uses them (tokenizer_backend "remote"/"auto")
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "model_max_length": engine.max_model_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            text = await _json_field(request, max_body, "prompt", lambda v: isinstance(v, str) and _encodable(v),
                                     '{"prompt": "text"}')
        except BadRequest as err:
            return _error(err, metrics)
        tokens = await off_loop(engine.encode, text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        vocab = engine.cfg.vocab_size
        try:
            tokens = await _json_field(
                request, max_body, "tokens",
                lambda v: isinstance(v, list) and all(isinstance(t, int) and 0 <= t < vocab for t in v),
                f'{{"tokens": [ids in [0, {vocab})]}}')
        except BadRequest as err:
            return _error(err, metrics)
        return {"prompt": await off_loop(engine.decode, tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "moe-pipeline",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        try:
            raw = await _read_json(request, max_body)
            req, encoded, texts, params = await off_loop(parse_completion, raw, engine, model_name,
                                                         config.max_prompts)
            check_room(engine, len(encoded) * req.n, config)  # no await from here to the submit
        except BadRequest as err:
            return refused(err, metrics)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if req.stream:
            events = stream_events(worker, metrics, model_name, req, encoded[0], params, texts[0], rid, created)
            return StreamingResponse(events, media_type="text/event-stream")
        seqs = await complete_all(worker, request, [(p, c) for p in encoded for c in choices_of(params, req.n)])
        if (unanswered := _unanswered(seqs, metrics)) is not None:
            return unanswered
        choices = []
        for i, seq in enumerate(seqs):  # prompt i // n, its choice i % n (OpenAI's order)
            text = texts[i // req.n]
            lp = await off_loop(logprobs_body, engine, seq, req.echo) if req.logprobs is not None else None
            choices.append({"text": (text if req.echo else "") + seq.text, "index": i, "logprobs": lp,
                            "finish_reason": seq.finish_reason})
            metrics.finished(seq)
        usage_in, usage_out = sum(len(p) for p in encoded), sum(len(s.generated) for s in seqs)
        metrics.latency.observe(time.perf_counter() - t0)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices,
                "usage": usage(usage_in, usage_out)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        try:
            raw = await _read_json(request, max_body)
            req, ids, params = await off_loop(parse_chat, raw, engine, model_name, config.max_prompts)
            check_room(engine, req.n, config)
        except BadRequest as err:
            return refused(err, metrics)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if req.stream:
            events = stream_events(worker, metrics, model_name, req, ids, params, "", rid, created, chat=True)
            return StreamingResponse(events, media_type="text/event-stream")
        seqs = await complete_all(worker, request, [(ids, c) for c in choices_of(params, req.n)])
        if (unanswered := _unanswered(seqs, metrics)) is not None:
            return unanswered
        choices = []
        for i, seq in enumerate(seqs):
            lp = await off_loop(chat_logprobs_body, engine, seq) if req.logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": seq.text}, "logprobs": lp,
                            "finish_reason": seq.finish_reason})
            metrics.finished(seq)
        metrics.latency.observe(time.perf_counter() - t0)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name, "choices": choices,
                "usage": usage(len(ids), sum(len(s.generated) for s in seqs))}

    return app
