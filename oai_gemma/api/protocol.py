"""OpenAI wire types as msgspec Structs: the request is decoded and validated in one pass, and responses
and stream chunks are encoded from these with one reused encoder.

Unknown request fields are ignored (as vLLM does) so newer SDKs keep working. The chat messages are chat's own
typed messages (`chat/messages.py`): decoded here once, read there as they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ..chat.messages import (  # noqa: F401 (the wire's message types, re-exported)
    ChatMessage, ContentPart, FunctionCall, ImageURL, ImageURLPart, TextPart, ToolCall,
)
from ..limits import CHAT, COMPLETIONS, SAMPLING, meta

S = SAMPLING[0]  # the sampling fields' limits are the same on every endpoint



# ---- request ---------------------------------------------------------------------------------------


class FunctionDefinition(Struct, omit_defaults=True):
    name: Annotated[str, meta("tools[].function.name", CHAT)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; unset means no arguments."""
    strict: bool | None = None


class ToolDefinition(Struct):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, tag="function", tag_field="type"):
    function: NamedFunction


class AllowedTool(Struct):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Struct):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class AllowedToolsChoice(Struct, tag="allowed_tools", tag_field="type"):
    """`{"type": "allowed_tools", ...}`: the model may call only these of `tools` (`required`: one of them)."""

    allowed_tools: AllowedTools


class StreamOptions(Struct):
    include_usage: bool = False


class JSONSchemaFormat(Struct):
    name: Annotated[str, meta("response_format.json_schema.name", CHAT)]
    schema: dict[str, Any] | None = None
    """None: any JSON value."""
    description: str | None = None
    strict: bool | None = None
    """Accepted either way: the schema is always enforced by the grammar."""


class TextFormat(Struct, tag="text", tag_field="type"):
    pass


class JSONObjectFormat(Struct, tag="json_object", tag_field="type"):
    pass


class JSONSchemaResponseFormat(Struct, tag="json_schema", tag_field="type"):
    json_schema: JSONSchemaFormat


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaResponseFormat


class SamplingFields(Struct, kw_only=True, omit_defaults=True):
    """The sampling fields chat, text completions and Responses share, declared once (their names and ranges are
    OpenAI's, then vLLM's extensions); `api/sampling.py` maps them onto the engine for all three."""

    temperature: Annotated[float, meta("temperature", S)] | None = None
    top_p: Annotated[float, meta("top_p", S)] | None = None
    stop: str | Annotated[list[str], meta("stop", S)] | None = None
    seed: Annotated[int, meta("seed", S)] | None = None
    presence_penalty: Annotated[float, meta("presence_penalty", S)] | None = None
    frequency_penalty: Annotated[float, meta("frequency_penalty", S)] | None = None
    logit_bias: dict[str, Annotated[float, meta("logit_bias", S)]] | None = None
    # vLLM extensions
    top_k: Annotated[int, meta("top_k", S)] | None = None
    min_p: Annotated[float, meta("min_p", S)] | None = None
    repetition_penalty: Annotated[float, meta("repetition_penalty", S)] | None = None
    min_tokens: Annotated[int, meta("min_tokens", S)] | None = None
    ignore_eos: bool | None = None
    cache_salt: Annotated[str, meta("cache_salt", S)] | None = None
    """Requests share cached prompt prefixes only with requests of the same salt (and, under
    `engine.prefix_cache_scope = key`, the same API key)."""
    speculative: bool | None = None
    """False: no speculative decoding for this request (the output is the same either way; only its speed differs)."""


