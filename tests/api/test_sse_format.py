"""The stream's bytes, exactly as OpenAI and vLLM send them."""


from conftest import MAX_MODEL_LEN, MODEL, user
from openai_schema import validate
from sse import post_stream

PAYLOAD = {"model": MODEL, "messages": user("Tell me about the moon."), "max_tokens": 8, "temperature": 0, "stream": True}


def test_stream_content_type_is_event_stream(http):
    stream = post_stream(http, PAYLOAD)
    assert stream.status == 200
    assert stream.headers["content-type"].split(";")[0] == "text/event-stream"


def test_every_event_is_data_json_with_lf_lf_and_no_cr(http):
    stream = post_stream(http, PAYLOAD)
    assert b"\r" not in stream.body
    for event in stream.events:
        assert event.startswith(b"data: ") and b"\n" not in event, event


def test_done_is_the_last_event(http):
    stream = post_stream(http, PAYLOAD)
    assert stream.body.endswith(b"data: [DONE]\n\n")
    assert stream.events.count(b"data: [DONE]") == 1


def test_every_chunk_matches_openai_schema_and_shares_one_id(http):
    stream = post_stream(http, {**PAYLOAD, "stream_options": {"include_usage": True}})
    chunks = stream.chunks
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    assert len({c["id"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {MODEL}


def test_first_chunk_delta_is_role_and_empty_content(http):
    first = post_stream(http, PAYLOAD).chunks[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None


def test_exactly_one_chunk_has_a_finish_reason_and_it_matches_non_stream(http):
    chunks = post_stream(http, PAYLOAD).chunks
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert reasons == ["length"]
    plain = http.post("/v1/chat/completions", json={**PAYLOAD, "stream": False}).json()
    assert plain["choices"][0]["finish_reason"] == reasons[0]


def test_include_usage_adds_one_usage_chunk_and_null_usage_elsewhere(http):
    chunks = post_stream(http, {**PAYLOAD, "stream_options": {"include_usage": True}}).chunks
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 8
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 8
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])


def test_without_include_usage_no_chunk_carries_usage(http):
    chunks = post_stream(http, PAYLOAD).chunks
    assert all("usage" not in c for c in chunks)
    assert all(c["choices"] for c in chunks)


def test_non_stream_response_matches_openai_schema(http):
    body = http.post("/v1/chat/completions", json={**PAYLOAD, "stream": False}).json()
    validate("CreateChatCompletionResponse", body)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 8


def test_stream_and_non_stream_give_the_same_greedy_text(http):
    streamed = post_stream(http, {**PAYLOAD, "max_tokens": 16}).content()
    plain = http.post("/v1/chat/completions", json={**PAYLOAD, "max_tokens": 16, "stream": False}).json()
    assert streamed == plain["choices"][0]["message"]["content"]
    assert streamed


def test_streaming_is_incremental(http):
    stream = post_stream(http, {**PAYLOAD, "max_tokens": 48})
    content_times = [t for t, raw in stream.arrivals if b'"content":"' in raw and b'"content":""' not in raw]
    assert content_times, "no content arrived"
    total = stream.arrivals[-1][0] - stream.arrivals[0][0]
    # the first words leave long before the last token is computed
    assert content_times[0] - stream.arrivals[0][0] < 0.5 * total, (content_times[0] - stream.arrivals[0][0], total)


def test_models_list_and_retrieve_match_schema(http):
    listing = http.get("/v1/models").json()
    validate("ListModelsResponse", listing)
    assert [m["id"] for m in listing["data"]] == [MODEL]
    one = http.get(f"/v1/models/{MODEL}").json()
    validate("Model", one)
    assert one["id"] == MODEL
    # what agent tools read instead of guessing: the embedded model reads text only
    assert (one["modalities"], one["status"], one["max_model_len"]) == (["text"], {"value": "loaded"}, MAX_MODEL_LEN)
    assert set(one["capabilities"]) == {"completion", "chat", "tools", "structured_output"}


def test_logprobs_chunks_and_response_match_openai_schema(http):
    payload = {**PAYLOAD, "logprobs": True, "top_logprobs": 2}
    chunks = post_stream(http, payload).chunks
    with_logprobs = [c for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
    assert with_logprobs
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    body = http.post("/v1/chat/completions", json={**payload, "stream": False}).json()
    validate("CreateChatCompletionResponse", body)
    assert len(body["choices"][0]["logprobs"]["content"]) == 8
