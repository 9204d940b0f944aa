"""The Responses API's wire types (`/v1/responses`) as msgspec Structs, kept apart from chat's `protocol.py`.

The request's `input` items and `tools` are decoded one by one in `responses_input.py` (an item without `type`
is a message, as OpenAI reads it), so that an error can name the item (`input[3].content[0]`); everything else
is decoded here in one pass. Unknown fields are ignored, as in chat.

Responses and stream events are encoded with chat's reused encoder. Fields the official `Response` schema
requires are always written (null when unset), so the SDKs' parsers and the spec both accept them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ...limits import RESPONSES, meta
from ..protocol import SamplingFields

# ---- request: input items ----------------------------------------------------------------------------


class InputText(Struct, tag="input_text", tag_field="type"):
    text: str


class InputImage(Struct, tag="input_image", tag_field="type"):
    image_url: str | None = None
    """A data: or http(s) URL (the same safety as chat's `image_url`); `file_id` has no Files API here."""
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"


class OutputTextContent(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class Refusal(Struct, tag="refusal", tag_field="type"):
    refusal: str


class MessageItem(Struct, tag="message", tag_field="type", kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | InputImage | OutputTextContent | Refusal]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(Struct, tag="function_call", tag_field="type", kw_only=True):
    call_id: Annotated[str, meta("input[].call_id", RESPONSES)]
    name: Annotated[str, meta("input[].name", RESPONSES)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Struct, tag="function_call_output", tag_field="type", kw_only=True):
    call_id: Annotated[str, meta("input[].call_id", RESPONSES)]
    output: str | list[InputText | InputImage]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryText(Struct, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(Struct, tag="reasoning", tag_field="type", kw_only=True, omit_defaults=True):
    """A reasoning model's item, replayed in `input` (an Agents SDK run handed over from such a model): accepted and
    listed as sent, left out of the prompt (Gemma-3 does not reason in a channel of its own)."""

    id: str
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# ---- request: tools, text format, the rest ---------------------------------------------------------------


class FunctionTool(Struct, kw_only=True):
    """A Responses function tool is flat (`{"type": "function", "name", "parameters"}`), unlike chat's."""

    type: Literal["function"] = "function"
    name: Annotated[str, meta("tools[].name", RESPONSES)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormatText(Struct, tag="text", tag_field="type"):
    pass


class TextFormatJSONObject(Struct, tag="json_object", tag_field="type"):
    pass


class TextFormatJSONSchema(Struct, tag="json_schema", tag_field="type", kw_only=True, omit_defaults=True):
    name: Annotated[str, meta("text.format.name", RESPONSES)]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = TextFormatText | TextFormatJSONObject | TextFormatJSONSchema


class TextParam(Struct, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=TextFormatText)
    verbosity: str | None = None


class ReasoningParam(Struct, omit_defaults=True):
    """Gemma-3 does not reason: only a neutral setting is accepted (the Agents SDK may send one)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    mode: str | None = None
    context: str | None = None


class ResponsesRequest(SamplingFields, kw_only=True, omit_defaults=True):
    """The sampling fields (`temperature`, `top_p`, vLLM's extensions ...) are chat's, mapped onto the engine alike."""

    model: str
    input: str | list[Any] | None = None
    """A string (one user message) or a list of items, decoded item by item in `responses_input.py`."""
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, meta("max_output_tokens", RESPONSES)] | None = None
    top_logprobs: Annotated[int, meta("top_logprobs", RESPONSES)] | None = None
    tools: list[Any] | None = None
    """Decoded one by one: a built-in tool (`web_search`, ...) is a 400 naming it."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    metadata: Annotated[dict[str, Annotated[str, meta("metadata", RESPONSES, "max_length")]], meta("metadata", RESPONSES, "max_items")] | None = None
    user: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    reasoning: ReasoningParam | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: Annotated[int, meta("max_tool_calls", RESPONSES)] | None = None
    """Caps built-in tool calls, of which this server has none: accepted, no effect."""
    # known, not done: a 400 naming them when set (see `unsupported_parameter`)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    def unsupported_parameter(self) -> str | None:
        """The first known parameter set to something this server does not do, else None."""
        if self.background:
            return "background"
        if self.conversation is not None:
            return "conversation"
        if self.prompt is not None:
            return "prompt"
        if self.truncation == "auto":
            return "truncation"
        reasoning = self.reasoning
        if reasoning is not None:
            if reasoning.effort not in (None, "none"):
                return "reasoning.effort"
            if reasoning.summary is not None or reasoning.generate_summary is not None:
                return "reasoning.summary"
        return None


request_decoder = msgspec.json.Decoder(ResponsesRequest)


# ---- response ---------------------------------------------------------------------------------------


class OutputMessage(Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    content: list[OutputTextContent]
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionToolCall(Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionToolCall


class InputTokensDetails(Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(Struct):
    code: str
    message: str


class NamedFunctionChoice(Struct, kw_only=True, tag="function", tag_field="type"):
    name: str


class AllowedFunction(Struct, kw_only=True):
    name: str
    type: Literal["function"] = "function"


class AllowedToolsChoice(Struct, kw_only=True, tag="allowed_tools", tag_field="type"):
    """`{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}]}` (request and response alike)."""

    mode: Literal["auto", "required"]
    tools: list[AllowedFunction]


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    output: list[OutputItem]
    instructions: str | None
    tools: list[FunctionTool]
    tool_choice: str | NamedFunctionChoice | AllowedToolsChoice
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    metadata: dict[str, str]
    object: Literal["response"] = "response"
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: TextParam = msgspec.field(default_factory=TextParam)
    truncation: str = "disabled"
    store: bool = True
    user: str | None | UnsetType = UNSET
    reasoning: ReasoningParam | None = None
    top_logprobs: int = 0
    usage: ResponseUsage | UnsetType = UNSET
    """Set once the response ended (the spec's `usage` is not nullable)."""
    output_text: str | UnsetType = UNSET
    """The SDKs compute it; written too, for curl users (the spec lists it as optional)."""


class DeletedResponse(Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


# ---- stored input items, as `GET /v1/responses/{id}/input_items` lists them --------------------------------


class MessageResource(Struct, tag="message", tag_field="type", kw_only=True):
    """An input message, or an earlier response's output message (assistant, `output_text` parts)."""

    id: str
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputText | InputImage | OutputTextContent]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallOutputResource(Struct, tag="function_call_output", tag_field="type", kw_only=True):
    id: str
    call_id: str
    output: str | list[InputText | InputImage]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


StoredItem = MessageResource | FunctionToolCall | FunctionCallOutputResource | ReasoningItem
"""Every item of a conversation as stored: inputs normalised (ids given, content as parts) and outputs."""

stored_items_decoder = msgspec.json.Decoder(list[StoredItem])


class StoredOutput(Struct):
    """A stored response read for its `output` alone (the next turn of a `previous_response_id` chain)."""

    output: list[StoredItem]


stored_output_decoder = msgspec.json.Decoder(StoredOutput)


class ItemList(Struct, kw_only=True):
    data: list[StoredItem]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"
