"""The schema helper itself: it must reject what the OpenAI spec rejects, or the wire tests prove nothing.

Each test runs against both sources (`source`): the OpenAPI spec beside the repo (skipped where it is absent, as
in a fresh clone) and the `openai` package's types (always there). A few presence rules only the spec has are
marked as such.
"""

import copy
import functools
import re

import pytest

import openai_schema
from openai_schema import schema_of, spec_path


@pytest.fixture(params=["spec", "sdk"])
def source(request):
    if request.param == "spec" and not spec_path().is_file():
        pytest.skip(f"OpenAI OpenAPI spec not found at {spec_path()}")
    return request.param


@pytest.fixture
def validate(source):
    return functools.partial(_validate, source=source)


@pytest.fixture
def errors(source):
    return functools.partial(_errors, source=source)


def _validate(name, obj, source):
    openai_schema.validate(name, obj, source)


def _errors(name, obj, source):
    return openai_schema.errors(name, obj, source)


needs_spec = pytest.mark.parametrize("source", ["spec"], indirect=True)

# what each source says about the same violation
MISSING = {"spec": "'{}' is a required property", "sdk": r"\.{}: Field required"}


def chat_completion() -> dict:
    return {
        "id": "chatcmpl-123",
        "object": "chat.completion",
        "created": 1741570283,
        "model": "gemma-3-270m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }


def chunk() -> dict:
    return {
        "id": "chatcmpl-123",
        "object": "chat.completion.chunk",
        "created": 1741570283,
        "model": "gemma-3-270m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
    }


def test_hand_made_chat_completion_is_accepted(validate):
    validate("CreateChatCompletionResponse", chat_completion())


def test_chat_completion_without_choices_is_rejected(validate, source):
    obj = chat_completion()
    del obj["choices"]
    with pytest.raises(AssertionError, match=MISSING[source].format("choices")):
        validate("CreateChatCompletionResponse", obj)


def test_chat_completion_with_wrong_object_is_rejected(validate):
    obj = chat_completion()
    obj["object"] = "chat.completion.chunk"
    with pytest.raises(AssertionError, match=r"\$\.object"):
        validate("CreateChatCompletionResponse", obj)


def test_every_violation_is_listed(errors):
    obj = chat_completion()
    del obj["choices"]
    obj["object"] = "completion"
    obj["created"] = "yesterday"
    assert len(errors("CreateChatCompletionResponse", obj)) == 3


@needs_spec
def test_choice_must_carry_logprobs_key_and_message_refusal(errors):
    obj = chat_completion()
    del obj["choices"][0]["logprobs"]
    del obj["choices"][0]["message"]["refusal"]
    problems = "\n".join(errors("CreateChatCompletionResponse", obj))
    assert "'logprobs' is a required property" in problems
    assert "'refusal' is a required property" in problems


def test_final_finish_reason_cannot_be_null_in_a_full_response(validate):
    obj = chat_completion()
    obj["choices"][0]["finish_reason"] = None
    with pytest.raises(AssertionError, match="finish_reason"):
        validate("CreateChatCompletionResponse", obj)


def test_stream_chunk_accepts_null_finish_reason_and_null_usage(validate):
    # both are `nullable: true` in the spec, which the helper turns into a null union
    obj = chunk()
    obj["usage"] = None
    validate("CreateChatCompletionStreamResponse", obj)


def test_stream_chunk_rejects_unknown_finish_reason_and_partial_usage(errors, source):
    obj = chunk()
    obj["choices"][0]["finish_reason"] = "done"
    obj["usage"] = {"prompt_tokens": 9}
    problems = "\n".join(errors("CreateChatCompletionStreamResponse", obj))
    assert {"spec": "'done' is not one of", "sdk": "$.choices[0].finish_reason: Input should be 'stop'"}[source] in problems
    assert re.search(MISSING[source].format("total_tokens"), problems)


def test_final_usage_chunk_may_have_no_choices(validate):
    obj = chunk()
    obj["choices"] = []
    obj["usage"] = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    validate("CreateChatCompletionStreamResponse", obj)


def test_model_list_and_error_envelope(validate, source):
    validate("ListModelsResponse", {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "me"}]})
    validate("ErrorResponse", {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}})
    with pytest.raises(AssertionError, match=MISSING[source].format("message")):
        validate("ErrorResponse", {"error": {"type": "invalid_request_error", "param": None, "code": None}})
    with pytest.raises(AssertionError, match=r"\$\.data\[0\]\.created"):
        validate("ListModelsResponse", {"object": "list", "data": [{"id": "m", "object": "model", "created": "0", "owned_by": "me"}]})


