"""Batch-1 decode tokens/s of the serving engine against the memory read-bandwidth bound (checked: >= 60% of it).

    .venv/bin/python benchmarks/decode_bandwidth.py                      # fp32 and bf16, a few minutes on 2 cores
    .venv/bin/python benchmarks/decode_bandwidth.py --dtype bf16 --new-tokens 512 --repeats 5
    .venv/bin/python benchmarks/decode_bandwidth.py --set model.hidden=256 --set model.experts=[4,8]  # a small one

The package is `benchmarks/common.random_package`: recipes/350m.yaml cut to 4 layers with random weights (hidden
1024, MoE layers 2 and 4 with 32 and 64 experts, top-1, residual MLP, tied 50,304-entry head: ~0.12B parameters
read per token, 475 MB in fp32, 238 MB in bf16, far past this machine's caches), built once per dtype under
`--work`. For each dtype, in one process with `--threads` threads:

  (a) read bandwidth: a 1 GiB fp32 buffer of random values (`--buffer-gib`) read by `torch.sum` and by `torch.mv` (a GEMV, the
      decode's own kind of read), sampled before every decode run and after the last, the best sample kept; the
      bound uses the faster of the two ops. `torch.mv` on a bf16 matrix is measured too, as a diagnostic of the
      bf16 GEMV kernel (it is not the bandwidth);
  (b) decode: `Engine.from_config(ServeConfig(package, max_batch=1))`, one greedy request of `--new-tokens`
      tokens (the end token ignored, so every run is as long), timed from its first token to its last: decode
      steps only, no prefill. Best and median of `--repeats` runs;
  (c) active bytes per token: the parameters one decode step reads, in their stored dtype (gates fp32): attention,
      dense MLPs, each MoE layer's gate + residual MLP + coefficient + top_k experts, the norms, the lm_head (the
      tied embedding: all of it), the embedding rows. The KV cache a step reads is shown beside (not in the bound).
      The bound counts the head in its stored dtype. Greedy steps read it through its int8 screen
      (export/serve/kernels/heads.py `HeadScreen`: 1 byte a weight plus a few exact rows); the table also shows the
      bytes read that way and the ratio on them.

bound = bandwidth / active bytes; ratio = decode tok/s (best run) / bound (also shown against the mv bandwidth);
paired ratio = each run's tok/s over the bound of the two samples taken just before and after it (the median run
shown): this VM's read bandwidth drifts (41-53 GB/s on random data, and one first sample of a run at 77), and the
best sample of a stretch can come from a fast moment that no decode run shared.
Then where the time goes: one more run timed by module (forward hooks: attention, dense MLP, gate + routing,
experts, residual MLP, lm_head, the rest), each with the bytes it reads and the bandwidth it reaches, and
torch.profiler's top operators. And (d), `--backends`: the engine loaded again with its linears on oneDNN for
every row count (--cpu-linears onednn: no few-row GEMV kernel) and on plain F.linear (aten: MKL in this
torch build), measured the same way in the same run, with how many greedy tokens equal the engine's (the three
round differently, so a near-tie of random weights can go either way).
Results: a table on stdout, `decode_bandwidth.json` and `decode_bandwidth.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (CATEGORIES, ROOT, active_bytes, best_bandwidth, cpu_info, cpu_line,  # noqa: E402
                    random_package, read_bandwidth)

sys.path.insert(1, str(ROOT))  # this checkout's pipeline/, export/

TARGET = 0.60  # the share of the bound decode is checked against (llama.cpp reaches 84-95% on CPUs)
PROMPT = "And God said"


# -- (a) read bandwidth: common.read_bandwidth, sampled around every decode run ---------------------------------

def paired_bandwidth(samples: list[dict]) -> float:
    """The mean bandwidth (the faster fp32 op) of the samples taken just before and just after one decode run: on a
    shared machine whose bandwidth drifts (here 41-53 GB/s, once 77), the bound of that run."""
    return statistics.mean(s["bytes_per_s"] for s in samples)


# -- (c) active bytes per token ------------------------------------------------------------------------------------

def kv_bytes_per_token(cfg, dtype, context: float) -> float:
    """KV-cache bytes a decode step reads at `context` cached tokens (keys and values of every layer)."""
    import torch

    return cfg.layers * 2 * context * cfg.kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


# -- (b) decode ----------------------------------------------------------------------------------------------------

def load_engine(pkg: Path, threads: int, cpu_linears: str = "kernel"):
    """The serving engine for `pkg` on this process alone (1 rank, one slot), `threads` threads, end token off, its
    linears on `cpu_linears` (serve --cpu-linears)."""
    import torch

    from export.serve.config import ServeConfig
    from export.serve.engine import Engine

    engine = Engine.from_config(ServeConfig(package=pkg, max_batch=1, cpu_linears=cpu_linears))
    torch.set_num_threads(threads)  # after dist.init, which sizes the pool for the local ranks
    engine.eos = None  # a benchmark: every run decodes exactly --new-tokens tokens
    return engine


def model_dtype(engine):
    """The dtype the engine serves in (the embedding's: the gates are fp32 whatever it is)."""
    return engine.model.wte.weight.dtype


def decode_run(engine, prompt: list[int], new_tokens: int) -> dict:
    """One greedy request; decode tokens/s from its first token to its last (prefill excluded)."""
    from export.serve.engine import generate
    from export.serve.request import SamplingParams

    (req,) = generate(engine, [prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0))
    if req.finish_reason != "length":
        raise RuntimeError(f"the decode request ended with {req.finish_reason!r}: {req.text}")
    n = len(req.generated) - 1  # tokens after the first: each one decode step
    seconds = req.done_at - req.first_token_at
    return {"decode_tokens": n, "seconds": seconds, "tok_s": n / seconds, "tokens": req.generated}


def module_breakdown(engine, prompt: list[int], new_tokens: int) -> dict:
    """Seconds per decode token by category, from one more run timed by forward hooks. The MoE layer's time less
    its residual MLP and its experts is `gate_routing` (gate, routing, dispatch); the experts are timed as modules
    (the reference MoE) or, with the engine's expert exchange, around its `_run_experts` and `run_local` (the
    latter, 1 rank's decode path, routes too: its routing counts as experts; else they stay in gate_routing:
    `experts_timed` False). `other`: the rest of the step (embeddings, norms, residual adds, sampling,
    the engine's Python). The steps run the model's own forward, module by module (the engine's `Decoder`, which
    runs a decode step's layers in one kernel call, calls no module to hook): slower than the served step, which
    the decode runs above time."""
    import torch

    from export.serve.request import SamplingParams

    model, spent, undo = engine.model, dict.fromkeys(CATEGORIES, 0.0), []

    def timed(category, fn, sign=1.0):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[category] += sign * (time.perf_counter() - t0)
        return wrapper

    def watch(module, category, sign=1.0):
        start = [0.0]

        def pre(_m, _a):
            start[0] = time.perf_counter()

        def post(_m, _a, _o):
            spent[category] += sign * (time.perf_counter() - start[0])
        undo.extend([module.register_forward_pre_hook(pre).remove, module.register_forward_hook(post).remove])

    experts_timed = False
    for block in model.blocks:
        watch(block.attn, "attention")
        if not block.is_moe:
            watch(block.mlp, "dense_mlp")
            continue
        watch(block.mlp, "gate_routing")  # the whole MoE layer; its parts are taken out again
        for name, sub in block.mlp.named_modules():
            if name in ("moe.mlp", "moe.coefficient"):
                watch(sub, "residual_mlp")
                watch(sub, "gate_routing", -1.0)
            elif ".deepspeed_experts." in f"{name}." and name.split(".")[-1].isdigit():
                watch(sub, "experts")
                watch(sub, "gate_routing", -1.0)
                experts_timed = True
    exchange = engine.exchange
    if not experts_timed and exchange is not None:
        run_experts = exchange._run_experts
        exchange._run_experts = timed("gate_routing", timed("experts", run_experts), -1.0)
        undo.append(lambda: delattr(exchange, "_run_experts"))
        # on 1 rank a decode batch's layer runs routing and experts in one kernel pair (Exchange.run_local): all of
        # it counted as experts
        run_local = exchange.run_local
        exchange.run_local = timed("gate_routing", timed("experts", run_local), -1.0)
        undo.append(lambda: delattr(exchange, "run_local"))
        experts_timed = True
    watch(model.lm_head, "lm_head")
    screen = getattr(model.lm_head, "screen", None)
    if screen is not None:  # greedy rows' tokens through the head's int8 screen: the lm_head's time, not the module's
        screen.argmax = timed("lm_head", screen.argmax)
        undo.append(lambda: delattr(screen, "argmax"))
    decoder, engine.worker.decoder = engine.worker.decoder, None
    undo.append(lambda: setattr(engine.worker, "decoder", decoder))
    steps = []
    try:
        req = engine.submit(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0))
        engine.step()  # the prefill and the first token: not counted
        spent.update(dict.fromkeys(CATEGORIES, 0.0))
        while not req.finished:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
    finally:
        for fn in undo:
            fn()
    n = len(steps)
    per_token = {c: spent[c] / n for c in CATEGORIES}
    per_token["other"] = statistics.mean(steps) - sum(v for c, v in per_token.items() if c != "other")
    # torch.profiler's view of a few decode steps: the operators that take the time
    from torch.profiler import ProfilerActivity, profile

    req = engine.submit(prompt, SamplingParams(max_tokens=min(new_tokens, 17), temperature=0.0))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while not req.finished:
            engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {"decode_steps": n, "seconds_per_token": per_token, "step_seconds_mean": statistics.mean(steps),
            "experts_timed": experts_timed, "torch_threads": torch.get_num_threads(),
            "top_ops": [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in ops]}


