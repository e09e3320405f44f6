"""`moe-pipeline serve` as a real process on 127.0.0.1: completions, streaming, logprobs, bad input, auth, shutdown, 2 ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from conftest import ROOT, child_env, cli, reference_greedy

pytestmark = pytest.mark.slow


def start(pkg: Path, *extra: str, nproc: int = 1, **env: str) -> tuple[subprocess.Popen, str]:
    from pipeline.dist import free_port

    port = free_port()
    args = [sys.executable, "-m", "cli", "serve", str(pkg), "--port", str(port), *extra]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    proc = subprocess.Popen(args, cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:  # not listening yet, or busy loading past the read timeout
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the server did not come up")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> int:
    import os

    os.killpg(proc.pid, sig) if sig != signal.SIGTERM else proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def package(small_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "pkg"
    cli("export", str(small_run), "--out", str(out))
    return out


@pytest.fixture(scope="module")
def server(package):
    proc, url = start(package)
    yield url
    assert stop(proc) == 0


def complete(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=120)


def test_greedy_completion_equals_the_models_own_tokens(server, package):
    r = complete(server, prompt="And God said", max_tokens=10, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    _, tokens, (_, tok) = reference_greedy(package, "And God said", 10)
    assert body["choices"][0]["text"] == tok.decode(tokens)
    assert body["usage"]["completion_tokens"] == len(tokens) and body["object"] == "text_completion"
    models = requests.get(f"{server}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "small-student"


def test_streaming_yields_the_same_text(server):
    whole = complete(server, prompt="To be, or not to be", max_tokens=12, temperature=0).json()["choices"][0]["text"]
    r = requests.post(f"{server}/v1/completions", json={"prompt": "To be, or not to be", "max_tokens": 12,
                                                         "temperature": 0, "stream": True}, stream=True, timeout=120)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks, done = [], False
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:])["choices"][0])
    assert done and "".join(c["text"] for c in chunks) == whole
    assert chunks[-1]["finish_reason"] in ("length", "stop") and len(chunks) > 2


def test_echo_logprobs_equal_the_models(server, package):
    prompt = "And God said, Let there be light"
    body = complete(server, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2).json()
    lp = body["choices"][0]["logprobs"]
    _, _, (model, tok) = reference_greedy(package, prompt, 0)
    ids = tok.encode(prompt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert body["choices"][0]["text"].startswith(prompt)
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 1
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(logp[i - 1, ids[i]]), abs=1e-4)
    assert lp["token_logprobs"][-1] == pytest.approx(float(logp[-1].max()), abs=1e-4)  # greedy: the argmax
    assert len(lp["top_logprobs"][1]) == 2


def test_lm_eval_local_completions_scores_through_the_server_equal_the_in_process_adapter(server, package):
    """lm-eval's OpenAI-compatible `local-completions` model (token-id prompts, echo + logprobs, our vLLM-style
    /tokenize endpoints as its tokenizer) gives the log-likelihoods and is_greedy of our own adapter."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from eval.adapter import MoEPipelineLM

    remote = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model="small-student", max_length=63,
                                 tokenizer_backend="auto", batch_size=2)
    assert remote.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    local = MoEPipelineLM(path=str(package), batch_size=2)
    pairs = [("And God said unto Moses,", " Go"), ("To be, or not to be,", " that is the question"),
             ("In the beginning God created", " the heaven and the earth"), ("And", " the")]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got, want = remote.loglikelihood(reqs), local.loglikelihood(reqs)
    for (lp, greedy), (lp0, greedy0) in zip(got, want):
        assert lp == pytest.approx(lp0, abs=1e-4) and greedy == greedy0


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server):
    prompts = [f"And {w} said" for w in ("God", "Moses", "the king", "Jesus", "Peter", "Paul", "Hamlet", "he")]
    alone = {p: complete(server, prompt=p, max_tokens=8, temperature=0).json()["choices"][0]["text"] for p in prompts}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: complete(server, prompt=p, max_tokens=8, temperature=0), prompts))
    assert [r.json()["choices"][0]["text"] for r in together] == [alone[p] for p in prompts]
    metrics = requests.get(f"{server}/metrics", timeout=10).text
    assert "moe_decode_batch_size_bucket" in metrics and 'moe_requests_total{status="200"}' in metrics


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"prompt": "the " * 200}, 400, "prompt"),
    ({"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": [1, 10 ** 9]}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": "x" * (2 << 20)}, 413, None),
])
def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_keeps_serving(server, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(f"{server}/v1/completions", data=data, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    assert complete(server, prompt="And", max_tokens=2, temperature=0).status_code == 200


def test_api_key_is_required_when_set_and_health_shows_the_options_in_force(package):
    """With a key: 401 without it, a terse open /health; with it, /health lists every option in force (the key left
    out), the kernels' build and choices and their thresholds, as the flags set them: the linears on oneDNN and the
    weights unmapped here, and the greedy tokens are still the model's own."""
    proc, url = start(package, "--cpu-linears", "onednn", "--no-map-weights", "--attention-kernel-rows", "32",
                      MOE_PIPELINE_API_KEY="sesame")
    try:
        assert complete(url, prompt="And", max_tokens=2).status_code == 401
        key = {"Authorization": "Bearer sesame"}
        r = requests.post(f"{url}/v1/completions", json={"prompt": "And God said", "max_tokens": 10, "temperature": 0},
                          headers=key, timeout=60)
        assert r.status_code == 200
        _, tokens, (_, tok) = reference_greedy(package, "And God said", 10)
        assert r.json()["choices"][0]["text"] == tok.decode(tokens)
        assert requests.get(f"{url}/health", timeout=10).json() == {"status": "ok"}  # health stays open, terse
        full = requests.get(f"{url}/health", headers=key, timeout=10).json()
        assert full["status"] == "ok" and full["rank_status"][0]["pid"] > 0
        server = full["server"]
        options, kernels = server["options"], server["kernels"]
        assert options["cpu_linears"] == "onednn" and options["map_weights"] is False and options["head_screen"]
        assert "api_key" not in options and options["max_batch"] == 32
        assert kernels["options"] == {"linears": "onednn", "head_screen": True, "map_weights": False,
                                      "local_reduce": True, "prefetch": "auto", "attention_kernel_rows": 32}
        assert kernels["isa"] and kernels["thresholds"]["ONEDNN_FROM"]["value"] == 1 << 19
        assert all(t["why"] for t in kernels["thresholds"].values())
        assert server["engine"]["coordinator"] == "RankZero" and server["engine"]["max_model_len"] > 0
    finally:
        assert stop(proc) == 0


def test_sigterm_drains_in_flight_requests_then_exits_0(package):
    proc, url = start(package)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, url, prompt="And God said", max_tokens=40, temperature=0)
        time.sleep(0.5)
        code = stop(proc)
        r = fut.result()
    assert code == 0 and r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_two_ranks_serve_the_same_tokens_and_a_killed_rank_stops_the_server(server, package):
    one = complete(server, prompt="And God said", max_tokens=10, temperature=0).json()["choices"][0]["text"]
    proc, url = start(package, nproc=2)
    try:
        assert requests.get(f"{url}/health", timeout=10).json()["ranks"] == 2
        assert complete(url, prompt="And God said", max_tokens=10, temperature=0).json()["choices"][0]["text"] == one
        # the two rank processes the DeepSpeed launcher started (`python -u -m cli serve ...`)
        ranks = subprocess.run(["pgrep", "-f", "--", f"-u -m cli serve {package} --port {url.rsplit(':', 1)[1]}"],
                               capture_output=True, text=True).stdout.split()
        children = [int(p) for p in ranks if int(p) != proc.pid]
        assert len(children) == 2
        import os

        # a rank dies while requests are in flight (the other waits for it inside the step's collectives)
        with ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(lambda: requests.post(f"{url}/v1/completions", timeout=60,
                                                      json={"prompt": "And God said", "max_tokens": 100}))
                    for _ in range(4)]
            time.sleep(1.0)
            t0 = time.time()
            os.kill(max(children), signal.SIGKILL)
            code = proc.wait(timeout=60)
            assert code != 0 and time.time() - t0 < 15
            for f in busy:  # every client got an answer or a closed connection, none hangs
                try:
                    f.result(timeout=30)
                except requests.RequestException:
                    pass
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL)


