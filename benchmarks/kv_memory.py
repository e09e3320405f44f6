"""The serving KV cache's memory, before and after paging, on a package whose context is 32,768 tokens.

    .venv/bin/python benchmarks/kv_memory.py                       # this checkout
    .venv/bin/python benchmarks/kv_memory.py --before bf1f25f      # and an earlier revision's server, side by side

One run (the server a separate process, `moe-pipeline serve`, 1 rank; the CPU printed with the figures):
  (a) peak RSS of `serve` after start-up at default flags (and at --kv-cache-memory 1), for each revision;
  (b) a 30,000-token prompt served (--kv-cache-memory 1): its status, time, tokens;
  (c) concurrency at a fixed KV budget (--kv-cache-memory 0.25): how many 512-token sequences (256 prompt + 256
      generated, ignore_eos) run at once: measured here from /metrics while 96 are sent together; for a
      revision with one cache row per sequence of the model's whole context, what that budget holds of those rows;
  (d) time to first token of a repeated 2,000-token prompt: a prefix-cache hit against a miss (median of 3 each).
The package: recipes/350m.yaml's model cut to 4 layers, hidden 512, 8 heads, experts [8, 8], 32,768 learned
positions, random weights, bf16 (benchmarks/common.py `random_package`). Results: a table on stdout and
`kv_memory.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, random_package  # noqa: E402

CONTEXT = 32768
OVERRIDES = [f"data.seq_len={CONTEXT}", "model.hidden=512", "model.heads=8", "model.experts=[8, 8]"]
KV_BYTES_PER_TOKEN = 2 * 4 * 512 * 2  # keys and values, 4 layers, hidden 512, bf16


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def tree_rss(pid: int) -> tuple[float, float]:
    """(peak RSS, RSS) in MiB of `pid` and its descendants (VmHWM / VmRSS summed)."""
    import psutil

    peak = now = 0.0
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for p in procs:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak += int(line.split()[1]) / 1024
            elif line.startswith("VmRSS:"):
                now += int(line.split()[1]) / 1024
    return peak, now


class Server:
    """`moe-pipeline serve PKG` from the checkout at `cwd` (this one, or a worktree of an earlier revision)."""

    def __init__(self, pkg: Path, flags: list[str], cwd: Path = ROOT):
        import requests

        from pipeline.dist import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = child_env()
        env["PYTHONPATH"] = str(cwd)  # the revision's own code, with this environment's packages
        self.log = open(Path("/tmp") / f"kv_memory_server_{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", str(pkg), "--port",
                                      str(self.port), *flags], cwd=cwd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited {self.proc.returncode} ({' '.join(flags)}): see {self.log.name}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit("the server did not come up")

    def rss(self) -> tuple[float, float]:
        return tree_rss(self.proc.pid)

    def metric(self, name: str) -> float:
        import requests

        for line in requests.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return float("nan")

    def complete(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        import requests

        r = requests.post(f"{self.url}/v1/completions", timeout=3600,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
        return {"status": r.status_code, **(r.json() if r.headers.get("content-type", "").startswith("application/json")
                                            else {})}

    def ttft(self, prompt: list[int]) -> float:
        """Seconds to the first streamed chunk of a 1-token completion."""
        import requests

        t0 = time.perf_counter()
        with requests.post(f"{self.url}/v1/completions", stream=True, timeout=600,
                           json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    took = time.perf_counter() - t0
                    if r.status_code != 200 or "choices" not in json.loads(line[5:]):
                        raise RuntimeError(f"{r.status_code}: {line[:300]!r}")
                    return took
        raise RuntimeError("no chunk")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def worktree(rev: str, where: Path) -> Path:
    """A checkout of `rev` (git worktree) at `where`."""
    if not where.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                       capture_output=True)
    return where


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50000) for _ in range(n)]


def concurrency(server: Server, n: int, rng: random.Random) -> dict:
    """Send `n` 256 + 256-token requests together; the most sequences running at once (polled from /metrics)."""
    from concurrent.futures import ThreadPoolExecutor

    peak, done = 0.0, threading.Event()

    def poll():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.metric("moe_running_sequences"))
            time.sleep(0.1)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda p: server.complete(p, 256, ignore_eos=True),
                                [random_prompt(rng, 256) for _ in range(n)]))
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    ok = [a for a in answers if a["status"] == 200]
    return {"sent": n, "ok": len(ok), "peak_running": int(peak), "seconds": round(wall, 1),
            "generated": sum(a["usage"]["completion_tokens"] for a in ok),
            "preemptions": server.metric("moe_preemptions")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="an earlier revision whose server to measure too (a git worktree)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "kv_memory")
    ap.add_argument("--concurrent", type=int, default=96)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pkg = args.out / "pkg-32k"
    if not (pkg / "manifest.json").is_file():
        random_package(pkg, layers=4, overrides=OVERRIDES, dtype="bf16")
    rng = random.Random(0)
    cpu = cpu_name()
    result: dict = {"cpu": cpu, "context": CONTEXT, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "revisions": {}}
    revisions = [("this checkout", ROOT)]
    if args.before:
        revisions.insert(0, (args.before, worktree(args.before, Path("/tmp") / f"kv-memory-{args.before}")))
    for name, cwd in revisions:
        rows = {}
        for label, flags in (("default flags", []), ("--kv-cache-memory 1", ["--kv-cache-memory", "1"])):
            try:
                server = Server(pkg, flags, cwd)
            except SystemExit as err:  # an earlier revision without the flag
                rows[label] = {"error": str(err)}
                continue
            time.sleep(1.0)
            peak, now = server.rss()
            rows[label] = {"peak_rss_mib": round(peak), "rss_mib": round(now)}
            if label != "default flags":
                t0 = time.perf_counter()
                answer = server.complete(random_prompt(rng, 30000), 8)
                rows[label]["prompt_30000"] = {"status": answer["status"], "seconds": round(time.perf_counter() - t0, 1),
                                               "completion_tokens": answer.get("usage", {}).get("completion_tokens")}
                rows[label]["peak_rss_mib_after_30000"] = round(server.rss()[0])
                miss = [server.ttft(random_prompt(rng, 2000)) for _ in range(3)]
                shared = random_prompt(rng, 2000)
                server.ttft(shared)
                hit = [server.ttft(shared) for _ in range(3)]
                rows[label]["ttft_2000"] = {"miss_s": round(statistics.median(miss), 3),
                                            "hit_s": round(statistics.median(hit), 3),
                                            "prefix_hits": server.metric("moe_prefix_cache_hits")}
            server.stop()
        result["revisions"][name] = rows
    server = Server(pkg, ["--kv-cache-memory", "0.25", "--max-batch", "256", "--max-waiting", "1024"])
    try:
        result["concurrency_at_0.25_gib"] = concurrency(server, args.concurrent, rng)
    finally:
        server.stop()
    result["rows_of_whole_context_in_0.25_gib"] = int(0.25 * 2**30 // (CONTEXT * KV_BYTES_PER_TOKEN))
    (args.out / "kv_memory.json").write_text(json.dumps(result, indent=1))

    print(f"KV memory, package with a {CONTEXT}-token context (4 layers, hidden 512, bf16), 1 rank; CPU: {cpu}")
    print(f"{'revision':<16} {'flags':<22} {'peak RSS after start':>21} {'30,000-token prompt':>22} "
          f"{'TTFT 2,000 miss':>16} {'hit':>8}")
    for name, rows in result["revisions"].items():
        for label, row in rows.items():
            if "error" in row:
                print(f"{name:<16} {label:<22} {'(no such flag)':>21}")
                continue
            p = row.get("prompt_30000")
            t = row.get("ttft_2000")
            served = f"{p['status']} in {p['seconds']} s" if p else ""
            print(f"{name:<16} {label:<22} {row['peak_rss_mib']:>17} MiB {served:>22} "
                  f"{(str(t['miss_s']) + ' s') if t else '':>16} {(str(t['hit_s']) + ' s') if t else '':>8}")
    c = result["concurrency_at_0.25_gib"]
    print(f"512-token sequences at once in 0.25 GiB of KV: {c['peak_running']} measured (paged; {c['ok']}/{c['sent']} "
          f"answered, {c['preemptions']:.0f} preemptions, {c['seconds']} s) against "
          f"{result['rows_of_whole_context_in_0.25_gib']} rows of the whole context (one row per sequence)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
