"""The GPU check: fp16/bf16 training, resume, the clip norm, the fp16 KD gradient, serving and a benchmark, on CUDA.

    bash scripts/gpu_check.sh OUT                        # the lent GPU machine: installs .gpu-wheels/, then this
    python benchmarks/gpu_check.py OUT                   # every part, on CUDA when there is a GPU (else the CPU side)
    python benchmarks/gpu_check.py OUT --only serve      # rerun parts: --only kd --only bench, or --only kd,bench
    .venv/bin/python benchmarks/gpu_check.py OUT --device cpu --write-reference   # refresh the carried CPU values

Everything it measures goes to OUT: one JSON per part (`train.json`, `kd.json`, `serve.json`, `bench.json`:
`ok`, `failures`, `seconds`, the numbers), `summary.json` (every part's ok/seconds/failures and the machine),
`summary.txt` (the same, readable) and `logs.tar.gz` (every command's output). At most 11 files, none in a
sub-folder, as the device tool brings back. Models, runs and packages go to `--work` (default
/tmp/moe-gpu-check-<device>), kept between calls so that a rerun part finds what an earlier one built. Exit status
0 when every part that ran passed, 1 otherwise, 2 for bad arguments.

Parts (on CUDA, unless --device cpu or there is no GPU, where each runs its CPU side):
  train  the tiny recipe, teacher and student (`moe-pipeline distill`, 1 rank, 150 + 150 steps, the same for every
         precision), in fp32, bf16 and fp16 (DeepSpeed's dynamic loss scale), the three runs at once on the one GPU.
         Fails if a run fails, if bf16's or fp16's held-out loss is more than 2% from the fp32 run's, or if the
         fp16 loss scaler skipped more than 10% of the updates (a skipped-step storm). The CPU's fp32 losses
         (benchmarks/gpu_check_cpu.json) are shown beside. On the CPU: fp32 and bf16 (DeepSpeed refuses fp16
         on its CPU accelerator, and so does our recipe check, with the fix in its message).
  kd     benchmarks/kd_precision.py on the device: the fused KD loss's gradient in fp16 (loss scale 2^16, 2^8) and
         bf16 against fp32 autograd at V = 50,304 (4096 tokens on a GPU, 1024 on a CPU); fails at relative L1 >= 1e-2.
  serve  export the fp32 student of `train` (trained here if `train` did not run), verify it, `moe-pipeline serve
         PKG --smoke`; the greedy tokens of one prompt from a server on the device and, on a GPU machine, from one
         on its CPU (must be equal); a package of seeded random weights (the same bits on every machine: its
         weights' sha256 is checked) whose greedy tokens must equal the CPU's carried in gpu_check_cpu.json;
         `moe-pipeline eval` of the fp32 package on two bundled tasks (lm-eval travels in the wheel folder).
  resume the tiny teacher (fp32, 1 rank, 60 steps, a checkpoint every 20) killed with SIGKILL at its first checkpoint
         and resumed, against the same run uninterrupted: the held-out losses (bit-equal on a CPU; on CUDA DeepSpeed's
         MoE backward adds with atomics, so equal to rounding: fails beyond 1e-3 relative).
  norm   tests/workers/clip_norm.py on the device, 1 rank: the gradient norm DeepSpeed clips by, for every precision
         and ZeRO stage the project generates, equals the norm with the expert gradients (fp16 with ZeRO included on
         a GPU); torch's AdamW in fp16 without ZeRO (what the project passed before) gets the one without them.
  serve2 serving beyond `serve`: a package with a 32,768-token context serving one long prompt (30,000 tokens on a
         GPU, 2,000 on a CPU); a temperature request twice with one seed (the same text); an echo + logprobs request
         (the prompt's tokens scored, the first None); `--placement reactive --resident-experts 0.5` on 1 rank (the
         greedy tokens of the package served without placement; its rank status counts expert loads, through pinned
         memory on a side stream on a GPU, and expert seconds, from CUDA events there); decode rows that leave and join the batch at
         different steps (non-contiguous rows: 8 requests of 8 or 48 tokens, 4 more once the short ones end), tokens/s.
  bench  benchmarks/serve_bench.py on the device for the medium package of benchmarks/common.random_package
         (recipes/350m.yaml cut to 4 layers, random weights, bf16 on a GPU; a CPU-sized one on a CPU): batch-1
         decode tokens/s against the bandwidth bound (active bytes per token / measured copy bandwidth), and 16
         concurrent requests against Hugging Face `generate` on the same package. Numbers only, no target.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, cli_command, random_package, start_server, stop_server  # noqa: E402

sys.path.insert(1, str(ROOT))  # this checkout's pipeline/, export/ (ahead of any installed copy)

PARTS = ("train", "resume", "norm", "kd", "serve", "serve2", "bench")
RECIPE = "recipes/tiny.yaml"
STEPS = 150          # teacher and student steps of every precision (the recipe's 300, halved: the CPU run fits)
TOLERANCE = 0.02     # bf16 and fp16 held-out losses within 2% of fp32's
STORM = 0.10         # more skipped fp16 updates than this share of the steps is a skipped-step storm
KD_TARGET = 1e-2
PROMPT = "And God said"
NEW_TOKENS = 32
REFERENCE = ROOT / "benchmarks" / "gpu_check_cpu.json"
# the seeded random package whose greedy tokens every machine must reproduce: small, fp32, GPT-2's tokenizer
REF_PACKAGE = {"layers": 4, "overrides": ["model.hidden=128", "model.heads=4", "model.experts=[4, 8]",
                                          "data.seq_len=256"], "dtype": "fp32", "seed": 0}
# the medium package of part bench: as common.random_package builds it on a GPU; a CPU-sized cut on a CPU
BENCH_PACKAGE = {"cuda": {"layers": 4, "overrides": [], "dtype": "bf16"},
                 "cpu": {"layers": 4, "overrides": ["model.hidden=256", "model.heads=4", "model.experts=[4, 8]"],
                         "dtype": "fp32"}}


class Check:
    """One invocation: the device, the folders, the logs, and a `run` for CLI commands."""

    def __init__(self, out: Path, work: Path, device: str):
        self.out, self.work, self.device = out, work, device
        self.cuda = device == "cuda"
        self.logs = work / "logs"
        shutil.rmtree(self.logs, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self.timeout = 300 if self.cuda else 1800  # per command: on the GPU the whole check must fit a 10-minute call

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = child_env()
        if not self.cuda:
            # OpenMP threads that sleep instead of spinning when they wait: on a small CPU shared with other jobs,
            # spinning threads made a training step here 15x slower (6-8 s instead of 0.5 s)
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.update(extra or {})
        return env

    def start(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        path = self.logs / f"{log}.log"
        f = open(path, "a")
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env(env), stdout=f, stderr=subprocess.STDOUT)
        f.close()
        return proc, path

    def wait(self, proc: subprocess.Popen, path: Path, timeout: float | None = None) -> None:
        try:
            rc = proc.wait(timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        if rc != 0:
            tail = path.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
            raise RuntimeError(f"`{' '.join(map(str, proc.args))}` failed ({rc}); {path.name}:\n" + "\n".join(tail))

    def run(self, cmd: list[str], log: str, env: dict[str, str] | None = None, timeout: float | None = None) -> str:
        """Run a command to its end (RuntimeError with its output's tail if it fails); its output."""
        proc, path = self.start(cmd, log, env)
        self.wait(proc, path, timeout)
        return path.read_text(errors="replace")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# -- part train ---------------------------------------------------------------------------------------------------

def train_sets(precision: str, steps: int = STEPS) -> list[str]:
    """--set values of one training run: the precision and step count of both stages, validation at the end only,
    one checkpoint (checkpoint_every = steps: the last step's)."""
    sets = []
    for stage in ("teacher", "student"):
        # bf16 and fp16 at ZeRO stage 1 (the recipe's rule): bf16 accumulating its gradients in fp32 over the tiny
        # recipe's 2 micro-steps, fp16 with DeepSpeed's dynamic loss scale
        for key, value in (("precision", precision), ("steps", steps), ("eval_every", steps),
                           ("checkpoint_every", steps), ("zero_stage", 0 if precision == "fp32" else 1)):
            sets += ["--set", f"{stage}.train.{key}={value}"]
    return sets


def train_command(run_dir: Path, precision: str) -> list[str]:
    return [*cli_command(), "distill", RECIPE, "--run-dir", str(run_dir), *train_sets(precision)]


def run_result(run_dir: Path) -> dict:
    """Both stages' DONE.json facts, and fp16's last logged loss scale."""
    out = {}
    for stage in ("teacher", "student"):
        done = read_json(run_dir / stage / "DONE.json")
        out[stage] = {k: done.get(k) for k in ("val_loss", "skipped_steps", "steps", "train_seconds", "wall_seconds")}
        if stage == "student":
            out[stage]["teacher_val_loss"] = done.get("teacher_val_loss")
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss_scale" in r:
            out[r["stage"]]["last_loss_scale"] = r["loss_scale"]
    return out


def fp32_run(check: Check) -> Path:
    """The fp32 run of part train (trained now if this work folder has none finished)."""
    run_dir = check.work / "train" / "fp32"
    if not (run_dir / "student" / "DONE.json").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        check.run(train_command(run_dir, "fp32"), "train-fp32")
    return run_dir


def part_train(check: Check, reference: dict) -> dict:
    precisions = ["fp32", "bf16", "fp16"] if check.cuda else ["fp32", "bf16"]
    res: dict = {"recipe": RECIPE, "steps": STEPS, "precisions": precisions, "failures": []}
    check.run([*cli_command(), "prepare", RECIPE], "prepare")  # the data cache, once, before the runs share it
    runs = {}

    def start(p: str):
        run_dir = check.work / "train" / p
        shutil.rmtree(run_dir, ignore_errors=True)
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 3) // len(precisions)))} if check.cuda else None
        return p, run_dir, *check.start(train_command(run_dir, p), f"train-{p}", threads)

    def finish(p: str, run_dir: Path, proc, log: Path, deadline: float | None = None) -> None:
        try:
            check.wait(proc, log, None if deadline is None else max(1.0, deadline - time.monotonic()))
            runs[p] = run_result(run_dir)
        except (RuntimeError, FileNotFoundError) as err:
            res["failures"].append(f"{p}: {err}")

    if check.cuda:  # the three runs share the GPU at once: each is launch-bound, one alone leaves it mostly idle
        jobs = [start(p) for p in precisions]
        deadline = time.monotonic() + check.timeout  # one limit for the three, not one each
        for job in jobs:
            finish(*job, deadline=deadline)
    else:
        for p in precisions:
            finish(*start(p))
        # fp16 on a CPU: refused before anything is written (DeepSpeed's CPU accelerator has no fp16 either)
        proc = subprocess.run([*cli_command(), "teacher", RECIPE, "--set", "teacher.train.precision=fp16", "--set",
                               "teacher.train.zero_stage=1", "--run-dir", str(check.work / "train" / "fp16-refused")],
                              cwd=ROOT, env=check.env(), capture_output=True, text=True, timeout=300)
        res["fp16_on_cpu"] = {"exit_status": proc.returncode, "message": (proc.stderr.strip().splitlines() or [""])[-1]}
        if proc.returncode != 2:
            res["failures"].append(f"fp16 on the CPU was not refused with exit status 2: {res['fp16_on_cpu']}")
    res["runs"] = runs
    cpu = (reference.get("train") or {})
    same_settings = cpu.get("steps") == STEPS and cpu.get("recipe") == RECIPE
    res["cpu_reference"] = {p: cpu.get(p) for p in ("fp32", "bf16")} if same_settings else None
    if "fp32" in runs:
        for p in precisions[1:]:
            if p not in runs:
                continue
            for stage in ("teacher", "student"):
                d = rel_diff(runs[p][stage]["val_loss"], runs["fp32"][stage]["val_loss"])
                runs[p][stage]["rel_diff_vs_fp32"] = d
                if d > TOLERANCE:
                    res["failures"].append(f"{p} {stage}: held-out loss {runs[p][stage]['val_loss']:.4f} is "
                                           f"{d:.2%} from fp32's {runs['fp32'][stage]['val_loss']:.4f} (limit 2%)")
        if res["cpu_reference"] and res["cpu_reference"].get("fp32"):
            for stage in ("teacher", "student"):
                runs["fp32"][stage]["rel_diff_vs_cpu_fp32"] = rel_diff(
                    runs["fp32"][stage]["val_loss"], res["cpu_reference"]["fp32"][stage]["val_loss"])
    for p, r in runs.items():
        for stage in ("teacher", "student"):
            skipped = r[stage].get("skipped_steps") or 0
            if skipped > STORM * STEPS:
                res["failures"].append(f"{p} {stage}: the loss scaler skipped {skipped} of {STEPS} updates "
                                       f"(a skipped-step storm: limit {STORM:.0%})")
    return res


