"""`/v1/responses` through the official `openai` client and raw HTTP: every response is checked against the
official spec's `Response`, every stream event against `ResponseStreamEvent`. Greedy outputs are compared with
chat completions' for the same conversation: one request path, two wire formats."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from conftest import MODEL, ServerProcess, user
from openai_schema import validate

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]},
}
# forced calls are one at a time (`parallel_tool_calls: false`): with a list allowed, whether this base model closes
# the list after its first call or repeats it is a near tie, which prefix-cache rounding can flip
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


REASONING = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "The user greets."}],
             "encrypted_content": "gAAAAB-opaque"}
"""A reasoning model's item, as the Agents SDK replays it after a handoff from such a model."""


def create(client: openai.OpenAI, **kw):
    """The parsed response and its raw JSON, the latter checked against the spec."""
    raw = client.responses.with_raw_response.create(model=MODEL, **kw)
    body = raw.http_response.json()
    validate("Response", body)
    return raw.parse(), body


def sse_events(http: httpx.Client, payload: dict) -> list[tuple[str, dict]]:
    """(event name, data) pairs of a raw stream; every event's bytes are checked for OpenAI's framing."""
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **payload}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read()
    assert body.endswith(b"\n\n")
    events = []
    for block in body[:-2].split(b"\n\n"):
        name, data = block.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: "), block
        event = json.loads(data[len(b"data: "):])
        assert event["type"] == name[len(b"event: "):].decode()
        validate("ResponseStreamEvent", event)
        events.append((event["type"], event))
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    return events


# ---- non-stream ------------------------------------------------------------------------------------------