def test_smoke_mode_serves_one_completion_over_http_and_exits_0(package):
    """README command 1's last step: `moe-pipeline serve PKG --port 0 --smoke PROMPT`."""
    out = cli("serve", str(package), "--port", "0", "--smoke", "And God said").stdout
    assert "[serve] POST /v1/completions 'And God said' -> " in out and "[serve] stopped after" in out


LAYOUTS = {
    "ep2": (["--ep-size", "2"], 2, "expert parallel 2"),  # 2 ranks implied by --ep-size
    "tp2": (["--nproc", "2", "--tp-size", "2"], 2, "tensor slicing 2"),
    "expert-slicing": (["--nproc", "4", "--ep-size", "2"], 4, "expert slicing 2"),
    # experts placed by a replica table (export/serve/placement/), half of them resident
    "placed-reactive": (["--ep-size", "2", "--placement", "reactive", "--replica-budget", "0.5",
                         "--resident-experts", "0.5"], 2, "expert parallel 2"),
}


@pytest.fixture(scope="module")
def predicted_package(package, tmp_path_factory) -> Path:
    """The package plus a (briefly trained) expert-demand predictor, for --placement predictive."""
    import shutil

    pkg = tmp_path_factory.mktemp("predicted") / "pkg"
    shutil.copytree(package, pkg)
    cli("predictor", "train", str(pkg), "--train-blocks", "64", "--val-blocks", "16", "--steps", "30")
    return pkg