# -- part resume --------------------------------------------------------------------------------------------------

RESUME_SETS = ["--set", "teacher.train.steps=60", "--set", "teacher.train.checkpoint_every=20", "--set",
               "teacher.train.eval_every=60", "--set", "teacher.train.eval_batches=8"]


def part_resume(check: Check) -> dict:
    import signal

    res: dict = {"steps": 60, "checkpoint_every": 20, "failures": []}
    runs = {}
    for name in ("straight", "killed"):
        run_dir = check.work / "resume" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [*cli_command(), "teacher", RECIPE, "--run-dir", str(run_dir), *RESUME_SETS]
        if name == "killed":  # SIGKILL the moment DeepSpeed's `latest` names a checkpoint, then run it again
            latest = run_dir / "teacher.partial" / "checkpoints" / "latest"
            proc, log = check.start(cmd, "resume-killed", {"PYTHONUNBUFFERED": "1"})
            deadline = time.monotonic() + check.timeout
            while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            res["killed_at"] = latest.read_text().strip() if latest.exists() else None
            if proc.returncode != -signal.SIGKILL or res["killed_at"] is None:
                res["failures"].append(f"the run was not killed at a checkpoint (exit {proc.returncode})")
                return res
        check.run(cmd, f"resume-{name}")
        runs[name] = read_json(run_dir / "teacher" / "DONE.json")
    a, b = runs["straight"]["val_loss"], runs["killed"]["val_loss"]
    res.update(straight_val_loss=a, resumed_val_loss=b, resumed_from_step=runs["killed"]["resumed_from_step"],
               rel_diff=rel_diff(b, a))
    limit = 1e-3 if check.cuda else 0.0
    if runs["killed"]["resumed_from_step"] == 0:
        res["failures"].append("the second run did not resume from the checkpoint")
    if res["rel_diff"] > limit:
        res["failures"].append(f"resumed held-out loss {b!r} vs uninterrupted {a!r}: {res['rel_diff']:.2e} "
                               f"relative (limit {limit:g})")
    return res


