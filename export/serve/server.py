"""`moe-pipeline serve`: start the engine on every rank, the HTTP server on rank 0, shut down cleanly.

    moe-pipeline serve runs/tiny/package                       # 1 rank, 127.0.0.1:8000
    moe-pipeline serve runs/tiny/package --ep-size 2           # 2 ranks, each its own sequences, experts split
    moe-pipeline serve runs/tiny/package --nproc 2 --tp-size 2 # dense part tensor-sliced over 2 ranks
    moe-pipeline serve runs/tiny/package --nproc 4 --ep-size 2 # more ranks than experts per group: expert slicing
    moe-pipeline serve runs/tiny/package --port 0 --smoke 'And God said'   # one completion, printed, then exit

Rank 0 runs the engine loop in its main thread (`EngineLoop`: admit, prefill, one shared decode
step, retire, repeat; PyTorch's CPU kernels ran ~40% slower from a secondary thread here) and
uvicorn (on uvloop and httptools) in a second thread (export/serve/http.py); the other ranks run every forward rank 0
sends (`Engine.follow`). Data parallel without --placement, each rank runs requests of its own (rank 0's `submit`
gives each to the rank with the fewest, as vLLM's data-parallel front end) and schedules them itself: the ranks
step together, agreeing in one small gather a step (export/serve/coordinator.py `OwnRequests`). SIGTERM (or Ctrl-C):
uvicorn stops accepting, in-flight requests finish, the engine drains, the other ranks are told to stop, exit 0. A dead rank or engine
fails every pending request and exits 1.
"""

from __future__ import annotations

import signal
import threading
import time

from export.serve.config import ServeConfig
from export.serve.engine import Engine
from export.serve.lifecycle import parent_alive
from export.serve.request import Request


class EngineLoop:
    """Runs `engine.step()` whenever there is work, in the thread that calls `run` (the main thread);
    requests come in through `submit` from the HTTP thread."""

    PING_SECONDS = 1.0

    def __init__(self, engine: Engine):
        self.engine = engine
        self.wake = threading.Event()
        self.alive = False
        self.error: BaseException | None = None

    def submit(self, *args, **kwargs) -> Request:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        req = self.engine.submit(*args, **kwargs)
        self.wake.set()
        return req

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
                if self.engine.has_work():
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


def serve(config: ServeConfig) -> int:
    """Collective: rank 0 serves HTTP until SIGTERM/SIGINT, the other ranks follow its forwards.

    `config.smoke`: serve, send that one completion over HTTP to ourselves, print it, shut down
    (README command 1's last step). Port 0 means a free port."""
    import uvicorn

    from export.serve.http import build_app
    from pipeline import dist
    from pipeline.artifacts import read_manifest

    ranks = dist.init(tune_allocator=config.malloc_tuning)
    # each data-parallel rank its own requests where it can, rank 0 taking them all (export/serve/coordinator.py)
    engine = Engine.from_config(config, ranks, own_requests=None, front=True)
    if ranks.rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop, then tells us
            signal.signal(sig, signal.SIG_IGN)
        engine.follow()
        return 0
    host, port = config.host, config.port or dist.free_port()
    name = read_manifest(config.package).get("name") or "model"
    loop = EngineLoop(engine)
    app = build_app(loop, name, config)
    server = _uvicorn_server_class()(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=30))
    http = threading.Thread(target=server.run, name="http", daemon=True)

    def on_signal(sig, frame):  # stop accepting, answer what is in flight, then the engine drains
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    def watch_parent():  # `serve --nproc N`: if the command we were launched from is killed outright, stop too
        while not server.should_exit:
            if not parent_alive():
                print("[serve] the launching process is gone: shutting down", flush=True)
                server.should_exit = True
                return
            time.sleep(1.0)

    def watch_ranks():  # a rank of this machine that died mid-step leaves the others waiting inside a collective
        import os

        if os.environ.get("LOCAL_SIZE") != str(ranks.world):
            return  # ranks on other machines: the collectives' timeouts and the launcher find them
        while True:
            time.sleep(0.5)
            for status in list(engine.rank_status):
                try:
                    os.kill(int(status["pid"]), 0)
                except ProcessLookupError:
                    print(f"[serve] rank {status['rank']} (pid {status['pid']}) is gone: exiting", flush=True)
                    engine.fail_all(f"rank {status['rank']} died")
                    os._exit(1)  # the engine may be stuck in a collective with the dead rank: nothing left to drain
                except (PermissionError, ValueError, KeyError):
                    pass

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    if ranks.world > 1:
        threading.Thread(target=watch_ranks, name="rank-watch", daemon=True).start()
    http.start()
    layout = engine.layout.describe() if engine.layout is not None else f"{ranks.world} rank(s)"
    if engine.dp > 1:
        layout += f", data parallel {engine.dp}: each rank its own sequences" + (
            " and requests (each rank schedules its own)" if engine.own else "")
    elif ranks.world > 1:
        layout += ", one data-parallel group: every rank runs the same sequences"
    placement = engine.placement_stats().controller
    if placement is not None:
        layout += (f", placement {placement.name} (replica budget {config.replica_budget}: {placement.slots} "
                   f"replica(s) per rank; {config.resident_experts:g} of the experts resident)")
    print(f"[serve] {name} on http://{host}:{port} ({layout}; up to {config.max_batch} sequences and "
          f"{config.max_batched_tokens} tokens per rank per step)", flush=True)
    print(f"[serve] {engine.kv.describe()}", flush=True)
    if config.smoke is not None:
        threading.Thread(target=_smoke, args=(server, f"http://{host}:{port}", config.smoke, config.api_key),
                         name="smoke", daemon=True).start()
    try:
        loop.run(keep_going=http.is_alive)
    except BaseException as err:  # noqa: BLE001 - a dead engine or rank: stop serving, exit non-zero
        print(f"[serve] engine failed: {type(err).__name__}: {err}", flush=True)
        server.should_exit = True
        http.join(timeout=30)
        return 1
    http.join()
    engine.close()
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
