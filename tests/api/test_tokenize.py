"""vLLM's `/tokenize` and `/detokenize` on the real server: chat counts match chat usage, errors are OpenAI's."""

import pytest

from conftest import MAX_MODEL_LEN, MODEL, user
from openai_schema import validate

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé, 日本語 and emoji 🦊!"
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one?"}]},
]


def ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    validate("ErrorResponse", body)
    return body["error"]


def test_messages_count_equals_chat_usage_prompt_tokens(http, client):
    tokenized = ok(http.post("/tokenize", json={"model": MODEL, "messages": CONVERSATION}))
    completion = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1, temperature=0)
    assert tokenized["count"] == completion.usage.prompt_tokens
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN


def test_messages_render_with_the_chat_template(http, tokenizer):
    tokens = ok(http.post("/tokenize", json={"model": MODEL, "messages": user("hi")}))["tokens"]
    assert tokenizer.decode(tokens) == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_add_generation_prompt_false_leaves_off_the_model_turn(http, tokenizer):
    payload = {"model": MODEL, "messages": user("hi"), "add_generation_prompt": False}
    tokens = ok(http.post("/tokenize", json=payload))["tokens"]
    assert tokenizer.decode(tokens) == "<bos><start_of_turn>user\nhi<end_of_turn>\n"


def test_prompt_gets_bos_by_default(http, tokenizer):
    tokens = ok(http.post("/tokenize", json={"model": MODEL, "prompt": TEXT}))["tokens"]
    assert tokens[0] == tokenizer.bos_token_id
    assert tokens[1:] == tokenizer.encode(TEXT, add_special_tokens=False)


def test_prompt_without_special_tokens_has_no_bos(http, tokenizer):
    payload = {"model": MODEL, "prompt": TEXT, "add_special_tokens": False}
    tokens = ok(http.post("/tokenize", json=payload))["tokens"]
    assert tokens == tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.bos_token_id not in tokens


def test_token_strs_only_when_asked(http, tokenizer):
    plain = ok(http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}))
    assert "token_strs" not in plain
    asked = ok(http.post("/tokenize", json={"model": MODEL, "prompt": "hello world", "return_token_strs": True}))
    assert asked["token_strs"] == tokenizer.convert_ids_to_tokens(asked["tokens"])
    assert asked["token_strs"][0] == "<bos>"


def test_detokenize_round_trips_tokenize(http):
    tokens = ok(http.post("/tokenize", json={"model": MODEL, "prompt": TEXT, "add_special_tokens": False}))["tokens"]
    assert ok(http.post("/detokenize", json={"model": MODEL, "tokens": tokens})) == {"prompt": TEXT}


def test_detokenize_keeps_special_tokens_as_vllm_does(http):
    tokens = ok(http.post("/tokenize", json={"model": MODEL, "prompt": "hi"}))["tokens"]
    assert ok(http.post("/detokenize", json={"model": MODEL, "tokens": tokens}))["prompt"] == "<bos>hi"


def test_vllm_paths_only_at_the_root(http):
    assert http.post("/v1/tokenize", json={"model": MODEL, "prompt": "hi"}).status_code == 404


@pytest.mark.parametrize("bad", [10**9, -1])
def test_detokenize_id_outside_the_vocabulary_is_400_naming_tokens(http, bad):
    error = error_of(http.post("/detokenize", json={"model": MODEL, "tokens": [2, bad]}), 400)
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == ("tokens[1]", "invalid_token_id")
    assert f"but got {bad} instead" in error["message"]


@pytest.mark.parametrize("path, payload", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [2]})])
def test_unknown_model_is_404_model_not_found(http, path, payload):
    error = error_of(http.post(path, json={"model": "gpt-4o", **payload}), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


@pytest.mark.parametrize("payload", [{"model": MODEL}, {"model": MODEL, "prompt": "hi", "messages": user("hi")}])
def test_exactly_one_of_prompt_and_messages(http, payload):
    error = error_of(http.post("/tokenize", json=payload), 400)
    assert error["param"] == "prompt"


@pytest.mark.parametrize(
    "path, payload, param",
    [
        ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"model": MODEL}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": ["a"]}, "tokens[0]"),
    ],
)
def test_validation_error_names_the_param(http, path, payload, param):
    error = error_of(http.post(path, json=payload), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_malformed_json_is_400(http, path):
    response = http.post(path, content=b"{bad", headers={"content-type": "application/json"})
    assert error_of(response, 400)["type"] == "invalid_request_error"


def test_image_on_the_text_only_model_is_the_same_400_as_chat(http):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    tokenized = error_of(http.post("/tokenize", json={"model": MODEL, "messages": messages}), 400)
    chat = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400)
    assert tokenized == chat
    assert tokenized["param"] == "messages[0].content[1]"
