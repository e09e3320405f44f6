"""`moe-pipeline serve`: an OpenAI-compatible HTTP API over the continuous-batching runtime.

    moe-pipeline serve runs/tiny/package                       # 1 rank, 127.0.0.1:8000
    moe-pipeline serve runs/tiny/package --ep-size 2           # 2 ranks, experts split between them
    moe-pipeline serve runs/tiny/package --nproc 2 --tp-size 2 # dense part tensor-sliced over 2 ranks
    moe-pipeline serve runs/tiny/package --nproc 4 --ep-size 2 # more ranks than experts per group: expert slicing
    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny-student", "prompt": "And God said", "max_tokens": 32, "stream": true}'

Rank 0 runs the HTTP front end (FastAPI on uvicorn) and the engine thread (`export.runtime.Engine`:
admit, prefill, one shared decode step, retire, repeat); the other ranks run every forward rank 0
announces (`Engine.follow`). Endpoints: `POST /v1/completions` (prompt as a string, token ids, or a
list of either; max_tokens, temperature, top_p, seed, stop, stream (SSE), logprobs, echo), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus text), and vLLM's `GET /tokenizer_info`,
`POST /tokenize`, `POST /detokenize`, so that lm-eval's `local-completions` model evaluates
log-likelihood tasks against the server:

    lm-eval run --model local-completions --tasks tiny_lastword \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=tiny-student,max_length=128

Bad requests get a 4xx with an OpenAI-style error body naming the field; bodies above `--max-body-bytes` get 413. With `--api-key`
(or MOE_PIPELINE_API_KEY) every endpoint but /health needs `Authorization: Bearer KEY`. SIGTERM
(or Ctrl-C): uvicorn stops accepting, in-flight requests finish, the engine drains, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

from fastapi import Request  # at module level: FastAPI resolves the handlers' (string) annotations here
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from export.runtime import Engine, SamplingParams, Sequence

API_KEY_ENV = "MOE_PIPELINE_API_KEY"
DEFAULT_MAX_BODY = 1 << 20


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


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class EngineLoop:
    """Runs `engine.step()` whenever there is work, in the thread that calls `run` (the main thread:
    PyTorch's CPU kernels ran ~40% slower from a secondary thread here); requests come in through
    `submit` from the HTTP thread."""

    PING_SECONDS = 1.0

    def __init__(self, engine: Engine):
        self.engine = engine
        self.wake = threading.Event()
        self.alive = False
        self.error: BaseException | None = None

    def submit(self, *args, **kwargs) -> Sequence:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        seq = self.engine.submit(*args, **kwargs)
        self.wake.set()
        return seq

    def run(self, keep_going) -> None:
        """Step while there is work or `keep_going()`; then return with nothing pending. Raises what the engine raised
        after failing every pending request (a dead rank, say)."""
        try:
            self.engine.ping()  # every rank answers once before /health says ok (and lists them)
            self.alive = True
            last_ping = time.monotonic()
            while True:
                if time.monotonic() - last_ping > self.PING_SECONDS:  # busy or idle: are the other ranks there?
                    self.engine.ping()
                    last_ping = time.monotonic()
                if self.engine.pending():
                    self.engine.step()
                    continue
                if not keep_going():
                    return
                self.wake.wait(0.05)
                self.wake.clear()
        except BaseException as err:
            self.error = err
            self.engine.fail_all(f"{type(err).__name__}: {err}")
            raise
        finally:
            self.alive = False


def build_app(worker: EngineLoop, model_name: str, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    engine = worker.engine
    reg = CollectorRegistry()
    m_requests = Counter("moe_requests", "completion requests by HTTP status", ["status"], registry=reg)
    m_tokens_in = Counter("moe_prompt_tokens", "prompt tokens processed", registry=reg)
    m_tokens_out = Counter("moe_generated_tokens", "tokens generated", registry=reg)
    m_latency = Histogram("moe_request_latency_seconds", "request latency", registry=reg,
                          buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
    m_ttft = Histogram("moe_time_to_first_token_seconds", "time to first token", registry=reg,
                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
    m_batch = Histogram("moe_decode_batch_size", "sequences per decode step", registry=reg,
                        buckets=(1, 2, 4, 8, 16, 32, 64))
    m_running = Gauge("moe_running_sequences", "sequences decoding now", registry=reg)
    m_waiting = Gauge("moe_waiting_sequences", "sequences waiting for a slot", registry=reg)
    m_experts = Gauge("moe_expert_tokens", "tokens routed to each expert since start (prompts included), by MoE "
                      "layer (0-based among the MoE layers)", ["layer", "expert"], registry=reg)
    m_rank_experts = Gauge("moe_rank_expert_tokens", "tokens routed to the experts each rank holds since start, "
                           "by MoE layer and rank", ["layer", "rank"], registry=reg)
    m_balance = Gauge("moe_expert_balancedness", "mean / max of the per-rank expert tokens, by MoE layer "
                      "(1: even)", ["layer"], registry=reg)
    m_place_bal = Gauge("moe_placement_balancedness", "with --placement: token-weighted mean over forwards of "
                        "mean/max tokens per rank as placed (replicas included), by MoE layer", ["layer"], registry=reg)
    m_replicas = Gauge("moe_placement_replicas", "with --placement: replicas in the table in force, by MoE layer",
                       ["layer"], registry=reg)
    m_hit = Gauge("moe_expert_prefetch_hit_rate", "with --placement: experts needed that were resident or prefetched "
                  "/ experts needed, by rank", ["rank"], registry=reg)
    m_replica_bytes = Gauge("moe_replica_bytes", "with --placement: bytes of replicas held, by rank", ["rank"],
                            registry=reg)
    m_recall = Gauge("moe_predictor_recall", "with --placement predictive: predicted-active experts among those "
                     "used, by MoE layer (running mean)", ["layer"], registry=reg)
    m_changes = Gauge("moe_placement_table_changes", "with --placement: replica tables swapped in since start",
                      registry=reg)
    m_late = Gauge("moe_predictor_late_steps", "with --placement predictive: decode steps whose predicted table was "
                   "not ready in time (the one in force was kept)", registry=reg)
    m_rank_rss = Gauge("moe_rank_resident_mib", "resident memory of each rank at its last health check", ["rank"],
                       registry=reg)
    seen_batches = [0]

    app = FastAPI(title="moe-pipeline", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            m_requests.labels("413").inc()
            return JSONResponse(error_body(f"request body of {length} bytes exceeds the limit of {max_body}"),
                                status_code=413)
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                               kind="authentication_error"), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        alive = worker.alive and worker.error is None
        ranks = engine.ranks.world if engine.ranks else 1
        heard = engine.rank_status_at
        body = {"status": "ok" if alive else "unhealthy", "ranks": ranks, "running": len(engine.running),
                "waiting": len(engine.waiting), "error": None if worker.error is None else repr(worker.error),
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
            raw = await request.json()
            text = raw["prompt"]
            if not isinstance(text, str):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            return JSONResponse(error_body("prompt: send {\"prompt\": \"text\"}", "prompt"), status_code=400)
        tokens = engine.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.cfg.seq_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            raw = await request.json()
            tokens = raw["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < engine.cfg.vocab_size
                                                       for t in tokens):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            return JSONResponse(error_body(f"tokens: send {{\"tokens\": [ids in [0, {engine.cfg.vocab_size})]}}",
                                           "tokens"), status_code=400)
        return {"prompt": engine.decode(tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "moe-pipeline",
                                            "max_model_len": engine.cfg.seq_len}]}

    @app.get("/metrics")
    async def metrics():
        m_running.set(len(engine.running))
        m_waiting.set(len(engine.waiting))
        sizes = engine.stats["batch_sizes"]
        for b in sizes[seen_batches[0]:]:
            m_batch.observe(b)
        seen_batches[0] = len(sizes)
        for layer, counts in enumerate(list(engine.expert_tokens)):
            for e, c in enumerate(counts.tolist()):
                m_experts.labels(str(layer), str(e)).set(c)
        for layer, per_rank in enumerate(engine.rank_expert_tokens()):
            for r, c in enumerate(per_rank):
                m_rank_experts.labels(str(layer), str(r)).set(c)
            if max(per_rank):
                m_balance.labels(str(layer)).set(sum(per_rank) / len(per_rank) / max(per_rank))
        for status in list(engine.rank_status):
            m_rank_rss.labels(str(status["rank"])).set(status["rss_mib"])
            if "expert_hits" in status:
                needed = status["expert_hits"] + status["expert_misses"]
                m_hit.labels(str(status["rank"])).set(status["expert_hits"] / needed if needed else 1.0)
                m_replica_bytes.labels(str(status["rank"])).set(status["replica_bytes"])
        pl = engine.placement
        if pl is not None and pl.stats.forwards:
            from export.placement import count_replicas

            for i, value in enumerate(pl.balancedness()):
                m_place_bal.labels(str(i)).set(value)
                m_replicas.labels(str(i)).set(sum(count_replicas([pl.table[i]], pl.ep)))
        for i, recall in enumerate(getattr(engine.policy, "recall", None) or []):
            m_recall.labels(str(i)).set(recall)
        if pl is not None:
            m_changes.set(pl.stats.table_changes)
        if hasattr(engine.policy, "late"):
            m_late.set(engine.policy.late)
        return PlainTextResponse(generate_latest(reg).decode(), media_type="text/plain; version=0.0.4")

    def logprobs_body(seq: Sequence, echo: bool, offset0: int) -> dict:
        toks, lps, tops = [], [], []
        ids = (seq.prompt if echo else []) + seq.generated
        if echo:
            lps += seq.prompt_logprobs
            tops += seq.prompt_top
        lps += seq.token_logprobs[:len(seq.generated)]
        tops += seq.top_logprobs[:len(seq.generated)]
        offsets, pos = [], offset0
        for t in ids:
            s = engine.decode([t])
            toks.append(s)
            offsets.append(pos)
            pos += len(s)
        top = [None if d is None else {engine.decode([k]): v for k, v in d.items()} for d in tops]
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            m_requests.labels("400").inc()
            return JSONResponse(error_body("the body is not valid JSON"), status_code=400)
        if not isinstance(raw, dict):
            m_requests.labels("400").inc()
            return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
        try:
            req = CompletionRequest.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            param = str(first["loc"][0]) if first["loc"] else None  # the request's field ('prompt', not 'prompt.str')
            m_requests.labels("400").inc()
            return JSONResponse(error_body(f"{param}: {first['msg']}", param), status_code=400)
        if req.model not in (None, model_name):
            m_requests.labels("404").inc()
            return JSONResponse(error_body(f"model {req.model!r} is not served here; this server serves "
                                           f"{model_name!r}", "model", "not_found_error"), status_code=404)
        prompts = req.prompts()
        if req.stream and len(prompts) > 1:
            m_requests.labels("400").inc()
            return JSONResponse(error_body("stream supports one prompt per request", "prompt"), status_code=400)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                seed=req.seed, stop=list(req.stop or []), logprobs=req.logprobs, echo=req.echo)
        encoded = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        vocab = engine.cfg.vocab_size
        if any(not 0 <= t < vocab for p in encoded for t in p):
            m_requests.labels("400").inc()
            return JSONResponse(error_body(f"prompt: token ids must lie in [0, {vocab})", "prompt"), status_code=400)
        prompts = [p if isinstance(p, str) else engine.decode(p) for p in prompts]  # texts, for echo
        for p in encoded:
            if len(p) + req.max_tokens > engine.cfg.seq_len:
                m_requests.labels("400").inc()
                param = "prompt" if len(p) >= engine.cfg.seq_len else "max_tokens"
                return JSONResponse(error_body(
                    f"{param}: the prompt's {len(p)} tokens + max_tokens {req.max_tokens} exceed the model's "
                    f"context of {engine.cfg.seq_len} tokens", param), status_code=400)
        loop = asyncio.get_running_loop()
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        if req.stream:
            queue: asyncio.Queue = asyncio.Queue()

            def on_token(seq):
                loop.call_soon_threadsafe(queue.put_nowait, ("token", seq.text))

            def on_finish(seq):
                loop.call_soon_threadsafe(queue.put_nowait, ("done", seq))

            seq = worker.submit(encoded[0], params, on_token=on_token, on_finish=on_finish)

            async def events():
                sent = prompts[0] if req.echo else ""
                if sent:
                    yield _sse(rid, created, model_name, sent, None)
                emitted = ""
                while True:
                    kind, value = await queue.get()
                    if kind == "token":
                        delta, emitted = value[len(emitted):], value
                        if delta:
                            yield _sse(rid, created, model_name, delta, None)
                    else:
                        final = value.text
                        if len(final) > len(emitted):
                            yield _sse(rid, created, model_name, final[len(emitted):], None)
                        yield _sse(rid, created, model_name, "", value.finish_reason)
                        yield "data: [DONE]\n\n"
                        _observe(value)
                        return

            return StreamingResponse(events(), media_type="text/event-stream")

        futures = []
        for p in encoded:
            fut = loop.create_future()

            def on_finish(seq, fut=fut):
                loop.call_soon_threadsafe(fut.set_result, seq)

            worker.submit(p, SamplingParams(**vars(params)), on_finish=on_finish)
            futures.append(fut)
        seqs = await asyncio.gather(*futures)
        failed = [s for s in seqs if s.finish_reason == "error"]
        if failed:
            m_requests.labels("500").inc()
            return JSONResponse(error_body(f"the engine failed: {failed[0].text}", kind="server_error"), status_code=500)
        choices = []
        for i, (seq, text) in enumerate(zip(seqs, prompts)):
            out = (text if req.echo else "") + seq.text
            lp = logprobs_body(seq, req.echo, 0) if req.logprobs is not None else None
            choices.append({"text": out, "index": i, "logprobs": lp, "finish_reason": seq.finish_reason})
            _observe(seq)
        usage_in = sum(len(p) for p in encoded)
        usage_out = sum(len(s.generated) for s in seqs)
        m_latency.observe(time.perf_counter() - t0)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out,
                          "total_tokens": usage_in + usage_out}}

    def _observe(seq: Sequence) -> None:
        m_requests.labels("200").inc()
        m_tokens_in.inc(len(seq.prompt))
        m_tokens_out.inc(len(seq.generated))
        if seq.first_token_at is not None:
            m_ttft.observe(seq.first_token_at - seq.arrived)

    return app


def _sse(rid: str, created: int, model: str, text: str, finish: str | None) -> str:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n"


def _uvicorn_server_class():
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server for a secondary thread: signals are ours (the main thread runs the engine and
        turns SIGTERM/SIGINT into `should_exit`); uvicorn's own handling would also re-raise the signal
        after shutting down, killing the process before the engine drains."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


def serve(pkg, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, max_batch: int = 32,
          ep_size: int | None = None, dtype: str | None = None, max_body: int = DEFAULT_MAX_BODY,
          smoke_prompt: str | None = None, tp_size: int | None = None, placement: str | None = None,
          replica_budget: float = 0.25, resident_experts: float = 1.0) -> int:
    """Collective: rank 0 serves HTTP until SIGTERM/SIGINT, the other ranks follow its forwards.

    `smoke_prompt`: serve, send that one completion over HTTP to ourselves, print it, shut down
    (README command 1's last step). Port 0 means a free port."""
    from pipeline import dist

    ranks = dist.init()
    if port == 0:
        port = dist.free_port()
    engine = Engine.from_package(pkg, ranks, ep_size=ep_size, dtype=dtype, max_batch=max_batch, tp_size=tp_size,
                                 placement=placement, replica_budget=replica_budget,
                                 resident_experts=resident_experts)
    if ranks.rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop, then tells us
            signal.signal(sig, signal.SIG_IGN)
        engine.follow()
        return 0
    import uvicorn

    _Server = _uvicorn_server_class()
    manifest = json.loads((Path(pkg) / "manifest.json").read_text())
    name = manifest.get("name") or "model"
    loop = EngineLoop(engine)
    app = build_app(loop, name, api_key or os.environ.get(API_KEY_ENV) or None, max_body)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30))
    http = threading.Thread(target=server.run, name="http", daemon=True)

    def on_signal(sig, frame):  # stop accepting, answer what is in flight, then the engine drains
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    def watch_parent():  # `serve --nproc N`: if the command we were launched from is killed outright, stop too
        while not server.should_exit:
            if not dist.parent_alive():
                print("[serve] the launching process is gone: shutting down", flush=True)
                server.should_exit = True
                return
            time.sleep(1.0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    http.start()
    layout = engine.model.layout.describe() if getattr(engine.model, "layout", None) else f"{ranks.world} rank(s)"
    if engine.policy is not None:
        layout += (f", placement {engine.policy.name} (replica budget {replica_budget}: {engine.policy.slots} "
                   f"replica(s) per rank; {resident_experts:g} of the experts resident)")
    print(f"[serve] {name} on http://{host}:{port} ({layout}; up to {max_batch} sequences per step)", flush=True)
    if smoke_prompt is not None:
        threading.Thread(target=_smoke, args=(server, f"http://{host}:{port}", smoke_prompt, api_key),
                         name="smoke", daemon=True).start()
    try:
        loop.run(keep_going=http.is_alive)
    except BaseException as err:  # noqa: BLE001 - a dead engine or rank: stop serving, exit non-zero
        print(f"[serve] engine failed: {type(err).__name__}: {err}", flush=True)
        server.should_exit = True
        http.join(timeout=30)
        return 1
    http.join()
    if engine.policy is not None:
        engine.policy.close()
    engine.stop_followers()
    print(f"[serve] stopped after {engine.stats['forwards']} forwards, {engine.stats['tokens_out']} tokens", flush=True)
    return 0


def _smoke(server, url: str, prompt: str, api_key: str | None) -> None:
    """One completion through the real HTTP API once the server is up, printed; then ask the server to stop."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        for _ in range(600):
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        r = requests.post(f"{url}/v1/completions", headers=headers, timeout=300,
                          json={"prompt": prompt, "max_tokens": 32, "temperature": 0})
        body = r.json()
        if r.status_code == 200:
            print(f"[serve] POST /v1/completions {prompt!r} -> {body['choices'][0]['text']!r} "
                  f"({body['usage']['completion_tokens']} tokens)", flush=True)
        else:
            print(f"[serve] POST /v1/completions failed: {r.status_code} {body}", flush=True)
    finally:
        server.should_exit = True
