"""Forced tool calls on the default model, unseeded, many at once (issue 42): every call holds to the parameters
its tool declares (no other key), its integers stay within +-9e18, and it ends as a call, not at `length`.

Unseeded sampling at temperature 1 is where the tiny model strays: with JSON Schema's default (any other key,
any value) 2 calls in 40 came back with a key the tool does not have and digits that ran to `max_tokens`. One call
per answer (`parallel_tool_calls: false`) and a `maxLength` on the city keep every valid call well inside
`max_tokens`, so a `length` here can only be a grammar that let the call run on.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from conftest import MODEL, user
from openai_schema import validate

pytestmark = pytest.mark.slow

CITY = {"type": "string", "maxLength": 32}
PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
    "forecast": {"type": "object", "properties": {"city": CITY, "days": {"type": "integer"}}, "required": ["city", "days"]},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS["get_weather"]}},
    {"type": "function", "function": {"name": "forecast", "description": "Forecast for some days", "parameters": PARAMETERS["forecast"]}},
]
QUESTIONS = ["What's the weather in Paris?", "Tell me a story.", "Forecast for Oslo, 3 days.", "hi", "How many days until rain in Rome?"]
INTEGER_BOUND = 9 * 10**18


def test_100_unseeded_forced_calls_are_calls_that_hold_to_the_declared_parameters(client):
    def ask(question):
        return client.with_options(timeout=600).chat.completions.create(
            model=MODEL, messages=user(question), tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            n=4, max_tokens=128,
        )

    with ThreadPoolExecutor(16) as pool:  # 16 sequences at once: the engine batches them, and none waits past the idle timeout
        choices = [choice for response in pool.map(ask, QUESTIONS * 5) for choice in response.choices]
    assert len(choices) == 100
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, {**PARAMETERS[call.function.name], "additionalProperties": False})
        assert all(abs(v) <= INTEGER_BOUND for v in arguments.values() if isinstance(v, int)), arguments


# ---- `allowed_tools`: the model may call only some of `tools` ---------------------------------------------


def allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def test_allowed_tools_required_calls_only_an_allowed_tool_in_chat_and_responses(http):
    body = {"model": MODEL, "messages": user("What's the weather in Paris?"), "tools": TOOLS, "n": 4, "max_tokens": 64,
            "tool_choice": allowed("required", "forecast"), "parallel_tool_calls": False}
    raw = http.post("/v1/chat/completions", json=body)
    assert raw.status_code == 200, raw.text
    validate("CreateChatCompletionResponse", raw.json())
    for choice in raw.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "forecast"
        jsonschema.validate(json.loads(call["function"]["arguments"]), {**PARAMETERS["forecast"], "additionalProperties": False})
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    response = http.post("/v1/responses", json={"model": MODEL, "input": "Forecast for Oslo, 3 days.", "tools": flat,
                                                "tool_choice": choice, "max_output_tokens": 64, "parallel_tool_calls": False})
    assert response.status_code == 200, response.text
    validate("Response", response.json())
    assert response.json()["tool_choice"] == choice, "echoed as sent"
    assert [(item["type"], item["name"]) for item in response.json()["output"]] == [("function_call", "get_weather")]


def test_allowed_tools_auto_offers_the_model_only_the_allowed_tools(client):
    """The prompt is the one a request declaring only the allowed tools gets (the model is not shown what it may not
    call), so the greedy answer is the same too."""
    ask = {"model": MODEL, "messages": user("What's the weather in Paris?"), "max_tokens": 24, "temperature": 0}
    narrowed = client.chat.completions.create(**ask, tools=TOOLS, tool_choice=allowed("auto", "get_weather"))
    alone = client.chat.completions.create(**ask, tools=TOOLS[:1], tool_choice="auto")
    both = client.chat.completions.create(**ask, tools=TOOLS, tool_choice="auto")
    assert narrowed.usage.prompt_tokens == alone.usage.prompt_tokens < both.usage.prompt_tokens
    assert narrowed.choices[0].message == alone.choices[0].message


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"tool_choice": allowed("required", "get_weather", "nowhere")}, "tool_choice.allowed_tools.tools[1]"),
    ("/v1/chat/completions", {"tool_choice": allowed("auto")}, "tool_choice.allowed_tools.tools"),
    ("/v1/chat/completions", {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "often", "tools": []}}}, "tool_choice.allowed_tools.mode"),
    ("/v1/chat/completions", {"tools": None, "tool_choice": allowed("auto", "get_weather")}, "tool_choice"),
    ("/v1/responses", {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "x"}]}}, "tool_choice.tools[0]"),
    ("/v1/responses", {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "server_label": "x"}]}}, "tool_choice.tools[0].type"),
])
def test_a_bad_allowed_tools_choice_is_400_naming_its_field(http, path, body, param):
    base = ({"messages": user("hi"), "tools": TOOLS} if path == "/v1/chat/completions"
            else {"input": "hi", "tools": [{"type": "function", **t["function"]} for t in TOOLS]})
    response = http.post(path, json={"model": MODEL, "max_tokens" if "chat" in path else "max_output_tokens": 4, **base, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_a_forced_call_the_budget_ends_before_its_arguments_open_is_a_call_not_content(http):
    """`max_tokens` smaller than the call's own frame (`[{"name":"get_weather","parameters":` is 8 tokens): a call
    with its arguments cut short (`""`) and `length`, as OpenAI's, never the frame as content."""
    body = {"model": MODEL, "messages": user("What's the weather in Paris?"), "tools": TOOLS[:1], "tool_choice": "required",
            "max_tokens": 8, "temperature": 0}
    message = http.post("/v1/chat/completions", json=body).json()
    validate("CreateChatCompletionResponse", message)
    choice = message["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [("get_weather", "")]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    assert [(t["function"]["name"], t["function"]["arguments"]) for d in deltas for t in d.get("tool_calls", [])] == [("get_weather", "")]
    response = http.post("/v1/responses", json={"model": MODEL, "input": "What's the weather in Paris?", "temperature": 0,
                                                "tools": [{"type": "function", **TOOLS[0]["function"]}],
                                                "tool_choice": "required", "max_output_tokens": 8}).json()
    validate("Response", response)
    assert [(i["type"], i["name"], i["arguments"], i["status"]) for i in response["output"]] == [("function_call", "get_weather", "", "incomplete")]
