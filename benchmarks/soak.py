"""Soak test of `moe-pipeline serve`: many clients, every kind of request, hostile ones and hang-ups, bounded in time.

    .venv/bin/python benchmarks/soak.py                       # runs/tiny/package, 1 rank then --ep-size 2
    .venv/bin/python benchmarks/soak.py --layouts 1 --clients 32 --requests 10

For each layout the server runs as its own process on 127.0.0.1. A warm-up round has every client send
every request kind once, all at once (the CPU allocator tuning keeps freed memory in the heap, which
grows to the clients' concurrency once; the steady state starts after it); then `--clients` threads
send `--requests` requests each, drawn (seeded) from:

  normal       a completion, greedy or sampled;
  stream       the same as server-sent events, read to [DONE];
  echo         echo + logprobs, as lm-eval's log-likelihood requests;
  batch        several prompts in one request;
  hostile      one of: invalid JSON, nested too deeply, a lone surrogate, a 64-bit-plus seed, too many prompts,
               an oversized chunked body, a wrong Content-Type, a foreign Host (each must get its 4xx);

and `--hang-up` of the clients (10%) hang up in the middle of some of their requests. A 429 is retried after its
Retry-After; one whose retry succeeds is not a failure. A watcher polls /health every 0.5 s.

Reported per layout, with targets: failures of well-formed requests (0), hostile requests answered
with anything but their 4xx (0), p50/p99 latency of well-formed requests, the server's resident memory
(summed over ranks, from /health) at the start and the end of the steady state (growth under 5%),
running and waiting sequences once the clients stopped (0), whether /health stayed ok. A table on
stdout and `soak.json` under --out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, start_server, stop_server  # noqa: E402
from pipeline.artifacts import is_package  # noqa: E402

PROMPTS = ["And God said", "To be, or not to be", "In the beginning", "The LORD is my shepherd", "O Romeo, Romeo",
           "Friends, Romans, countrymen", "Blessed are the meek", "Is this a dagger"]
WELL_FORMED = ("normal", "stream", "echo", "batch")
HOSTILE = ("invalid", "nested", "surrogate", "seed", "prompts", "chunked", "content_type", "host")
LAYOUTS = {"1": [], "ep2": ["--ep-size", "2"]}


class Client:
    def __init__(self, url: str, max_tokens: int, max_prompts: int, max_body: int):
        self.url, self.max_tokens, self.max_prompts, self.max_body = url, max_tokens, max_prompts, max_body
        self.host, self.port = url.removeprefix("http://").split(":")

    def post(self, body, timeout: float = 300, **kw) -> requests.Response:
        """POST /v1/completions, retrying a 429 after its Retry-After."""
        for _ in range(600):
            r = requests.post(f"{self.url}/v1/completions", json=body, timeout=timeout, **kw)
            if r.status_code != 429:
                return r
            time.sleep(float(r.headers.get("Retry-After", "1")))
        return r

    def well_formed(self, kind: str, rng: random.Random) -> bool:
        prompt = rng.choice(PROMPTS)
        sampling = {"max_tokens": rng.randint(1, self.max_tokens), "temperature": rng.choice([0, 0.8]),
                    "seed": rng.randrange(1 << 30)}
        if kind == "normal":
            r = self.post({"prompt": prompt, **sampling})
            return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        if kind == "echo":
            r = self.post({"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
            return r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
        if kind == "batch":
            n = rng.randint(2, 4)
            r = self.post({"prompt": [rng.choice(PROMPTS) for _ in range(n)], **sampling})
            return r.status_code == 200 and len(r.json()["choices"]) == n
        r = self.post({"prompt": prompt, "stream": True, **sampling}, stream=True)
        if r.status_code != 200:
            return False
        lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        return bool(lines) and lines[-1] == "data: [DONE]"

    def hang_up(self, rng: random.Random) -> None:
        """A request sent whole, then the connection closed before (plain) or while (streaming) it is answered."""
        body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": self.max_tokens, "temperature": 0,
                           "stream": rng.random() < 0.5}).encode()
        s = socket.create_connection((self.host, int(self.port)), timeout=30)
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        time.sleep(rng.random() * 0.2)
        s.close()

    def hostile(self, kind: str) -> bool:
        """True when the server answered this hostile request with its 4xx."""
        json_headers = {"Content-Type": "application/json"}
        bodies = {"invalid": "{not json", "nested": '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}",
                  "surrogate": '{"prompt": "And \\ud800"}', "seed": json.dumps({"prompt": "And", "seed": 1 << 65}),
                  "prompts": json.dumps({"prompt": ["And"] * (self.max_prompts + 1)})}
        if kind in bodies:
            r = requests.post(f"{self.url}/v1/completions", data=bodies[kind], headers=json_headers, timeout=60)
            return r.status_code == 400
        if kind == "content_type":
            r = requests.post(f"{self.url}/v1/completions", data='{"prompt": "And"}', timeout=60,
                              headers={"Content-Type": "text/plain"})
            return r.status_code == 415
        if kind == "host":
            return requests.get(f"{self.url}/v1/models", headers={"Host": "rebind.example"}, timeout=30).status_code == 400
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)  # chunked, past the body limit
        chunk = b"x" * (64 << 10)
        chunks = [b'{"prompt": "'] + [chunk] * (self.max_body // len(chunk) + 2) + [b'"}']
        try:
            conn.request("POST", "/v1/completions", body=iter(chunks), encode_chunked=True,
                         headers={**json_headers, "Transfer-Encoding": "chunked"})
            return conn.getresponse().status == 413
        except (ConnectionError, OSError):  # the server may close once it has answered 413
            return True
        finally:
            conn.close()


def health(url: str) -> dict:
    return requests.get(f"{url}/health", timeout=30).json()


def rss_mib(url: str) -> float:
    return sum(s["rss_mib"] for s in health(url)["rank_status"])


def soak(pkg: Path, layout: str, args) -> dict:
    proc, url = start_server(pkg, [*LAYOUTS[layout], "--max-prompts", str(args.max_prompts)])
    client = Client(url, args.max_tokens, args.max_prompts, 1 << 20)
    unhealthy: list[str] = []
    stop_watch = threading.Event()

    def watch():
        while not stop_watch.wait(0.5):
            try:
                h = health(url)
                if h["status"] != "ok":
                    unhealthy.append(json.dumps(h)[:200])
            except requests.RequestException as err:
                unhealthy.append(repr(err))

    try:
        # warm-up: every kind once, from as many clients at once as the steady state has (the heap grows to
        # its concurrency once), then the steady state starts
        def warm(c: int):
            rng = random.Random(c)
            for kind in WELL_FORMED:
                client.well_formed(kind, rng)
            client.hostile(HOSTILE[c % len(HOSTILE)])
            if c == 0:
                client.hang_up(rng)

        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(warm, range(args.clients)))
        time.sleep(1.5)  # the next /health ping has every rank's memory after the warm-up
        rss_start = rss_mib(url)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        latencies, failures, hostile_wrong, counts = [], [], [], {}
        lock = threading.Lock()
        hangers = set(range(0, args.clients, max(1, round(1 / args.hang_up)))) if args.hang_up > 0 else set()

        def run_client(c: int):
            crng = random.Random(1000 + c)
            for i in range(args.requests):
                roll = crng.random()
                if c in hangers and roll < 0.5:
                    kind = "hang_up"
                elif roll < 0.15:
                    kind = crng.choice(HOSTILE)
                else:
                    kind = crng.choice(WELL_FORMED)
                t0 = time.perf_counter()
                try:
                    if kind == "hang_up":
                        client.hang_up(crng)
                        ok = True
                    elif kind in HOSTILE:
                        ok = client.hostile(kind)
                    else:
                        ok = client.well_formed(kind, crng)
                except requests.RequestException as err:
                    ok, kind = False, f"{kind} ({type(err).__name__})"
                dt = time.perf_counter() - t0
                with lock:
                    counts[kind.split()[0]] = counts.get(kind.split()[0], 0) + 1
                    if kind.split()[0] in WELL_FORMED:
                        latencies.append(dt)
                        if not ok:
                            failures.append(kind)
                    elif kind.split()[0] in HOSTILE and not ok:
                        hostile_wrong.append(kind)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(run_client, range(args.clients)))
        wall = time.perf_counter() - t0
        deadline = time.time() + 30
        while time.time() < deadline:
            h = health(url)
            if h["running"] == 0 and h["waiting"] == 0:
                break
            time.sleep(0.2)
        time.sleep(1.5)  # a fresh ping
        rss_end = rss_mib(url)
        stop_watch.set()
        watcher.join()
        h = health(url)
    finally:
        stop_server(proc)
    latencies.sort()
    return {"layout": layout, "ranks": len(h["rank_status"]), "clients": args.clients, "requests": args.requests,
            "wall_s": round(wall, 1), "counts": counts, "well_formed_failures": len(failures),
            "failure_kinds": sorted(set(failures)), "hostile_not_refused": len(hostile_wrong),
            "hostile_wrong_kinds": sorted(set(hostile_wrong)),
            "p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "p99_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3) if latencies else None,
            "rss_start_mib": round(rss_start, 1), "rss_end_mib": round(rss_end, 1),
            "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
            "running_after": h["running"], "waiting_after": h["waiting"], "health_stayed_ok": not unhealthy,
            "unhealthy_samples": unhealthy[:5], "exit_code": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", type=Path, default=ROOT / "runs" / "tiny" / "package")
    p.add_argument("--layouts", default="1,ep2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=20, help="per client")
    p.add_argument("--hang-up", type=float, default=0.1, help="share of clients that hang up mid-request")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-prompts", type=int, default=8, help="the server's --max-prompts")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    args = p.parse_args(argv)
    if not is_package(args.package):
        raise SystemExit(f"{args.package} is not a package: run README command 1 (or `moe-pipeline export`) first")
    results = [soak(args.package, layout, args) for layout in args.layouts.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'layout':>7} {'reqs':>5} {'wall s':>7} {'fail':>5} {'hostile!':>8} {'p50 s':>6} {'p99 s':>6} "
          f"{'RSS start':>9} {'RSS end':>8} {'growth':>7} {'left':>5} {'health':>7} {'exit':>5}")
    for r in results:
        print(f"{r['layout']:>7} {sum(r['counts'].values()):>5} {r['wall_s']:>7} {r['well_formed_failures']:>5} "
              f"{r['hostile_not_refused']:>8} {r['p50_s']:>6} {r['p99_s']:>6} {r['rss_start_mib']:>9} "
              f"{r['rss_end_mib']:>8} {r['rss_growth_pct']:>6}% {r['running_after'] + r['waiting_after']:>5} "
              f"{'ok' if r['health_stayed_ok'] else 'NO':>7} {r['exit_code']:>5}")
        print(f"        counts {r['counts']}" + (f"; failures {r['failure_kinds']}" if r["failure_kinds"] else "")
              + (f"; hostile answered wrongly {r['hostile_wrong_kinds']}" if r["hostile_wrong_kinds"] else ""))
    print("targets: 0 failures, 0 hostile answered wrongly, RSS growth < 5%, 0 left, health ok, exit 0")
    bad = [r for r in results if r["well_formed_failures"] or r["hostile_not_refused"] or r["rss_growth_pct"] >= 5
           or r["running_after"] or r["waiting_after"] or not r["health_stayed_ok"] or r["exit_code"] != 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
