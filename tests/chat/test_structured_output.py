"""`response_format` end to end: the tiny base model's output always parses and validates, streamed or not."""

import asyncio
import json

import jsonschema
import openai
import pytest

from conftest import MODEL, user
from openai_schema import validate
from sse import post_stream

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PROMPT = user("Describe a person as JSON.")


def ask(client, response_format, messages=PROMPT, **kw):
    kw = {"temperature": 0, "max_tokens": 150, **kw}
    return client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format, **kw)


def error_of(http, patch: dict) -> dict:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": 8, **patch})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_json_object_output_parses_as_an_object(client):
    # this prompt's greedy object closes by itself (others are closed for it within max_tokens: finish `length`)
    choice = ask(client, {"type": "json_object"}, user("Give me a JSON object.")).choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("seed", [None, 1])
def test_json_schema_output_validates_greedy_and_sampled(client, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    choice = ask(client, PERSON_FORMAT, **sampling).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_schema_concatenates_to_a_valid_document(http):
    payload = {"model": MODEL, "messages": PROMPT, "response_format": PERSON_FORMAT, "max_tokens": 150, "stream": True}
    stream = post_stream(http, {**payload, "temperature": 0})
    for chunk in stream.chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(stream.content()), PERSON)


def test_plain_request_beside_constrained_ones_gives_its_output_alone(client, async_client):
    text = "Write about the ocean."
    alone = client.chat.completions.create(model=MODEL, messages=user(text), temperature=0, max_tokens=16)

    async def batched():
        constrained = [
            async_client.chat.completions.create(
                model=MODEL, messages=PROMPT, response_format=fmt, temperature=0, max_tokens=24
            )
            for fmt in (PERSON_FORMAT, {"type": "json_object"}, PERSON_FORMAT)
        ]
        plain = async_client.chat.completions.create(model=MODEL, messages=user(text), temperature=0, max_tokens=16)
        return await asyncio.gather(plain, *constrained)

    together = asyncio.run(batched())[0]
    assert together.choices[0].message.content == alone.choices[0].message.content


def test_text_format_is_free_text(client):
    plain = client.chat.completions.create(model=MODEL, messages=PROMPT, temperature=0, max_tokens=6)
    as_text = ask(client, {"type": "text"}, max_tokens=6)
    assert as_text.choices[0].message.content == plain.choices[0].message.content


def test_too_small_max_tokens_cuts_the_document_with_length(client):
    response = ask(client, PERSON_FORMAT, max_tokens=3)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3


def test_a_budget_shorter_than_any_document_still_cuts_it_with_length_not_an_error(client):
    # the README's promise: a `max_tokens` below the schema's shortest document (a string of at least 80 characters)
    # still gets a cut document, `length`; not a 400 `invalid_json_schema`, which is for a grammar failing on its own
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 80}}, "required": ["a"]}
    response = ask(client, {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}, max_tokens=4)
    assert response.choices[0].finish_reason == "length"


def test_logprobs_come_from_the_masked_distribution(client):
    response = ask(client, {"type": "json_object"}, max_tokens=1, logprobs=True, top_logprobs=5)
    validate("CreateChatCompletionResponse", response.model_dump(exclude_unset=True))
    first = response.choices[0].logprobs.content[0]
    assert first.token.startswith("{")
    alternatives = [t for t in first.top_logprobs if t.logprob > -9999]
    assert alternatives and all(t.token.startswith("{") for t in alternatives)


def test_unsupported_schema_feature_is_400_naming_it(http):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    error = error_of(http, {"response_format": {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}})
    assert error["param"] == "response_format"
    assert error["code"] == "unsupported_schema_feature"
    assert "uniqueItems" in error["message"]


FORCED_CALL = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
    "tool_choice": "required",
}


@pytest.mark.parametrize("beside", [{}, FORCED_CALL], ids=["alone", "beside-a-forced-call"])
def test_invalid_schema_is_400(http, beside):
    # a forced call decides the answer's grammar, but a bad `response_format` is still the user's error
    schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    error = error_of(http, {"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}, **beside})
    assert error["param"] == "response_format"
    assert error["code"] == "invalid_json_schema"


@pytest.mark.parametrize(
    "response_format, param",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ],
)
def test_malformed_response_format_is_400_naming_the_field(http, response_format, param):
    assert error_of(http, {"response_format": response_format})["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_cannot_be_completed_is_400_not_a_cut_document_called_stop(http, stream):
    # `a` only refers to itself: the grammar fails after `{"a":` and allows only the end (it came back as
    # `{"a":` with finish_reason "stop")
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"], "$defs": {"x": {"$ref": "#/$defs/x"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}}
    if not stream:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    else:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        error = events[-1]["error"]
        assert not any(c["choices"][0]["finish_reason"] for c in events[:-1] if c.get("choices")), "no finish before the error"
    assert error["code"] == "invalid_json_schema" and error["type"] == "invalid_request_error", error


def test_bad_schema_through_the_client_is_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        ask(client, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
