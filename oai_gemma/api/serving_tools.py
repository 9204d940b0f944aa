"""`tools`, `tool_choice` and `parallel_tool_calls` on the wire -> the `chat.tools.ToolPlan` the prompt, the grammar
and the choice assembler work from; parsed calls -> OpenAI's `tool_calls`.

The prompt, the plan and the parser are in `chat/`; this module only translates between them and the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chat.tool_parser import ParsedCall
from ..chat.tools import Function, ToolPlan
from .choices import call_id
from .errors import invalid_request
from .protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall


@dataclass(frozen=True)
class DeclaredTool:
    """One function tool as a request declared it, and where: chat's `tools[i].function`, Responses' `tools[i]`."""

    function: Function
    path: str


def chat_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls`."""
    declared = [
        DeclaredTool(Function(t.function.name, t.function.description, t.function.parameters), f"tools[{i}].function")
        for i, t in enumerate(request.tools or [])
    ]
    choice = request.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return plan_tools(declared, None if named else choice, named, request.parallel_tool_calls)


def plan_tools(tools: list[DeclaredTool], choice: str | None, named: str | None, parallel: bool | None) -> ToolPlan | None:
    """The request's tools, checked (a 400 naming the tool's own field or `tool_choice`); None when the answer is
    prose only (no tools, or `tool_choice: "none"`). `choice`: none, auto, required or unset; `named`: the one
    function `tool_choice` names instead."""
    if not tools:
        if named is not None or choice not in (None, "none", "auto"):
            raise invalid_request("`tool_choice` needs `tools`", "tool_choice")
        return None
    functions = _functions(tools)
    if choice == "none":
        return None
    if named is not None:
        chosen = [f for f in functions if f.name == named]
        if not chosen:
            raise invalid_request(f"tool_choice names the function `{named}`, which is not in `tools`", "tool_choice")
        return ToolPlan(functions, chosen, parallel=False, named=True)
    return ToolPlan(functions, functions if choice == "required" else None, parallel is not False)


def _functions(tools: list[DeclaredTool]) -> list[Function]:
    functions: list[Function] = []
    for tool in tools:
        f = tool.function
        if f.name in {g.name for g in functions}:
            raise invalid_request(f"tool names must be unique: `{f.name}` is defined twice", f"{tool.path}.name")
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise invalid_request("function parameters must be a JSON schema of `type: object`", f"{tool.path}.parameters")
        functions.append(f)
    return functions


def wire_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(call_id(), FunctionCall(c.name, c.arguments_json)) for c in calls]
