"""Function calling end to end: `tools`, `tool_choice`, `parallel_tool_calls`, through the openai client, raw SSE
and langchain-openai, on the real server and model.

The embedded model is a small base model that does not call tools from the instructions alone; it does copy a
pattern. So the conversations here show it earlier turns in which the assistant called the tool (rendered back
into the prompt as multi-turn tool calls and `tool` results), and greedy decoding continues the pattern. What is
asserted is the protocol (calls parsed, ids, finish reasons, deltas, the spec), never a fixed output text.
Forcing a call on a question alone (`required`, a named function) is the grammar engine's job: there the model
gets no examples.
"""

import json

import jsonschema
import openai
import pytest

import openai_schema
from conftest import MODEL, user
from sse import post_stream

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TOOLS = [WEATHER]


def calls(*cities: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for c in cities
    ]}


def result(city: str, weather: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{city}", "content": weather}


# One earlier round of question, two calls, their results and the answer; then a new question.
ASK = [
    user("Weather in Paris and Berlin?")[0], calls("Paris", "Berlin"), result("Paris", "sunny"), result("Berlin", "rain"),
    {"role": "assistant", "content": "Sunny and rain."},
    user("Weather in Rome and Oslo?")[0],
]
ANSWERED = [*ASK, calls("Rome", "Oslo"), result("Rome", "cloudy"), result("Oslo", "snow")]


def ask(client, messages, **kw):
    return client.with_options(timeout=600).chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=kw.pop("max_tokens", 50), **kw
    )


@pytest.fixture(scope="module")
def called(client):
    return ask(client, ASK)


# ---- calls -------------------------------------------------------------------------------------------------


def test_a_call_comes_back_as_tool_calls_with_finish_reason_tool_calls(called):
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_parallel_calls_come_back_as_several_tool_calls_with_distinct_ids(called):
    tool_calls = called.choices[0].message.tool_calls
    assert len(tool_calls) == 2
    assert len({c.id for c in tool_calls}) == 2


def test_a_tool_call_response_follows_the_openai_spec(called):
    openai_schema.validate("CreateChatCompletionResponse", called.model_dump(exclude_unset=True))


def test_the_model_stops_being_read_once_its_calls_are_complete(called):
    # the rest of the turn is dropped, so the calls cost fewer tokens than the cap
    assert called.usage.completion_tokens < 50


def test_tool_results_are_rendered_and_answered_in_text(client):
    response = ask(client, ANSWERED, max_tokens=6)
    choice = response.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert {"cloudy", "snow"} & set(choice.message.content.lower().split())  # what the tools said reached the model


def test_parallel_tool_calls_false_gives_at_most_one_call(client):
    response = ask(client, ASK, parallel_tool_calls=False)
    assert response.choices[0].finish_reason == "tool_calls"
    assert len(response.choices[0].message.tool_calls) == 1


def test_tool_choice_none_keeps_tools_out_of_the_prompt_and_answers_in_text(client, called):
    response = ask(client, ASK, tool_choice="none", max_tokens=8)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content
    assert response.usage.prompt_tokens < called.usage.prompt_tokens


# ---- streaming ---------------------------------------------------------------------------------------------


