"""The Gemma-3 tool prompt, the call parser and the streaming splitter (`oai_gemma/chat/tools.py`), pure."""

import json

import jsonschema
import llguidance
import pytest

from oai_gemma.chat import render_chat
from oai_gemma.chat.tools import (
    MAX_FORCED_CALLS,
    CallDelta,
    Function,
    ParsedCall,
    ToolCallStream,
    calls_schema,
    closed,
    parse_tool_calls,
    render_tool_calls,
    tool_prompt,
)

NAMES = frozenset({"get_weather", "add"})
WEATHER = ParsedCall("get_weather", {"city": "Paris"})
ADD = ParsedCall("add", {"a": 1, "b": 2})
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = [
    Function("get_weather", "Current weather of a city", WEATHER_SCHEMA),
    Function("add", None, {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
]


# ---- whole answers ---------------------------------------------------------------------------------------


def test_json_object_is_one_call():
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}', NAMES) == [WEATHER]


def test_json_list_is_several_calls_in_order():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {"a": 1, "b": 2}}]'
    assert parse_tool_calls(text, NAMES) == [WEATHER, ADD]


def test_arguments_key_and_arguments_as_json_text_are_accepted():
    text = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
    assert parse_tool_calls(text, NAMES) == [WEATHER]


def test_python_style_list_is_parsed_with_json_literals():
    text = '[get_weather(city="Paris"), add(a=1, b=2, exact=true, note=None)]'
    assert parse_tool_calls(text, NAMES) == [WEATHER, ParsedCall("add", {"a": 1, "b": 2, "exact": True, "note": None})]


def test_bare_python_style_call_is_parsed():
    assert parse_tool_calls("get_weather(city='Paris')", NAMES) == [WEATHER]


@pytest.mark.parametrize("language", ["", "json", "tool_code", "python"])
def test_calls_inside_a_code_fence_are_parsed(language):
    assert parse_tool_calls(f'```{language}\n[get_weather(city="Paris")]\n```', NAMES) == [WEATHER]


def test_leading_whitespace_and_trailing_text_do_not_hide_the_call():
    assert parse_tool_calls('\n  {"name": "add", "parameters": {"a": 1, "b": 2}}\nDone!', NAMES) == [ADD]


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        "Sure: [get_weather(city='Paris')]",  # a call must open the answer
        '{"name": "delete_everything", "parameters": {}}',  # not one of the tools
        "[1, 2, 3]",
        '{"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1}',
        "get_weather('Paris')",  # positional arguments cannot be named
        '```js\n{"name": "get_weather", "parameters": {}}\n```',
        "",
    ],
)
def test_text_that_is_not_a_call_of_a_tool_is_none(text):
    assert parse_tool_calls(text, NAMES) is None


def test_a_call_cut_short_is_none():
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Par', NAMES) is None


def test_without_parallel_only_the_first_call_is_kept():
    assert parse_tool_calls("[get_weather(city='Paris'), add(a=1, b=2)]", NAMES, parallel=False) == [WEATHER]


def test_arguments_json_is_valid_json_of_the_arguments():
    call = ParsedCall("get_weather", {"city": "Zürich", "days": [1, 2]})
    assert json.loads(call.arguments_json) == call.arguments


# ---- streaming -------------------------------------------------------------------------------------------


def run_stream(text: str, step: int = 1, parallel: bool = True) -> list:
    """Feed `text` in pieces of `step` characters; (position, output) for every output, then ("end", output)."""
    stream, out = ToolCallStream(NAMES, parallel=parallel), []
    for i in range(0, len(text), step):
        emitted = stream.feed(text[i : i + step])
        if emitted:
            out.append((i, emitted))
        if stream.done:
            break
    out.append(("end", stream.finish()))
    return out


def streamed_calls(out: list) -> list[tuple[str, str]]:
    """(name, arguments text) per call, put together from the stream's CallDeltas as a client would."""
    calls: dict[int, list[str]] = {}
    for _, pieces in out:
        for piece in pieces:
            if isinstance(piece, CallDelta):
                if piece.name is not None:
                    assert piece.index == len(calls)  # a call's first delta names it; calls start in order
                    calls[piece.index] = [piece.name, ""]
                calls[piece.index][1] += piece.arguments
    return [tuple(call) for _, call in sorted(calls.items())]


def test_plain_text_passes_through_from_its_first_piece():
    out = run_stream("The weather is nice.", step=4)
    assert out[0] == (0, ["The "])
    assert "".join(p for _, pieces in out for p in pieces) == "The weather is nice."