# -- part norm ----------------------------------------------------------------------------------------------------

def part_norm(check: Check) -> dict:
    path = check.work / "clip_norm.json"
    path.unlink(missing_ok=True)
    check.run([sys.executable, "tests/workers/clip_norm.py", str(path)], "norm")
    res = {**read_json(path), "failures": []}
    for c in res["cases"]:
        want = c["with_experts"] if c["optimizer"] == "project" else c["without_experts"]
        c["expected"] = "with experts" if c["optimizer"] == "project" else "without experts (the old fp16 path)"
        if not abs(c["norm"] - want) <= 1e-3 * want:
            res["failures"].append(f"{c['precision']} ZeRO {c['zero_stage']} {c['optimizer']} ({c['wrapper']}): "
                                   f"clip norm {c['norm']:.6g}, expected {c['expected']} {want:.6g}")
    if check.cuda and not any(c["precision"] == "fp16" for c in res["cases"]):
        res["failures"].append("no fp16 case ran on the GPU")
    return res


# -- part kd ------------------------------------------------------------------------------------------------------

def part_kd(check: Check) -> dict:
    tokens = 4096 if check.cuda else 1024
    path = check.work / "kd_precision.json"
    path.unlink(missing_ok=True)
    try:  # exit 1 with its JSON written: a gradient off target, reported below
        check.run([sys.executable, "benchmarks/kd_precision.py", "--device", check.device, "--tokens", str(tokens),
                   "--json", str(path)], "kd")
    except RuntimeError:
        if not path.is_file():
            raise
    res = {**read_json(path), "failures": []}
    for c in res["cases"]:
        if not c["now"]["rel_l1"] < KD_TARGET:
            res["failures"].append(f"{c['dtype']} scale {c['scale']:g} {c['kind']}: relative L1 "
                                   f"{c['now']['rel_l1']:.3e} (target < {KD_TARGET:g})")
    return res


