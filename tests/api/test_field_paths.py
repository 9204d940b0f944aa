"""Errors name the field the client sent from the start (issue 25 item 3): each wire format records its own field
paths as it fills the generation plan, so nothing renames a `param` afterwards. Fast: no model, no server."""

import pytest

from oai_gemma.api.errors import APIError
from oai_gemma.api.responses.input import decode_input, to_messages
from oai_gemma.api.serving_tools import DeclaredTool, plan_tools
from oai_gemma.chat import ChatInputError, render_chat
from oai_gemma.chat.messages import ChatMessage, FunctionCall, ToolCall
from oai_gemma.chat.render import MessagePath
from oai_gemma.chat.tools import Function

IMAGE = "data:image/png;base64,iVBORw0KGgo="


def conversation(items: list[dict], instructions: str | None = None):
    stored = decode_input(items)
    return to_messages(instructions, stored, [f"input[{i}]" for i in range(len(stored))])


def test_a_responses_image_part_is_named_by_its_input_item():
    chat = conversation([
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [{"type": "input_text", "text": "Look"}, {"type": "input_image", "image_url": IMAGE}]},
    ], instructions="Be brief.")
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert render_chat(chat.messages, paths=chat.paths).images[0].param == "input[1].content[1]"


def test_a_function_call_joins_the_assistant_turn_before_it_and_keeps_its_own_item():
    chat = conversation([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ])
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.paths[1] == MessagePath("input[1]", "content", ("input[2]",))
    assert chat.paths[2] == MessagePath("input[3]", "output")


def test_a_malformed_tool_call_names_its_own_item_or_chats_field():
    bad = ChatMessage("assistant", None, tool_calls=[ToolCall("c1", FunctionCall("f", "[1]"))])
    messages = [ChatMessage("user", "Hi"), bad]
    with pytest.raises(ChatInputError) as chat:
        render_chat(messages)
    assert chat.value.param == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(ChatInputError) as responses:
        render_chat(messages, paths=[MessagePath("input[0]"), MessagePath("input[4]", "", ("input[4]",))])
    assert responses.value.param == "input[4].arguments"


@pytest.mark.parametrize("path", ["tools[1].function", "tools[1]"], ids=["chat", "responses"])
def test_a_tool_error_names_the_tool_where_its_wire_format_declares_it(path):
    tools = [DeclaredTool(Function("f"), path.replace("[1]", "[0]")), DeclaredTool(Function("f"), path)]
    with pytest.raises(APIError) as error:
        plan_tools(tools, None, None, None)
    assert error.value.body.error.param == f"{path}.name"
