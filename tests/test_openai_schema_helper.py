"""The schema helper itself: it must reject what the OpenAI spec rejects, or the wire tests prove nothing."""

import copy

import pytest

from openai_schema import errors, schema_of, spec_path, validate

if not spec_path().is_file():
    pytest.skip(f"OpenAI OpenAPI spec not found at {spec_path()}", allow_module_level=True)


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


def test_hand_made_chat_completion_is_accepted():
    validate("CreateChatCompletionResponse", chat_completion())


def test_chat_completion_without_choices_is_rejected():
    obj = chat_completion()
    del obj["choices"]
    with pytest.raises(AssertionError, match="'choices' is a required property"):
        validate("CreateChatCompletionResponse", obj)


def test_chat_completion_with_wrong_object_is_rejected():
    obj = chat_completion()
    obj["object"] = "chat.completion.chunk"
    with pytest.raises(AssertionError, match=r"\$\.object"):
        validate("CreateChatCompletionResponse", obj)


def test_every_violation_is_listed():
    obj = chat_completion()
    del obj["choices"]
    obj["object"] = "completion"
    obj["created"] = "yesterday"
    assert len(errors("CreateChatCompletionResponse", obj)) == 3


def test_choice_must_carry_logprobs_key_and_message_refusal():
    obj = chat_completion()
    del obj["choices"][0]["logprobs"]
    del obj["choices"][0]["message"]["refusal"]
    problems = "\n".join(errors("CreateChatCompletionResponse", obj))
    assert "'logprobs' is a required property" in problems
    assert "'refusal' is a required property" in problems


def test_final_finish_reason_cannot_be_null_in_a_full_response():
    obj = chat_completion()
    obj["choices"][0]["finish_reason"] = None
    with pytest.raises(AssertionError, match="finish_reason"):
        validate("CreateChatCompletionResponse", obj)


def test_stream_chunk_accepts_null_finish_reason_and_null_usage():
    # both are `nullable: true` in the spec, which the helper turns into a null union
    obj = chunk()
    obj["usage"] = None
    validate("CreateChatCompletionStreamResponse", obj)


def test_stream_chunk_rejects_unknown_finish_reason_and_partial_usage():
    obj = chunk()
    obj["choices"][0]["finish_reason"] = "done"
    obj["usage"] = {"prompt_tokens": 9}
    problems = "\n".join(errors("CreateChatCompletionStreamResponse", obj))
    assert "'done' is not one of" in problems
    assert "'total_tokens' is a required property" in problems


def test_final_usage_chunk_may_have_no_choices():
    obj = chunk()
    obj["choices"] = []
    obj["usage"] = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    validate("CreateChatCompletionStreamResponse", obj)


def test_model_list_and_error_envelope():
    validate("ListModelsResponse", {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "me"}]})
    validate("ErrorResponse", {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}})
    with pytest.raises(AssertionError, match="'param' is a required property"):
        validate("ErrorResponse", {"error": {"message": "bad", "type": "invalid_request_error", "code": None}})


def test_schema_of_returns_the_component_and_rejects_unknown_names():
    assert set(schema_of("CreateChatCompletionResponse")["required"]) == {"choices", "created", "id", "model", "object"}
    with pytest.raises(KeyError):
        schema_of("NoSuchComponent")


def test_original_object_is_not_mutated():
    obj = chat_completion()
    before = copy.deepcopy(obj)
    validate("CreateChatCompletionResponse", obj)
    assert obj == before
