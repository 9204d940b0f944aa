"""Constrained output always terminates and parses (issue 18 item 3): a catalogue of schema/prompt pairs on the
real embedded model, greedy and sampled, with small token budgets. Every answer must parse (no object with a
repeated key), validate against its schema, and end with `stop` or `length` (a document closed early to fit
its budget still reports `length`). Forced tool calls too: their arguments validate against `parameters`."""

import asyncio
import json

import jsonschema
import pytest

from conftest import MODEL, user

pytestmark = pytest.mark.slow

OBJ = {"type": "object"}


def obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS = [  # (name, schema, prompt); None: json_object
    ("object", None, "Give me a JSON object."),
    ("object-colors", None, "List the colors of a cat as a JSON object."),
    ("object-person", None, "Describe a person in JSON."),
    ("object-config", None, "Write a JSON config file for a web server."),
    ("object-empty-prompt", None, "{"),
    ("integer", obj({"n": {"type": "integer"}}), "Pick a huge number."),
    ("integers", obj({"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}), "Count to a billion."),
    ("number", obj({"x": {"type": "number"}}), "What is pi to many digits?"),
    ("numbers", {"type": "array", "items": {"type": "number"}}, "The first digits of e, as numbers."),
    ("bounded-int", obj({"age": {"type": "integer", "minimum": 0, "maximum": 130}}), "How old is the oldest tree?"),
    ("enum", obj({"color": {"enum": ["red", "green", "blue"]}}), "Favorite color?"),
    ("enum-numbers", obj({"level": {"enum": [1, 2, 3, 5, 8]}}), "Priority?"),
    ("const", obj({"kind": {"const": "cat"}, "name": {"type": "string"}}), "Name a cat."),
    ("boolean", obj({"ok": {"type": "boolean"}, "why": {"type": "string", "maxLength": 40}}), "Is water wet?"),
    ("null-union", obj({"v": {"type": ["string", "null"]}}), "Nothing."),
    ("string", obj({"text": {"type": "string"}}), "Write a very long story."),
    ("string-bounded", obj({"word": {"type": "string", "minLength": 3, "maxLength": 10}}), "One word."),
    ("pattern", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}), "A zip code."),
    ("format-date", obj({"when": {"type": "string", "format": "date"}}), "When was the moon landing?"),
    ("array-min-max", obj({"tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}}), "Tags for a blog post."),
    ("array-min-only", {"type": "array", "items": {"type": "integer"}, "minItems": 3}, "Many numbers."),
    ("array-of-objects", {"type": "array", "items": obj({"id": {"type": "integer"}, "name": {"type": "string"}}), "maxItems": 3}, "Users."),
    ("array-unbounded-strings", {"type": "array", "items": {"type": "string"}}, "Every word you know."),
    ("nested", obj({"user": obj({"name": {"type": "string"}, "address": obj({"city": {"type": "string"}, "zip": {"type": "string"}})})}), "A user record."),
    ("deep", obj({"a": obj({"b": obj({"c": obj({"d": {"type": "array", "items": {"type": "integer"}}})})})}), "Nest deeply."),
    ("optional-props", obj({"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}, required=[]), "Anything."),
    ("additional-props", {"type": "object", "additionalProperties": {"type": "integer"}}, "Word counts of a text."),
    ("anyof", obj({"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}}), "A value."),
    ("ref", {"$defs": {"p": obj({"x": {"type": "number"}, "y": {"type": "number"}})}, **obj({"from": {"$ref": "#/$defs/p"}, "to": {"$ref": "#/$defs/p"}})}, "A line segment."),
    ("recursive", {"$defs": {"t": obj({"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}})}, "$ref": "#/$defs/t"}, "A tree."),
    ("many-required", obj({f"f{i}": {"type": "string"} for i in range(4)}), "Fill in the form."),
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
           "parameters": obj({"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}})}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web",
          "parameters": obj({"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}})}}
TOOL_CASES = [  # (name, tools, tool_choice, parallel, prompt)
    ("required-one", [WEATHER], "required", True, "Weather in Paris for three days?"),
    ("required-two", [WEATHER, SEARCH], "required", True, "Search for cats and get the weather in Rome."),
    ("named", [WEATHER, SEARCH], {"type": "function", "function": {"name": "search"}}, False, "Find the tallest building."),
    ("required-no-parallel", [SEARCH], "required", False, "Look up everything about everything."),
]
RUNS = [({"temperature": 0}, 48), ({"temperature": 1, "seed": 7}, 32)]  # (sampling, max_tokens)


def no_repeated_keys(pairs):
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key: {keys}"
    return dict(pairs)


async def one_schema(client, name, schema, prompt, sampling, max_tokens):
    response_format = ({"type": "json_object"} if schema is None
                       else {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": schema, "strict": True}})
    reply = await client.chat.completions.create(model=MODEL, messages=user(prompt), response_format=response_format,
                                                 max_tokens=max_tokens, **sampling)
    choice = reply.choices[0]
    where = f"{name} {sampling} max_tokens={max_tokens}: {choice.message.content!r}"
    assert choice.finish_reason in ("stop", "length"), where
    assert reply.usage.completion_tokens <= max_tokens, where
    try:
        document = json.loads(choice.message.content, object_pairs_hook=no_repeated_keys)
        jsonschema.validate(document, OBJ if schema is None else schema)
    except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
        raise AssertionError(f"{where}\n{exc}") from None
    return choice.finish_reason


async def one_tool_case(client, name, tools, tool_choice, parallel, prompt, sampling, max_tokens):
    reply = await client.chat.completions.create(model=MODEL, messages=user(prompt), tools=tools, tool_choice=tool_choice,
                                                 parallel_tool_calls=parallel, max_tokens=max_tokens, **sampling)
    choice = reply.choices[0]
    where = f"{name} {sampling} max_tokens={max_tokens}: {choice.message}"
    assert choice.finish_reason in ("tool_calls", "stop", "length"), where
    assert choice.message.tool_calls, where
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for call in choice.message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments, object_pairs_hook=no_repeated_keys)
            jsonschema.validate(arguments, parameters[call.function.name])
        except (ValueError, AssertionError, jsonschema.ValidationError, KeyError) as exc:
            raise AssertionError(f"{where}\n{exc}") from None
    if isinstance(tool_choice, dict):
        assert {call.function.name for call in choice.message.tool_calls} == {tool_choice["function"]["name"]}, where
    if not parallel:
        assert len(choice.message.tool_calls) == 1, where
    return choice.finish_reason


def test_every_constrained_answer_parses_and_validates(async_client):
    assert len(SCHEMAS) + len(TOOL_CASES) >= 30
    jobs = [(one_schema, (name, schema, prompt)) for name, schema, prompt in SCHEMAS]
    jobs += [(one_tool_case, case) for case in TOOL_CASES]

    async def run_all():
        limit = asyncio.Semaphore(16)

        async def bounded(fn, args, sampling, max_tokens):
            async with limit:
                return await fn(async_client, *args, sampling, max_tokens)

        return await asyncio.gather(*(bounded(fn, args, sampling, max_tokens)
                                      for fn, args in jobs for sampling, max_tokens in RUNS),
                                    return_exceptions=True)

    results = asyncio.run(run_all())
    failures = [str(r) for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of {len(results)} answers broke their promise:\n" + "\n\n".join(failures)
    assert "length" in results  # the small budgets did cut some documents, which still parsed