def test_a_word_that_starts_like_a_tool_name_is_held_only_until_it_differs():
    out = run_stream("get the weather", step=1)
    assert out[0] == (4, ["get t"])
    assert "".join(p for _, pieces in out for p in pieces) == "get the weather"


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize(
    "text",
    ['{"name": "get_weather", "parameters": {"city": "Paris"}}', '```json\n[{"name": "get_weather", "parameters": {"city": "Paris"}}]\n```'],
)
def test_a_json_call_streams_its_arguments_as_they_are_written(text, step):
    out = run_stream(text + "\nAnd some rambling after it.", step=step)
    assert streamed_calls(out) == [("get_weather", '{"city": "Paris"}')]
    assert all(isinstance(p, CallDelta) for _, pieces in out for p in pieces)
    if step == 1:  # the name first (with the arguments' opening brace), then the arguments bit by bit
        first = out[0]
        assert first[0] == text.index('{"city"') and first[1] == [CallDelta(0, "get_weather", "{")]
        assert len(out) > len('{"city": "Paris"}') / 2


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_python_style_call_is_held_back_and_sent_whole_once_complete(step):
    text = '  [get_weather(city="Paris")]'
    out = run_stream(text + " and more", step=step)
    assert [p for _, pieces in out for p in pieces] == [CallDelta(0, "get_weather", '{"city": "Paris"}')]
    assert out[0][0] != "end"  # recognised while streaming, before the generation ended


def test_several_json_calls_stream_one_after_the_other():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {"a": 1, "b": 2}}]'
    out = run_stream(text, step=3)
    assert streamed_calls(out) == [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]


def test_the_name_after_the_arguments_starts_the_call_with_the_arguments_so_far():
    out = run_stream('{"parameters": {"a": 1, "b": 2}, "name": "add"}', step=1)
    assert streamed_calls(out) == [("add", '{"a": 1, "b": 2}')]


def test_partial_json_literals_and_numbers_keep_a_call_pending():
    text = '{"name": "add", "parameters": {"a": -1.5e+3, "b": true, "c": null, "d": false}}'
    stream = ToolCallStream(NAMES)
    pieces = [p for ch in text for p in stream.feed(ch)]
    assert stream.done and stream.complete
    assert stream.calls == [ParsedCall("add", {"a": -1500.0, "b": True, "c": None, "d": False})]
    assert "".join(p.arguments for p in pieces) == text[text.index('{"a"') : -1]


ESCAPED_CITIES = [
    "2017-08-09T19:23:35.+0\\u00b0",  # issue 42's failure: a \uXXXX escape that came in pieces broke the call off
    "a\\\\",  # an escaped backslash right before the closing quote
    "\\\\\\\"\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00",  # every escape, and a surrogate pair
    "x" * 30 + "\\\\",  # 32 characters of value (a maxLength of 32), 33 of text
]


@pytest.mark.parametrize("city", ESCAPED_CITIES)
def test_a_call_whose_strings_hold_escapes_is_complete_wherever_the_pieces_split_it(city):
    """Split in two at every point and fed char by char: an escape cut anywhere (`\\`, `\\u`, `\\u00`) keeps the
    call pending, and the call ends complete with the arguments exactly as written."""
    arguments = '{"city":"' + city + '"}'
    text = '{"name":"get_weather","parameters":' + arguments + "}"
    assert json.loads(arguments)["city"] == json.loads('"' + city + '"')
    splits = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for pieces in splits:
        stream = ToolCallStream(NAMES, parallel=False)
        out = [(i, stream.feed(piece)) for i, piece in enumerate(pieces)]
        assert stream.done and stream.complete, pieces
        assert stream.calls == [ParsedCall("get_weather", json.loads(arguments))]
        assert streamed_calls(out) == [("get_weather", arguments)] == [(c.name, c.arguments_json) for c in stream.calls]


def test_arguments_as_a_json_string_are_sent_whole_once_complete():
    out = run_stream('{"name": "add", "arguments": "{\\"a\\": 1}"}', step=2)
    assert streamed_calls(out) == [("add", '{"a": 1}')]


@pytest.mark.parametrize("text", ['{"answer": 42}', '{"answer": "\\u12g4"}'])
def test_a_held_back_answer_that_is_no_call_comes_out_whole_as_text(text):
    out = run_stream(text, step=3)
    assert "".join(p for _, pieces in out for p in pieces) == text
    assert out[0][0] != "end"  # recognised while streaming (an invalid \u escape is no escape cut short)


