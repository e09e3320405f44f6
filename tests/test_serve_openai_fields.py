"""vLLM's and OpenAI's fields, against a real `moe-pipeline serve` on 127.0.0.1: those clients count tokens with
(`vllm bench serve`, the OpenAI SDK: stream_options.include_usage, ignore_eos, min_tokens, usage), the sampling
fields (penalties, logit_bias, top_k, min_p, stop_token_ids, n, chat logprobs), structured output, and the refusal
of fields the server would otherwise ignore."""

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
    ({"logit_bias": {"60000": 5}}, "logit_bias"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
])
def test_bad_fields_get_a_400_naming_them(server, path, body, fields, param):
    r = post(server, path, **body, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param)


def test_the_fields_reach_the_engines_sampling_params():
    from export.serve.protocol import ChatRequest, CompletionRequest

    got = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 8, "ignore_eos": True, "min_tokens": 3})
    assert (got.sampling().ignore_eos, got.sampling().min_tokens) == (True, 3)
    chat = ChatRequest.model_validate({"messages": MESSAGES, "ignore_eos": True, "min_tokens": 2})
    assert (chat.sampling().ignore_eos, chat.sampling().min_tokens) == (True, 2)
    assert (CompletionRequest.model_validate({"prompt": "x"}).sampling().ignore_eos,
            ChatRequest.model_validate({"messages": MESSAGES}).sampling().min_tokens) == (False, 0)


def test_fields_that_change_nothing_are_taken(server):
    r = post(server, "/v1/completions", prompt="And", max_tokens=3, temperature=0, user="someone",
             metadata={"k": "v"}, best_of=1, skip_special_tokens=True, suffix=None)
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=3, echo=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def greedy_ids(server, **body) -> list[int]:
    r = post(server, "/v1/completions", prompt="And God said", max_tokens=12, temperature=0, logprobs=0, **body)
    assert r.status_code == 200, r.text
    text_tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return post(server, "/tokenize", prompt="".join(text_tokens)).json()["tokens"], r.json()


def test_penalties_bias_and_stop_token_ids_change_greedy_text(server):
    plain, _ = greedy_ids(server, ignore_eos=True)
    assert len(set(plain)) <= 3  # the test model's greedy text repeats a few tokens (newlines)
    spread, _ = greedy_ids(server, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(spread)) > len(set(plain))
    rep, _ = greedy_ids(server, ignore_eos=True, repetition_penalty=2.0)
    assert rep != plain
    word = post(server, "/tokenize", prompt=" God").json()["tokens"][0]
    forced, body = greedy_ids(server, ignore_eos=True, logit_bias={str(word): 100})
    assert body["choices"][0]["text"] == post(server, "/detokenize", tokens=[word] * 12).json()["prompt"]
    # a stop token finishes as the end token does, and may not come before min_tokens (as vLLM masks it)
    stop = post(server, "/v1/completions", prompt="And God said", max_tokens=12, temperature=0, ignore_eos=True,
                logit_bias={str(word): 100}, stop_token_ids=[word]).json()
    assert stop["choices"][0]["finish_reason"] == "stop" and stop["choices"][0]["text"] == ""
    held = post(server, "/v1/completions", prompt="And God said", max_tokens=12, temperature=0, ignore_eos=True,
                logit_bias={str(word): 100}, stop_token_ids=[word], min_tokens=5).json()
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 5
    assert word not in post(server, "/tokenize", prompt=held["choices"][0]["text"]).json()["tokens"][:1]


def test_top_k_one_and_min_p_one_sample_greedily(server):
    greedy = post(server, "/v1/completions", prompt="To be", max_tokens=8, temperature=0, ignore_eos=True).json()
    for field in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = post(server, "/v1/completions", prompt="To be", max_tokens=8, temperature=1.5, seed=5,
                       ignore_eos=True, **field).json()
        assert sampled["choices"][0]["text"] == greedy["choices"][0]["text"], field


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_seeded_apart_and_reproducible(server, stream):
    body = dict(prompt="And God said", max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    if stream:
        chunks = streamed(server, "/v1/completions", **body)
        texts = ["", "", ""]
        for c in chunks:
            texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
        finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert sorted(finishes) == [0, 1, 2]
    else:
        r = post(server, "/v1/completions", **body).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 24
        texts = [c["text"] for c in r["choices"]]
    again = [c["text"] for c in post(server, "/v1/completions", **body).json()["choices"]]
    assert texts == again and len(set(texts)) > 1
    one = post(server, "/v1/completions", **{**body, "n": 1, "seed": 12}).json()["choices"][0]["text"]
    assert one == texts[1]  # choice j draws with seed + j
    two = post(server, "/v1/completions", **{**body, "prompt": ["And God said", "To be"], "n": 2}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3] and two["choices"][0]["text"] == texts[0]


def test_chat_logprobs_and_top_logprobs(server):
    r = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=5, temperature=0, ignore_eos=True,
             logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["token"] == entry["top_logprobs"][0]["token"]  # greedy: the most probable
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    assert "".join(e["token"] for e in content) == r.json()["choices"][0]["message"]["content"]
    chunks = streamed(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=5, temperature=0,
                      ignore_eos=True, logprobs=True)
    streamed_lp = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed_lp] == pytest.approx([e["logprob"] for e in content], abs=1e-5)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},  # fits the test model's
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},  # 64 positions
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "A person:"}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
@pytest.mark.parametrize("constraint", ["response_format", "structured_outputs", "guided_json"])
def test_json_schema_outputs_parse_and_validate(server, path, body, constraint):
    import jsonschema

    field = {"response_format": {"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": SCHEMA}}},
             "structured_outputs": {"structured_outputs": {"json": SCHEMA}},
             "guided_json": {"guided_json": SCHEMA}}[constraint]
    for seed in range(3):
        r = post(server, path, **body, **field, max_tokens=48, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert choice["finish_reason"] == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_regex_and_json_object_constrain_the_text(server):
    import re

    for seed in range(3):
        r = post(server, "/v1/completions", prompt="Colour:", max_tokens=10, temperature=1.0, seed=seed,
                 guided_choice=["red", "green", "blue"]).json()
        assert r["choices"][0]["text"] in ("red", "green", "blue")
        r = post(server, "/v1/completions", prompt="Date:", max_tokens=20, temperature=1.0, seed=seed,
                 structured_outputs={"regex": r"20[0-9]{2}-[01][0-9]"}).json()
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", r["choices"][0]["text"])
        r = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=48, temperature=0.7, seed=seed,
                 response_format={"type": "json_object"}).json()
        if r["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    mixed = [post(server, "/v1/completions", prompt="Colour:", max_tokens=6, temperature=1.0, seed=s,
                  **({"guided_choice": ["red", "blue"]} if s % 2 else {})) for s in range(6)]
    assert all(r.status_code == 200 for r in mixed)