class Prediction(Struct):
    """Predicted Outputs: text the output is expected to largely repeat (a file regenerated with a small change);
    drafted from as the output aligns with it (engine/speculative/prediction.py)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class SamplingRequest(SamplingFields, kw_only=True, omit_defaults=True):
    """The sampling and streaming fields chat and text completions share."""

    n: Annotated[int, meta("n", CHAT)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def unsupported_parameter(self) -> str | None:
        """The first known parameter set to something this server does not do (yet), else None."""
        return None


class ChatCompletionRequest(SamplingRequest, kw_only=True, omit_defaults=True):
    model: str
    messages: Annotated[list[ChatMessage], meta("messages", CHAT)]
    max_tokens: Annotated[int, meta("max_tokens", CHAT)] | None = None
    max_completion_tokens: Annotated[int, meta("max_completion_tokens", CHAT)] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, meta("top_logprobs", CHAT)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    # known, accepted by the schema, but not honoured yet: rejected with a 400 naming them unless at their
    # neutral value (see `unsupported_parameter`)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: Prediction | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported_parameter(self) -> str | None:
        """The first known parameter set to something this server does not do yet, else None."""
        neutral = {
            "functions": (None, []),
            "function_call": (None, "none"),
            "audio": (None,),
            "reasoning_effort": (None,),
            "web_search_options": (None,),
            "modalities": (None, ["text"]),
        }
        for name, allowed in neutral.items():
            if getattr(self, name) not in allowed:
                return name
        return None


# ---- responses ---------------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(Struct):
    """Predicted Outputs' counts (sent when the request has a `prediction`)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0
    audio_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: None = None


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class Choice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


class FunctionCallDelta(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(Struct):
    """A call's first delta carries `id`, `type` and `function.name`; later ones `function.arguments` fragments."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: FunctionCallDelta | UnsetType = UNSET


class Delta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class StreamChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[StreamChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET
    """Omitted unless stream_options.include_usage; then null on every chunk but the last."""


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "oai-gemma"
    object: str = "model"
    max_model_len: int | UnsetType = UNSET
    root: str | UnsetType = UNSET
    """A LoRA adapter's directory (vLLM's shape)."""
    parent: str | UnsetType = UNSET
    """A LoRA adapter's base model (vLLM's shape)."""
    modalities: list[str] | UnsetType = UNSET
    """What a request may send it: `text`, and `image` for a multimodal model (unset while it loads)."""
    capabilities: list[str] | UnsetType = UNSET
    """Ollama's word: `completion`, `chat`, `tools`, `structured_output`, `vision`."""
    status: dict[str, str] | UnsetType = UNSET
    """llama-server's router shape: `{"value": "loaded"}` when it answers, `loading` before."""


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody


decoder = msgspec.json.Decoder(ChatCompletionRequest)
encoder = msgspec.json.Encoder()


# ==== /v1/completions: the legacy text-completions endpoint ==========================================
# (kept apart from the chat types above; `SamplingRequest`, `Usage` and `StreamOptions` are shared)

TokenId = Annotated[int, meta("prompt[]", COMPLETIONS, "min")]
TokenIds = Annotated[list[TokenId], meta("prompt[]", COMPLETIONS, "min_items")]


class CompletionRequest(SamplingRequest, kw_only=True, omit_defaults=True):
    model: str
    prompt: str | Annotated[list[str | TokenId | TokenIds], meta("prompt", COMPLETIONS)]
    """A string, a list of strings, a list of token ids or a list of token-id lists (msgspec allows one
    array type per union, so the list's items are checked to be of one kind in `serving_completions`)."""
    max_tokens: Annotated[int, meta("max_tokens", COMPLETIONS)] | None = None
    """None: OpenAI's legacy default, 16. 0 only with `echo` (the prompt back, nothing generated)."""
    best_of: Annotated[int, meta("best_of", COMPLETIONS)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, meta("logprobs", COMPLETIONS)] | None = None
    suffix: str | None = None

    def unsupported_parameter(self) -> str | None:
        """The first known parameter set to something this server does not do (yet), else None."""
        if self.best_of not in (None, 1, self.n or 1):
            return "best_of"
        if self.suffix is not None:
            return "suffix"
        return None


class CompletionLogprobs(Struct):
    """The legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    """Null on every stream chunk but a choice's last."""


class Completion(Struct):
    """Both the response and each stream chunk (OpenAI's legacy endpoint uses one shape for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | UnsetType = UNSET
    """Always in a response; in a stream only on the last chunk (`"choices": []`), with include_usage."""


completion_decoder = msgspec.json.Decoder(CompletionRequest)
