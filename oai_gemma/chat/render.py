"""OpenAI chat messages -> Gemma-3 prompt text, without Jinja.

The output is byte-identical to Google's chat template (`gemma3_chat_template.jinja`, the one shipped in
google/gemma-3-*-it) for every conversation that template renders sensibly. Where it raises, or lets through
something Gemma-3 was not trained on, we render what a client of an OpenAI-compatible server expects instead:

* `developer` is `system`. All system messages, wherever they stand, are joined with a blank line into the one
  system text, which prefixes the first user turn, followed by a blank line. (The template takes only the first
  message's first text part, and lets a late system message through as a `<start_of_turn>system` turn.)
* Consecutive turns of one role merge into one turn, their texts joined with a blank line (empty ones skipped).
* A conversation with no user turn before its first assistant turn is rendered as is: the model can still continue
  it, and refusing would break clients that replay a greeting. A system text then becomes a user turn of its own in
  front, as it does when it is the only message (the template silently drops it there).

Tools (see `tools.py`): the tool prompt follows the system text in the first user turn; an assistant message's
`tool_calls` are written after its content the way the model is asked to write them; a `tool` message is a user
turn holding a ```` ```tool_output ```` block (merged like any user turn).

What we cannot render faithfully yet (audio, files, the legacy `function` role) is a `ChatInputError` naming the
offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tools import render_tool_calls, render_tool_result

OFFICIAL_TEMPLATE_PATH = Path(__file__).with_name("gemma3_chat_template.jinja")
IMAGE_TOKEN = "<start_of_image>"
_DETAILS = ("auto", "low", "high")


class ChatInputError(ValueError):
    """A request the renderer refuses; `param` names the field, as OpenAI's error object does."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class ImagePart:
    url: str
    detail: str
    param: str


@dataclass
class RenderedChat:
    prompt: str
    images: list[ImagePart]


@dataclass
class _Turn:
    role: str  # "user" or "model"
    text: str
    images: list[ImagePart] = field(default_factory=list)


def render_chat(
    messages: list[dict], *, tool_prompt: str | None = None, add_generation_prompt: bool = True,
    bos_token: str = "<bos>",
) -> RenderedChat:
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("messages must be a non-empty list", "messages")
    system: list[str] = []
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = _role(message, where)
        if role == "system":
            system.append(_system_text(message.get("content"), where))
            continue
        if role == "tool":
            role, text, images = "user", _tool_result(message, where), []
        else:
            text, images = _turn_content(role, message, where)
        if turns and turns[-1].role == role:
            turns[-1].text = "\n\n".join(t for t in (turns[-1].text, text) if t)
            turns[-1].images += images
        else:
            turns.append(_Turn(role, text, images))

    if tool_prompt:
        system.append(tool_prompt)
    if system:
        prefix = "\n\n".join(system)
        if turns and turns[0].role == "user":
            turns[0].text = prefix + "\n\n" + turns[0].text
        else:  # nothing to prefix: the system text is the conversation's opening user turn
            turns.insert(0, _Turn("user", prefix.strip()))

    prompt = bos_token + "".join(f"<start_of_turn>{t.role}\n{t.text}<end_of_turn>\n" for t in turns)
    if add_generation_prompt:
        prompt += "<start_of_turn>model\n"
    return RenderedChat(prompt, [image for t in turns for image in t.images])


def _role(message: Any, where: str) -> str:
    if not isinstance(message, dict):
        raise ChatInputError("each message must be an object", where)
    role = message.get("role")
    if role in ("system", "developer"):
        return "system"
    if role == "user":
        return "user"
    if role == "assistant":
        return "model"
    if role == "tool":
        return "tool"
    if role == "function":
        raise ChatInputError("messages with role 'function' are not supported: send 'tool' messages", where)
    raise ChatInputError(f"unknown role {role!r}: expected system, developer, user or assistant", where)


def _system_text(content: Any, where: str) -> str:
    """Kept as sent (the official template does not trim it); images have no place in Gemma-3's system text."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(_parts(content, where)):
        kind, value = _part(part, f"{where}.content[{j}]")
        if kind == "image":
            raise ChatInputError("images are not allowed in system messages", value.param)
        texts.append(value)
    return "".join(texts)


def _turn_content(role: str, message: dict, where: str) -> tuple[str, list[ImagePart]]:
    """Each text trimmed and the parts concatenated as the official template does; an image is its marker."""
    content = message.get("content")
    if role == "model" and message.get("tool_calls"):
        text, images = _turn_content(role, {"content": content}, where)
        return "\n".join(t for t in (text, _tool_calls(message["tool_calls"], where)) if t), images
    if role == "model" and content is None:
        return "", []
    if isinstance(content, str):
        return content.strip(), []
    pieces, images = [], []
    for j, part in enumerate(_parts(content, where)):
        kind, value = _part(part, f"{where}.content[{j}]")
        if kind == "image":
            images.append(value)
            pieces.append(IMAGE_TOKEN)
        else:
            pieces.append(value.strip())
    return "".join(pieces), images


def _tool_calls(tool_calls: Any, where: str) -> str:
    if not isinstance(tool_calls, list):
        raise ChatInputError("tool_calls must be a list", f"{where}.tool_calls")
    try:
        return render_tool_calls(tool_calls)
    except ValueError as exc:
        raise ChatInputError("each tool call needs a function name and JSON object arguments", f"{where}.{exc}") from None


def _tool_result(message: dict, where: str) -> str:
    """A tool's answer (text only, as OpenAI allows) in the block the model is told results come in."""
    text, images = _turn_content("user", message, where)
    if images:
        raise ChatInputError("tool messages can only hold text", images[0].param)
    return render_tool_result(text)


def _parts(content: Any, where: str) -> list:
    if content is None:
        raise ChatInputError("content is required", where)
    if not isinstance(content, list):
        raise ChatInputError("content must be a string or a list of content parts", where)
    return content


def _part(part: Any, where: str) -> tuple[str, Any]:
    """One content part, checked: ("text", str) or ("image", ImagePart)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ChatInputError("a text part needs a string 'text'", where)
        return "text", part["text"]
    if kind == "image_url":
        image = part.get("image_url")
        if isinstance(image, str):
            image = {"url": image}
        url = image.get("url") if isinstance(image, dict) else None
        if not isinstance(url, str) or not url:
            raise ChatInputError("an image_url part needs 'image_url.url'", where)
        detail = image.get("detail") or "auto"
        if detail not in _DETAILS:
            raise ChatInputError(f"image_url.detail must be one of {', '.join(_DETAILS)}", where)
        return "image", ImagePart(url, detail, where)
    raise ChatInputError(f"content part type {kind!r} is not supported: expected 'text' or 'image_url'", where)
