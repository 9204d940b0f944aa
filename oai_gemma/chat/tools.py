"""Function calling for Gemma-3, which has no tool tokens: the tools are described in the prompt and the calls
are recognised in the generated text.

The format is the JSON variant of Google's documented Gemma function-calling prompt
(ai.google.dev/gemma/docs/capabilities/function-calling): the definitions, as JSON, open the first user turn with
an instruction to answer a call with nothing but `{"name": function name, "parameters": {argument: value}}`;
several calls are a JSON list of those. An assistant turn with `tool_calls` is rendered back in that same format,
and a `tool` message is a ```` ```tool_output ```` block in a user turn (Google's convention for results), so a
multi-turn conversation reads to the model as the prompt promised. When a grammar forces a call, it forces this
same format (`calls_schema`), so forced and free calls parse, stream and re-render alike.

The parser and the streaming splitter are in `tool_parser.py` and `tool_stream.py` (re-exported here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from ..engine.sampling.json_document import map_subschemas, schema_types
from .messages import ToolCall
from .tool_parser import ParsedCall, parse_tool_calls
from .tool_stream import CallDelta, ToolCallStream

__all__ = [
    "CallDelta", "Function", "ParsedCall", "ToolCallStream", "calls_schema", "closed", "parse_tool_calls", "render_tool_calls",
    "render_tool_result", "tool_prompt", "ToolPlan",
]

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_COMPOSED = frozenset({"allOf", "anyOf", "oneOf", "$ref"})
MAX_FORCED_CALLS = 16
"""The most calls one forced answer holds (OpenAI states no limit; 16 keeps a looping list within 1024 tokens)."""


@dataclass(frozen=True)
class Function:
    """One tool the request offers (OpenAI's `tools[i].function`, already validated)."""

    name: str
    description: str | None = None
    parameters: dict | None = None


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the answer (wire-independent: chat completions and Responses both make one)."""

    functions: list[Function]
    """Every tool of the request, all offered in the prompt."""
    forced: list[Function] | None
    """The functions one of which must be called (`required`: all; named: that one), None with `auto`."""
    parallel: bool
    """Several calls in one answer allowed (never with a named function)."""
    named: bool = False
    """`tool_choice` named the function."""

    def finish_reason(self, calls: ToolCallStream, event_finish: str | None) -> str:
        """OpenAI's for an answer that is calls: `stop` when the request named the function, else `tool_calls`;
        calls cut short by the generation's end keep its reason (`length`, as OpenAI's), also when the grammar
        closed the call early to fit the token budget (complete then, and still `length`)."""
        if event_finish == "length" or (not calls.complete and event_finish is not None):
            return event_finish
        return "stop" if self.named else "tool_calls"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def prompt(self) -> str:
        must_call = None
        if self.forced is not None:
            must_call = self.forced[0].name if len(self.forced) == 1 else ""
        return tool_prompt(self.functions, parallel=self.parallel, must_call=must_call)

    def forced_schema(self) -> dict | None:
        """The JSON schema a grammar holds the answer to, or None when the model may answer in prose."""
        return None if self.forced is None else calls_schema(self.forced, parallel=self.parallel)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.names, parallel=self.parallel, forced=self.forced is not None)


# ---- prompt ------------------------------------------------------------------------------------------


def tool_prompt(functions: list[Function], *, parallel: bool = True, must_call: str | None = None) -> str:
    """The instruction and the definitions that open the first user turn.

    `must_call`: a function's name (a named `tool_choice`) or "" for any of them (`required`).
    """
    definitions = []
    for f in functions:
        definition: dict[str, Any] = {"name": f.name}
        if f.description:
            definition["description"] = f.description
        definition["parameters"] = f.parameters or EMPTY_PARAMETERS
        definitions.append(json.dumps(definition, ensure_ascii=False))
    several = (
        "To call several functions at once, answer with a JSON list of such objects.\n"
        if parallel else "Call at most one function at a time.\n"
    )
    return (
        "You have access to functions. If you decide to invoke a function, answer with only a JSON object in "
        "the format\n"
        '{"name": function name, "parameters": dictionary of argument name and its value}\n'
        f"{several}"
        "Do not write any other text in a response that calls a function.\n"
        "The functions you can call, in JSON:\n"
        "[\n" + ",\n".join(definitions) + "\n]"
        + _obligation(must_call)
    )


def _obligation(must_call: str | None) -> str:
    if must_call is None:
        return ""
    if must_call:
        return f"\nAnswer with a call of the function {must_call}."
    return "\nAnswer with a call of one of these functions."


class MalformedToolCall(ValueError):
    """Call `index` of a message's `tool_calls` is malformed at `field` (`name`, `arguments`)."""

    def __init__(self, index: int, field: str):
        super().__init__(f"tool_calls[{index}].function.{field}")
        self.index = index
        self.field = field