def test_text_input_gives_a_completed_message_with_usage(client):
    # the embedded base model rarely ends by itself: vLLM's `stop` extension ends this one at its first line
    response, body = create(
        client, input="Write a haiku about the sea.", max_output_tokens=32, temperature=0, extra_body={"stop": ["\n"]}
    )
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert response.status == "completed" and response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].text == response.output_text
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    response, body = create(client, input="Count to one hundred.", max_output_tokens=3, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and body["max_output_tokens"] == 3


def test_instructions_and_items_render_as_the_same_chat(client):
    """`instructions` is a system message; a list of items is the chat's messages, so greedy text matches."""
    items = [
        {"role": "user", "content": "My name is Ann."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ann."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    response, _ = create(client, instructions="Answer briefly.", input=items, max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[
            {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "My name is Ann."},
            {"role": "assistant", "content": "Hello Ann."}, {"role": "user", "content": "What is my name?"},
        ],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_text_format_is_held_by_the_grammar(client):
    schema = {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    response, body = create(client, input="Weather in Paris as JSON.", text=text, max_output_tokens=48, temperature=0)
    parsed = json.loads(response.output_text)
    assert set(parsed) == {"city", "sunny"} and isinstance(parsed["sunny"], bool)
    assert body["text"]["format"]["type"] == "json_schema"
    obj, _ = create(client, input="A JSON object.", text={"format": {"type": "json_object"}}, max_output_tokens=3)
    assert obj.output_text.lstrip().startswith("{")


def test_required_tool_choice_returns_a_function_call_item(client):
    response, body = create(
        client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=48,
        parallel_tool_calls=False,
        temperature=0,
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id != call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert response.status == "completed"
    assert body["tools"][0]["name"] == "get_weather" and body["tool_choice"] == "required"


def test_tool_result_round_trip_renders_as_chat_tool_messages(client):
    first, _ = create(
        client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48, temperature=0,
    )
    [call] = first.output
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    second, _ = create(client, input=items, tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert second.output[0].type == "message"
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, tools=[CHAT_WEATHER],
        messages=[
            *user("What is the weather in Paris?"),
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # the same turn through previous_response_id: only the tool's output is sent
    chained, _ = create(
        client, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )
    assert chained.output_text == second.output_text


def test_include_logprobs_reports_each_output_token(client, http):
    kw = {"input": "Name a color.", "max_output_tokens": 4, "temperature": 0, "top_logprobs": 2,
          "include": ["message.output_text.logprobs"]}
    response, body = create(client, **kw)
    entries = body["output"][0]["content"][0]["logprobs"]
    assert len(entries) == response.usage.output_tokens == 4
    assert "".join(e["token"] for e in entries) == response.output_text
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)
    events = sse_events(http, kw)
    streamed = [entry for name, e in events if name == "response.output_text.delta" for entry in e["logprobs"]]
    # the same tokens; the logprobs up to the last bits (the second request's prompt comes from the prefix cache)
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in entries], abs=1e-3)
    plain, _ = create(client, **{**kw, "include": []})
    assert plain.output[0].content[0].logprobs == []


# ---- state -----------------------------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation_from_the_store(client):
    first, _ = create(client, input="Write one sentence about lighthouses.", max_output_tokens=6, temperature=0)
    second, body = create(
        client, previous_response_id=first.id, input="Now one about boats.", max_output_tokens=4, temperature=0
    )
    assert body["previous_response_id"] == first.id
    explicit, _ = create(
        client, max_output_tokens=4, temperature=0, store=False,
        input=[
            {"role": "user", "content": "Write one sentence about lighthouses."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Now one about boats."},
        ],
    )
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens
    # the engine's prefix reuse serves the resent history from its KV cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16  # its full blocks
    items = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")
    ]
    assert items.data[1].content[0].text == first.output_text


def test_get_lists_and_delete_a_stored_response(client, http):
    created, body = create(client, input="Say hi.", max_output_tokens=4, metadata={"team": "blue"}, user="u-1")
    fetched = http.get(f"/v1/responses/{created.id}")
    assert fetched.status_code == 200 and fetched.json() == body
    assert client.responses.retrieve(created.id).output_text == created.output_text
    listed = http.get(f"/v1/responses/{created.id}/input_items").json()
    validate("ResponseItemList", listed)
    assert listed["data"][0]["content"] == [{"type": "input_text", "text": "Say hi."}]
    assert listed["first_id"] == listed["last_id"] == listed["data"][0]["id"] and listed["has_more"] is False
    deleted = http.delete(f"/v1/responses/{created.id}")
    assert deleted.json() == {"id": created.id, "object": "response.deleted", "deleted": True}
    for path in (f"/v1/responses/{created.id}", f"/v1/responses/{created.id}/input_items"):
        gone = http.get(path)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert http.delete(f"/v1/responses/{created.id}").status_code == 404


def test_store_false_keeps_nothing(client, http):
    response, body = create(client, input="Say hi.", max_output_tokens=4, store=False)
    assert body["store"] is False
    assert http.get(f"/v1/responses/{response.id}").status_code == 404
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Again.", previous_response_id=response.id, max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"


def test_input_items_paginate_in_both_orders(client, http):
    items = [{"role": "user", "content": f"Line {i}."} for i in range(5)]
    response, _ = create(client, input=items, max_output_tokens=2)
    ids = [i["id"] for i in http.get(f"/v1/responses/{response.id}/input_items", params={"order": "asc"}).json()["data"]]
    assert len(ids) == 5
    newest = http.get(f"/v1/responses/{response.id}/input_items").json()  # OpenAI's default order: desc
    assert [i["id"] for i in newest["data"]] == ids[::-1]
    page = http.get(f"/v1/responses/{response.id}/input_items", params={"order": "asc", "limit": 2, "after": ids[1]}).json()
    assert [i["id"] for i in page["data"]] == ids[2:4] and page["has_more"] is True
    assert [i.id for i in client.responses.input_items.list(response.id, order="asc", limit=2)] == ids  # auto-paging


# ---- streaming -------------------------------------------------------------------------------------------


def test_stream_helper_assembles_the_same_response_as_non_stream(client):
    # the SDK's helper wants `response.completed` (a response cut by max_output_tokens ends `response.incomplete`,
    # as OpenAI's): vLLM's `stop` extension ends this one at its first line
    kw = {"input": "Write a haiku about the sea.", "max_output_tokens": 32, "temperature": 0, "extra_body": {"stop": ["\n"]}}
    with client.responses.stream(model=MODEL, **kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    plain, _ = create(client, **kw, store=False)
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored at the end


def test_raw_text_stream_sends_openais_event_sequence(http):
    events = sse_events(http, {"input": "Count to ten.", "max_output_tokens": 4, "temperature": 0})
    names = [name for name, _ in events]
    assert names[:5] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
    ]
    assert names[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"
    ]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    created, last = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    text = "".join(e["delta"] for name, e in events if name == "response.output_text.delta")
    assert last["output"][0]["content"][0]["text"] == text == events[-4][1]["text"]
    assert last["status"] == "incomplete" and last["usage"]["output_tokens"] == 4
    item_id = events[2][1]["item"]["id"]
    assert all(e["item_id"] == item_id for name, e in events[3:-2])
    assert events[-2][1]["item"]["id"] == item_id and events[-2][1]["item"]["status"] == "incomplete"


def test_raw_function_call_stream_sends_argument_deltas(http):
    events = sse_events(http, {
        "input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 48,
        "parallel_tool_calls": False,
        "temperature": 0,
    })
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2][1]["item"]["type"] == "function_call" and events[2][1]["item"]["name"] == "get_weather"
    deltas = [e["delta"] for name, e in events if name == "response.function_call_arguments.delta"]
    [done] = [e for name, e in events if name == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done["arguments"]
    assert names[-2:] == ["response.output_item.done", "response.completed"]
    final = events[-1][1]["response"]
    assert final["output"][0]["arguments"] == done["arguments"] and "city" in json.loads(done["arguments"])


def test_stream_helper_handles_function_calls(client):
    with client.responses.stream(
        model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required", max_output_tokens=48, temperature=0,
        parallel_tool_calls=False,
    ) as stream:
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and "city" in json.loads(call.arguments)


def test_a_client_that_leaves_a_stream_frees_its_slot(server, http):
    with http.stream("POST", "/v1/responses", json={
        "model": MODEL, "input": "Tell a very long story.", "stream": True, "max_output_tokens": 1500, "store": False,
        "temperature": 0, "ignore_eos": True,
    }) as response:
        for line in response.iter_lines():
            if "output_text.delta" in line:
                break
    for _ in range(100):
        if http.get("/health").json()["running"] == 0:
            break
        time.sleep(0.05)
    assert http.get("/health").json()["running"] == 0


# ---- errors and parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"input": [{"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[1].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[0]"),
        ({"input": []}, "input"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "Hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "temperature": 3}, "temperature"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strange"}}}}}}, "text.format"),
        ({"input": "Hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "Hi" * 40_000}, "input"),
        ({"input": "Hi", "instructions": "Answer <start_of_image>"}, "instructions"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "<image_soft_token>"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": "<end_of_image>"}'}]}, "input[0]"),
        ({"input": [REASONING]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "Hi"}]}, "input[0].id"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(http, payload, param):
    response = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, **payload})
    assert response.status_code == 400, response.text
    validate("ErrorResponse", response.json())
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404(http):
    response = http.post("/v1/responses", json={"model": "gpt-9", "input": "Hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_images_on_a_text_only_model_name_the_input_part(http):
    response = http.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"},
    ]}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[0].content[1]"
    assert response.json()["error"]["code"] == "image_not_supported"