# -- part serve ---------------------------------------------------------------------------------------------------

def greedy(pkg: Path, env: dict[str, str] | None = None) -> dict:
    """The greedy completion of PROMPT from a `moe-pipeline serve` of `pkg`: its tokens (as the API names them) and
    text."""
    import requests

    try:
        proc, url = start_server(pkg, env=env)
    except SystemExit as err:  # start_server's way of saying the server exited or never came up
        raise RuntimeError(f"moe-pipeline serve {pkg}: {err}") from None
    try:
        r = requests.post(f"{url}/v1/completions", timeout=300, json={
            "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0})
        r.raise_for_status()
        choice = r.json()["choices"][0]
    finally:
        stop_server(proc)
    return {"prompt": PROMPT, "tokens": choice["logprobs"]["tokens"], "text": choice["text"],
            "token_logprobs": choice["logprobs"]["token_logprobs"]}


def logprob_gap(a: dict, b: dict) -> float:
    """The largest difference between two greedy runs' log-probabilities of the tokens they chose (a measure of how
    close the two devices' arithmetic is, where the tokens agree; reported, not checked)."""
    return max((abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])), default=0.0)


def weights_sha256(pkg: Path) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes in name order (the files' own hashes also cover
    metadata that names the machine's paths)."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(pkg.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for key in sorted(sf.keys()):
                t = sf.get_tensor(key).contiguous()
                h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def part_serve(check: Check, reference: dict) -> dict:
    res: dict = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "failures": []}
    cli = cli_command()
    # 1. the trained fp32 student: export, verify, --smoke, greedy tokens here (and on this machine's CPU)
    pkg = check.work / "pkg-fp32"
    check.run([*cli, "export", str(fp32_run(check)), "--out", str(pkg), "--force"], "export")
    check.run([*cli, "verify", str(pkg)], "verify")
    out = check.run([*cli, "serve", str(pkg), "--port", "0", "--smoke", PROMPT], "smoke", timeout=300)
    line = [ln for ln in out.splitlines() if "POST /v1/completions" in ln]
    res["smoke"] = line[-1] if line else None
    if not line or "failed" in line[-1]:
        res["failures"].append(f"serve --smoke printed no completion: {res['smoke']}")
    res["trained"] = {check.device: greedy(pkg)}
    if check.cuda:
        res["trained"]["cpu"] = greedy(pkg, env={"CUDA_VISIBLE_DEVICES": ""})
        res["trained"]["max_logprob_gap"] = logprob_gap(res["trained"]["cpu"], res["trained"]["cuda"])
        if res["trained"]["cpu"]["tokens"] != res["trained"]["cuda"]["tokens"]:
            res["failures"].append("the fp32 package's greedy tokens on CUDA differ from the same machine's CPU: "
                                   f"{res['trained']['cuda']['text']!r} vs {res['trained']['cpu']['text']!r}")
    # 2. the seeded random package: the same weights everywhere, so the same greedy tokens as the carried CPU's
    ref_pkg = random_package(check.work / "pkg-ref", REF_PACKAGE["layers"], REF_PACKAGE["overrides"],
                             REF_PACKAGE["dtype"], REF_PACKAGE["seed"])
    res["reference_package"] = {**REF_PACKAGE, "weights_sha256": weights_sha256(ref_pkg), **greedy(ref_pkg)}
    carried = (reference.get("serve") or {}).get("reference_package")
    if carried is None:
        res["reference_package"]["vs_cpu"] = "no carried CPU tokens (benchmarks/gpu_check_cpu.json)"
        if check.cuda:
            res["failures"].append("benchmarks/gpu_check_cpu.json has no reference_package tokens to compare with")
    elif carried["weights_sha256"] != res["reference_package"]["weights_sha256"]:
        res["failures"].append("the seeded random package's weights differ from the CPU's (sha256): its tokens "
                               "cannot be compared")
    else:
        same = carried["tokens"] == res["reference_package"]["tokens"]
        res["reference_package"]["vs_cpu"] = "equal" if same else "different"
        res["reference_package"]["cpu_text"] = carried["text"]
        if "token_logprobs" in carried:
            res["reference_package"]["max_logprob_gap"] = logprob_gap(res["reference_package"], carried)
        if not same:
            res["failures"].append(f"the random package's greedy tokens on {check.device} differ from the CPU's: "
                                   f"{res['reference_package']['text']!r} vs {carried['text']!r}")
    # 3. zero-shot eval of the fp32 package on two bundled tasks
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        res["eval"] = {"skipped": f"lm-eval is not installed here ({err})"}
    else:
        eval_dir = check.work / f"eval-{check.device}"
        shutil.rmtree(eval_dir, ignore_errors=True)
        t0 = time.perf_counter()
        check.run([*cli, "eval", str(pkg), "--tasks", "tiny_lastword,tiny_nextline", "--limit", "200",
                   "--batch-size", "32", "--bootstrap-iters", "0", "--out", str(eval_dir)], "eval")
        results = read_json(eval_dir / "results.json")
        scores = {}
        for model, entry in results.items():
            if model.startswith("_"):
                continue
            for task, metrics in entry["results"].items():
                scores[task] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        res["eval"] = {"tasks": scores, "limit": 200, "seconds": round(time.perf_counter() - t0, 1)}
    return res


