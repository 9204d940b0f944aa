"""Every bad input gets OpenAI's error envelope with the right status, type, param and code."""

import openai
import pytest

from conftest import MAX_MODEL_LEN, MODEL, user
from openai_schema import validate


def post(http, payload=None, content=None):
    if content is not None:
        return http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    return http.post("/v1/chat/completions", json=payload)


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    validate("ErrorResponse", body)
    return body["error"]




@pytest.mark.parametrize("content", [b"{bad", b"", b"[1, 2]", b"\xff\xfe not utf-8"])
def test_unparseable_body_is_400_invalid_request(http, content):
    error = error_of(post(http, content=content), 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_completion_tokens": "many"}, "max_completion_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "messages[0].content[0].type"),
        ({"seed": "abc"}, "seed"),
        ({"logit_bias": {"100": 150}}, "logit_bias"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_validation_error_names_the_param(http, patch, param):
    payload = {"model": MODEL, "messages": user("hi"), **patch}
    error = error_of(post(http, payload), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_missing_model_names_model(http):
    error = error_of(post(http, {"messages": user("hi")}), 400)
    assert error["param"] == "model"


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=user("hi"), max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"


def test_unknown_model_in_retrieve_is_404(http):
    error = error_of(http.get("/v1/models/gpt-4o"), 404)
    assert error["code"] == "model_not_found"


def test_prompt_plus_max_tokens_over_context_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=MAX_MODEL_LEN)
    assert info.value.body["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in info.value.body["message"]


def test_prompt_longer_than_context_is_context_length_exceeded(http):
    error = error_of(post(http, {"model": MODEL, "messages": user("word " * (MAX_MODEL_LEN + 10))}), 400)
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ],
)
def test_known_but_unhonoured_parameter_is_400_naming_it(http, patch, param):
    error = error_of(post(http, {"model": MODEL, "messages": user("hi"), "max_tokens": 1, **patch}), 400)
    assert error["param"] == param
    assert param in error["message"]


def test_image_part_on_text_only_model_is_400_naming_the_part(http):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]}]
    error = error_of(post(http, {"model": MODEL, "messages": messages}), 400)
    assert error["param"] == "messages[0].content[1]"
    assert "gemma-3-4b-it" in error["message"]


def test_null_user_content_is_400_naming_the_message(http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]
    error = error_of(post(http, {"model": MODEL, "messages": messages}), 400)
    assert (error["param"], error["code"]) == ("messages[1].content", "missing_required_parameter")


def test_stream_options_without_stream_is_400(http):
    error = error_of(post(http, {"model": MODEL, "messages": user("hi"), "stream_options": {"include_usage": True}}), 400)
    assert error["param"] == "stream_options"


def test_unknown_route_is_404_in_envelope(http):
    error_of(http.get("/v1/nope"), 404)
    error_of(http.post("/v1/completions/nope", json={}), 404)


def test_wrong_method_is_405_in_envelope(http):
    error_of(http.get("/v1/chat/completions"), 405)
    error_of(http.delete("/v1/models"), 405)


@pytest.mark.parametrize("patch, message", [
    ({"max_tokens": 0}, "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead."),
    ({"max_tokens": "many"}, "Invalid type for 'max_tokens': expected an integer or null, but got a string instead."),
    ({"temperature": 3}, "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 3 instead."),
    ({"n": 200}, "Invalid 'n': integer above maximum value. Expected a value <= 128, but got 200 instead."),
    ({"n": 40}, "Invalid 'n': integer above maximum value. Expected a value <= 32 (`engine.max_num_seqs`: a request's "
                "choices run in one batch), but got 40 instead."),
    ({"stop": ["x"] * 17}, "Invalid 'stop': array too long. Expected an array with maximum length 16, but got an array "
                           "with length 17 instead."),
    ({"messages": []}, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead."),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]},
     "Missing required parameter: 'messages[1].content'."),
    ({"stop": 5}, "Invalid type for 'stop': expected a string, an array or null, but got an integer instead."),
    ({"model": None}, "Invalid type for 'model': expected a string, but got null instead."),
    ({"response_format": {"type": "yaml"}}, "Invalid value for 'response_format.type': 'yaml' is not one of the supported values."),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "Invalid value for 'messages[0].role': 'wizard' is not one of the supported values."),
])
def test_validation_messages_are_in_openais_words(http, patch, message):
    error = error_of(post(http, {"model": MODEL, "messages": user("hi"), **patch}), 400)
    assert error["message"] == message and error["param"]


def test_a_missing_parameter_is_named_as_openai_names_it(http):
    error = error_of(post(http, {"messages": user("hi")}), 400)
    assert (error["message"], error["param"]) == ("Missing required parameter: 'model'.", "model")


def test_malformed_json_says_where_with_a_null_param(http):
    error = error_of(post(http, content=b'{"model": "x",\n  "max_tokens": 5,,}'), 400)
    assert error["param"] is None
    assert error["message"].startswith("We could not parse the JSON body of your request: ")
    assert "line 2, column 19" in error["message"], error["message"]
