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
from .protocol import AllowedToolsChoice, ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall


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
    if isinstance(choice, NamedToolChoice):
        return plan_tools(declared, None, choice.function.name, request.parallel_tool_calls)
    if isinstance(choice, AllowedToolsChoice):
        allowed = AllowedNames([t.function.name for t in choice.allowed_tools.tools], "tool_choice.allowed_tools.tools")
        return plan_tools(declared, choice.allowed_tools.mode, None, request.parallel_tool_calls, allowed)
    return plan_tools(declared, choice, None, request.parallel_tool_calls)


@dataclass(frozen=True)
class AllowedNames:
    """The functions an `allowed_tools` choice names, and where its list sits (chat's `tool_choice.allowed_tools.tools`,
    Responses' `tool_choice.tools`)."""

    names: list[str]
    path: str


def plan_tools(
    tools: list[DeclaredTool], choice: str | None, named: str | None, parallel: bool | None,
    allowed: AllowedNames | None = None,
) -> ToolPlan | None:
    """The request's tools, checked (a 400 naming the tool's own field or `tool_choice`); None when the answer is
    prose only (no tools, or `tool_choice: "none"`). `choice`: none, auto, required or unset; `named`: the one
    function `tool_choice` names instead; `allowed`: an `allowed_tools` choice's functions (with `choice` its mode,
    auto or required), the only ones the prompt offers and a call may name."""
    if not tools:
        if named is not None or allowed is not None or choice not in (None, "none", "auto"):
            raise invalid_request("`tool_choice` needs `tools`", "tool_choice")
        return None
    functions = _functions(tools)
    if choice == "none":
        return None
    if allowed is not None:
        functions = _allowed(functions, allowed)
    if named is not None:
        chosen = [f for f in functions if f.name == named]
        if not chosen:
            raise invalid_request(f"tool_choice names the function `{named}`, which is not in `tools`", "tool_choice")
        return ToolPlan(functions, chosen, parallel=False, named=True)
    return ToolPlan(functions, functions if choice == "required" else None, parallel is not False)


def _allowed(functions: list[Function], allowed: AllowedNames) -> list[Function]:
    """The declared functions an `allowed_tools` choice names, in `tools`' order (each named one must be there)."""
    if not allowed.names:
        raise invalid_request("an `allowed_tools` tool_choice needs at least one tool", allowed.path)
    declared = {f.name for f in functions}
    for i, name in enumerate(allowed.names):
        if name not in declared:
            raise invalid_request(f"tool_choice allows the function `{name}`, which is not in `tools`", f"{allowed.path}[{i}]")
    return [f for f in functions if f.name in allowed.names]


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