# -- part serve2 --------------------------------------------------------------------------------------------------

LONG_PACKAGE = {"layers": 4, "overrides": ["model.hidden=128", "model.heads=4", "model.experts=[4, 8]",
                                            "data.seq_len=32768"], "dtype": "fp32", "seed": 0}


def _post(url: str, body: dict) -> dict:
    import requests

    r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{body.get('prompt', '')!r:.40}: HTTP {r.status_code} {r.text[:300]}")
    return r.json()


def part_serve2(check: Check) -> dict:
    import concurrent.futures as cf

    import requests

    res: dict = {"failures": []}
    ref_pkg = random_package(check.work / "pkg-ref", REF_PACKAGE["layers"], REF_PACKAGE["overrides"],
                             REF_PACKAGE["dtype"], REF_PACKAGE["seed"])
    # 1. a 32,768-token context, one long prompt
    long_pkg = random_package(check.work / "pkg-long", LONG_PACKAGE["layers"], LONG_PACKAGE["overrides"],
                              LONG_PACKAGE["dtype"], LONG_PACKAGE["seed"])
    n = 30000 if check.cuda else 2000
    proc, url = start_server(long_pkg)
    try:
        t0 = time.perf_counter()
        body = _post(url, {"prompt": [int(i % 50000) for i in range(n)], "max_tokens": 8, "temperature": 0})
        res["long_context"] = {"context": 32768, "prompt_tokens": body["usage"]["prompt_tokens"],
                               "completion_tokens": body["usage"]["completion_tokens"],
                               "seconds": round(time.perf_counter() - t0, 2)}
        if body["usage"]["prompt_tokens"] != n or body["usage"]["completion_tokens"] != 8:
            res["failures"].append(f"long prompt: usage {body['usage']}")
    finally:
        stop_server(proc)
    # 2. temperature (twice, one seed), echo + logprobs, rows leaving and joining the batch
    proc, url = start_server(ref_pkg)
    try:
        sampled = [_post(url, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 7})
                   ["choices"][0]["text"] for _ in range(2)]
        res["temperature"] = {"texts": sampled, "same_with_one_seed": sampled[0] == sampled[1]}
        if sampled[0] != sampled[1]:
            res["failures"].append(f"temperature 0.8, seed 7, twice: {sampled[0]!r} vs {sampled[1]!r}")
        echo = _post(url, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1})
        choice = echo["choices"][0]
        lp = choice["logprobs"]
        scored = len(lp["tokens"]) == echo["usage"]["prompt_tokens"] + 4 and lp["token_logprobs"][0] is None \
            and all(x is not None for x in lp["token_logprobs"][1:])
        res["echo_logprobs"] = {"text": choice["text"], "tokens": len(lp["tokens"]), "scored": scored}
        if not (choice["text"].startswith(PROMPT) and scored):
            res["failures"].append(f"echo + logprobs: {choice['text']!r}, {len(lp['tokens'])} tokens, "
                                   f"first logprob {lp['token_logprobs'][0]!r}")
        greedy_plain = _post(url, {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})["choices"][0]["text"]
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(12) as pool:  # 8 at once (short and long), 4 more as the short ones end
            first = [pool.submit(_post, url, {"prompt": f"{PROMPT} {i}", "max_tokens": 8 if i % 2 else 48,
                                              "temperature": 0, "ignore_eos": True}) for i in range(8)]
            for f in [f for i, f in enumerate(first) if i % 2]:
                f.result()
            more = [pool.submit(_post, url, {"prompt": f"{PROMPT} again {i}", "max_tokens": 24, "temperature": 0,
                                             "ignore_eos": True}) for i in range(4)]
            tokens = sum(f.result()["usage"]["completion_tokens"] for f in first + more)
        seconds = time.perf_counter() - t0
        res["rows_leaving_and_joining"] = {"requests": 12, "completion_tokens": tokens, "seconds": round(seconds, 2),
                                           "tokens_per_s": round(tokens / seconds, 1)}
        if tokens != 4 * 8 + 4 * 48 + 4 * 24:
            res["failures"].append(f"rows leaving and joining: {tokens} tokens, expected {4 * 8 + 4 * 48 + 4 * 24}")
    finally:
        stop_server(proc)
    # 3. expert placement with half the experts resident, 1 rank: the same greedy tokens
    # (on a GPU the experts it loads go through pinned memory on the store's own stream, and its expert seconds come
    # from CUDA events: the rank's status must count loads and expert time)
    proc, url = start_server(ref_pkg, extra=["--placement", "reactive", "--resident-experts", "0.5"])
    try:
        placed = _post(url, {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})["choices"][0]["text"]
        time.sleep(1.5)  # the engine asks every rank for its status once a second
        status = requests.get(f"{url}/health", timeout=30).json()["rank_status"][0]
    finally:
        stop_server(proc)
    res["placement_reactive_half_resident"] = {
        "text": placed, "same_as_without": placed == greedy_plain,
        **{k: status.get(k) for k in ("expert_hits", "expert_misses", "expert_s", "forward_s")}}
    if placed != greedy_plain:
        res["failures"].append(f"--placement reactive --resident-experts 0.5: {placed!r}, without: {greedy_plain!r}")
    if not (status.get("expert_misses", 0) + status.get("expert_hits", 0) > 0 and status.get("expert_s", 0) > 0):
        res["failures"].append(f"--resident-experts 0.5: no expert loads or no expert time in the rank's status "
                               f"{status}")
    return res


