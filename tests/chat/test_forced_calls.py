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
