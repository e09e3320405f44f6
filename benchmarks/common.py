"""Shared by the benchmark scripts: how to start our own CLI as a user would, in a clean environment; a medium
random package to serve; the machine's read bandwidth and the bytes a decode step reads (decode_bandwidth.py and
ep_scale_model.py). Nothing heavy at the top: each helper imports torch and the pipeline when it is called."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


ISA = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # the flags that decide which kernels a server picks


def cpu_info() -> dict:
    """lscpu's model name, the cores this process may use and which of `ISA` the CPU has: printed with every figure
    (the machines here differ between sessions)."""
    import subprocess

    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}
    flags = set(field.get("Flags", "").split())
    return {"model": field.get("Model name", "?"), "cores": len(os.sched_getaffinity(0)),
            **{f: f in flags for f in ISA}}


def cpu_line(cpu: dict) -> str:
    """`cpu_info()` in one line: model, cores, the flags it has."""
    return f"{cpu['model']}, {cpu['cores']} cores; " + ", ".join(f"{f} {'yes' if cpu[f] else 'no'}" for f in ISA)


def cli_command() -> list[str]:
    """`moe-pipeline` from this interpreter's environment (or `python -m cli`)."""
    script = Path(sys.executable).parent / "moe-pipeline"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cli"]


def child_env() -> dict[str, str]:
    """This environment without a launcher's rank variables (pipeline.dist's LAUNCH_VARS: a child that inherited them
    would take itself for a rank), offline for the hubs, unbuffered output."""
    from pipeline.dist import LAUNCH_VARS  # here, not at the top: it loads torch, which --help does without

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def start_server(pkg: Path, extra: list[str] = (), threads: int | None = None, env: dict[str, str] | None = None):
    """`moe-pipeline serve PKG --port P EXTRA` as a separate process, once /health answers: (process, url).
    `env`: variables to set for the server (CUDA_VISIBLE_DEVICES="" serves on the CPU of a GPU machine)."""
    import subprocess
    import time

    import requests

    from pipeline.dist import free_port

    port = free_port()
    extra_env, env = env, child_env()
    env.update(extra_env or {})
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen([*cli_command(), "serve", str(pkg), "--port", str(port), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited {proc.returncode}: moe-pipeline serve {pkg} {' '.join(extra)}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except (requests.ConnectionError, requests.Timeout):  # not up yet, or too busy starting to answer in 2 s
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up")


def stop_server(proc) -> None:
    """SIGTERM (the server drains, then exits) and wait."""
    proc.terminate()
    proc.wait(timeout=120)


def run_logged(cmd: list[str], log: Path, timeout: float | None, append: bool = True) -> float:
    """Run a CLI command with its output in `log`; the wall seconds, or RuntimeError with the log's tail."""
    import subprocess
    import time

    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "a" if append else "w") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-25:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({rc}); last lines of {log}:\n" + "\n".join(tail))
    return wall


def random_package(out: Path, layers: int = 4, overrides: list[str] = (), dtype: str = "bf16", seed: int = 0) -> Path:
    """A package of recipes/350m.yaml's model cut to its first `layers` layers, with random weights: a medium
    model to measure serving on, with no training.

    The cut keeps the pyramid: the last MoE layer gets the recipe's top expert count, the ones below it the
    lower layers' (4 layers: MoE layers 2 and 4 with [32, 64] experts, 0.91B parameters, 0.12B active per
    token, hidden 1024, GPT-2's tokenizer, 2048 positions). `overrides` are `--set` values applied after the
    cut (e.g. ["model.hidden=256", "model.experts=[4, 8]"] for a CPU-sized one). Weights come from
    `init_weights(seed)` (drawn on the CPU: the same bits on every machine), exported in `dtype` (the gates fp32)
    to `out` (replaced if it exists). Returns `out`.
    """
    import json
    import shutil

    from export.package import export_package
    from pipeline import data as data_lib
    from pipeline.artifacts import CONFIG, DONE, DTYPES, RECIPE_FILE, TOKENIZER
    from pipeline.build import teacher_config
    from pipeline.model import GPT, init_weights
    from pipeline.recipe import dump_recipe, load_recipe
    from pipeline.weights import save_weights

    base = load_recipe(ROOT / "recipes" / "350m.yaml")
    moe_count = layers // base.model.moe_every
    experts = list(base.model.experts[:moe_count - 1]) + list(base.model.experts[-1:]) if moe_count else []
    recipe = load_recipe(ROOT / "recipes" / "350m.yaml",
                         [f"model.layers={layers}", f"model.experts={experts}", f"student.layers={layers - 1}",
                          "distributed.nproc=1", *overrides])  # student and ranks: only to pass validation
    cfg = teacher_config(recipe)
    out = Path(out)
    build = out.parent / f".{out.name}.build"
    run = build / f"350m-{layers}layers"  # a run directory with one finished stage, `random`: the package's name
    stage = run / "random"
    shutil.rmtree(build, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        model = GPT(cfg, moe_impl="reference")
        init_weights(model, seed)
        save_weights(model.to(DTYPES[dtype]), stage, {"stage": "random", "recipe": recipe.name})
        del model
        (stage / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))
        data_lib.save_tokenizer(data_lib.gpt2_tokenizer(cfg.seq_len), stage / TOKENIZER)
        (stage / DONE).write_text(json.dumps({"stage": "random", "steps": 0, "seed": seed}))
        (run / RECIPE_FILE).write_text(dump_recipe(recipe))
        return export_package(stage, out, dtype=dtype, force=True)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call (a read bound wants the best sample)."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# -- read bandwidth and the bytes a decode step reads -------------------------------------------------------------

def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> dict:
    """Bytes read per second of a `gib` GiB buffer: {op: bytes/s} for sum_fp32, mv_fp32 (and mv_bf16, a kernel
    diagnostic), best of `repeats` after one untimed run; `bytes_per_s` and `op`: the faster fp32 one."""
    import torch

    torch.set_num_threads(threads)
    n = int(gib * (1 << 30)) // 4
    cols = 4096
    rows = n // cols

    def best(fn, nbytes):
        return nbytes / best_seconds(fn, repeats)

    # random values, as the model's weights (a constant buffer, torch.ones, read at 63 GB/s in one of three tries
    # where random data read at 48). Even so the first sample of a run has read at 77 GB/s twice here, against
    # 41-53 for the other 15: not explained; decode_bandwidth's paired ratio does not depend on one sample
    a = random_buffer(rows, cols)
    v = torch.rand(cols)
    ops = {"sum_fp32": best(lambda: a.sum(), a.numel() * 4), "mv_fp32": best(lambda: torch.mv(a, v), a.numel() * 4)}
    b = torch.rand(rows, 2 * cols, dtype=torch.bfloat16)  # the same bytes
    vb = torch.rand(2 * cols).bfloat16()
    ops["mv_bf16"] = best(lambda: torch.mv(b, vb), b.numel() * 2)
    del a, b
    op = max(("sum_fp32", "mv_fp32"), key=ops.get)
    return {"ops_bytes_per_s": ops, "op": op, "bytes_per_s": ops[op], "buffer_bytes": rows * cols * 4,
            "threads": threads, "repeats": repeats, "samples": 1}


_buffers: dict = {}


def random_buffer(rows: int, cols: int):
    """A [rows, cols] fp32 buffer of uniform random values, made once per shape (1 GiB takes a second to fill)."""
    import torch

    if (rows, cols) not in _buffers:
        _buffers.clear()
        _buffers[rows, cols] = torch.rand(rows, cols, generator=torch.Generator().manual_seed(0))
    return _buffers[rows, cols]


def best_bandwidth(samples: list[dict]) -> dict:
    """The best of several `read_bandwidth` samples, op by op (a shared machine's slow moments left out)."""
    ops = {k: max(s["ops_bytes_per_s"][k] for s in samples) for k in samples[0]["ops_bytes_per_s"]}
    op = max(("sum_fp32", "mv_fp32"), key=ops.get)
    return {**samples[0], "ops_bytes_per_s": ops, "op": op, "bytes_per_s": ops[op], "samples": len(samples),
            "sample_bytes_per_s": [s["bytes_per_s"] for s in samples],
            "repeats": sum(s["repeats"] for s in samples)}


# the categories of `active_bytes`: where a decode step's reads go
CATEGORIES = ("attention", "dense_mlp", "gate_routing", "experts", "residual_mlp", "lm_head", "other")


def category_of(name: str) -> str:
    """The breakdown category of a parameter name (pipeline/model.py's names)."""
    if ".deepspeed_experts." in name:
        return "experts"
    if "gate.wg" in name:
        return "gate_routing"
    if ".mlp.moe." in name:  # the residual MLP and its mixing coefficient
        return "residual_mlp"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    if name.startswith("lm_head") or name == "wte.weight":
        return "lm_head"  # tied: the embedding is the head, read whole every step
    return "other"  # norms, the positional embedding's row


def active_bytes(cfg, dtype) -> dict:
    """Bytes of the parameters one decode step of one token reads, by category: counted on the model of `cfg`
    built on the meta device (whatever module layout the engine serves it with), in `dtype` with the gates fp32.
    The experts read are `pipeline.model.param_counts`'s active ones (top_k experts a token)."""
    from pipeline.build import cast_keeping_gates, meta_model
    from pipeline.model import param_counts, split_expert_key

    model = cast_keeping_gates(meta_model(cfg), dtype)
    tied = model.lm_head.weight is model.wte.weight
    out = dict.fromkeys(CATEGORIES, 0)
    dense_params = expert_size = 0
    for name, p in model.named_parameters():  # a tied weight once
        if split_expert_key(name) is not None:
            expert_size = p.element_size()
            continue
        dense_params += p.numel()
        if name == "wpe.weight" or (name == "wte.weight" and not tied):
            out["other"] += p.shape[1] * p.element_size()  # one row
        else:
            out[category_of(name)] += p.numel() * p.element_size()
    out["experts"] = (param_counts(model)["active_per_token"] - dense_params) * expert_size
    out["total"] = sum(out.values())
    return out