# -- part bench ---------------------------------------------------------------------------------------------------

def part_bench(check: Check) -> dict:
    spec = BENCH_PACKAGE["cuda" if check.cuda else "cpu"]
    t0 = time.perf_counter()
    pkg = random_package(check.work / "pkg-medium", spec["layers"], spec["overrides"], spec["dtype"])
    build_s = time.perf_counter() - t0
    out = check.work / "bench"
    shutil.rmtree(out, ignore_errors=True)
    # on a CPU: fewer and shorter runs (2 cores: the GPU's settings would take many minutes)
    n, repeats, latency, threads = (NEW_TOKENS, 3, 320, 4) if check.cuda else (16, 1, 32, 2)
    check.run([sys.executable, "benchmarks/serve_bench.py", "--package", str(pkg), "--device", check.device,
               "--new-tokens", str(n), "--repeats", str(repeats), "--latency-requests", str(latency),
               "--threads", str(threads), "--out", str(out)], "serve_bench")
    sb = read_json(out / "serve_bench.json")
    manifest = read_json(pkg / "manifest.json")
    one, six, bw = sb["one_request"], sb["sixteen"], sb["bandwidth"]
    res = {"package": {**spec, "params": manifest["params"], "architecture": manifest["architecture"],
                       "build_seconds": round(build_s, 1)},
           "new_tokens": n, "repeats": repeats,
           "batch1_decode_tok_s": one["server_tok_s"], "batch1_hf_tok_s": one["hf_tok_s"],
           "bandwidth_bound_tok_s": bw["bound_tok_s"], "batch1_share_of_bound": one["server_tok_s"] / bw["bound_tok_s"],
           "copy_bandwidth_GBps": bw["copy_bytes_per_s"] / 1e9, "active_bytes_per_token": bw["active_bytes_per_token"],
           "sixteen_server_tok_s": six["server_tok_s"], "sixteen_hf_tok_s": six["hf_tok_s"],
           "sixteen_ratio": six["server_tok_s"] / six["hf_tok_s"], "sixteen_failures": six["failures"],
           "latency": sb["latency"], "serve_bench": sb, "failures": []}
    if six["failures"] or sb["latency"]["failures"]:
        res["failures"].append(f"{six['failures']} of 16 and {sb['latency']['failures']} of "
                               f"{sb['latency']['requests']} requests failed")
    return res


# -- summary ------------------------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    import importlib.metadata as md

    import torch

    env = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "cpu_count": os.cpu_count(), "machine": platform.machine()}
    for name in ("deepspeed", "transformers", "lm_eval", "fastapi", "pydantic", "datasets"):
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            env[name] = None
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   gpu_memory_GiB=round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1))
    return env


