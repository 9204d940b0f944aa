"""`/v1/chat/completions`: the wire request -> one engine request; the choices' deltas -> a `chat.completion`
or a stream of `chat.completion.chunk` SSE events.

The HTTP layer translates; it does not compute: prompts are chat's (`build_prompt`), the deltas the assembler's
(`choices.py`), the checks and the submission the serving base's (`serving.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from ..chat.tools import ToolPlan
from ..engine.submission import Submission
from ..engine.types import GenerationRequest, TokenEvent
from .exchange import Exchange
from .choices import ChoiceAssembler, ChoiceDelta, Finish, TextDelta, ToolCallStart, assemble, indexed
from .errors import APIError, generation_failure, over_limit
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    CompletionTokensDetails,
    Delta,
    FunctionCallDelta,
    PromptTokensDetails,
    StreamChoice,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    decoder,
    encoder,
)
from .plan import GenerationPlan
from .response_format import chat_output_format
from .serving import DONE, OpenAIServing, ServingContext, sse, sse_error
from .serving_tools import chat_tools, wire_calls


@dataclass(frozen=True)
class PreparedChat:
    request: ChatCompletionRequest
    generation: GenerationRequest
    created: int
    tools: ToolPlan | None = None


class ChatService(OpenAIServing):
    def __init__(self, context: ServingContext, default_max_tokens: int):
        super().__init__(context)
        self.default_max_tokens = default_max_tokens

    # ---- request -> engine ------------------------------------------------------------------------

    async def prepare(self, body: bytes, arrival: float, cache_scope: str = "") -> PreparedChat:
        """The checked request and its engine request (built once), or an `APIError` before any byte is sent
        (`cache_scope`: the tenant whose cached prefixes it may share, `GenerationPlan.cache_scope`)."""
        request: ChatCompletionRequest = self.decode(decoder, body)
        tools = chat_tools(request)
        prompt = await self.build_prompt(request.messages, tool_prompt=tools and tools.prompt())
        if request.top_logprobs and not request.logprobs:
            raise over_limit("top_logprobs", "requires", "logprobs: true", f"logprobs: {'false' if request.logprobs is False else 'null'}")
        plan = GenerationPlan(
            f"chatcmpl-{uuid.uuid4().hex}", prompt, request, arrival, request.max_completion_tokens or request.max_tokens,
            self.default_max_tokens, "messages", tools, chat_output_format(request.response_format),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None, n=request.n, cache_scope=cache_scope,
            adapter=self.adapter_of(request.model),
            prediction=request.prediction.text if request.prediction else "",
        )
        return PreparedChat(request, await self.generation(plan), int(time.time()), tools)

    def _assemblers(self, prepared: PreparedChat) -> dict[int, ChoiceAssembler]:
        logprobs = prepared.generation.sampling.logprobs is not None
        return {i: ChoiceAssembler(i, prepared.tools, logprobs=logprobs) for i in range(prepared.generation.n)}

    # ---- engine -> response -----------------------------------------------------------------------

    async def complete(self, prepared: PreparedChat, exchange: Exchange) -> bytes:
        """The whole `chat.completion`: the assemblers fold the deltas as they go."""
        assemblers = self._assemblers(prepared)
        async with self.submit(prepared.generation) as submission:
            async for _ in assemble(indexed(submission), assemblers):
                pass
        if not all(a.done for a in assemblers.values()):
            raise generation_failure(None)
        _report(prepared, assemblers.values(), exchange)
        choices = [self._choice(a, prepared) for a in assemblers.values()]
        usage = _usage([a.last for a in assemblers.values()], prepared.request.prediction is not None)
        response = ChatCompletion(prepared.generation.request_id, prepared.created, prepared.request.model, choices, usage)
        return encoder.encode(response)

    def _choice(self, assembler: ChoiceAssembler, prepared: PreparedChat) -> Choice:
        calls = assembler.tool_calls
        message = AssistantMessage(None, tool_calls=wire_calls(calls)) if calls is not None else AssistantMessage(assembler.text)
        logprobs = ChoiceLogprobs(logprob_entries(self.engine.token_text, assembler.tokens)) if assembler.logprobs else None
        return Choice(assembler.index, message, assembler.finish_reason, logprobs)

    def stream(self, prepared: PreparedChat, exchange: Exchange) -> AsyncIterator[bytes]:
        """Takes the request's place in the engine now (a 429 or 503 before the status line), held by the exchange
        until the stream ends; then the stream's events."""
        submission = self.submit(prepared.generation)
        exchange.hold(submission)
        return self._stream(prepared, submission, exchange)

    async def _stream(self, prepared: PreparedChat, submission: Submission, exchange: Exchange) -> AsyncIterator[bytes]:
        """`chat.completion.chunk` events: a role chunk per choice, then each delta as it comes, usage, `[DONE]`."""
        chunks = _ChunkEncoder(self, prepared)
        assemblers = self._assemblers(prepared)
        async with submission:
            for index in assemblers:
                yield chunks.encode(index, Delta(role="assistant", content=""))
            try:
                async for assembler, deltas in assemble(indexed(submission), assemblers):
                    for delta in deltas:
                        yield chunks.delta(assembler.index, delta)
            except APIError as exc:  # one choice failed: the request fails (the rest is cancelled)
                yield sse_error(exc)
                return
        _report(prepared, assemblers.values(), exchange)
        finished = [a.last for a in assemblers.values() if a.finish_reason is not None]
        if chunks.include_usage and finished:
            yield chunks.usage(_usage(finished, prepared.request.prediction is not None))
        yield DONE