def test_streamed_call_deltas_follow_the_spec_and_arguments_concatenate_to_json(http):
    stream = post_stream(http, {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0,
                                "max_tokens": 50, "stream": True})
    assert stream.status == 200
    for chunk in stream.chunks:
        openai_schema.validate("CreateChatCompletionStreamResponse", chunk)
    deltas = [d for c in stream.chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    indexes = sorted({d["index"] for d in deltas})
    assert indexes == [0, 1]
    for index in indexes:
        first, *rest = [d for d in deltas if d["index"] == index]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"]["name"] == "get_weather"
        assert all("id" not in d and "name" not in d.get("function", {}) for d in rest)
        arguments = "".join(d["function"].get("arguments", "") for d in [first, *rest])
        assert set(json.loads(arguments)) == {"city"}
        assert len(rest) > 1  # the arguments stream as they are generated, not in one piece at the end
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert stream.events[-1] == b"data: [DONE]"


def test_streamed_calls_match_the_non_streamed_ones(client, called):
    deltas = [d for c in ask(client, ASK, stream=True) if c.choices for d in c.choices[0].delta.tool_calls or []]
    streamed = [
        ([d.function.name for d in deltas if d.index == i and d.function.name],
         "".join(d.function.arguments or "" for d in deltas if d.index == i))
        for i in sorted({d.index for d in deltas})
    ]
    assert streamed == [([c.function.name], c.function.arguments) for c in called.choices[0].message.tool_calls]


@pytest.mark.slow
def test_each_of_n_choices_gets_its_own_calls(client, called):
    response = ask(client, ASK, n=2)
    assert [c.finish_reason for c in response.choices] == ["tool_calls", "tool_calls"]
    expected = [c.function for c in called.choices[0].message.tool_calls]
    for choice in response.choices:
        assert [c.function for c in choice.message.tool_calls] == expected  # greedy: each choice as alone


@pytest.mark.slow
def test_each_of_n_streamed_choices_gets_its_own_call_deltas_and_finish(http):
    stream = post_stream(http, {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0,
                                "max_tokens": 50, "stream": True, "n": 2})
    for index in (0, 1):
        choices = [c["choices"][0] for c in stream.chunks if c["choices"] and c["choices"][0]["index"] == index]
        deltas = [d for c in choices for d in c["delta"].get("tool_calls", [])]
        assert sorted({d["index"] for d in deltas}) == [0, 1]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]


def test_a_plain_answer_with_tools_present_streams_from_its_first_token(http):
    stream = post_stream(http, {"model": MODEL, "messages": ANSWERED, "tools": TOOLS, "temperature": 0,
                                "max_tokens": 6, "stream": True, "logprobs": True})
    first = stream.chunks[1]["choices"][0]  # the one after the role chunk
    # it carries the first token alone: nothing was held back to look for a call
    assert [entry["token"] for entry in first["logprobs"]["content"]] == [first["delta"]["content"]]
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in stream.chunks if c["choices"])


# ---- errors ------------------------------------------------------------------------------------------------


def error_of(exc_info) -> dict:
    return exc_info.value.body


def test_tool_choice_naming_an_unknown_function_is_400_naming_tool_choice(client):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, user("hi"), tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=1)
    assert error_of(info)["param"] == "tool_choice"
    assert "get_time" in error_of(info)["message"]


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "has spaces"}}], "tools[0].function.name"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
         "tools[1].function.parameters"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        ("get_weather", "tools"),
    ],
)
def test_malformed_tools_are_400_naming_the_field(http, tools, param):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi"), "tools": tools})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    openai_schema.validate("ErrorResponse", response.json())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forcing_a_call_without_tools_is_400_naming_tool_choice(client, choice):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("hi"), tool_choice=choice, max_tokens=1)
    assert error_of(info)["param"] == "tool_choice"


def test_forced_call_whose_parameters_the_grammar_cannot_enforce_is_400_naming_tools(http):
    ids = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi"), "tools": [ids],
                                                       "tool_choice": "required"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert response.json()["error"]["code"] == "unsupported_schema_feature"


def test_unknown_tool_choice_value_is_400_naming_tool_choice(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi"), "tools": TOOLS,
                                                       "tool_choice": "always"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"


def test_assistant_tool_call_with_arguments_that_are_not_json_is_400_naming_them(client):
    bad = calls("Paris")
    bad["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, [user("Weather?")[0], bad, result("Paris", "sunny")], max_tokens=1)
    assert error_of(info)["param"] == "messages[1].tool_calls[0].function.arguments"


# ---- langchain-openai ----------------------------------------------------------------------------------------


def chat_model(server, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_retries=0,
                      timeout=600, **{"max_tokens": 50, **kw})


def get_weather(city: str) -> str:
    """Current weather of a city."""
    raise AssertionError("the server only asks for the call")


@pytest.mark.slow
def test_langchain_bind_tools_invoke_returns_tool_calls(server):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    history = [
        HumanMessage("Weather in Paris and Berlin?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": c}, "id": f"call_{c}"} for c in ("Paris", "Berlin")]),
        ToolMessage("sunny", tool_call_id="call_Paris"),
        ToolMessage("rain", tool_call_id="call_Berlin"),
        AIMessage("Sunny and rain."),
        HumanMessage("Weather in Rome and Oslo?"),
    ]
    reply = chat_model(server).bind_tools([get_weather]).invoke(history)
    assert reply.tool_calls
    assert all(call["name"] == "get_weather" and set(call["args"]) == {"city"} for call in reply.tool_calls)
    assert all(call["id"].startswith("call_") for call in reply.tool_calls)