def lines_of(part: str, r: dict) -> list[str]:
    """A part's numbers, readable."""
    out = []
    if part == "train" and "runs" in r:
        cpu = r.get("cpu_reference") or {}
        for p, run in r["runs"].items():
            for stage in ("teacher", "student"):
                s = run[stage]
                extra = ""
                if "rel_diff_vs_fp32" in s:
                    extra += f", {s['rel_diff_vs_fp32']:+.2%} vs fp32"
                if cpu.get(p):
                    extra += f", CPU {p} {cpu[p][stage]['val_loss']:.4f}"
                if p == "fp16":
                    extra += (f", skipped {s.get('skipped_steps')} of {s['steps']} "
                              f"(loss scale {s.get('last_loss_scale')})")
                out.append(f"  {p:5s} {stage:8s} held-out loss {s['val_loss']:.4f} ({s['train_seconds']:.0f}s){extra}")
        if "fp16_on_cpu" in r:
            out.append(f"  fp16 on the CPU: exit {r['fp16_on_cpu']['exit_status']}, {r['fp16_on_cpu']['message']}")
    elif part == "resume" and "rel_diff" in r:
        out.append(f"  killed at {r['killed_at']}, resumed from step {r['resumed_from_step']}: held-out loss "
                   f"{r['resumed_val_loss']:.6f} vs uninterrupted {r['straight_val_loss']:.6f} ({r['rel_diff']:.1e})")
    elif part == "norm" and "cases" in r:
        for c in r["cases"]:
            out.append(f"  {c['precision']} ZeRO {c['zero_stage']} {c['optimizer']:11s} {c['wrapper']:22s} clip norm "
                       f"{c['norm']:.5f}; with experts {c['with_experts']:.5f}, without {c['without_experts']:.5f}")
    elif part == "serve2" and "long_context" in r:
        lc = r["long_context"]
        out.append(f"  32,768-token context: a {lc['prompt_tokens']}-token prompt in {lc['seconds']}s")
        out.append(f"  temperature 0.8, one seed, twice: {'the same' if r['temperature']['same_with_one_seed'] else 'different'}"
                   f"; echo + logprobs: {r['echo_logprobs']['tokens']} tokens scored")
        if "rows_leaving_and_joining" in r:
            rows = r["rows_leaving_and_joining"]
            out.append(f"  rows leaving and joining: {rows['completion_tokens']} tokens in {rows['seconds']}s, "
                       f"{rows['tokens_per_s']} tok/s")
        if "placement_reactive_half_resident" in r:
            out.append(f"  --placement reactive --resident-experts 0.5: "
                       f"{'same greedy tokens' if r['placement_reactive_half_resident']['same_as_without'] else 'DIFFERENT'}")
    elif part == "kd" and "cases" in r:
        out.append(f"  V = {r['vocab']}, {r['tokens']} tokens on {r['device']}: "
                   f"worst relative L1 {r['worst_rel_l1']:.2e}")
        for c in r["cases"]:
            out.append(f"  {c['dtype']:8s} scale {c['scale']:>7g} {c['kind']:10s} now {c['now']['rel_l1']:.2e} "
                       f"(flushed {c['now']['flushed']:.1%}); before {c['before']['rel_l1']:.2e}")
    elif part == "serve":
        if r.get("smoke"):
            out.append(f"  smoke: {r['smoke'].strip()}")
        trained = r.get("trained") or {}
        for dev in ("cuda", "cpu"):
            if dev in trained:
                out.append(f"  fp32 package on {dev}: {trained[dev]['text']!r}")
        if "max_logprob_gap" in trained:
            out.append(f"  fp32 package, CUDA vs CPU: largest log-prob difference {trained['max_logprob_gap']:.2e}")
        ref = r.get("reference_package")
        if ref:
            vs = ref.get("vs_cpu")
            vs = f"{vs} to the carried CPU tokens" if vs in ("equal", "different") else vs
            gap = f", largest log-prob difference {ref['max_logprob_gap']:.2e}" if "max_logprob_gap" in ref else ""
            out.append(f"  random package (weights sha256 {ref['weights_sha256'][:12]}): {ref['text']!r} ({vs}{gap})")
        ev = r.get("eval") or {}
        if "skipped" in ev:
            out.append(f"  eval skipped: {ev['skipped']}")
        for task, m in (ev.get("tasks") or {}).items():
            out.append(f"  eval {task}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items()))
    elif part == "bench" and "batch1_decode_tok_s" in r:
        a, n = r["package"]["architecture"], r["package"]["params"]
        out.append(f"  package: {a['layers']} layers, hidden {a['hidden']}, experts {a['experts']}, "
                   f"{n['total'] / 1e6:.0f}M parameters ({n['active_per_token'] / 1e6:.0f}M active), "
                   f"{r['package']['dtype']}")
        out.append(f"  batch-1 decode {r['batch1_decode_tok_s']:.1f} tok/s (HF {r['batch1_hf_tok_s']:.1f}) vs bound "
                   f"{r['bandwidth_bound_tok_s']:.0f} tok/s ({r['active_bytes_per_token'] / 1e6:.0f} MB a token, copy "
                   f"{r['copy_bandwidth_GBps']:.0f} GB/s): {r['batch1_share_of_bound']:.1%} of the bound")
        out.append(f"  16 concurrent: server {r['sixteen_server_tok_s']:.1f} tok/s, HF generate one after another "
                   f"{r['sixteen_hf_tok_s']:.1f} tok/s ({r['sixteen_ratio']:.2f}x)")
        L = r["latency"]
        out.append(f"  32 clients, {L['requests']} requests of 16 tokens: p50 {L['p50_s'] * 1e3:.0f} ms, "
                   f"p99 {L['p99_s'] * 1e3:.0f} ms")
    for f in r.get("failures", []):
        out.append(f"  FAILED: {f}")
    return out


def write_summary(out: Path, env: dict, results: dict, argv: list[str]) -> bool:
    # parts of an earlier call in this folder that were not rerun keep their files and count too
    for part in PARTS:
        if part not in results and (out / f"{part}.json").is_file():
            results[part] = read_json(out / f"{part}.json")
    ok = all(r.get("ok") for r in results.values())
    summary = {"ok": ok, "argv": argv, "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "environment": env,
               "parts": {p: {k: results[p].get(k) for k in ("ok", "seconds", "failures")}
                         for p in PARTS if p in results}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = [f"GPU check on {env['device']}" + (f" ({env.get('gpu')})" if env.get("gpu") else "")
            + f": {'PASSED' if ok else 'FAILED'}",
            "  " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device")]
    for p in PARTS:
        if p in results:
            r = results[p]
            text.append(f"{p}: {'ok' if r.get('ok') else 'FAILED'} ({r.get('seconds', 0):.0f}s)")
            text += lines_of(p, r)
    (out / "summary.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text), flush=True)
    return ok


def parse_parts(values: list[str] | None) -> list[str]:
    """--only values (repeatable, comma-separated) as parts in their running order; every part without any."""
    if not values:
        return list(PARTS)
    wanted = {v.strip() for item in values for v in item.split(",") if v.strip()}
    unknown = sorted(wanted - set(PARTS))
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: parts are {', '.join(PARTS)}")
    return [p for p in PARTS if p in wanted]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="where every measurement goes (created)")
    p.add_argument("--only", action="append", metavar="PART",
                   help=f"run only these parts ({', '.join(PARTS)}); repeatable or comma-separated")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu (the CPU side of each part)")
    p.add_argument("--work", type=Path, default=None,
                   help="models, runs and packages (default /tmp/moe-gpu-check-DEVICE)")
    p.add_argument("--write-reference", action="store_true",
                   help=f"--device cpu: write the CPU's fp32 losses and greedy tokens to {REFERENCE.relative_to(ROOT)}")
    args = p.parse_args(argv)
    try:
        parts = parse_parts(args.only)
    except ValueError as err:
        p.error(str(err))
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: this process and its children run on the CPU
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU here")
    if args.write_reference and device != "cpu":
        p.error("--write-reference: the carried values are the CPU's (--device cpu)")
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out.resolve(), (args.work or Path(f"/tmp/moe-gpu-check-{device}")).resolve(), device)
    env = environment(device)
    # --write-reference: nothing to compare with (the values are being replaced)
    reference = read_json(REFERENCE) if REFERENCE.is_file() and not args.write_reference else {}
    print(f"[gpu-check] {', '.join(parts)} on {device}; work folder {check.work}, output {check.out}", flush=True)
    results = {}
    for part in parts:
        t0 = time.perf_counter()
        print(f"[gpu-check] {part} ...", flush=True)
        try:
            r = {"train": lambda: part_train(check, reference), "resume": lambda: part_resume(check),
                 "norm": lambda: part_norm(check), "kd": lambda: part_kd(check),
                 "serve": lambda: part_serve(check, reference), "serve2": lambda: part_serve2(check),
                 "bench": lambda: part_bench(check)}[part]()
        except Exception as err:  # noqa: BLE001 - a part that breaks is a failure of that part; the others still run
            (check.logs / f"{part}-error.log").write_text(traceback.format_exc())
            r = {"failures": [f"{type(err).__name__}: {err}"]}
        r.update(part=part, device=device, seconds=round(time.perf_counter() - t0, 1), ok=not r.get("failures"))
        (check.out / f"{part}.json").write_text(json.dumps(r, indent=1) + "\n")
        results[part] = r
        print(f"[gpu-check] {part}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']:.0f}s", flush=True)
    with tarfile.open(check.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(check.logs, arcname="logs")
    if args.write_reference:
        write_reference(results, env)
    return 0 if write_summary(check.out, env, results, argv) else 1


def write_reference(results: dict, env: dict) -> None:
    """The CPU's fp32 (and bf16) held-out losses and the random package's greedy tokens, for the GPU run to compare
    with; parts not run keep their carried values."""
    ref = read_json(REFERENCE) if REFERENCE.is_file() else {}
    ref["about"] = ("CPU values that benchmarks/gpu_check.py compares the GPU's with, written by "
                    "`.venv/bin/python benchmarks/gpu_check.py OUT --device cpu --write-reference`")
    ref["produced"] = {k: env.get(k) for k in ("python", "torch", "deepspeed", "transformers", "cpu_count")}
    ref["produced"]["date"] = _dt.date.today().isoformat()
    t = results.get("train")
    if t and t.get("ok"):
        ref["train"] = {"recipe": RECIPE, "steps": STEPS,
                        **{p: {s: {"val_loss": r[s]["val_loss"]} for s in ("teacher", "student")}
                           for p, r in t["runs"].items()}}
    s = results.get("serve")
    if s and s.get("ok"):
        rp = s["reference_package"]
        ref["serve"] = {"reference_package": {k: rp[k] for k in ("layers", "overrides", "dtype", "seed",
                                                                 "weights_sha256", "prompt", "tokens", "text",
                                                                 "token_logprobs")},
                        "trained_fp32_cpu": s["trained"]["cpu"]}
    REFERENCE.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"[gpu-check] wrote {REFERENCE}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