class _ChunkEncoder:
    """Deltas -> `chat.completion.chunk` SSE events of one response."""

    def __init__(self, service: ChatService, prepared: PreparedChat):
        options = prepared.request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.usage_field = None if self.include_usage else msgspec.UNSET
        self.token_text = service.engine.token_text
        self.head = (prepared.generation.request_id, prepared.created, prepared.request.model)
        self.logprobs = prepared.generation.sampling.logprobs is not None

    def delta(self, index: int, delta: ChoiceDelta) -> bytes:
        logprobs = ChoiceLogprobs(logprob_entries(self.token_text, delta.tokens)) if self.logprobs and delta.tokens else None
        if isinstance(delta, Finish):
            return self.encode(index, Delta(), delta.reason, logprobs)
        return self.encode(index, _wire_delta(delta), None, logprobs)

    def encode(self, index: int, delta: Delta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> bytes:
        return sse(ChatCompletionChunk(*self.head, [StreamChoice(index, delta, logprobs, finish)], usage=self.usage_field))

    def usage(self, usage: Usage) -> bytes:
        return sse(ChatCompletionChunk(*self.head, [], usage=usage))


def logprob_entries(token_text, events: tuple[TokenEvent, ...] | list[TokenEvent]) -> list[TokenLogprob]:
    """OpenAI's `logprobs.content` for the events' tokens (stop tokens carry none); `token_text`: the engine's
    token id -> (text, UTF-8 bytes)."""
    entries = []
    for event in events:
        if event.logprob is not None:
            text, raw = token_text(event.token_id)
            entries.append(TokenLogprob(text, event.logprob, raw, [_top(token_text, *pair) for pair in event.top_logprobs]))
    return entries


def _top(token_text, token_id: int, logprob: float) -> TopLogprob:
    text, raw = token_text(token_id)
    return TopLogprob(text, logprob, raw)


def _report(prepared: PreparedChat, assemblers, exchange: Exchange) -> None:
    """A tool-call answer's finish reason (`tool_calls`, not the engine's `stop`) is the one the metrics count."""
    called = [a.finish_reason for a in assemblers if a.tool_calls is not None]
    if called:
        exchange.refine(prepared.generation.request_id, called[0])


def _wire_delta(delta: ChoiceDelta) -> Delta:
    if isinstance(delta, TextDelta):
        return Delta(content=delta.text)
    if isinstance(delta, ToolCallStart):  # a call's first delta: `id`, `type`, `function.name`, arguments ""
        return Delta(tool_calls=[ToolCallDelta(delta.call, delta.id, "function", FunctionCallDelta(delta.name, ""))])
    return Delta(tool_calls=[ToolCallDelta(delta.call, function=FunctionCallDelta(arguments=delta.arguments))])


def _usage(last_events: list[TokenEvent], predicted: bool = False) -> Usage:
    """One prompt, however many choices: completion tokens add up over the choices' last events (so do Predicted
    Outputs' accepted and rejected tokens, sent when the request had a `prediction`)."""
    prompt = last_events[0].num_prompt_tokens
    completion = sum(e.num_output_tokens for e in last_events)
    details = CompletionTokensDetails(
        sum(e.accepted_prediction_tokens for e in last_events), sum(e.rejected_prediction_tokens for e in last_events),
    ) if predicted else msgspec.UNSET
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(last_events[0].num_cached_tokens), details)
