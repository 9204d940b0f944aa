"""`/v1/responses`: the Responses API, a sibling of chat completions on the same request path.

    wire request --input.py--> chat messages (instructions, the previous response's conversation, input), each
                 with the item it came from --build_prompt--> prompt
                 --a GenerationPlan (tools, `text.format`, sampling, budget)--> one engine request, as chat's is built
    engine events --choices.ChoiceAssembler--> deltas --events.ResponseEvents--> output items and events
                 --> a `response` object, or SSE `event: ...` / `data: {...}` ending with `response.completed`

Only the translation is this module's: tools, grammars, images, templates and the assembler are chat's, so a
fix there lands here too. Each field is named as the client sent it from the start (`input[3].content[0]`,
`tools[0].name`, `text.format`), so errors need no renaming.

State: with `store` (default true, as OpenAI's) a finished response and its conversation go to the
`ResponseStore` under the caller's owner (API key); `previous_response_id` reads it back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import msgspec

from ...chat.tools import Function, ToolPlan
from ...engine.submission import Submission
from ...engine.types import GenerationRequest
from ..choices import ChoiceAssembler, assemble, indexed
from ..errors import APIError, check_limits, generation_failure, invalid_request
from ...limits import INPUT_ITEMS
from ..exchange import Exchange
from ..plan import GenerationPlan
from ..protocol import encoder
from ..response_format import OutputFormat
from ..serving import OpenAIServing, ServingContext
from ..serving_chat import logprob_entries
from ..serving_tools import AllowedNames, DeclaredTool, plan_tools
from .events import ResponseEvents
from .input import decode_input, to_messages, validation_error
from .protocol import (
    AllowedToolsChoice,
    DeletedResponse,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    ItemList,
    NamedFunctionChoice,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
    StoredItem,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    TextParam,
    request_decoder,
    stored_items_decoder,
    stored_output_decoder,
)
from .store import ResponseStore, StoreError

LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for the output tokens' logprobs (`top_logprobs` sets how many alternatives)."""

@dataclass
class PreparedResponse:
    request: ResponsesRequest
    generation: GenerationRequest
    tools: ToolPlan | None
    response: Response
    """The response as it starts (`in_progress`, no output)."""
    items: list[StoredItem]
    """The conversation's input items, the previous response's included: stored with the response."""
    owner: str


