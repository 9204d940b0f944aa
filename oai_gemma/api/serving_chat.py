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
from ..engine.types import GenerationRequest
from ..settings import ImageSettings
from .access_log import set_finish_reason
from .errors import APIError, context_length_exceeded, decode_body, invalid_request, model_not_found, not_supported
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    Delta,
    PromptTokensDetails,
    StreamChoice,
    TokenLogprob,
    TopLogprob,
    Usage,
    decoder,
    encoder,
)
from .response_format import response_format_grammar
from .sampling import choice_count, completion_budget, sampling_params
from .serving_tools import ToolPlan, force_calls, plan_tools, stream_deltas, wire_calls

DONE = b"data: [DONE]\n\n"
FINISHED = ("stop", "length")
"""A choice that ended with one of these succeeded."""
LONG_PROMPT_CHARS = 20_000


def sse(payload) -> bytes:
    return b"data: " + encoder.encode(payload) + b"\n\n"


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    generation: GenerationRequest
    created: int
    tools: ToolPlan | None = None


class ChatService:
    def __init__(
        self, engine: Engine, served_name: str, max_model_len: int, default_max_tokens: int, images: ImageSettings
    ):
        self.engine = engine
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.images = images
        self.processor = engine.processor
        self.max_prompt_chars = max_model_len * longest_token_chars(engine.tokenizer)
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
        tools = plan_tools(request)
        try:
            rendered = render_chat(msgspec.to_builtins(request.messages), tool_prompt=tools and tools.prompt())
        except ChatInputError as exc:
            raise invalid_request(exc.message, exc.param) from None
        vision = await self.vision_prompt(rendered) if rendered.images else None
        if vision is not None:
            prompt_ids = vision.token_ids
        else:
            prompt_ids = await self.encode_prompt(rendered.prompt, "messages")
        generation = self._generation_request(request, prompt_ids, arrival)
        generation.grammar = await response_format_grammar(self.engine, request.response_format)
        if vision is not None:
            generation.pixel_values, generation.crop_keys = vision.pixel_values, tuple(vision.crop_keys)
        if tools is not None:
            await force_calls(self.engine, generation, tools)
        try:
            self.engine.check_capacity()
        except EngineBusyError as exc:
            raise busy(exc) from None
        return PreparedChat(request, generation, int(time.time()), tools)

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; a long one (a book) is tokenized off the event loop."""
        def run() -> list[int]:
            return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(run) if len(text) > LONG_PROMPT_CHARS else run()

    async def encode_prompt(self, text: str, where: str, add_special_tokens: bool = False) -> list[int]:
        """A prompt's token ids; one too long to fit whatever it says is a 400 at once, not after tokenizing megabytes."""
        if len(text) > self.max_prompt_chars:
            raise context_length_exceeded(
                self.max_model_len, f"the {where} is {len(text)} characters long, more than that many tokens can hold", where
            )
        return await self.encode(text, add_special_tokens)

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
        asked = request.max_completion_tokens or request.max_tokens
        max_tokens = completion_budget(len(prompt_ids), asked, self.default_max_tokens, self.max_model_len, "messages")
        if request.top_logprobs and not request.logprobs:
            raise invalid_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        sampling = sampling_params(request, max_tokens, logprobs, self.engine.vocab_limit)
        n = choice_count(request.n, self.engine.num_slots)
        return GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, sampling, arrival, n=n)

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
        n = prepared.generation.n
        pieces: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        want_logprobs = prepared.generation.sampling.logprobs is not None
        last: dict[int, object] = {}  # choice index -> its last event
        calls = [prepared.tools.stream() for _ in range(n)] if prepared.tools else None
        try:
            async with self.engine.generate(prepared.generation) as events:
                async for event in events:
                    if calls is not None and calls[event.index].done:
                        continue  # complete calls end the answer: what the model adds after them is dropped
                    pieces[event.index].append(event.text)
                    if want_logprobs:
                        logprobs[event.index].append(event)
                    if calls is not None:
                        calls[event.index].feed(event.text)
                        if event.finish_reason in FINISHED and not calls[event.index].done:
                            calls[event.index].finish()  # the end: a call cut short stays a call, as in a stream
                        if calls[event.index].done:
                            last[event.index] = event
                    if event.finish_reason is not None:
                        last[event.index] = event
                    if calls is not None and all(c.done for c in calls):
                        break
        except EngineDeadError as exc:
            raise unavailable(exc) from None
        except EngineBusyError as exc:
            raise busy(exc) from None
        called = [calls is not None and calls[i].done for i in range(n)]
        failed = [e for i, e in last.items() if e.finish_reason not in FINISHED and not called[i]]
        if failed or len(last) < n:
            raise generation_failure(failed[0] if failed else None)
        finishes = [
            prepared.tools.finish_reason(calls[i], last[i].finish_reason) if called[i] else last[i].finish_reason
            for i in range(n)
        ]
        if any(called):
            set_finish_reason(prepared.generation.request_id, finishes[called.index(True)])
        choices = [
            Choice(
                i,
                AssistantMessage(None, tool_calls=wire_calls(calls[i].calls)) if called[i]
                else AssistantMessage("".join(pieces[i])),
                finishes[i],
                ChoiceLogprobs(self._logprob_entries(logprobs[i])) if want_logprobs else None,
            )
            for i in range(n)
        ]
        response = ChatCompletion(
            id=prepared.generation.request_id, created=prepared.created, model=self.served_name, choices=choices,
            usage=_usage(list(last.values())),
        )
        return encoder.encode(response)

    async def stream(self, prepared: PreparedChat) -> AsyncIterator[bytes]:
        include_usage = bool(prepared.request.stream_options and prepared.request.stream_options.include_usage)
        usage_field = None if include_usage else msgspec.UNSET
        rid, created, model = prepared.generation.request_id, prepared.created, self.served_name
        n = prepared.generation.n

        want_logprobs = prepared.generation.sampling.logprobs is not None
        pending: list[list] = [[] for _ in range(n)]  # per choice: events whose text is still held back
        calls = [prepared.tools.stream() for _ in range(n)] if prepared.tools else None

        def chunk(index: int, delta: Delta, finish: str | None = None) -> bytes:
            held = pending[index]
            logprobs = ChoiceLogprobs(self._logprob_entries(held)) if want_logprobs and held else None
            held.clear()
            choice = StreamChoice(index, delta, logprobs, finish)
            return sse(ChatCompletionChunk(rid, created, model, [choice], usage=usage_field))

        try:
            submission = self.engine.generate(prepared.generation)  # takes its place before the first byte
        except (EngineDeadError, EngineBusyError) as exc:
            yield sse(unavailable(exc).body)
            yield DONE
            return
        last = []
        async with submission:
            for index in range(n):
                yield chunk(index, Delta(role="assistant", content=""))
            async for event in submission:
                if calls is not None and calls[event.index].done:
                    continue  # complete calls end the answer: what the model adds after them is dropped
                if want_logprobs:
                    pending[event.index].append(event)
                if calls is None:
                    if event.text:
                        yield chunk(event.index, Delta(content=event.text))
                else:
                    splitter = calls[event.index]
                    for delta in stream_deltas(splitter.feed(event.text)):
                        yield chunk(event.index, delta)
                    if event.finish_reason in FINISHED and not splitter.done:
                        for delta in stream_deltas(splitter.finish()):
                            yield chunk(event.index, delta)
                    if splitter.done:
                        last.append(event)
                        finish = prepared.tools.finish_reason(splitter, event.finish_reason)
                        set_finish_reason(rid, finish)
                        yield chunk(event.index, Delta(), finish)
                        if all(c.done for c in calls):
                            break
                        continue
                if event.finish_reason is None:
                    continue
                if event.finish_reason not in FINISHED:  # one choice failed: the request fails (the rest is cancelled)
                    yield sse(generation_failure(event).body)
                    yield DONE
                    return
                last.append(event)
                yield chunk(event.index, Delta(), event.finish_reason)
        if include_usage and last:
            yield sse(ChatCompletionChunk(rid, created, model, [], usage=_usage(last)))
        yield DONE


