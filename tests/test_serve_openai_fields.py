"""vLLM's and OpenAI's fields that clients count tokens with (`vllm bench serve`, the OpenAI SDK), against a real
`moe-pipeline serve` on 127.0.0.1: stream_options.include_usage, ignore_eos, min_tokens, usage."""

from __future__ import annotations

import json

import pytest
import requests

from test_serve import chat_package, package, start, stop  # noqa: F401  (the module's package fixtures)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "And God said"}]


@pytest.fixture(scope="module")
def server(chat_package):  # noqa: F811
    """One server for the module, on the package with a chat template: it serves both endpoints."""
    proc, url = start(chat_package)
    yield url
    assert stop(proc) == 0


def post(url: str, path: str, **body) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=120)


def streamed(url: str, path: str, **body) -> list[dict]:
    """The data chunks of a streamed answer, checked to end with [DONE]."""
    with requests.post(f"{url}{path}", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path, obj, body", [
    ("/v1/completions", "text_completion", {"prompt": "And God said"}),
    ("/v1/chat/completions", "chat.completion.chunk", {"messages": MESSAGES}),
])
def test_include_usage_ends_the_stream_with_the_usage_of_the_same_request_not_streamed(server, path, obj, body):
    body = {**body, "max_tokens": 9, "temperature": 0}
    whole = post(server, path, **body)
    assert whole.status_code == 200, whole.text
    usage = whole.json()["usage"]
    chunks = streamed(server, path, **body, stream_options={"include_usage": True, "continuous_usage_stats": False})
    last, rest = chunks[-1], chunks[:-1]
    assert last["choices"] == [] and last["usage"] == usage
    assert usage["completion_tokens"] == 9 and usage["total_tokens"] == usage["prompt_tokens"] + 9
    assert {c["id"] for c in chunks} == {last["id"]} and all(c["object"] == obj for c in chunks)
    assert set(last) == {"id", "object", "created", "model", "choices", "usage"}
    assert all(c["usage"] is None and c["choices"] for c in rest)  # as OpenAI's: null on every other chunk
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    # without include_usage (false, or no stream_options) the stream is as before: no usage anywhere
    for options in ({"stream_options": {"include_usage": False}}, {}):
        plain = streamed(server, path, **body, **options)
        assert all("usage" not in c and c["choices"] for c in plain) and len(plain) == len(rest)


def test_usage_counts_the_prompts_tokens_and_the_generated_ones(server):
    prompt = "To be, or not to be"
    n = post(server, "/tokenize", prompt=prompt).json()["count"]
    one = post(server, "/v1/completions", prompt=prompt, max_tokens=5, temperature=0).json()
    assert one["usage"] == {"prompt_tokens": n, "completion_tokens": 5, "total_tokens": n + 5}
    two = post(server, "/v1/completions", prompt=[prompt, "And"], max_tokens=5, temperature=0).json()
    assert two["usage"]["prompt_tokens"] == n + 1 and two["usage"]["completion_tokens"] == 10
    chat = post(server, "/v1/chat/completions", messages=MESSAGES, max_completion_tokens=4, temperature=0).json()
    rendered = post(server, "/tokenize", prompt="<user>: And God said\n<assistant>:").json()["count"]  # test_serve's template
    assert chat["usage"] == {"prompt_tokens": rendered, "completion_tokens": 4, "total_tokens": rendered + 4}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "And God said"}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
def test_ignore_eos_generates_max_tokens(server, path, body):
    r = post(server, path, **body, max_tokens=20, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 20 and r.json()["choices"][0]["finish_reason"] == "length"


def test_min_tokens_holds_off_a_stop_string(server):
    body = {"prompt": "And God said", "max_tokens": 12, "temperature": 0, "stop": "\n"}
    early = post(server, "/v1/completions", **body).json()
    if early["choices"][0]["finish_reason"] != "stop" or early["usage"]["completion_tokens"] >= 6:
        pytest.skip("this package's greedy text has no newline in its first 5 tokens")
    held = post(server, "/v1/completions", **body, min_tokens=6).json()
    assert held["usage"]["completion_tokens"] >= 6
    chat = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=12, temperature=0, stop="\n",
                min_tokens=6).json()
    assert chat["usage"]["completion_tokens"] >= 6


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "And"}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens (16)
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "few"}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    ({"stream": True, "stream_options": "usage"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
])
def test_bad_fields_get_a_400_naming_them(server, path, body, fields, param):
    r = post(server, path, **body, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param)


def test_the_fields_reach_the_engines_sampling_params():
    from export.serve.http import ChatRequest, CompletionRequest

    got = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 8, "ignore_eos": True, "min_tokens": 3})
    assert (got.sampling().ignore_eos, got.sampling().min_tokens) == (True, 3)
    chat = ChatRequest.model_validate({"messages": MESSAGES, "ignore_eos": True, "min_tokens": 2})
    assert (chat.sampling().ignore_eos, chat.sampling().min_tokens) == (True, 2)
    assert (CompletionRequest.model_validate({"prompt": "x"}).sampling().ignore_eos,
            ChatRequest.model_validate({"messages": MESSAGES}).sampling().min_tokens) == (False, 0)
