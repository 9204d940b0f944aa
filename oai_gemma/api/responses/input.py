"""The Responses API's `input` (and `instructions`, and a previous response's conversation) as chat messages.

Responses and chat completions say the same things in two shapes: a `message` item is a chat message, a run of
`function_call` items is one assistant message with `tool_calls`, a `function_call_output` is a `tool` message, and
a `reasoning` item (another model's, replayed) is kept and listed but has no place in Gemma-3's prompt. So this
module only translates, and the one chat path (template, tools, images, grammar) renders the result.

Items are checked here, one by one, so that an error names the item as the client wrote it
(`input[3].content[0]`); each chat message carries where its item sits (`chat.MessagePath`), so an error the chat
path raises names the item too. Validated items are kept in the stored shape (ids given, content as parts),
which is what `GET /v1/responses/{id}/input_items` lists and what `previous_response_id` continues.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...chat import ChatMessage, MessagePath
from ...chat.messages import FunctionCall, ImageURL, ImageURLPart, TextPart, ToolCall
from .. import errors
from ..errors import APIError, check_limits, invalid_request
from ...limits import RESPONSES, missing
from .protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionCallOutputResource,
    FunctionToolCall,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    MessageResource,
    OutputTextContent,
    ReasoningItem,
    Refusal,
    StoredItem,
)

ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
              "reasoning": ReasoningItem}
USER_PARTS = ("input_text", "input_image")
ASSISTANT_PARTS = ("output_text", "refusal")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- wire -> checked, stored items ------------------------------------------------------------------------


def decode_input(raw: str | list[Any] | None) -> list[StoredItem]:
    """`input` as stored items; a 400 naming `input[i]...` for the first item that is wrong."""
    if raw is None:
        raise invalid_request(missing("input"), "input", "missing_required_parameter")
    if isinstance(raw, str):
        return [MessageResource(id=new_id("msg"), role="user", content=[InputText(raw)])]
    check_limits("input", RESPONSES, raw)
    return [_stored(_decode_item(item, f"input[{i}]"), f"input[{i}]") for i, item in enumerate(raw)]


def _decode_item(item: Any, where: str) -> InputItem:
    if not isinstance(item, dict):
        raise invalid_request("each input item must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise invalid_request(
            f"input item type {_shown(kind)} is not supported: expected message, function_call, function_call_output "
            "or reasoning",
            f"{where}.type" if kind is not None else where,
        )
    if kind == "message":
        _check_part_types(item, where)
    elif kind == "function_call_output" and isinstance(item.get("output"), list):
        _check_parts(item["output"], USER_PARTS, f"{where}.output", "a function_call_output")
    try:
        return msgspec.convert(item, ITEM_TYPES[kind])
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where, item) from None


def validation_error(exc: msgspec.ValidationError, where: str, value: Any) -> APIError:
    """msgspec's complaint about `value` (decoded on its own), as a 400 naming the field from the request's root."""
    return errors.validation_error(str(exc), value, where)


def _check_part_types(item: dict, where: str) -> None:
    content = item.get("content")
    if not isinstance(content, list):
        return  # a string, or something msgspec names
    assistant = item.get("role") == "assistant"
    allowed = ASSISTANT_PARTS if assistant else USER_PARTS
    _check_parts(content, allowed, f"{where}.content", "an assistant message" if assistant else "this message")


def _check_parts(parts: list, allowed: tuple[str, ...], where: str, what: str) -> None:
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            extra = " (files are not supported: send images as input_image with an image_url)" if kind == "input_file" else ""
            raise invalid_request(
                f"content part type {_shown(kind)} is not allowed in {what}: expected {' or '.join(allowed)}{extra}",
                f"{where}[{j}]",
            )


def _stored(item: InputItem, where: str) -> StoredItem:
    """The item as stored and listed: an id, content as a list of parts, arguments checked."""
    if isinstance(item, ReasoningItem):
        return item
    if isinstance(item, MessageItem):
        return MessageResource(id=item.id or new_id("msg"), role=item.role, content=_message_parts(item, where))
    if isinstance(item, FunctionCallItem):
        try:
            arguments = json.loads(item.arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid_request("function_call arguments must be a JSON object", f"{where}.arguments")
        return FunctionToolCall(id=item.id or new_id("fc"), call_id=item.call_id, name=item.name, arguments=item.arguments)
    if not isinstance(item.output, str):
        for j, part in enumerate(item.output):
            _check_image_url(part, f"{where}.output[{j}]")
    return FunctionCallOutputResource(id=item.id or new_id("fco"), call_id=item.call_id, output=item.output)


def _check_image_url(part, where: str) -> None:
    if isinstance(part, InputImage) and not part.image_url:
        raise invalid_request(
            "an input_image needs an image_url (a data: or http(s) URL); file_id needs a Files API, which this "
            "server does not have", where,
        )


def _message_parts(item: MessageItem, where: str) -> list:
    if isinstance(item.content, str):
        return [OutputTextContent(item.content) if item.role == "assistant" else InputText(item.content)]
    parts = []
    for j, part in enumerate(item.content):
        _check_image_url(part, f"{where}.content[{j}]")
        if isinstance(part, Refusal):
            part = OutputTextContent(part.refusal)
        elif isinstance(part, InputImage) and item.role in ("system", "developer"):
            raise invalid_request("images are not allowed in system or developer messages", f"{where}.content[{j}]")
        parts.append(part)
    return parts


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 64 else text[:64] + "..."


# ---- stored items -> chat messages ------------------------------------------------------------------------


@dataclass
class Conversation:
    """The chat messages, and where each one sits in the request (so chat's errors name the item the client sent)."""

    messages: list[ChatMessage] = field(default_factory=list)
    paths: list[MessagePath] = field(default_factory=list)

    def add(self, message: ChatMessage, path: MessagePath) -> None:
        self.messages.append(message)
        self.paths.append(path)


def to_messages(instructions: str | None, items: list[StoredItem], params: list[str]) -> Conversation:
    """Chat messages for `instructions` (a system message, as OpenAI's developer message) and the items;
    `params[k]` names item k in errors (`input[3]`, or `previous_response_id` for a stored one)."""
    conversation = Conversation()
    if instructions:
        conversation.add(ChatMessage("system", instructions), MessagePath("instructions", ""))
    for item, param in zip(items, params, strict=True):
        if isinstance(item, ReasoningItem):
            continue  # another model's reasoning: nothing Gemma-3's template has a place for
        if isinstance(item, FunctionToolCall):
            call = ToolCall(item.call_id, FunctionCall(item.name, item.arguments))
            last = conversation.messages[-1] if conversation.messages else None
            if last is not None and last.role == "assistant":  # its text, then its calls: one model turn
                last.tool_calls = [*(last.tool_calls or []), call]
                path = conversation.paths[-1]
                conversation.paths[-1] = MessagePath(path.where, path.content, (*path.calls, param))
            else:
                conversation.add(ChatMessage("assistant", None, tool_calls=[call]), MessagePath(param, "", (param,)))
        elif isinstance(item, FunctionCallOutputResource):
            output = item.output if isinstance(item.output, str) else [_chat_part(p) for p in item.output]
            conversation.add(ChatMessage("tool", output, tool_call_id=item.call_id), MessagePath(param, "output"))
        else:
            conversation.add(ChatMessage(item.role, [_chat_part(p) for p in item.content]), MessagePath(param))
    return conversation


def _chat_part(part) -> TextPart | ImageURLPart:
    if isinstance(part, InputImage):
        return ImageURLPart(ImageURL(part.image_url, part.detail))
    return TextPart(part.text)