def test_predictive_placement_on_two_ranks_serves_the_one_rank_tokens(server, predicted_package):
    """--placement predictive at EP 2: the predictor thread's replica tables, half the experts resident."""
    prompts = ["And God said", "To be, or not to be", "The LORD is my shepherd", "O Romeo, Romeo"]
    one = [complete(server, prompt=p, max_tokens=12, temperature=0).json()["choices"][0]["text"] for p in prompts]
    proc, url = start(predicted_package, "--ep-size", "2", "--placement", "predictive", "--replica-budget", "0.5",
                      "--resident-experts", "0.5")
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(url, prompt=p, max_tokens=12, temperature=0), prompts))
        assert [r.json()["choices"][0]["text"] for r in got] == one
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        assert 'moe_predictor_recall{layer="0"}' in metrics and 'moe_placement_balancedness{layer="0"}' in metrics
    finally:
        assert stop(proc) == 0  # the predictor thread stops with the server


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_parallel_layout_serves_the_one_rank_greedy_tokens(server, package, layout):
    """--ep-size 2, --tp-size 2 (DeepSpeed AutoTP through init_inference) and expert slicing (4 ranks, each
    expert's FFN split over the 2 ranks that hold it): the same greedy tokens as 1 rank, concurrent
    requests batched, every rank in /health and /metrics, and SIGTERM still drains and exits 0."""
    prompts = ["And God said", "To be, or not to be", "The LORD is my shepherd"]
    one = [complete(server, prompt=p, max_tokens=12, temperature=0).json()["choices"][0]["text"] for p in prompts]
    extra, world, described = LAYOUTS[layout]
    proc, url = start(package, *extra)
    try:
        health = requests.get(f"{url}/health", timeout=10).json()
        assert health["ranks"] == world and described in health["layout"]
        assert sorted(s["rank"] for s in health["rank_status"]) == list(range(world))
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: complete(url, prompt=p, max_tokens=12, temperature=0), prompts))
        assert [r.json()["choices"][0]["text"] for r in got] == one
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        for r in range(world):
            assert f'moe_rank_expert_tokens{{layer="0",rank="{r}"}}' in metrics
        if "--placement" in extra:
            assert 'moe_placement_balancedness{layer="0"}' in metrics and "moe_expert_prefetch_hit_rate" in metrics
    finally:
        assert stop(proc) == 0


def test_killing_the_launching_command_stops_every_rank(package):
    """`serve --nproc 2` killed outright (SIGKILL, no handler runs): rank 0 notices and every rank exits."""
    import os

    proc, url = start(package, nproc=2)
    port = url.rsplit(":", 1)[1]
    pattern = f"-u -m cli serve {package} --port {port}"
    ranks = [int(p) for p in subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True,
                                            text=True).stdout.split()]
    assert len(ranks) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.time() + 30
    while time.time() < deadline and subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True).returncode == 0:
        time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
    try:
        assert not left, "ranks outlived the command that launched them"
    finally:
        for pid in left:
            os.kill(int(pid), signal.SIGKILL)


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>:{% endif %}")


@pytest.fixture(scope="module")
def chat_package(package, tmp_path_factory) -> Path:
    """The package with a chat template in its tokenizer (as an instruct teacher's tokenizer carries one), its
    manifest updated for the changed file."""
    import hashlib
    import shutil

    out = tmp_path_factory.mktemp("chat") / "pkg"
    shutil.copytree(package, out)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**tok_cfg, "chat_template": CHAT_TEMPLATE}, indent=1))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["tokenizer_config.json"] = {"sha256": hashlib.sha256(cfg_path.read_bytes()).hexdigest(),
                                                  "size": cfg_path.stat().st_size}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def test_chat_completions_render_the_template_and_stream_openai_chunks(chat_package, server):
    proc, url = start(chat_package)
    try:
        messages = [{"role": "system", "content": "Answer in the words of the King James Bible."},
                    {"role": "user", "content": "And God said"}]
        rendered = "".join(f"<{m['role']}>: {m['content']}\n" for m in messages) + "<assistant>:"
        plain = complete(url, prompt=rendered, max_tokens=12, temperature=0).json()
        r = requests.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                               "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == plain["choices"][0]["text"]
        assert choice["finish_reason"] == plain["choices"][0]["finish_reason"]
        assert body["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        with requests.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 12,
                                                               "temperature": 0, "stream": True},
                           stream=True, timeout=120) as s:
            events = [line[6:] for line in s.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
        bad = requests.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    finally:
        assert stop(proc) == 0
    # a base model's tokenizer has no template: 400 naming messages, and the server keeps serving
    r = requests.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "no chat template" in r.json()["error"]["message"]
    assert complete(server, prompt="And God said", max_tokens=2).status_code == 200