def longest_token_chars(tokenizer) -> int:
    """No token stands for more characters than its longest vocabulary piece (Gemma's normalizer only maps " " to
    "▁"), so a prompt longer than `max_model_len` times this cannot fit, whatever it says."""
    return max(len(piece) for piece in tokenizer.get_vocab())


def busy(exc: Exception) -> APIError:
    return APIError(429, str(exc), "requests", None, "rate_limit_exceeded", {"Retry-After": "1"})


def unavailable(exc: Exception) -> APIError:
    return APIError(503, str(exc), "server_error", None, "engine_unavailable")


def generation_failure(event) -> APIError:
    """Why a request ended without `stop` or `length`, as the client sees it (status, or a stream's error event)."""
    if event is None:
        return APIError(500, "generation failed: no output", "server_error", None, "generation_failed")
    if event.finish_reason == "timeout":
        return APIError(504, event.error, "server_error", None, "timeout")
    if event.finish_reason == "aborted":
        return APIError(503, event.error, "server_error", None, "server_shutting_down")
    return APIError(500, f"generation failed: {event.error or event.finish_reason}", "server_error", None, "generation_failed")


def _usage(last_events: list) -> Usage:
    """One prompt, however many choices: completion tokens add up over the choices' last events."""
    prompt = last_events[0].num_prompt_tokens
    completion = sum(e.num_output_tokens for e in last_events)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(last_events[0].num_cached_tokens))