# -- (d) the same engine on the other linears ---------------------------------------------------------------------

# variant -> serve --cpu-linears (export/serve/kernels/options.py): the engine as it serves (the few-row GEMV kernel,
# oneDNN for more rows), oneDNN for every row count, and every layer left to F.linear (MKL on this torch build)
BACKENDS = {"engine": "kernel", "onednn": "onednn", "F.linear": "aten"}


# -- one dtype -----------------------------------------------------------------------------------------------------

def timed_runs(engine, prompt: list[int], new_tokens: int, repeats: int, label: str, before_each=None) -> dict:
    """`repeats` decode runs after a warm-up (`before_each()` before each): best and median tokens/s, the tokens."""
    from tqdm import tqdm

    decode_run(engine, prompt, 8)
    runs = []
    for _ in tqdm(range(repeats), desc=label, leave=False):
        if before_each is not None:
            before_each()
        runs.append(decode_run(engine, prompt, new_tokens))
    if len({tuple(r["tokens"]) for r in runs}) != 1:
        raise RuntimeError("greedy decoding gave different tokens run to run")
    return {"tok_s_best": max(r["tok_s"] for r in runs), "tok_s_median": statistics.median(r["tok_s"] for r in runs),
            "runs": [{k: r[k] for k in ("decode_tokens", "seconds", "tok_s")} for r in runs],
            "tokens": runs[0]["tokens"]}


