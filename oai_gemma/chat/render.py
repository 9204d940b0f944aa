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
turn holding a ```` ```tool_output ```` block (merged like any user turn), with the images a tool returned in it.

What we cannot render faithfully yet (audio, files, the legacy `function` role) is a `ChatInputError` naming the
offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine.model.processor import TOKENS as PROCESSOR_TOKENS
from ..limits import missing
from .messages import ChatInputError, ChatMessage, ContentPart, ImageURL, TextPart, ToolCall, parse_messages
from .tools import MalformedToolCall, render_tool_calls, render_tool_result

OFFICIAL_TEMPLATE_PATH = Path(__file__).with_name("gemma3_chat_template.jinja")
IMAGE_TOKENS = tuple(PROCESSOR_TOKENS.values())
"""What an image part becomes in the prompt (its marker, then the processor's 256 soft tokens a crop and the end):
the tokenizer reads these in any text as the tokens themselves, so a text holding one would stand for an image
that is not there (or move the pixels of one that is)."""
IMAGE_TOKEN = PROCESSOR_TOKENS["boi_token"]
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "model", "tool": "tool"}


@dataclass
class ImagePart:
    url: str
    detail: str
    param: str


@dataclass(frozen=True)
class MessagePath:
    """Where one message sits in the request, so that an error's `param` names what the client sent: chat's
    `messages[i]`; another wire format names its own (a Responses item is `input[3]`, its parts
    `input[3].content[j]`, a tool result's `input[4].output[j]`, each tool call the item it came from)."""

    where: str
    content: str = "content"
    """The field holding the message's parts; "" when the parts are named as the message itself."""
    calls: tuple[str, ...] = ()
    """Where each tool call sits, when not in the message's own `tool_calls`."""

    def field(self) -> str:
        """The field holding the message's content (or its parts)."""
        return f"{self.where}.{self.content}" if self.content else self.where

    def part(self, j: int) -> str:
        return f"{self.field()}[{j}]" if self.content else self.where

    def calls_field(self) -> str:
        """Where the message's tool calls sit (the first's item, when they are items of their own)."""
        return self.calls[0] if self.calls else f"{self.where}.tool_calls"

    def call(self, exc: MalformedToolCall) -> str:
        if exc.index < len(self.calls):
            return f"{self.calls[exc.index]}.{exc.field}"
        return f"{self.where}.{exc}"


def chat_paths(count: int) -> list[MessagePath]:
    """Chat's own: message i is `messages[i]`."""
    return [MessagePath(f"messages[{i}]") for i in range(count)]


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
    messages: list[ChatMessage] | list[dict], *, tool_prompt: str | None = None, add_generation_prompt: bool = True,
    bos_token: str = "<bos>", paths: list[MessagePath] | None = None,
) -> RenderedChat:
    """The prompt text, with a `<start_of_image>` where each image goes, and the images in prompt order
    (`paths`: where each message sits in the request, for errors; chat's `messages[i]` by default)."""
    system: list[str] = []
    turns: list[_Turn] = []
    messages = parse_messages(messages)
    for message, where in zip(messages, paths or chat_paths(len(messages)), strict=True):
        role = _role(message, where)
        if role == "system":
            system.append(_system_text(message.content, where))
            continue
        if role == "tool":
            role, (text, images) = "user", _tool_result(message, where)
        else:
            text, images = _turn_content(role, message, where)
        if turns and turns[-1].role == role:
            turns[-1].text = "\n\n".join(t for t in (turns[-1].text, text) if t)
            turns[-1].images += images
        else:
            turns.append(_Turn(role, text, images))
    if tool_prompt:
        system.append(_text(tool_prompt, "tools"))
    if system:
        _prefix(turns, "\n\n".join(system))
    prompt = bos_token + "".join(f"<start_of_turn>{t.role}\n{t.text}<end_of_turn>\n" for t in turns)
    if add_generation_prompt:
        prompt += "<start_of_turn>model\n"
    return RenderedChat(prompt, [image for t in turns for image in t.images])


def _prefix(turns: list[_Turn], prefix: str) -> None:
    """The system text opens the first user turn, or is the conversation's opening user turn of its own."""
    if turns and turns[0].role == "user":
        turns[0].text = prefix + "\n\n" + turns[0].text
    else:
        turns.insert(0, _Turn("user", prefix.strip()))


def _role(message: ChatMessage, where: MessagePath) -> str:
    if message.role == "function":
        raise ChatInputError("messages with role 'function' are not supported: send 'tool' messages", where.where)
    return _ROLES[message.role]


def _system_text(content: str | list[ContentPart] | None, where: MessagePath) -> str:
    """Kept as sent (the official template does not trim it); images have no place in Gemma-3's system text."""
    if isinstance(content, str):
        return _text(content, where.field())
    texts = []
    for j, part in enumerate(_parts(content, where)):
        value = _part(part, where.part(j))
        if isinstance(value, ImagePart):
            raise ChatInputError("images are not allowed in system messages", value.param)
        texts.append(_text(value, where.part(j)))
    return "".join(texts)


def _turn_content(role: str, message: ChatMessage, where: MessagePath) -> tuple[str, list[ImagePart]]:
    """Each text trimmed and the parts concatenated as the official template does; an image is its marker."""
    content = message.content
    if role == "model" and message.tool_calls:
        text, images = ("", []) if content is None else _content(content, where)
        calls = _text(_tool_calls(message.tool_calls, where), where.calls_field())
        return "\n".join(t for t in (text, calls) if t), images
    if role == "model" and content is None:
        return "", []
    return _content(content, where)


def _content(content: str | list[ContentPart] | None, where: MessagePath) -> tuple[str, list[ImagePart]]:
    if isinstance(content, str):
        return _text(content, where.field()).strip(), []
    pieces, images = [], []
    for j, part in enumerate(_parts(content, where)):
        value = _part(part, where.part(j))
        if isinstance(value, ImagePart):
            images.append(value)
            pieces.append(IMAGE_TOKEN)
        else:
            pieces.append(_text(value, where.part(j)).strip())
    return "".join(pieces), images


def _tool_calls(tool_calls: list[ToolCall], where: MessagePath) -> str:
    try:
        return render_tool_calls(tool_calls)
    except MalformedToolCall as exc:
        raise ChatInputError("each tool call needs a function name and JSON object arguments", where.call(exc)) from None


def _tool_result(message: ChatMessage, where: MessagePath) -> tuple[str, list[ImagePart]]:
    """A tool's answer in the block the model is told results come in, an image in it where the tool returned one
    (a Responses `function_call_output`'s `input_image`, the Agents SDK's `ToolOutputImage`; chat's `image_url`
    parts too, as vLLM takes them, where OpenAI's chat allows text only)."""
    text, images = _content(message.content, where)
    return render_tool_result(text), images


def _parts(content: list[ContentPart] | None, where: MessagePath) -> list[ContentPart]:
    if content is None:
        param = where.field()
        raise ChatInputError(missing(param), param, "missing_required_parameter")
    return content


def _text(text: str, param: str) -> str:
    """`text` as sent, refused where it holds one of IMAGE_TOKENS (`param`: the field it came in)."""
    token = next((token for token in IMAGE_TOKENS if token in text), None)
    if token:
        raise ChatInputError(f"text may not contain the image token {token}: send an image as an image_url part", param)
    return text


def _part(part: ContentPart, where: str) -> str | ImagePart:
    """One content part: its text, or the image it names (a URL is required)."""
    if isinstance(part, TextPart):
        return part.text
    image = part.image_url if isinstance(part.image_url, ImageURL) else ImageURL(part.image_url)
    if not image.url:
        raise ChatInputError("an image_url part needs 'image_url.url'", where)
    return ImagePart(image.url, image.detail, where)