def test_a_call_cut_short_after_it_started_stays_a_call_with_the_arguments_sent():
    text = '{"name": "get_weather", "parameters": {"ci'
    stream = ToolCallStream(NAMES)
    pieces = [p for i in range(0, len(text), 5) for p in stream.feed(text[i : i + 5])]
    assert stream.finish() == []
    assert stream.done and not stream.complete
    assert stream.calls == [ParsedCall("get_weather", {})]
    assert stream.calls[0].arguments_json == '{"ci' == "".join(p.arguments for p in pieces)


def test_a_call_that_breaks_off_mid_stream_ends_there():
    stream = ToolCallStream(NAMES)
    for ch in '{"name": "add", "parameters": {"a": 1}, "oops": 2}':
        stream.feed(ch)
    assert stream.done and not stream.complete
    assert stream.calls[0].name == "add"


def test_an_unfinished_call_whose_arguments_never_opened_is_text():
    text = '{"name": "get_weather", "param'
    assert run_stream(text, step=5)[-1] == ("end", [text])


@pytest.mark.parametrize("text, calls", [
    ('[{"name":"get_weather","parameters":', [ParsedCall("get_weather", {})]),
    ('{"name": "add", "param', [ParsedCall("add", {})]),
    ('[{"name":"get_we', []),
])
def test_a_forced_answer_cut_before_its_arguments_open_is_a_call_with_no_arguments_or_nothing(text, calls):
    """A grammar held the answer to calls (`tool_choice` required or named): the budget's end is never content."""
    stream = ToolCallStream(NAMES, forced=True)
    pieces = [p for i in range(0, len(text), 5) for p in stream.feed(text[i : i + 5])]
    pieces += stream.finish()
    assert not [p for p in pieces if isinstance(p, str)], pieces
    assert stream.done and not stream.complete and stream.calls == calls
    assert [(p.name, p.arguments) for p in pieces] == [(c.name, "") for c in calls]


def test_a_code_fence_in_another_language_streams_as_text_early():
    out = run_stream("```python\nprint(1)\n```", step=1)
    assert out[0][0] <= len("```python\np")


def test_streaming_without_parallel_emits_one_call():
    out = run_stream("[get_weather(city='Paris'), add(a=1, b=2)]", step=3, parallel=False)
    assert streamed_calls(out) == [("get_weather", '{"city": "Paris"}')]
    json_out = run_stream('[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {}}]', parallel=False)
    assert streamed_calls(json_out) == [("add", '{"a": 1}')]


# ---- prompt, rendering, forcing ----------------------------------------------------------------------------


def test_tool_prompt_lists_every_definition_as_json():
    prompt = tool_prompt(FUNCTIONS)
    listed = json.loads(prompt[prompt.index("[\n") :])
    assert [d["name"] for d in listed] == ["get_weather", "add"]
    assert listed[0]["parameters"] == WEATHER_SCHEMA
    assert "description" not in listed[1]


def test_tool_prompt_without_parallel_asks_for_one_call():
    assert "JSON list" in tool_prompt(FUNCTIONS)
    assert "JSON list" not in tool_prompt(FUNCTIONS, parallel=False)


def test_tool_prompt_opens_the_first_user_turn_after_the_system_text():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    rendered = render_chat(messages, tool_prompt=tool_prompt(FUNCTIONS)).prompt
    assert rendered.startswith("<bos><start_of_turn>user\nBe brief.\n\n" + tool_prompt(FUNCTIONS) + "\n\nWeather in Paris?")


def test_assistant_tool_calls_render_in_the_prompted_format_and_parse_back():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    text = render_tool_calls([call])
    assert parse_tool_calls(text, NAMES) == [WEATHER]


def test_several_assistant_tool_calls_render_as_a_list():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
    ]
    assert parse_tool_calls(render_tool_calls(calls), NAMES) == [WEATHER, ADD]