def test_a_reasoning_item_in_input_is_listed_as_sent_and_left_out_of_the_prompt(client, http):
    plain, _ = create(client, input=[{"role": "user", "content": "Say hi."}], max_output_tokens=6, temperature=0)
    replayed, _ = create(client, input=[REASONING, {"role": "user", "content": "Say hi."}], max_output_tokens=6, temperature=0)
    assert replayed.output_text == plain.output_text and replayed.usage.input_tokens == plain.usage.input_tokens
    items = http.get(f"/v1/responses/{replayed.id}/input_items", params={"order": "asc"}).json()
    validate("ResponseItemList", items)
    assert items["data"][0] == REASONING
    follow, _ = create(client, input="And again.", previous_response_id=replayed.id, max_output_tokens=4)
    assert follow.status in ("completed", "incomplete")


def test_parameters_the_agents_sdk_sends_are_accepted(client):
    response, body = create(
        client, input="Say hi.", max_output_tokens=4, include=[], reasoning={}, store=True, metadata={"a": "b"},
        prompt_cache_key="conversation-1", parallel_tool_calls=True, text={"format": {"type": "text"}, "verbosity": "medium"},
        truncation="disabled", service_tier="auto", safety_identifier="user-1", top_logprobs=0,
        extra_body={"stream_options": None, "some_future_field": 1},
    )
    assert response.status == "incomplete" or response.status == "completed"
    assert body["metadata"] == {"a": "b"} and body["parallel_tool_calls"] is True


# ---- the store, bounded and per key, across a restart ---------------------------------------------------


@pytest.mark.slow
def test_store_survives_a_restart_and_keys_never_read_each_other(tmp_path):
    env = {
        "OAI_GEMMA_API_KEYS": "key-a,key-b", "OAI_GEMMA_RESPONSES__STORE_PATH": str(tmp_path / "responses.sqlite3"),
        "OAI_GEMMA_RESPONSES__MAX_STORED": "2",
    }
    log = tmp_path / "server.log"

    def clients(url):
        return [openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=120) for k in ("key-a", "key-b")]

    with ServerProcess(env=env, log=log) as server:
        a, b = clients(server.url)
        first = a.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(first.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=4)
        second = a.responses.create(model=MODEL, input="Say bye.", max_output_tokens=4)
        server.stop()  # gone before the next one opens the store (leaving the block would not wait)
    with ServerProcess(env=env, log=log) as server:
        a, b = clients(server.url)
        assert a.responses.retrieve(first.id).output_text == first.output_text
        assert a.responses.retrieve(second.id).output_text == second.output_text
        a.responses.create(model=MODEL, input="Say yes.", max_output_tokens=4)  # the third: the oldest goes
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(first.id)
        assert a.responses.retrieve(second.id).id == second.id