def measure(pkg: Path, threads: int, new_tokens: int, repeats: int, buffer_gib: float, breakdown_tokens: int,
            backends: tuple[str, ...] = tuple(BACKENDS)) -> dict:
    """(a)-(c) and the breakdown for each of `backends` (d): the engine loaded again with its linears on each (one
    engine at a time). The bandwidth is sampled before every decode run and after the last (best of 2 each, the
    engine's memory held), and the best sample is the bound's: decode and bandwidth both best-of over the same
    stretch of time."""
    samples, variants = [], {}

    def sample():
        samples.append(read_bandwidth(threads, buffer_gib, 2))

    for name in backends:
        engine = load_engine(pkg, threads, BACKENDS[name])
        prompt = engine.encode(PROMPT)
        dtype = model_dtype(engine)
        act = active_bytes(engine.model.cfg, dtype)
        kv = kv_bytes_per_token(engine.model.cfg, dtype, len(prompt) + new_tokens / 2)
        v = timed_runs(engine, prompt, new_tokens, repeats, f"decode {pkg.name}, {name}", sample)
        # the greedy head read through its int8 screen (export/serve/kernels/heads.py `HeadScreen`): 1 byte a weight
        screened = getattr(engine.model.lm_head, "screen", None) is not None
        head_read = act["lm_head"] / dtype.itemsize if screened else act["lm_head"]
        v["head_screen"], v["head_read_bytes"] = screened, head_read
        v["read_bytes_per_token"] = act["total"] - act["lm_head"] + head_read
        v["breakdown"] = module_breakdown(engine, prompt, breakdown_tokens)
        if variants:
            v["same_tokens"] = sum(a == b for a, b in zip(v["tokens"], next(iter(variants.values()))["tokens"]))
        variants[name] = v
        del engine
    sample()
    bw = best_bandwidth(samples)
    bound = bw["bytes_per_s"] / act["total"]
    first = 0  # samples[first + i] was taken just before the variant's run i, samples[first + i + 1] just after
    for v in variants.values():
        v["ratio"] = v["tok_s_best"] / bound
        v["paired_ratios"] = [run["tok_s"] / (paired_bandwidth(samples[first + i: first + i + 2]) / act["total"])
                              for i, run in enumerate(v["runs"])]
        v["ratio_paired_median"] = statistics.median(v["paired_ratios"])
        first += len(v["runs"])
        v["ratio_to_gemv_bound"] = v["tok_s_best"] / (bw["ops_bytes_per_s"]["mv_fp32"] / act["total"])
        v["ratio_read"] = v["tok_s_best"] / (bw["bytes_per_s"] / v["read_bytes_per_token"])
        spt = v["breakdown"]["seconds_per_token"]
        read = {**act, "lm_head": v["head_read_bytes"]}
        v["breakdown"]["achieved_bytes_per_s"] = {c: read[c] / spt[c] for c in CATEGORIES if read[c] and spt[c] > 0}
    return {"package": str(pkg), "dtype": str(dtype).replace("torch.", ""), "threads": threads,
            "new_tokens": new_tokens, "prompt_tokens": len(prompt), "bandwidth": bw, "active_bytes_per_token": act,
            "kv_bytes_per_token_mean": kv, "bound_tok_s": bound, "target": TARGET, "variants": variants}