def test_multi_turn_with_tool_results_renders_calls_and_output_blocks():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    rendered = render_chat(messages).prompt
    assert rendered == (
        "<bos><start_of_turn>user\nWeather in Paris?<end_of_turn>\n"
        '<start_of_turn>model\n{"name": "get_weather", "parameters": {"city": "Paris"}}<end_of_turn>\n'
        "<start_of_turn>user\n```tool_output\nsunny, 21 C\n```<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_forced_schema_of_one_function_accepts_exactly_its_call():
    schema = calls_schema(FUNCTIONS[:1], parallel=False)
    jsonschema.validate({"name": "get_weather", "parameters": {"city": "Paris"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "parameters": {"city": "Paris"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {}}, schema)


def test_forced_schema_refuses_parameters_the_tool_does_not_declare():
    # issue 42: JSON Schema's default (`additionalProperties` absent: any key) let the model add `":":5005571...`
    schema = calls_schema(FUNCTIONS[:1], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"city": "Paris", ":": 5}}, schema)
    with pytest.raises(jsonschema.ValidationError):  # a function without parameters: `{}` only
        jsonschema.validate({"name": "f", "parameters": {"x": 1}}, calls_schema([Function("f")], parallel=False))


def test_closed_closes_every_object_that_does_not_say_otherwise():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "at": point, "path": {"type": "array", "items": point}, "either": {"anyOf": [point, {"type": "null"}]},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}}, "free": {"type": "object", "additionalProperties": True},
            "properties": {"type": "object"},  # a parameter named like a keyword is a parameter
            "both": {"allOf": [point, {"properties": {"y": {"type": "integer"}}}]},
            "ref": {"$ref": "#/$defs/point"},
            "mixed": {"allOf": [{"$ref": "#/$defs/point"}, {"$ref": "#/$defs/label"}]},
            "kind": {"enum": [{"type": "object"}]},  # data, not a schema: untouched
        },
        "$defs": {"point": point, "label": {"type": "object", "properties": {"text": {"type": "string"}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["at"]["additionalProperties"] is False and props["path"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["tags"]["additionalProperties"] == {"type": "string"} and props["free"]["additionalProperties"] is True
    assert props["properties"] == {"type": "object", "additionalProperties": False}
    assert all("additionalProperties" not in member for member in props["both"]["allOf"])  # each sees its own only
    assert "additionalProperties" not in props["ref"] and "additionalProperties" not in out["$defs"]["label"]
    assert "additionalProperties" not in out["$defs"]["point"]  # an allOf member, by $ref
    assert props["kind"] == {"enum": [{"type": "object"}]} and "additionalProperties" not in schema  # the declared one unchanged
    jsonschema.validate({"both": {"x": 1, "y": 2}, "free": {"any": [1]}, "mixed": {"x": 1, "text": "a"}}, out)
    closed_point = closed({"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "$defs": {"point": point}})
    assert closed_point["$defs"]["point"]["additionalProperties"] is False  # a $ref outside any allOf: closed


def test_forced_schema_with_parallel_is_a_non_empty_list_of_any_tool_call():
    schema = calls_schema(FUNCTIONS, parallel=True)
    answer = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {"a": 1, "b": 2}}]
    jsonschema.validate(answer, schema)
    assert parse_tool_calls(json.dumps(answer), NAMES) == [WEATHER, ADD]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):  # a looping list ends: at most MAX_FORCED_CALLS calls
        jsonschema.validate([answer[0]] * (MAX_FORCED_CALLS + 1), schema)


LEG = {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}}, "required": ["from", "to"]}
BOOK = Function("book", parameters={  # as pydantic writes a model with a nested one
    "type": "object", "properties": {"leg": {"$ref": "#/$defs/Leg"}, "back": {"anyOf": [{"$ref": "#/$defs/Leg"}, {"type": "null"}]},
                                     "note": {"const": {"$ref": "#/data"}}},
    "required": ["leg"], "$defs": {"Leg": LEG},
})
TREE = Function("tree", parameters={
    "type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["value"],
})


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_schema_keeps_what_the_parameters_refs_point_at(parallel):
    # pydantic's `#/$defs/Leg` and a tree's `#` mean the parameters' own root: nested in the call's schema they
    # pointed at the call's root (a 400 "Pointer '/$defs/Leg' does not exist", a tree whose children were calls)
    schema = calls_schema([BOOK, TREE], parallel=parallel)
    good = [{"name": "book", "parameters": {"leg": {"from": "A", "to": "B"}, "back": None}},
            {"name": "tree", "parameters": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}}]
    bad = [{"name": "book", "parameters": {"leg": {"from": "A"}}},
           {"name": "tree", "parameters": {"value": 1, "children": [{"name": "tree", "parameters": {"value": 2}}]}}]
    for call in good:
        jsonschema.validate([call] if parallel else call, schema)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([call] if parallel else call, schema)
    assert '"note":{"const":{"$ref":"#/data"}}' in json.dumps(schema, separators=(",", ":")), "data stays as sent"
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema, {})) == ""


def test_forced_schema_of_parameters_without_refs_is_inline_as_before():
    schema = calls_schema(FUNCTIONS[:1], parallel=False)
    assert "$defs" not in schema and schema["properties"]["parameters"]["properties"]["city"] == {"type": "string"}