@needs_spec
def test_error_param_must_be_present(validate):
    with pytest.raises(AssertionError, match="'param' is a required property"):
        validate("ErrorResponse", {"error": {"message": "bad", "type": "invalid_request_error", "code": None}})


@needs_spec
def test_schema_of_returns_the_component_and_rejects_unknown_names(source):
    assert set(schema_of("CreateChatCompletionResponse")["required"]) == {"choices", "created", "id", "model", "object"}
    with pytest.raises(KeyError):
        schema_of("NoSuchComponent")


def test_original_object_is_not_mutated(validate):
    obj = chat_completion()
    before = copy.deepcopy(obj)
    validate("CreateChatCompletionResponse", obj)
    assert obj == before


def test_a_legacy_completion_is_checked_too(validate):
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}]}
    validate("CreateCompletionResponse", obj)
    obj["choices"][0]["finish_reason"] = "tool_calls"  # not a legacy completion's reason
    with pytest.raises(AssertionError, match="finish_reason"):
        validate("CreateCompletionResponse", obj)


def test_without_the_spec_file_the_openai_types_are_used(monkeypatch, tmp_path):
    # a fresh clone has no ../shared: the wire tests must still validate, not fail or skip
    monkeypatch.setenv("OAI_OPENAPI_SPEC", str(tmp_path / "absent.yaml"))
    assert openai_schema.backend() == "sdk"
    openai_schema.validate("CreateChatCompletionResponse", chat_completion())
    broken = chat_completion()
    broken["choices"][0]["finish_reason"] = "done"
    with pytest.raises(AssertionError, match=r"CreateChatCompletionResponse \(sdk\)"):
        openai_schema.validate("CreateChatCompletionResponse", broken)
    with pytest.raises(KeyError):
        openai_schema.validate("NoSuchComponent", {})


def _schema_names_used_in_tests() -> dict[str, str]:
    """Every schema name passed as a literal to validate()/errors() anywhere in tests/, with where it was seen."""
    import ast
    from pathlib import Path

    found: dict[str, str] = {}
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in {"validate", "errors", "_validate", "_errors"} and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.setdefault(first.value, f"{path.name}:{node.lineno}")
    found.pop("NoSuchComponent", None)  # the helper's own unknown-name tests
    return found


def test_every_schema_name_the_tests_use_has_an_sdk_type():
    # a clean clone has no ../shared: each name the wire tests validate against needs the openai package's type,
    # whether or not this machine has the spec file (CI does, so it would not notice otherwise)
    used = _schema_names_used_in_tests()
    assert {"CreateChatCompletionResponse", "Response", "ResponseStreamEvent"} <= set(used)  # the scan finds them
    missing = {name: where for name, where in used.items() if name not in openai_schema.SDK_TYPE_NAMES}
    assert not missing, f"schema names with no openai SDK type in tests/openai_schema.py: {missing}"


def test_responses_objects_validate_against_the_sdk_types(monkeypatch, tmp_path):
    monkeypatch.setenv("OAI_OPENAPI_SPEC", str(tmp_path / "absent.yaml"))
    response = {
        "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m",
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "hi", "annotations": []}]}],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None, "incomplete_details": None,
        "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0,
    }
    openai_schema.validate("Response", response)
    openai_schema.validate("ResponseStreamEvent", {"type": "response.output_text.delta", "item_id": "msg_1",
                                                    "output_index": 0, "content_index": 0, "delta": "hi",
                                                    "sequence_number": 3, "logprobs": []})
    item = {"type": "message", "id": "msg_0", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": "hello"}]}
    openai_schema.validate("ResponseItemList", {"object": "list", "data": [item], "first_id": "msg_0",
                                                 "last_id": "msg_0", "has_more": False})
    with pytest.raises(AssertionError, match=r"Response \(sdk\)"):
        openai_schema.validate("Response", {**response, "status": "done"})
    with pytest.raises(AssertionError, match=r"ResponseStreamEvent \(sdk\)"):
        openai_schema.validate("ResponseStreamEvent", {"type": "response.output_text.delta", "delta": 5})
