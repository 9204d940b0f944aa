"""The serving base every OpenAI route builds on, as vLLM's `OpenAIServing`.

    HTTP body --OpenAIServing.decode--> wire request (msgspec Struct), checked: model, unsupported parameters,
                                        `stream_options`
              --build_prompt / encode--> chat.Prompt (token ids, images, cache keys)     [chat/prompt.py]
              --the route fills a GenerationPlan--> engine GenerationRequest (one builder)  [plan.py]
              --submit--> engine Submission --choices.assemble--> deltas                  [choices.py]
              --the route's encoder--> JSON response, or SSE `data: {...}` ... `data: [DONE]` (`sse`, `DONE`)

The routes (`serving_chat.ChatService`, `serving_completions.CompletionService`, `serving_tokenize.TokenizeService`,
the Responses API) are siblings: each subclasses `OpenAIServing`, and all are built once at start-up
(`services.py`), sharing one `PromptBuilder`. Every refusal is an `APIError` (OpenAI's envelope, the right status).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ..chat import ChatInputError, ChatMessage, Prompt, PromptBuilder
from ..engine.engine import Engine, EngineBusyError, EngineDeadError
from ..engine.submission import Submission
from ..engine.types import GenerationRequest
from .errors import APIError, busy, chat_input_error, decode_body, invalid_request, model_not_found, not_supported, over_limit, unavailable
from .plan import GenerationPlan, generation_request
from .protocol import SamplingRequest, encoder

DONE = b"data: [DONE]\n\n"


def sse(payload: Any) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return b"data: " + encoder.encode(payload) + b"\n\n"


def sse_error(exc: APIError) -> bytes:
    """A stream that fails after its status line: the error as its last event, then `[DONE]` (as vLLM does)."""
    return sse(exc.body) + DONE


@dataclass(frozen=True)
class ServingContext:
    """What every service is built from, once at start-up."""

    engine: Engine
    served_name: str
    max_model_len: int
    prompts: PromptBuilder


class OpenAIServing:
    """The engine handle, the served name, `max_model_len`, prompt building, the common checks, admission."""

    unsupported_why: dict[str, str] = {}
    """Per parameter, why it is refused, where a generic "not supported yet" would mislead."""

    def __init__(self, context: ServingContext):
        self.engine = context.engine
        self.served_name = context.served_name
        self.max_model_len = context.max_model_len
        self.prompts = context.prompts

    # ---- request checks ---------------------------------------------------------------------------

    def decode(self, decoder: msgspec.json.Decoder, body: bytes, *, model_required: bool = True):
        """The wire request, checked (a 400/404 otherwise): it names the served model (a request that may leave
        `model` unset skips that when it does); a chat or completions request also `check_options`."""
        request = decode_body(decoder, body)
        if model_required or request.model is not None:
            self.check_model(request.model)
        if isinstance(request, SamplingRequest):
            self.check_options(request.unsupported_parameter(), request.stream_options, request.stream)
        return request

    def check_options(self, unsupported: str | None, stream_options: object | None, stream: bool | None) -> None:
        """No parameter this server does not do (`unsupported`: the first one set), `stream_options` only with `stream`."""
        if unsupported:
            why = self.unsupported_why.get(unsupported)
            raise invalid_request(why, unsupported, "unsupported_parameter") if why else not_supported(unsupported)
        if stream_options is not None and not stream:
            raise invalid_request("`stream_options` is only allowed when `stream` is true", "stream_options")

    def check_model(self, model: str) -> None:
        """The base model's name or a LoRA adapter's, else a 404 `model_not_found`."""
        if model != self.served_name and self.adapter_of(model) is None:
            raise model_not_found(model, self.served_name)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (engine/lora/), None for the base model or a name no adapter has."""
        adapters = self.engine.adapters
        if model is None or model == self.served_name or adapters is None:
            return None
        return model if adapters.lookup(model) is not None else None

    # ---- prompts ----------------------------------------------------------------------------------

    async def build_prompt(self, messages: list[ChatMessage], **options) -> Prompt:
        """`PromptBuilder.build_prompt`, its refusals as 400s (`options`: tool_prompt, add_generation_prompt,
        add_special_tokens)."""
        try:
            return await self.prompts.build_prompt(messages, **options)
        except ChatInputError as exc:
            raise chat_input_error(exc, self.max_model_len) from None

    async def encode(self, text: str, where: str, add_special_tokens: bool = False) -> list[int]:
        """A text prompt's token ids; one that cannot fit the context is a 400 `context_length_exceeded`."""
        try:
            return await self.prompts.encode(text, where, add_special_tokens)
        except ChatInputError as exc:
            raise chat_input_error(exc, self.max_model_len) from None

    def check_token_ids(self, ids: list[int], param: str, limit: int | None = None) -> None:
        """Every id within the vocabulary (`limit`: its size; the sampler's by default), else a 400 naming the id
        (`param[i]`)."""
        limit = self.engine.vocab_limit if limit is None else limit
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < limit), None)  # -1 would fail the whole step
        if bad is not None:
            kind, bound = ("min", 0) if ids[bad] < 0 else ("max", limit - 1)
            raise over_limit(f"{param}[{bad}]", kind, bound, ids[bad], " (the vocabulary's ids)", "invalid_token_id")

    # ---- the engine -------------------------------------------------------------------------------

    async def generation(self, plan: GenerationPlan) -> GenerationRequest:
        """The engine request of an endpoint's plan, built alike for every wire format (`plan.py`)."""
        return await generation_request(plan, self.engine, self.max_model_len)

    def submit(self, *generations: GenerationRequest) -> Submission:
        """Every request's place in the engine (one per choice), all or none, or a 429/503: the engine's one
        `admit`, decided at once, so concurrent requests cannot overfill the engine."""
        try:
            return self.engine.admit(generations)
        except EngineBusyError as exc:
            raise busy(exc) from None
        except EngineDeadError as exc:
            raise unavailable(exc) from None