def render_tool_calls(tool_calls: list[ToolCall] | list[dict]) -> str:
    """An assistant message's OpenAI `tool_calls` as the model would have written them.

    Raises MalformedToolCall (a ValueError naming the field, relative to the message) when a call is malformed.
    """
    rendered = []
    for j, call in enumerate(tool_calls):
        name, arguments = _name_and_arguments(call, j)
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise MalformedToolCall(j, "arguments") from None
        if not isinstance(parsed, dict):
            raise MalformedToolCall(j, "arguments")
        rendered.append({"name": name, "parameters": parsed})
    return json.dumps(rendered[0] if len(rendered) == 1 else rendered, ensure_ascii=False)


def _name_and_arguments(call: ToolCall | dict, j: int) -> tuple[str, str]:
    if not isinstance(call, ToolCall):  # a plain dict (a notebook, a test): typed here, once
        try:
            call = msgspec.convert(call, ToolCall)
        except msgspec.ValidationError:
            raise MalformedToolCall(j, "name") from None
    if not call.function.name:
        raise MalformedToolCall(j, "name")
    return call.function.name, call.function.arguments


def render_tool_result(text: str) -> str:
    return f"```tool_output\n{text.strip()}\n```"


# ---- forcing a call ----------------------------------------------------------------------------------


def calls_schema(functions: list[Function], *, parallel: bool) -> dict:
    """The JSON schema of the answers that are calls of `functions`, in the prompt's format.

    One function (a named `tool_choice`): that call. Several (`required`): any one of them. With `parallel`, a
    list of 1 to MAX_FORCED_CALLS such calls (a small model would otherwise repeat calls until the budget ends).
    """
    options, moved = [], {}
    for i, f in enumerate(functions):
        parameters = closed(f.parameters or EMPTY_PARAMETERS)
        name = f"oai_gemma_parameters_{i}"
        rebased = rebase_refs(parameters, f"#/$defs/{name}")
        if rebased != parameters:  # its `$ref`s point into itself: it moves to the document's `$defs`, they follow
            moved[name], parameters = rebased, {"$ref": f"#/$defs/{name}"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": f.name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    call = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_FORCED_CALLS} if parallel else call
    return {**schema, "$defs": moved} if moved else schema


def rebase_refs(schema, base: str):
    """A copy of `schema` whose local `$ref`s (`#` and `#/...`: JSON pointers into `schema` itself) point into `base`
    instead: a tool's parameters nested inside the call's schema keep meaning what they meant as a document of
    their own (pydantic's `#/$defs/Model`, a tree's `#`). Through the subschemas `map_subschemas` visits (the
    keywords it leaves out are refused by the grammar engine anyway); data (`const`, `enum`, ...) stays as sent."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, lambda sub: rebase_refs(sub, base))
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def closed(schema):
    """A copy of a `parameters` schema in which every object that does not say `additionalProperties` has it
    false: a forced call holds to the parameters its tool declares (JSON Schema's default would let a small model
    add any key, with any value, without end). Objects whose properties come from a sibling `allOf`, `anyOf`,
    `oneOf` or `$ref`, and the members of an `allOf`, also by `$ref` (each sees only its own properties: closed,
    they would refuse each other's), are left as declared."""
    out = _closed(schema)
    refs = _allof_refs(schema)
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) if isinstance(schema.get(key), dict) else {}).items():
            if f"#/{key}/{name}" in refs and isinstance(sub, dict):
                out[key][name] = map_subschemas(sub, _closed)
    return out


def _closed(schema):
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, _closed)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [map_subschemas(sub, _closed) if isinstance(sub, dict) else sub for sub in schema["allOf"]]
    is_object = "object" in schema_types(out) or "properties" in out
    if is_object and "additionalProperties" not in out and not _COMPOSED & set(out):
        out["additionalProperties"] = False
    return out


def _allof_refs(schema) -> set[str]:
    """The `$ref`s that are members of an `allOf` anywhere in `schema`."""
    found: set[str] = set()

    def visit(sub):
        if isinstance(sub, dict):
            members = sub.get("allOf") if isinstance(sub.get("allOf"), list) else []
            found.update(m["$ref"] for m in members if isinstance(m, dict) and isinstance(m.get("$ref"), str))
            map_subschemas(sub, visit)
        return sub

    visit(schema)
    return found