def test_tool_choice_required_forces_a_call_on_a_plain_question(client):
    response = ask(client, user("Tell me a story."), tool_choice="required", max_tokens=60)
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_named_tool_choice_forces_that_function_with_valid_arguments(client):
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
    response = client.chat.completions.create(
        model=MODEL, messages=user("Hello!"), tools=[WEATHER, time_tool], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["zone"], str)
    assert response.choices[0].finish_reason == "stop"  # OpenAI's when the request named the function


def test_a_forced_call_of_a_pydantic_tool_with_a_nested_model_validates_as_that_model(client):
    # pydantic puts the nested model in `$defs` and points at it (`#/$defs/Leg`): nested in the call's schema that
    # pointer was a 400 ("Pointer '/$defs/Leg' does not exist") for the Agents SDK's and LangChain's tools
    from pydantic import BaseModel

    class Leg(BaseModel):
        origin: str
        destination: str

    class BookFlight(BaseModel):
        outbound: Leg
        back: Leg | None

    tool = openai.pydantic_function_tool(BookFlight)
    assert "$defs" in tool["function"]["parameters"]
    response = client.chat.completions.create(
        model=MODEL, messages=user("Book me a flight."), tools=[tool], temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "BookFlight"}},
    )
    [call] = response.choices[0].message.tool_calls
    BookFlight.model_validate_json(call.function.arguments)  # raises where it is not one


def test_named_tool_choice_stream_ends_with_stop(http):
    stream = post_stream(http, {"model": MODEL, "messages": user("Hello!"), "tools": TOOLS, "temperature": 0,
                                "max_tokens": 60, "stream": True,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    deltas = [d for c in stream.chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather"
    finishes = [c["choices"][0]["finish_reason"] for c in stream.chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]


def test_langchain_bind_tools_with_forced_choice_returns_tool_calls(server):
    reply = chat_model(server, max_tokens=60).bind_tools([get_weather], tool_choice="get_weather").invoke("Hello!")
    assert reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)


@pytest.mark.slow
def test_langchain_structured_output_by_function_calling(server):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    person = chat_model(server, max_tokens=60).with_structured_output(Person, method="function_calling").invoke(
        "Invent a person."
    )
    assert isinstance(person, Person)


@pytest.mark.slow
def test_a_call_cut_short_by_max_tokens_stays_a_call_with_finish_length(client, http):
    """As OpenAI's: `finish_reason: "length"`, in a stream and not. A forced call is a grammar's JSON document,
    which is closed within the budget (issue 18): its arguments parse and validate, within max_tokens."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    # the forced call is `{"name":"get_weather","parameters":{...`: a budget that ends inside the arguments
    whole = ask(client, user("Hello!"), tool_choice=forced, max_tokens=60)
    budget = whole.usage.completion_tokens - 2
    response = ask(client, user("Hello!"), tool_choice=forced, max_tokens=budget)
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens <= budget
    [call] = choice.message.tool_calls
    full = whole.choices[0].message.tool_calls[0].function.arguments
    assert call.function.name == "get_weather" and call.function.arguments != full
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    stream = post_stream(http, {"model": MODEL, "messages": user("Hello!"), "tools": TOOLS, "temperature": 0,
                                "max_tokens": budget, "stream": True, "tool_choice": forced})
    deltas = [d for c in stream.chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(d["function"].get("arguments", "") for d in deltas) == call.function.arguments
    finishes = [c["choices"][0]["finish_reason"] for c in stream.chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
