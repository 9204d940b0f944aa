"""`tools`, `tool_choice` and `parallel_tool_calls`: which functions the prompt offers, which call (if any) is
forced, and the calls found in the answer as OpenAI's `tool_calls`, whole or as stream deltas.

The prompt and the parser are in `chat/tools.py`; this module translates between them and the wire.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ..chat.tools import CallDelta, Function, ParsedCall, ToolCallStream, calls_schema, tool_prompt
from ..engine.engine import Engine
from ..engine.types import GenerationRequest
from .errors import invalid_request
from .protocol import (
    ChatCompletionRequest,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from .response_format import json_schema_grammar


@dataclass(frozen=True)
class ToolPlan:
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
        return ToolCallStream(self.names, parallel=self.parallel)


def plan_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, checked (a 400 naming `tools[i]...` or `tool_choice`); None when the answer is prose
    only (no tools, or `tool_choice: "none"`)."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none", "auto"):
            raise invalid_request("`tool_choice` needs `tools`", "tool_choice")
        return None
    functions: list[Function] = []
    for i, tool in enumerate(request.tools):
        f = tool.function
        if f.name in {g.name for g in functions}:
            raise invalid_request(f"tool names must be unique: `{f.name}` is defined twice", f"tools[{i}].function.name")
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise invalid_request(
                "function parameters must be a JSON schema of `type: object`", f"tools[{i}].function.parameters"
            )
        functions.append(Function(f.name, f.description, f.parameters))
    if choice == "none":
        return None
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f.name == choice.function.name]
        if not named:
            raise invalid_request(
                f"tool_choice names the function `{choice.function.name}`, which is not in `tools`", "tool_choice"
            )
        return ToolPlan(functions, named, parallel=False, named=True)
    return ToolPlan(functions, functions if choice == "required" else None, parallel)


async def force_calls(engine: Engine, generation: GenerationRequest, plan: ToolPlan) -> None:
    """With `required` or a named function, hold the answer to a valid call by a grammar (in place of a
    `response_format` grammar: the answer is the call). A schema the grammar cannot take is a 400 naming `tools`."""
    schema = plan.forced_schema()
    if schema is not None:
        generation.grammar = await json_schema_grammar(engine, schema, "tools")


def wire_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(_call_id(), FunctionCall(c.name, c.arguments_json)) for c in calls]


def stream_deltas(pieces: list[str | CallDelta]) -> list[Delta]:
    """`ToolCallStream` output as deltas: text as content; a call's first piece as `index`, `id`, `type` and
    `function.name` (arguments ""), then its arguments fragments."""
    deltas = []
    for piece in pieces:
        if isinstance(piece, str):
            deltas.append(Delta(content=piece))
            continue
        if piece.name is not None:
            head = ToolCallDelta(piece.index, _call_id(), "function", FunctionCallDelta(piece.name, ""))
            deltas.append(Delta(tool_calls=[head]))
        if piece.arguments:
            fragment = ToolCallDelta(piece.index, function=FunctionCallDelta(arguments=piece.arguments))
            deltas.append(Delta(tool_calls=[fragment]))
    return deltas


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
