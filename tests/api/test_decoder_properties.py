"""The request decoders under hypothesis: whatever arrives, the answer is a decoded request or a 400 APIError,
never another exception; a valid request decodes to exactly what was sent. Pure: no server, no model."""

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oai_gemma.api.errors import APIError, decode_body
from oai_gemma.api.protocol import ChatCompletionRequest, decoder
from oai_gemma.api.serving_tokenize import DetokenizeRequest, TokenizeRequest, _detokenize_decoder, _tokenize_decoder

DECODERS = {
    "chat": (decoder, ChatCompletionRequest),
    "tokenize": (_tokenize_decoder, TokenizeRequest),
    "detokenize": (_detokenize_decoder, DetokenizeRequest),
}
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(sorted(set(ChatCompletionRequest.__struct_fields__) | {"prompt", "tokens"}))
# objects whose keys are mostly real field names, so the values reach the field validators
request_like = st.dictionaries(field_names, json_values, max_size=6)


def decode_or_error(name: str, body: bytes):
    """The decoded Struct, or the APIError; any other exception escapes and fails the test."""
    try:
        return decode_body(DECODERS[name][0], body)
    except APIError as exc:
        return exc


def assert_rejected_well(error: APIError, struct: type) -> None:
    assert error.status == 400
    assert error.body.error.type == "invalid_request_error"
    assert error.body.error.message
    if error.body.error.param is not None:  # names a real field of the request
        top = error.body.error.param.split(".")[0].split("[")[0]
        assert top in struct.__struct_fields__, error.body.error.param


@pytest.mark.parametrize("name", DECODERS)
@FAST
@given(body=st.binary(max_size=200))
def test_any_bytes_decode_or_give_a_400(name, body):
    result = decode_or_error(name, body)
    if isinstance(result, APIError):
        assert_rejected_well(result, DECODERS[name][1])


@pytest.mark.parametrize("name", DECODERS)
@FAST
@given(value=json_values | request_like)
def test_any_json_value_decodes_or_gives_a_400_naming_a_real_field(name, value):
    result = decode_or_error(name, msgspec.json.encode(value))
    if isinstance(result, APIError):
        assert_rejected_well(result, DECODERS[name][1])
    else:
        assert isinstance(result, DECODERS[name][1])


FLOAT_FIELDS = [f.name for f in msgspec.structs.fields(ChatCompletionRequest) if "float" in str(f.type)]


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_numbers_are_a_400_naming_the_field(field, literal):
    """JSON has no NaN or Infinity, and 1e999 overflows to infinity: never a sampling parameter."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field.encode(), literal)
    result = decode_or_error("chat", body)
    assert isinstance(result, APIError), getattr(result, field)
    assert result.status == 400


def messages():
    text_part = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=20))
    content = st.text(max_size=40) | st.lists(text_part, min_size=1, max_size=3)
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": content},
        optional={"name": st.text(min_size=1, max_size=10)},
    )
    return st.lists(message, min_size=1, max_size=4)


unit = st.floats(min_value=0, max_value=1, allow_nan=False)
valid_requests = st.fixed_dictionaries(
    {"model": st.text(max_size=30), "messages": messages()},
    optional={
        "max_tokens": st.integers(1, 2**31),
        "max_completion_tokens": st.integers(1, 2**31),
        "temperature": st.floats(min_value=0, max_value=2, allow_nan=False),
        "top_p": unit,
        "min_p": unit,
        "n": st.integers(1, 128),
        "stream": st.booleans(),
        "stop": st.text(max_size=10) | st.lists(st.text(max_size=10), max_size=16),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "presence_penalty": st.floats(min_value=-2, max_value=2, allow_nan=False),
        "frequency_penalty": st.floats(min_value=-2, max_value=2, allow_nan=False),
        "logit_bias": st.dictionaries(st.integers(0, 262143).map(str), st.floats(-100, 100, allow_nan=False), max_size=4),
        "top_k": st.integers(-1, 1000),
        "user": st.text(max_size=10),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "ignore_eos": st.booleans(),
    },
)


@FAST
@given(sent=valid_requests)
def test_a_valid_chat_request_decodes_to_what_was_sent(sent):
    result = decode_or_error("chat", msgspec.json.encode(sent))
    assert isinstance(result, ChatCompletionRequest), result.body if isinstance(result, APIError) else result
    for field, value in sent.items():
        if field == "messages":
            continue
        assert getattr(result, field) == value, field
    assert len(result.messages) == len(sent["messages"])
    for got, message in zip(result.messages, sent["messages"]):
        assert got.role == message["role"] and got.name == message.get("name")
        content = message["content"]
        assert got.content == content if isinstance(content, str) else [p.text for p in got.content] == [p["text"] for p in content]
