"""`/v1/chat/completions`: translate the wire request into an engine request, and the engine's token
events back into a `chat.completion` or a stream of `chat.completion.chunk` SSE events.

The HTTP layer translates; it does not compute.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from ..chat import ChatInputError, RenderedChat, render_chat
from ..chat.images import image_client, load_images
from ..chat.vision import VisionPrompt, expand_images
from ..engine.engine import Engine, EngineBusyError, EngineDeadError
from ..engine.types import GenerationRequest, SamplingParams
from ..settings import ImageSettings
from .errors import APIError, decode_body, invalid_request, model_not_found, not_supported
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    Delta,
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    StreamChoice,
    TokenLogprob,
    TopLogprob,
    Usage,
    decoder,
    encoder,
)
from .response_format import response_format_grammar

DONE = b"data: [DONE]\n\n"
LONG_PROMPT_CHARS = 20_000


def sse(payload) -> bytes:
    return b"data: " + encoder.encode(payload) + b"\n\n"


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    generation: GenerationRequest
    created: int


class ChatService:
    def __init__(
        self, engine: Engine, served_name: str, max_model_len: int, default_max_tokens: int, images: ImageSettings
    ):
        self.engine = engine
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.images = images
        self.processor = engine.loaded.processor
        self._image_client = None

    # ---- request -> engine ------------------------------------------------------------------------

    async def prepare(self, body: bytes, arrival: float) -> PreparedChat:
        request = decode_body(decoder, body)
        if request.model != self.served_name:
            raise model_not_found(request.model, self.served_name)
        unsupported = request.unsupported_parameter()
        if unsupported:
            raise not_supported(unsupported)
        if request.stream_options is not None and not request.stream:
            raise invalid_request("`stream_options` is only allowed when `stream` is true", "stream_options")
        try:
            rendered = render_chat(msgspec.to_builtins(request.messages))
        except ChatInputError as exc:
            raise invalid_request(exc.message, exc.param) from None
        vision = await self.vision_prompt(rendered) if rendered.images else None
        if vision is not None:
            prompt_ids = vision.token_ids
        else:
            prompt_ids = await self.encode(rendered.prompt)
        generation = self._generation_request(request, prompt_ids, arrival)
        generation.grammar = await response_format_grammar(self.engine, request.response_format)
        if vision is not None:
            generation.pixel_values, generation.crop_keys = vision.pixel_values, tuple(vision.crop_keys)
        try:
            self.engine.check_capacity()
        except EngineBusyError as exc:
            raise busy(exc) from None
        return PreparedChat(request, generation, int(time.time()))

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; a long one (a book) is tokenized off the event loop."""
        def run() -> list[int]:
            return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(run) if len(text) > LONG_PROMPT_CHARS else run()

    async def vision_prompt(self, rendered: RenderedChat) -> VisionPrompt:
        """Fetch and decode the images (concurrently, off the event loop), then run the model's processor."""
        if self.processor is None:
            raise invalid_request(
                f"the model `{self.served_name}` is text-only and cannot read images; "
                "serve a multimodal Gemma-3 model (google/gemma-3-4b-it, -12b-it or -27b-it) to send images",
                rendered.images[0].param, "image_not_supported",
            )
        if self._image_client is None:
            self._image_client = image_client(self.images)
        try:
            images = await load_images(rendered.images, self.images, self._image_client)
        except ChatInputError as exc:
            raise invalid_request(exc.message, exc.param, "invalid_image") from None
        scans = [p.detail == "high" or (p.detail == "auto" and self.images.pan_and_scan) for p in rendered.images]
        return await asyncio.to_thread(expand_images, self.processor, rendered.prompt, images, scans)

    def _generation_request(self, request: ChatCompletionRequest, prompt_ids: list[int], arrival: float) -> GenerationRequest:
        room = self.max_model_len - len(prompt_ids)
        asked = request.max_completion_tokens or request.max_tokens
        if room < 1 or (asked is not None and asked > room):
            wanted = len(prompt_ids) + (asked or 1)
            raise invalid_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(prompt_ids)} in the messages, {asked or 1} in the completion). "
                "Please reduce the length of the messages or completion.",
                "messages", "context_length_exceeded",
            )
        stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
        if request.top_logprobs and not request.logprobs:
            raise invalid_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        if request.min_tokens and asked and request.min_tokens > asked:
            raise invalid_request("`min_tokens` must not exceed `max_tokens`", "min_tokens")
        sampling = SamplingParams(
            max_tokens=asked or min(self.default_max_tokens, room),
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=max(request.top_k or 0, 0),
            seed=request.seed,
            stop=stop,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=request.repetition_penalty or 1.0,
            min_p=request.min_p or 0.0,
            logit_bias=self._logit_bias(request.logit_bias),
            min_tokens=request.min_tokens or 0,
            ignore_eos=bool(request.ignore_eos),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        )
        return GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, sampling, arrival)

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's `{"token id": bias}`; the ids must be in the vocabulary."""
        pairs = []
        for key, value in (bias or {}).items():
            if not key.isdigit() or int(key) >= self.engine.vocab_limit:
                raise invalid_request(f"logit_bias key {key!r} is not a token id of this model", "logit_bias")
            pairs.append((int(key), float(value)))
        return tuple(pairs)

    # ---- engine -> response -----------------------------------------------------------------------

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.engine.token_text(token_id)
        return TopLogprob(text, logprob, raw)

    def _logprob_entries(self, events) -> list[TokenLogprob]:
        """OpenAI's `logprobs.content` for the events' tokens (stop tokens carry none)."""
        entries = []
        for event in events:
            if event.logprob is None:
                continue
            text, raw = self.engine.token_text(event.token_id)
            top = [self._top_logprob(i, lp) for i, lp in event.top_logprobs]
            entries.append(TokenLogprob(text, event.logprob, raw, top))
        return entries

    async def complete(self, prepared: PreparedChat) -> bytes:
        pieces: list[str] = []
        logprobs: list = []
        want_logprobs = prepared.generation.sampling.logprobs is not None
        event = None
        try:
            async with self.engine.generate(prepared.generation) as events:
                async for event in events:
                    pieces.append(event.text)
                    if want_logprobs:
                        logprobs.append(event)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", None, "engine_unavailable") from None
        except EngineBusyError as exc:
            raise busy(exc) from None
        if event is None or event.finish_reason not in ("stop", "length"):
            raise APIError(500, f"generation failed: {event.error if event else 'no output'}", "server_error")
        response = ChatCompletion(
            id=prepared.generation.request_id,
            created=prepared.created,
            model=self.served_name,
            choices=[
                Choice(
                    0, AssistantMessage("".join(pieces)), event.finish_reason,
                    ChoiceLogprobs(self._logprob_entries(logprobs)) if want_logprobs else None,
                )
            ],
            usage=_usage(event),
        )
        return encoder.encode(response)

    async def stream(self, prepared: PreparedChat) -> AsyncIterator[bytes]:
        include_usage = bool(prepared.request.stream_options and prepared.request.stream_options.include_usage)
        usage_field = None if include_usage else msgspec.UNSET
        rid, created, model = prepared.generation.request_id, prepared.created, self.served_name

        want_logprobs = prepared.generation.sampling.logprobs is not None
        pending: list = []  # events whose text is still held back (a partial character or stop string)

        def chunk(delta: Delta, finish: str | None = None) -> bytes:
            logprobs = ChoiceLogprobs(self._logprob_entries(pending)) if want_logprobs and pending else None
            pending.clear()
            choice = StreamChoice(0, delta, logprobs, finish)
            return sse(ChatCompletionChunk(rid, created, model, [choice], usage=usage_field))

        event = None
        try:
            submission = self.engine.generate(prepared.generation)  # takes its place before the first byte
        except (EngineDeadError, EngineBusyError) as exc:
            yield sse(ErrorResponse(ErrorBody(str(exc), "server_error", None, "engine_unavailable")))
            yield DONE
            return
        async with submission:
            yield chunk(Delta(role="assistant", content=""))
            async for event in submission:
                if want_logprobs:
                    pending.append(event)
                if event.text:
                    yield chunk(Delta(content=event.text))
        if event is not None:
            if event.finish_reason in ("stop", "length"):
                yield chunk(Delta(), event.finish_reason)
                if include_usage:
                    yield sse(ChatCompletionChunk(rid, created, model, [], usage=_usage(event)))
            else:
                message = f"generation failed: {event.error or event.finish_reason}"
                yield sse(ErrorResponse(ErrorBody(message, "server_error", None, "generation_failed")))
        yield DONE


def busy(exc: Exception) -> APIError:
    return APIError(429, str(exc), "requests", None, "rate_limit_exceeded", {"Retry-After": "1"})


def _usage(event) -> Usage:
    return Usage(
        event.num_prompt_tokens, event.num_output_tokens, event.num_prompt_tokens + event.num_output_tokens,
        PromptTokensDetails(event.num_cached_tokens),
    )
