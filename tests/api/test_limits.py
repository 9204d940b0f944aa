"""Every row of `api/limits.LIMITS` (issue 42 item 4): a request one past the limit gets a 400 `invalid_request_error`
whose `param` is the field's path and whose message names the field, the limit and the value, in the one phrasing of
its kind; a request at the limit (where cheap: max_tokens 1) is served. docs/api.md's table is the module's.
Against the session server; the rows it cannot reach (images on a text-only model, LoRA loading, which it does not
enable) are checked where they are enforced."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from conftest import MAX_MODEL_LEN, MODEL, user
from oai_gemma import limits
from oai_gemma.api.errors import APIError, check_limits
from oai_gemma.limits import CHAT, COMPLETIONS, DETOKENIZE, INPUT_ITEMS, LIMITS, LORA, RESPONSES, TOKENIZE, Limit
from oai_gemma.chat import ChatInputError
from oai_gemma.chat.images import ImagePolicy, load_images
from oai_gemma.chat.render import ImagePart
from openai_schema import validate

DOCS = Path(__file__).parents[2] / "docs" / "api.md"
MAX_NUM_SEQS = 32  # the session server's `engine.max_num_seqs` (the default)
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses",
         TOKENIZE: "/tokenize", DETOKENIZE: "/detokenize"}
BASE = {
    CHAT: {"model": MODEL, "messages": user("hi"), "max_tokens": 1},
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 1, "store": False},
    TOKENIZE: {"prompt": "hi"},
    DETOKENIZE: {"tokens": [2]},
}
NEEDS = {  # what a field needs beside it to be read at all
    (CHAT, "top_logprobs"): {"logprobs": True},
    (COMPLETIONS, "max_tokens"): {"echo": True},
}
NOT_AT_THE_LIMIT = {  # (endpoint, param, kind): why a request at that limit is refused all the same
    (CHAT, "n", "max"): "128 is over the server's batch size",
    (COMPLETIONS, "best_of", "min"): "a best_of other than 1 or n is not supported",
    (COMPLETIONS, "best_of", "max"): "a best_of other than 1 or n is not supported",
}
CODES = {("tokens[]", "min"): "invalid_token_id"}  # /detokenize's own check: an id outside the vocabulary, either side
ITEM = {"messages": user("hi")[0], "prompt[]": 2, "input": {"role": "user", "content": "hi"}}  # an item of the list where "x" is not one


def wire(param: str, value, endpoint: str) -> dict:
    """The request fields that put `value` at `param`."""
    if param == "logit_bias":
        return {"logit_bias": {"2": value}}
    if param == "metadata":
        return {"metadata": value if isinstance(value, dict) else {"key": value}}
    if param == "tools[].function.name":
        return {"tools": [{"type": "function", "function": {"name": value}}]}
    if param == "response_format.json_schema.name":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": value}}}
    if param == "tools[].name":
        return {"tools": [{"type": "function", "name": value}]}
    if param == "text.format.name":
        return {"text": {"format": {"type": "json_schema", "name": value, "schema": {"type": "object"}}}}
    if param in ("input[].call_id", "input[].name"):
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", param[8:]: value}
        return {"input": [call]}
    if param in ("prompt[]", "tokens[]"):
        return {param[:-2]: [value]}
    return {param: value}


def past(row: Limit, limit):
    """A value one past `limit` (the `above` bound: the limit itself)."""
    return {
        "min": lambda: limit - 1, "above": lambda: limit, "max": lambda: limit + 1,
        "min_items": lambda: [], "max_items": lambda: ({f"k{i}": "v" for i in range(limit + 1)} if row.param == "metadata"
                                                     else ["x"] * (limit + 1)),
        "min_length": lambda: "", "max_length": lambda: "x" * (limit + 1), "pattern": lambda: "no spaces allowed",
    }[row.kind]()


def at(row: Limit, limit):
    """A value at `limit` (None for a bound that has none: `above`, `pattern`)."""
    if row.kind in ("min", "max"):
        return limit
    if row.kind in ("min_length", "max_length"):
        return "x" * limit
    if row.kind == "max_items" and row.param == "metadata":
        return {f"k{i}": "v" for i in range(limit)}
    return [ITEM.get(row.param, "x")] * limit if row.kind in ("min_items", "max_items") else None


def shown(row: Limit, value) -> str:
    """How the message quotes the value sent."""
    if row.kind in ("min_items", "max_items"):
        return f"with {len(value)} entries" if isinstance(value, dict) else "an empty array" if not value else f"with length {len(value)}"
    if row.kind in ("min_length", "max_length"):
        return "an empty string" if not value else f"with length {len(value)}"
    return f"'{value}'" if row.kind == "pattern" else f"got {limits.number(value)} instead"


def bound(row: Limit) -> str:
    """How the message states the limit."""
    if row.kind in ("min", "above", "max"):
        return f"Expected a value {dict(min='>=', above='>', max='<=')[row.kind]} {limits.number(row.limit)}"
    if row.kind == "pattern":
        return f"the pattern '{row.limit}'"
    return f"at most {row.limit} entries" if row.param == "metadata" and row.kind == "max_items" else f"length {row.limit}"


SERVED = [(row, endpoint) for row in LIMITS for endpoint in row.endpoints if endpoint in PATHS and row.static]


def post(http, endpoint: str, fields: dict):
    return http.post(PATHS[endpoint], json={**BASE[endpoint], **fields})


def refusal(response, param: str) -> dict:
    assert response.status_code == 400, response.text[:500]
    body = response.json()
    validate("ErrorResponse", body)
    error = body["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    return error


@pytest.mark.parametrize("row, endpoint", SERVED, ids=[f"{e}-{r.param}-{r.kind}" for r, e in SERVED])
def test_one_past_a_constant_limit_is_refused_naming_the_field_the_limit_and_the_value(http, row, endpoint):
    value = past(row, row.limit)
    param = row.param.replace("[]", "[0]")
    fields = wire(row.param, value, endpoint)
    fields.update(NEEDS.get((endpoint, row.param), {}))
    error = refusal(post(http, endpoint, fields), param)
    message = error["message"]
    assert message.startswith(f"Invalid '{param}': "), message
    assert bound(row) in message and shown(row, value) in message, message
    assert error["code"] == (CODES.get((row.param, row.kind)) or limits.phrase(param, row.kind, row.limit, value)[1])


AT_LIMIT = [(row, endpoint) for row, endpoint in SERVED if endpoint == row.endpoints[0] and at(row, row.limit) is not None
            and (endpoint, row.param, row.kind) not in NOT_AT_THE_LIMIT]


@pytest.mark.parametrize("row, endpoint", AT_LIMIT, ids=[f"{e}-{r.param}-{r.kind}" for r, e in AT_LIMIT])
def test_a_constant_limit_itself_is_served(http, row, endpoint):
    fields = wire(row.param, at(row, row.limit), endpoint)
    fields.update(NEEDS.get((endpoint, row.param), {}))
    response = post(http, endpoint, fields)
    assert response.status_code == 200, response.text[:500]


# ---- the limits a server or a request sets -----------------------------------------------------------------


def test_n_past_the_batch_size_reads_as_n_past_128(http):
    for endpoint in (CHAT, COMPLETIONS):
        error = refusal(post(http, endpoint, {"n": MAX_NUM_SEQS + 1}), "n")
        assert error["message"] == (
            f"Invalid 'n': integer above maximum value. Expected a value <= {MAX_NUM_SEQS} (`engine.max_num_seqs`: a "
            f"request's choices run in one batch), but got {MAX_NUM_SEQS + 1} instead."
        )
        assert error["code"] == "integer_above_max_value"


def test_min_tokens_past_max_tokens_names_both(http):
    for endpoint, budget in ((CHAT, "max_tokens"), (COMPLETIONS, "max_tokens"), (RESPONSES, "max_output_tokens")):
        error = refusal(post(http, endpoint, {"min_tokens": 3, budget: 2}), "min_tokens")
        assert "Expected a value <= 2 (the completion's `max_tokens`), but got 3 instead." in error["message"]


@pytest.mark.parametrize("endpoint, field", [(COMPLETIONS, "prompt"), (DETOKENIZE, "tokens")])
def test_a_token_id_past_the_vocabulary_names_it_and_the_last_id(http, endpoint, field):
    error = refusal(post(http, endpoint, {field: [2, 10**7]}), f"{field}[1]")
    last = int(re.search(r"<= (\d+)", error["message"]).group(1))
    assert error["code"] == "invalid_token_id" and error["message"].startswith(f"Invalid '{field}[1]': integer above maximum value.")
    assert "(the vocabulary's ids), but got 10000000 instead." in error["message"]
    refusal(post(http, endpoint, {field: [2, last + 1]}), f"{field}[1]")
    assert post(http, endpoint, {field: [2, last]}).status_code == 200


@pytest.mark.parametrize("endpoint, field", [(CHAT, "messages"), (COMPLETIONS, "prompt"), (RESPONSES, "input"), (TOKENIZE, "prompt")])
def test_a_prompt_past_its_characters_is_context_length_exceeded_naming_both(http, tokenizer, endpoint, field):
    most = MAX_MODEL_LEN * max(len(piece) for piece in tokenizer.get_vocab())
    text = "x" * (most + 1)
    error = refusal(post(http, endpoint, {field: user(text) if field == "messages" else text}), field)
    assert error["code"] == "context_length_exceeded"
    length = int(re.search(rf"`{field}` is (\d+) characters long; the most this server takes is {most}\.", error["message"]).group(1))
    assert length > most


def test_top_logprobs_without_logprobs_names_what_it_needs(http):
    error = refusal(post(http, CHAT, {"top_logprobs": 2}), "top_logprobs")
    assert error["message"] == "Invalid 'top_logprobs': only read with `logprobs: true`, but got logprobs: null instead."
    error = refusal(post(http, CHAT, {"top_logprobs": 2, "logprobs": False}), "top_logprobs")
    assert error["message"].endswith("but got logprobs: false instead.")


def test_a_prediction_past_the_context_names_its_tokens_and_the_limit(http, tokenizer):
    text = "hello " * (MAX_MODEL_LEN + 10)
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    error = refusal(post(http, CHAT, {"prediction": {"type": "content", "content": text}}), "prediction")
    assert error["message"] == (f"Invalid 'prediction': text too long. Expected a text of at most {MAX_MODEL_LEN} tokens "
                                f"(`max_model_len`), but got a text of {tokens} tokens instead."), error
    assert error["code"] == "string_above_max_length"


@pytest.mark.parametrize("literal, param, expected", [
    ("1e999", "temperature", "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 1E+999 instead."),
    ("-1e999", "presence_penalty", "Invalid 'presence_penalty': decimal below minimum value. Expected a value >= -2, but got -1E+999 instead."),
    ("99999999999999999999999", "n", "Invalid 'n': integer above maximum value. Expected a value <= 128, but got 99999999999999999999999 instead."),
    ("1e999", "seed", "Invalid 'seed': integer above maximum value. Expected a value <= 9223372036854775807, but got 1E+999 instead."),
    ("1e999", "top_k", "Invalid value for 'top_k': number out of range. Expected a finite decimal (at most about 1.8e308 either way), but got 1E+999 instead."),
])
def test_a_number_too_large_to_read_names_the_limit_and_the_value(http, literal, param, expected):
    body = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "%s": %s}' % (MODEL, param, literal)
    response = http.post(PATHS[CHAT], content=body.encode(), headers={"content-type": "application/json"})
    assert refusal(response, param)["message"] == expected


def test_the_page_size_of_input_items_is_limited(http):
    for kind, limit, value in (("min", 1, 0), ("max", 100, 101)):
        error = refusal(http.get("/v1/responses/resp_none/input_items", params={"limit": value}), "limit")
        assert error["message"] == limits.phrase("limit", kind, limit, value)[0]
    assert limits.limit("limit", INPUT_ITEMS, "max").limit == 100


def test_an_empty_responses_input_is_an_empty_array(http):
    error = refusal(post(http, RESPONSES, {"input": []}), "input")
    assert error["message"] == limits.phrase("input", "min_items", 1, [])[0] and error["code"] == "empty_array"


@pytest.mark.parametrize("param", ["lora_name", "lora_path"])
def test_lora_loading_needs_a_name_and_a_path(param):
    """The session server does not load adapters at run time: the check `load_lora_adapter` runs, on its own."""
    with pytest.raises(APIError) as error:
        check_limits(param, LORA, "")
    assert error.value.body.error.message == f"Invalid '{param}': string too short. Expected a string with minimum length 1, but got an empty string instead."


@pytest.mark.parametrize("kind, policy, count, expected", [
    ("max_images", ImagePolicy(max_images=1), 2, "too many images. Expected at most 1 images per request (`images.max_images`), but got 2 instead."),
    ("max_bytes", ImagePolicy(max_download_bytes=10), 1, "image too large. Expected at most 10 bytes (`images.max_download_bytes`), but got"),
    ("max_pixels", ImagePolicy(max_pixels=0), 1, "image too large. Expected at most 0 pixels (`images.max_pixels`), but got 1 (1x1) instead."),
])
def test_image_limits_name_the_part_the_limit_and_the_value(kind, policy, count, expected):
    """The session model reads no images: `load_images`, where they are enforced, on its own."""
    png = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    parts = [ImagePart(png, "auto", f"messages[0].content[{j}]") for j in range(count)]
    with pytest.raises(ChatInputError) as error:
        asyncio.run(load_images(parts, policy))
    assert error.value.message.startswith(f"Invalid '{parts[-1].param}': {expected}"), error.value.message
    assert any(row.kind == kind for row in LIMITS)


# ---- the table itself ----------------------------------------------------------------------------------------


def test_every_row_is_walked_here():
    walked = {(row.param, row.kind) for row, _ in SERVED} | {
        ("n", "max"), ("min_tokens", "max"), ("prompt[]", "max"), ("tokens[]", "max"), ("messages", "max_chars"),
        ("prompt", "max_chars"), ("input", "max_chars"), ("lora_name", "min_length"), ("lora_path", "min_length"),
        ("limit", "min"), ("limit", "max"), ("input", "min_items"),
        ("messages[].content[]", "max_images"), ("messages[].content[]", "max_bytes"), ("messages[].content[]", "max_pixels"),
        ("top_logprobs", "requires"), ("prediction", "max_tokens"),
    }
    assert {(row.param, row.kind) for row in LIMITS} == walked


def test_docs_show_the_table_of_the_module():
    text = DOCS.read_text()
    start = text.index("<!-- limits table: generated from oai_gemma/limits.py -->\n") + len("<!-- limits table: generated from oai_gemma/limits.py -->\n")
    assert text[start:text.index("<!-- end of limits table -->")] == limits.markdown_table()


@pytest.mark.parametrize("args", [
    ("n", "max", 128, 200), ("stop", "max_items", 16, ["x"] * 17), ("metadata", "max_items", 16, {str(i): "" for i in range(17)}),
    ("cache_salt", "min_length", 1, ""), ("tools[0].function.name", "pattern", limits.NAME, "my tool"),
    ("messages[0].content[3]", "max_images", 16, 17, " (`images.max_images`)"),
    ("prediction", "max_tokens", 2048, 2059, " (`max_model_len`)"), ("top_logprobs", "requires", "logprobs: true", "logprobs: null"),
    ("temperature", "max", 2.0, __import__("decimal").Decimal("1E+999")),
])
def test_docs_examples_are_the_phrasings(args):
    message, code = limits.phrase(*args)
    assert message in DOCS.read_text() and f"`{code}`" in DOCS.read_text()


def test_a_body_over_the_cap_is_413_naming_the_setting_and_its_value(http):
    most = 32 * 1024 * 1024  # the session server's `server.max_body_bytes` (the default)
    response = http.post(PATHS[CHAT], content=b" " * (most + 1), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:500]
    error = response.json()["error"]
    assert error["message"] == f"The request body is larger than {most} bytes, the most this server takes (`server.max_body_bytes`)."
