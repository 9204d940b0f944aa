"""A catalogue of hostile inputs, each with the answer it must get: its status, OpenAI's error envelope and the
`param`/`code` where they matter, quickly, and never a 500 or a hang. Against the session server."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from conftest import MODEL, user
from openai_schema import validate

ANY = object()
MAX_BODY_BYTES = 32 * 1024 * 1024  # the default `server.max_body_bytes`
ANSWER_WITHIN_S = 10.0  # none of these reaches the model; before the fixes a 10 MB prompt took 35 s


@dataclass
class Bad:
    id: str
    body: Any  # a dict (sent as JSON) or raw bytes
    status: int = 400
    param: Any = ANY
    code: Any = ANY
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": user("hi"), "max_tokens": 1, **fields}


def raw(fragment: bytes) -> bytes:
    """A chat body with `fragment` spliced in as its last field, for what `json.dumps` would refuse to write."""
    return b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, %s}' % (MODEL.encode(), fragment)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


CATALOGUE = [
    # wrong types
    Bad("model-is-a-number", {**chat(), "model": 5}, param="model"),
    Bad("messages-is-an-object", chat(messages={"role": "user", "content": "hi"}), param="messages"),
    Bad("content-is-a-number", chat(messages=[{"role": "user", "content": 5}]), param="messages[0].content"),
    Bad("max-tokens-is-a-bool", chat(max_tokens=True), param="max_tokens"),
    Bad("max-tokens-is-a-float", chat(max_tokens=1.5), param="max_tokens"),
    Bad("stop-holds-numbers", chat(stop=[1, 2]), param="stop[0]"),
    Bad("logit-bias-is-a-list", chat(logit_bias=[1]), param="logit_bias"),
    Bad("body-is-a-string", b'"hello"'),
    Bad("body-is-null", b"null"),
    # huge numbers
    Bad("max-tokens-10e30", chat(max_tokens=10**30), param="messages", code="context_length_exceeded"),
    Bad("max-tokens-5000-digits", raw(b'"max_completion_tokens": 1' + b"0" * 5000), param="max_completion_tokens"),
    Bad("seed-5000-digits", raw(b'"seed": 1' + b"0" * 5000), param="seed"),
    Bad("seed-10e30", chat(seed=10**30), param="seed", code="integer_above_max_value"),
    Bad("seed-minus-10e30", chat(seed=-(10**30)), param="seed", code="integer_below_min_value"),
    Bad("temperature-1e308", chat(temperature=1e308), param="temperature"),
    Bad("logit-bias-key-5000-digits", chat(logit_bias={"9" * 5000: 1}), param="logit_bias"),
    Bad("logit-bias-key-unicode-digit", chat(logit_bias={"\u00b2": 1}), param="logit_bias"),
    Bad("min-tokens-beyond-default-max", {"model": MODEL, "messages": user("hi"), "min_tokens": 10**9}, param="min_tokens"),
    # not-a-number floats: not JSON, or out of every range
    Bad("temperature-NaN", raw(b'"temperature": NaN')),
    Bad("top-p-Infinity", raw(b'"top_p": Infinity')),
    Bad("temperature-1e999", raw(b'"temperature": 1e999'), param="temperature"),
    Bad("presence-penalty-minus-1e999", raw(b'"presence_penalty": -1e999'), param="presence_penalty"),
    # negative or absurd counts
    Bad("max-tokens-negative", chat(max_tokens=-1), param="max_tokens"),
    Bad("max-completion-tokens-negative", chat(max_completion_tokens=-100), param="max_completion_tokens"),
    Bad("n-10000", chat(n=10000), param="n"),
    Bad("top-logprobs-10000", chat(logprobs=True, top_logprobs=10000), param="top_logprobs"),
    Bad("stop-17-strings", chat(stop=["x"] * 17), param="stop"),
    # deeply nested JSON, in an unknown field and in a known free-form one, and on /tokenize
    Bad("nested-100k-unknown-field", raw(b'"extra": ' + nested(100_000))),
    Bad("nested-100k-in-tools", raw(b'"tools": [{"f": ' + nested(100_000) + b"}]")),
    Bad("nested-100k-on-tokenize", b'{"prompt": "hi", "x": ' + nested(100_000) + b"}", path="/tokenize"),
    # not UTF-8, not JSON text
    Bad("invalid-utf8-in-content", raw(b'"user": "a\xff\xfeb"')),
    Bad("lone-surrogate-escape", raw(b'"user": "\\ud800"')),
    Bad("binary-body", bytes(range(256))),
    # sizes
    Bad("10MB-prompt", chat(messages=user("word " * 2_000_000)), param="messages", code="context_length_exceeded"),
    Bad("100k-token-prompt", chat(messages=user("hello " * 100_000)), param="messages", code="context_length_exceeded"),
    Bad("10k-messages", chat(messages=user("hi") * 10_000), param="messages", code="context_length_exceeded"),
    Bad("body-over-the-cap", b" " * (MAX_BODY_BYTES + 1), status=413),
    Bad("megabyte-model-name", {**chat(), "model": "x" * 1_000_000}, status=404, param="model", code="model_not_found"),
    # /v1/completions: the same limits on its `prompt`
    Bad("completions-10MB-prompt", {"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 1}, path="/v1/completions",
        param="prompt", code="context_length_exceeded"),
    Bad("completions-negative-token-id", {"model": MODEL, "prompt": [-1], "max_tokens": 1}, path="/v1/completions",
        param="prompt[0]"),
    Bad("completions-token-id-10e30", {"model": MODEL, "prompt": [10**30], "max_tokens": 1}, path="/v1/completions",
        param="prompt[0]", code="invalid_token_id"),
    Bad("completions-nested-100k", b'{"model": "%s", "prompt": ' % MODEL.encode() + nested(100_000) + b"}", path="/v1/completions"),
    # /tokenize: the same limit on a text that cannot fit the context, whatever it says
    Bad("tokenize-10MB-prompt", {"prompt": "word " * 2_000_000}, path="/tokenize", param="prompt", code="context_length_exceeded"),
    Bad("tokenize-10MB-messages", {"messages": user("word " * 2_000_000)}, path="/tokenize", param="messages",
        code="context_length_exceeded"),
    # ids outside every range
    Bad("detokenize-id-10e30", {"tokens": [10**30]}, path="/detokenize", param="tokens[0]", code="invalid_token_id"),
    Bad("detokenize-negative-id", {"tokens": [1, -1]}, path="/detokenize", param="tokens[1]", code="invalid_token_id"),
    # routes
    Bad("unknown-route", {}, status=404, path="/v1/nope"),
]


@pytest.mark.parametrize("bad", CATALOGUE, ids=lambda bad: bad.id)
def test_bad_input_gets_its_status_in_the_error_envelope(http, bad):
    content = bad.body if isinstance(bad.body, bytes) else msgspec.json.encode(bad.body)
    started = time.monotonic()
    response = http.post(bad.path, content=content, headers={"content-type": "application/json", **bad.headers})
    elapsed = time.monotonic() - started
    assert response.status_code == bad.status, response.text[:500]
    body = response.json()
    validate("ErrorResponse", body)
    error = body["error"]
    if bad.param is not ANY:
        assert error["param"] == bad.param, error
    if bad.code is not ANY:
        assert error["code"] == bad.code, error
    assert len(error["message"]) < 2000, "the error quotes too much of the input back"
    assert elapsed < ANSWER_WITHIN_S, f"answered in {elapsed:.1f} s"


def test_body_over_the_cap_without_content_length_is_413(http):
    """A chunked upload has no Content-Length to check up front: the cap still holds while reading."""
    def chunks():
        for _ in range(MAX_BODY_BYTES // 2**20 + 2):
            yield b" " * 2**20

    response = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:500]
    validate("ErrorResponse", response.json())


def test_wrong_method_is_405_naming_the_allowed_ones(http):
    response = http.delete("/v1/chat/completions")
    assert response.status_code == 405
    validate("ErrorResponse", response.json())
    assert "POST" in response.headers["allow"].split(", ")


@pytest.mark.parametrize(
    "fields",
    [{"top_k": 10**30}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"stop": [""]}, {"logit_bias": {str(i): 1 for i in range(20_000)}}],
    ids=["top-k-10e30", "seed-int64-max", "seed-int64-min", "empty-stop-string", "logit-bias-20k-entries"],
)
def test_extreme_but_valid_values_are_served(http, fields):
    response = http.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 200, response.text[:500]
    validate("CreateChatCompletionResponse", response.json())


@pytest.mark.slow
def test_extreme_values_do_not_fail_requests_batched_with_them(http):
    """The sampler runs every row of a step together: one request's absurd value must not fail its neighbours."""
    neighbour = {"model": MODEL, "messages": user("Count to fifty."), "max_tokens": 24, "ignore_eos": True, "stream": True}
    chunks: list[bytes] = []

    def stream():
        with http.stream("POST", "/v1/chat/completions", json=neighbour) as response:
            chunks.extend(line for line in response.iter_lines() if line)

    thread = threading.Thread(target=stream)
    thread.start()
    for fields in ({"top_k": 10**30}, {"seed": 2**63 - 1}, {"logit_bias": {"0": 100}}):
        assert http.post("/v1/chat/completions", json=chat(max_tokens=4, **fields)).status_code == 200
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert not [line for line in chunks if '"error"' in line]
    assert chunks[-1] == "data: [DONE]"
