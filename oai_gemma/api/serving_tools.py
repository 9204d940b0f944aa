"""`tools`, `tool_choice` and `parallel_tool_calls` on the wire -> the `chat.tools.ToolPlan` the prompt, the grammar
and the choice assembler work from; parsed calls -> OpenAI's `tool_calls`.

The prompt, the plan and the parser are in `chat/`; this module only translates between them and the wire.
"""

from __future__ import annotations

from ..chat.tool_parser import ParsedCall
from ..chat.tools import Function, ToolPlan
from .choices import call_id
from .errors import invalid_request
from .protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall


def plan_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, checked (a 400 naming `tools[i]...` or `tool_choice`); None when the answer is prose
    only (no tools, or `tool_choice: "none"`)."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none", "auto"):
            raise invalid_request("`tool_choice` needs `tools`", "tool_choice")
        return None
    functions = _functions(request)
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f.name == choice.function.name]
        if not named:
            raise invalid_request(
                f"tool_choice names the function `{choice.function.name}`, which is not in `tools`", "tool_choice"
            )
        return ToolPlan(functions, named, parallel=False, named=True)
    parallel = request.parallel_tool_calls is not False
    return ToolPlan(functions, functions if choice == "required" else None, parallel)


def _functions(request: ChatCompletionRequest) -> list[Function]:
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
    return functions


def wire_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(call_id(), FunctionCall(c.name, c.arguments_json)) for c in calls]