class ResponsesService(OpenAIServing):
    unsupported_why: ClassVar[dict[str, str]] = {
        "background": "background responses are not supported: leave `background` unset and wait for the response",
        "conversation": "the Conversations API is not supported: use `previous_response_id` or send the items",
        "prompt": "stored prompt templates are not supported: send `instructions` and `input`",
        "truncation": "`truncation: auto` is not supported: an input over the context is a 400 (`disabled`)",
        "reasoning.effort": "Gemma-3 does not reason: leave `reasoning.effort` unset",
        "reasoning.summary": "Gemma-3 does not reason: leave `reasoning.summary` unset",
    }

    def __init__(self, context: ServingContext, default_max_tokens: int, store: ResponseStore):
        super().__init__(context)
        self.default_max_tokens = default_max_tokens
        self.store = store

    # ---- request -> engine ------------------------------------------------------------------------

    async def prepare(self, body: bytes, arrival: float, owner: str, cache_scope: str = "") -> PreparedResponse:
        request: ResponsesRequest = self.decode(request_decoder, body)
        self.check_options(request.unsupported_parameter(), request.stream_options, request.stream)
        history = await self._history(request.previous_response_id, owner)
        items = decode_input(request.input)
        choice = _tool_choice(request.tool_choice)
        tools = plan_tools(_declared_tools(request.tools), choice.mode, choice.named, request.parallel_tool_calls, choice.allowed)
        conversation = to_messages(
            request.instructions, history + items, ["previous_response_id"] * len(history) + [f"input[{i}]" for i in range(len(items))]
        )
        if not conversation.messages:
            raise invalid_request("`input` holds no message (reasoning items alone are not a conversation)", "input")
        prompt = await self.build_prompt(
            conversation.messages, tool_prompt=tools and tools.prompt(), paths=conversation.paths, field="input"
        )
        response_id = f"resp_{uuid.uuid4().hex}"
        plan = GenerationPlan(
            response_id, prompt, request, arrival, request.max_output_tokens, self.default_max_tokens, "input", tools,
            _output_format(request.text), logprobs=(request.top_logprobs or 0) if LOGPROBS in (request.include or ()) else None,
            cache_scope=cache_scope, adapter=self.adapter_of(request.model),
        )
        generation = await self.generation(plan)
        response = self._skeleton(request, response_id, generation.sampling, choice.echo)
        return PreparedResponse(request, generation, tools, response, history + items, owner)

    async def _history(self, previous_id: str | None, owner: str) -> list[StoredItem]:
        """The previous response's conversation: its input items, then its output."""
        if previous_id is None:
            return []
        stored = await self.store.get(owner, previous_id)
        if stored is None:
            raise invalid_request(
                f"Previous response with id '{previous_id}' not found.", "previous_response_id", "previous_response_not_found"
            )
        return stored_items_decoder.decode(stored.input_items) + stored_output_decoder.decode(stored.response).output

    def _skeleton(self, request: ResponsesRequest, response_id: str, sampling, tool_choice) -> Response:
        return Response(
            id=response_id, created_at=int(time.time()), model=request.model, status="in_progress", output=[],
            instructions=request.instructions, tools=[msgspec.convert(t, FunctionTool) for t in request.tools or []],
            tool_choice=tool_choice,
            temperature=sampling.temperature, top_p=sampling.top_p, parallel_tool_calls=request.parallel_tool_calls is not False,
            metadata=request.metadata or {}, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, text=request.text or TextParam(),
            store=request.store is not False, user=request.user if request.user is not None else msgspec.UNSET,
            reasoning=request.reasoning, top_logprobs=request.top_logprobs or 0,
        )

    # ---- engine -> response -----------------------------------------------------------------------

    def _builders(self, prepared: PreparedResponse) -> tuple[ResponseEvents, ChoiceAssembler]:
        if prepared.generation.sampling.logprobs is None:
            return ResponseEvents(prepared.response), ChoiceAssembler(0, prepared.tools)
        entries = partial(logprob_entries, self.engine.token_text)
        return ResponseEvents(prepared.response, entries), ChoiceAssembler(0, prepared.tools, logprobs=True)

    async def complete(self, prepared: PreparedResponse, exchange: Exchange) -> bytes:
        """The whole response: the same deltas and items as a stream, its events dropped."""
        builder, assembler = self._builders(prepared)
        async with self.submit(prepared.generation) as submission:
            async for _, deltas in assemble(indexed(submission), {0: assembler}):
                for delta in deltas:
                    builder.feed(delta)
        if not assembler.done:
            raise generation_failure(None)
        builder.finish(self._end(prepared, assembler, exchange))
        body = encoder.encode(builder.response)
        await self._keep(prepared, body)
        return body

    def stream(self, prepared: PreparedResponse, exchange: Exchange) -> AsyncIterator[bytes]:
        """Takes the request's place in the engine now (a 429 or 503 before the status line, as chat does), held
        by the exchange until the stream ends; then the stream's events."""
        submission = self.submit(prepared.generation)
        exchange.hold(submission)
        return self._stream(prepared, submission, exchange)

    async def _stream(self, prepared: PreparedResponse, submission: Submission, exchange: Exchange) -> AsyncIterator[bytes]:
        builder, assembler = self._builders(prepared)
        for event in builder.start():
            yield sse_event(event)
        try:
            async with submission:
                async for _, deltas in assemble(indexed(submission), {0: assembler}):
                    for delta in deltas:
                        for event in builder.feed(delta):
                            yield sse_event(event)
        except APIError as exc:  # a failure after the response started: `response.failed` says why
            prepared.response.error = ResponseError(_error_code(exc), exc.body.error.message)
            for event in builder.finish("failed"):
                yield sse_event(event)
            return
        last = builder.finish(self._end(prepared, assembler, exchange))
        try:
            await self._keep(prepared, encoder.encode(builder.response))
        except APIError as exc:  # not stored: the client must not take it for a response it can continue from
            prepared.response.error = ResponseError("server_error", exc.body.error.message)
            last[-1:] = builder.refinish("failed")
        for event in last:
            yield sse_event(event)

    def _end(self, prepared: PreparedResponse, assembler: ChoiceAssembler, exchange: Exchange) -> str:
        """Sets the usage and why it is incomplete; returns the final status."""
        if assembler.tool_calls is not None:  # the refined outcome (`tool_calls`) is the one the metrics count
            exchange.refine(prepared.generation.request_id, assembler.finish_reason)
        last = assembler.last
        response = prepared.response
        response.usage = ResponseUsage(
            last.num_prompt_tokens, last.num_output_tokens, last.num_prompt_tokens + last.num_output_tokens,
            InputTokensDetails(last.num_cached_tokens),
        )
        response.completed_at = int(time.time())
        if assembler.finish_reason == "length":
            response.incomplete_details = IncompleteDetails("max_output_tokens")
            return "incomplete"
        return "completed"

    async def _keep(self, prepared: PreparedResponse, body: bytes) -> None:
        """Store the response (`store: true`) before it is sent; a 503 if that fails (disk full, read-only store)."""
        if prepared.response.store:
            try:
                await self.store.put(prepared.owner, prepared.response.id, body, encoder.encode(prepared.items))
            except StoreError as exc:
                raise APIError(503, f"{exc}; `store: false` requests are served", "server_error", None, "store_unavailable") from None

    # ---- stored responses -------------------------------------------------------------------------

    async def retrieve(self, owner: str, response_id: str) -> bytes:
        return (await self._stored(owner, response_id)).response

    async def delete(self, owner: str, response_id: str) -> bytes:
        if not await self.store.delete(owner, response_id):
            raise not_found(response_id)
        return encoder.encode(DeletedResponse(response_id))

    async def input_items(self, owner: str, response_id: str, order: str, after: str | None, limit: int) -> bytes:
        """One page of the conversation's input items, OpenAI's default order (`desc`, newest first)."""
        if order not in ("asc", "desc"):
            raise invalid_request("`order` must be `asc` or `desc`", "order")
        check_limits("limit", INPUT_ITEMS, limit)
        items = stored_items_decoder.decode((await self._stored(owner, response_id)).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise invalid_request(f"no input item `{after}` in response `{response_id}`", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return encoder.encode(ItemList(
            data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
            has_more=len(items) > limit,
        ))

    async def _stored(self, owner: str, response_id: str):
        stored = await self.store.get(owner, response_id)
        if stored is None:
            raise not_found(response_id)
        return stored


def sse_event(event) -> bytes:
    """A Responses stream event: OpenAI names each with an `event:` line, and sends no `[DONE]`."""
    return b"event: " + type(event).__struct_config__.tag.encode() + b"\ndata: " + encoder.encode(event) + b"\n\n"


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id", "response_not_found")


def _error_code(exc: APIError) -> str:
    """`Response.error.code` takes OpenAI's few codes: a busy engine is `rate_limit_exceeded`, the rest `server_error`."""
    return "rate_limit_exceeded" if exc.status == 429 else "server_error"


# ---- Responses' tools and text format, as the plan takes them ---------------------------------------------


def _declared_tools(raw: list | None) -> list[DeclaredTool]:
    """`tools`, each named `tools[i]`; a built-in tool (`web_search`, `file_search`, ...) or a malformed one is a
    400 naming it."""
    tools = []
    for i, tool in enumerate(raw or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid_request(
                f"tool type {kind!r} is not supported: this server runs function tools only", f"tools[{i}].type"
            )
        try:
            f = msgspec.convert(tool, FunctionTool)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, f"tools[{i}]", tool) from None
        tools.append(DeclaredTool(Function(f.name, f.description, f.parameters), f"tools[{i}]"))
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """Responses' `tool_choice` read: `plan_tools`' arguments, and what the response echoes."""

    mode: str | None
    """none, auto, required or unset (an `allowed_tools` choice's mode)."""
    echo: str | NamedFunctionChoice | AllowedToolsChoice
    named: str | None = None
    allowed: AllowedNames | None = None


def _tool_choice(choice) -> ToolChoice:
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(choice, choice or "auto")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return ToolChoice(None, NamedFunctionChoice(name=choice["name"]), named=choice["name"])
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        try:
            allowed = msgspec.convert(choice, AllowedToolsChoice)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, "tool_choice", choice) from None
        return ToolChoice(allowed.mode, allowed, allowed=AllowedNames([t.name for t in allowed.tools], "tool_choice.tools"))
    raise invalid_request(
        "`tool_choice` must be none, auto, required, {\"type\": \"function\", \"name\": ...} or "
        "{\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}", "tool_choice"
    )


def _output_format(text: TextParam | None) -> OutputFormat | None:
    """`text.format` (None for plain text)."""
    fmt = text.format if text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        return OutputFormat({"type": "object"}, "text.format")
    if isinstance(fmt, TextFormatJSONSchema):
        return OutputFormat(fmt.schema, "text.format")
    return None