def columns(results: list[dict]) -> list[tuple[str, dict, dict]]:
    """(label, the dtype's result, one variant) for each table column: the engine, then the other linears."""
    return [(r["spec"]["dtype"] + ("" if name == "engine" else f" {name}"), r, v)
            for r in results for name, v in r["variants"].items()]


def table(results: list[dict]) -> str:
    cols = columns(results)
    rows = [("active MB / token", lambda r, v: f"{r['active_bytes_per_token']['total'] / 1e6:.1f}"),
            ("  of it lm_head, experts MB", lambda r, v: f"{r['active_bytes_per_token']['lm_head'] / 1e6:.0f}, "
                                                         f"{r['active_bytes_per_token']['experts'] / 1e6:.0f}"),
            ("KV cache MB / token (mean)", lambda r, v: f"{r['kv_bytes_per_token_mean'] / 1e6:.1f}"),
            ("read GB/s sum, mv fp32", lambda r, v: "{sum_fp32:.1f}, {mv_fp32:.1f}".format(
                **{k: x / 1e9 for k, x in r["bandwidth"]["ops_bytes_per_s"].items()})),
            ("bf16 mv GB/s (diagnostic)", lambda r, v: f"{r['bandwidth']['ops_bytes_per_s']['mv_bf16'] / 1e9:.1f}"),
            ("bound tok/s (faster op)", lambda r, v: f"{r['bound_tok_s']:.1f} ({r['bandwidth']['op']})"),
            ("decode tok/s best (median)", lambda r, v: f"{v['tok_s_best']:.1f} ({v['tok_s_median']:.1f})"),
            ("ratio (target >= 60%)", lambda r, v: f"{v['ratio']:.1%}"),
            ("  paired ratio, median run", lambda r, v: f"{v['ratio_paired_median']:.1%}"),
            ("  ratio to the mv bound", lambda r, v: f"{v['ratio_to_gemv_bound']:.1%}"),
            ("MB read / token (head screen)", lambda r, v: f"{v['read_bytes_per_token'] / 1e6:.1f}" + (
                " (yes)" if v["head_screen"] else " (no)")),
            ("  ratio on the bytes read", lambda r, v: f"{v['ratio_read']:.1%}"),
            ("greedy tokens as the engine's",
             lambda r, v: f"{v.get('same_tokens', len(v['tokens']))}/{len(v['tokens'])}")]
    w = 24
    lines = [f"{'':30s}" + "".join(f"{c[0]:>{w}s}" for c in cols)]
    lines += [f"{name:30s}" + "".join(f"{fn(r, v):>{w}s}" for _, r, v in cols) for name, fn in rows]
    lines.append("where a decode step's time goes: ms per token (GB/s reached on the bytes it reads)")
    for c in CATEGORIES:
        cells = []
        for _, r, v in cols:
            ms = v["breakdown"]["seconds_per_token"][c] * 1e3
            gbs = v["breakdown"]["achieved_bytes_per_s"].get(c)
            big = r["active_bytes_per_token"][c] > 0.01 * r["active_bytes_per_token"]["total"]
            cells.append(f"{ms:.2f} ms" + (f" ({gbs / 1e9:.1f} GB/s)" if gbs and big else ""))
        lines.append(f"  {c:28s}" + "".join(f"{x:>{w}s}" for x in cells))
    for label, r, v in cols:
        lines.append(f"top operators ({label}): " + ", ".join(f"{o['op']} {o['share']:.0%}"
                                                         for o in v["breakdown"]["top_ops"][:5]))
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = columns(results)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), dpi=80)
    ax = axes[0]
    x = range(len(cols))
    ax.bar([i - 0.2 for i in x], [v["tok_s_best"] for _, _, v in cols], 0.4, label="decode (best run)")
    ax.bar([i + 0.2 for i in x], [r["bound_tok_s"] for _, r, _ in cols], 0.4, label="bandwidth bound")
    for i, (_, r, v) in enumerate(cols):
        ax.hlines(TARGET * r["bound_tok_s"], i - 0.4, i + 0.4, colors="k", linestyles="--", lw=1)
        ax.text(i - 0.2, v["tok_s_best"], f"{v['ratio']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [c[0] for c in cols], fontsize=8)
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_title("batch-1 decode vs read-bandwidth bound (dashed: the 60% target)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    w = 0.8 / len(cols)
    for j, (label, _, v) in enumerate(cols):
        spt = v["breakdown"]["seconds_per_token"]
        ax.bar([i + j * w for i in range(len(CATEGORIES))], [spt[c] * 1e3 for c in CATEGORIES], w, label=label)
    ax.set_xticks([i + w * (len(cols) - 1) / 2 for i in range(len(CATEGORIES))], CATEGORIES, fontsize=7, rotation=20)
    ax.set_ylabel("ms per decode token")
    ax.set_title("where a decode step's time goes", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(dtypes: list[str], work: Path, out: Path, layers: int = 4, overrides: list[str] = (), threads: int = 2,
        new_tokens: int = 384, repeats: int = 3, buffer_gib: float = 1.0, breakdown_tokens: int = 64,
        backends: tuple[str, ...] = tuple(BACKENDS), package: Path | None = None) -> dict:
    """Build (or reuse) each dtype's package under `work` (or take `package`, in its own dtype), measure it, write
    the JSON and the plot to `out`."""
    results = []
    if package is not None:
        from pipeline.artifacts import read_manifest

        spec = {"package": str(package), "layers": None, "overrides": [], "dtype": read_manifest(package)["dtype"]}
        results.append({**measure(package, threads, new_tokens, repeats, buffer_gib, breakdown_tokens, backends),
                        "spec": spec})
    for dtype in dtypes if package is None else []:
        pkg = work / f"pkg-{layers}layers-{dtype}"
        spec = {"layers": layers, "overrides": list(overrides), "dtype": dtype}
        spec_file = work / f"{pkg.name}.spec.json"
        built = (pkg / "manifest.json").is_file() and spec_file.is_file()
        if not built or json.loads(spec_file.read_text()) != spec:
            print(f"[decode-bandwidth] building {pkg} ...", flush=True)
            work.mkdir(parents=True, exist_ok=True)
            random_package(pkg, layers, list(overrides), dtype)
            spec_file.write_text(json.dumps(spec))
        results.append({**measure(pkg, threads, new_tokens, repeats, buffer_gib, breakdown_tokens, backends),
                        "spec": spec})
    res = {"results": results, "machine": {"cpu_count": os.cpu_count(), "cpu": cpu_info(),
                                           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_bandwidth.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(results, out / "decode_bandwidth.png")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--new-tokens", type=int, default=384, help="tokens per decode run (several hundred)")
    p.add_argument("--repeats", type=int, default=5, help="decode runs per dtype and variant (best and median)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of decode and bandwidth")
    p.add_argument("--buffer-gib", type=float, default=1.0, help="the bandwidth buffer, GiB")
    p.add_argument("--breakdown-tokens", type=int, default=64, help="decode tokens of the per-module breakdown run")
    p.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS),
                   help="(d): the engine on its own linears (engine), on oneDNN alone, on F.linear (MKL)")
    p.add_argument("--layers", type=int, default=4, help="recipes/350m.yaml cut to this many layers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="recipe overrides after the cut (random_package), e.g. model.hidden=256")
    p.add_argument("--package", type=Path, help="measure this package (any family, its own dtype) instead")
    p.add_argument("--work", type=Path, default=Path("/tmp/moe-decode-bandwidth"), help="the packages (reused)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_bandwidth")
    args = p.parse_args(argv)
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        print("[decode-bandwidth] note: OMP_WAIT_POLICY=PASSIVE is recommended on a shared machine", flush=True)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    res = run(dtypes, args.work, args.out, args.layers, args.overrides, args.threads, args.new_tokens, args.repeats,
              args.buffer_gib, args.breakdown_tokens, tuple(args.backends), args.package)
    r0 = res["results"][0]
    a = r0["spec"]
    what = (f"package {args.package}" if args.package else
            f"recipes/350m.yaml cut to {a['layers']} layers, random weights {' '.join(a['overrides'])}")
    print(f"\n== batch-1 decode vs read-bandwidth bound: {what}, {r0['threads']} threads, {r0['new_tokens']} tokens "
          f"a run; CPU: {cpu_line(cpu_info())} ==")
    print(table(res["results"]))
    print(f"wrote {args.out / 'decode_bandwidth.json'} and decode_bandwidth.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
