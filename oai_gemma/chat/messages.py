"""Chat messages as small typed objects (msgspec Structs), in OpenAI's shape.

These are the types the HTTP layer decodes `messages` into (`api/protocol.py` uses them as they are), so a
message is checked for its shape once, by the decoder, and `render.py` reads typed fields: no dict round trip.
What a shape cannot say (a user message needs content, the `function` role is refused, an image needs a URL)
`render.py` checks, once, naming the field.

`parse_messages` turns plain dicts (a notebook, a test, the engine's own tests) into the same objects.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import Struct


class ChatInputError(ValueError):
    """A request the chat layer refuses; `param` names the field, as OpenAI's error object does; `code`, when set,
    is OpenAI's error code (`invalid_image`, `image_not_supported`, `context_length_exceeded`)."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ImageURL(Struct):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageURLPart(Struct, tag="image_url", tag_field="type"):
    image_url: ImageURL | str


ContentPart = TextPart | ImageURLPart


class FunctionCall(Struct):
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's shape, in requests and responses)."""


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


_AT = re.compile(r" - at `\$\[(\d+)\]([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_PART = re.compile(r"^\.content\[\d+\]")


def parse_messages(messages: Any) -> list[ChatMessage]:
    """Typed messages from plain dicts (typed ones pass through); a `ChatInputError` names the message at fault,
    or its content part, or the tool-call field."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("messages must be a non-empty list", "messages")
    if all(isinstance(m, ChatMessage) for m in messages):
        return messages
    try:
        return msgspec.convert(messages, list[ChatMessage])
    except msgspec.ValidationError as exc:
        raise ChatInputError(str(exc), _param(str(exc))) from None


def _param(error: str) -> str:
    """`... - at $[2].content[1].type` -> `messages[2].content[1]`; a tool call's own field keeps its full path."""
    at = _AT.search(error)
    if at is None:
        return "messages"
    where, rest = f"messages[{at.group(1)}]", at.group(2)
    if rest.startswith(".tool_calls"):
        missing = _MISSING.search(error)
        return where + rest + (f".{missing.group(1)}" if missing else "")
    part = _PART.match(rest)
    return where + part.group(0) if part else where
