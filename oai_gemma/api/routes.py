"""The routes: each one reads its body, asks its service (built once, `services.py`) and answers; the services
do the work. The server's state (`app.ServerState`) is `request.app.state.server`."""

from __future__ import annotations

import asyncio
import time
from litestar import Request, Response, get, post
from litestar.response import Stream

from .exchange import exchange_of
from .errors import APIError, model_not_found
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .openapi import HEALTH, SERVER_INFO, documented
from .protocol import (
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion, CompletionRequest, ModelCard, ModelList, encoder,
)
from .serving_tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request):
    """The app's `ServerState` (`app.py`, which imports this module)."""
    return request.app.state.server


def _json(payload, status: int = 200) -> Response:
    return Response(content=encoder.encode(payload), media_type=JSON, status_code=status)


@post("/v1/chat/completions", status_code=200, operation_class=documented(ChatCompletion, request=ChatCompletionRequest, stream=ChatCompletionChunk))
async def chat_completions(request: Request) -> Response:
    arrival, body = time.perf_counter(), await request.body()
    async with _state(request).use(body) as services:  # the model `model` names, loaded if need be
        chat, exchange = services.chat, exchange_of(request.scope)
        prepared = await chat.prepare(body, arrival, _state(request).cache_scope(request))
        if prepared.request.stream:  # a stream notices a gone client when a write fails; Litestar then closes it
            return Stream(chat.stream(prepared, exchange), media_type="text/event-stream", headers=SSE_HEADERS)
        return Response(content=await unless_disconnected(request, chat.complete(prepared, exchange)), media_type=JSON)


@post("/v1/completions", status_code=200, operation_class=documented(Completion, request=CompletionRequest, stream=Completion))
async def completions(request: Request) -> Response:
    arrival, body = time.perf_counter(), await request.body()
    async with _state(request).use(body) as services:
        service, exchange = services.completions, exchange_of(request.scope)
        prepared = await service.prepare(body, arrival, _state(request).cache_scope(request))
        if prepared.request.stream:
            return Stream(service.stream(prepared, exchange), media_type="text/event-stream", headers=SSE_HEADERS)
        return Response(content=await unless_disconnected(request, service.complete(prepared, exchange)), media_type=JSON)


@post("/tokenize", status_code=200, operation_class=documented(TokenizeResponse, request=TokenizeRequest))  # vLLM's extensions, at the root as vLLM serves them
async def tokenize_route(request: Request) -> Response:
    body = await request.body()
    async with _state(request).use(body) as services:
        return Response(content=await services.tokenize.tokenize(body), media_type=JSON)


@post("/detokenize", status_code=200, operation_class=documented(DetokenizeResponse, request=DetokenizeRequest))
async def detokenize_route(request: Request) -> Response:
    body = await request.body()
    async with _state(request).use(body) as services:
        return Response(content=services.tokenize.detokenize(body), media_type=JSON)


def _cards(state) -> list[ModelCard]:
    """Each configured model (loaded or not), then each loaded one's LoRA adapters with `parent` = its base (vLLM's
    shape); each says what it reads and does, and whether it answers now (what agent tools read instead of
    guessing)."""
    cards = []
    for slot in state.router.slots.values():
        facts = {"max_model_len": slot.settings.model.max_model_len, "status": {"value": slot.status}, **slot.facts}
        cards.append(ModelCard(id=slot.name, created=state.created, **facts))
        adapters = slot.engine.adapters if slot.engine is not None else None
        modules = [r.module for r in adapters.known.copy().values()] if adapters is not None else slot.adapters
        cards += [  # an unloaded model's: those configured, which a request loads it for
            ModelCard(id=m.name, created=state.created, root=m.path, parent=m.base_model_name or slot.name, **facts)
            for m in modules
        ]
    return cards


@get("/v1/models", operation_class=documented(ModelList, errors=(401,)))
async def list_models(request: Request) -> Response:
    return _json(ModelList(data=_cards(_state(request))))


@get("/v1/models/{model_id:path}", operation_class=documented(ModelCard, errors=(401, 404)))
async def retrieve_model(request: Request, model_id: str) -> Response:
    state = _state(request)
    card = next((c for c in _cards(state) if c.id == model_id.lstrip("/")), None)
    if card is None:
        raise model_not_found(model_id.lstrip("/"), ", ".join(state.router.slots))
    return _json(card)


@get("/health", operation_class=documented(HEALTH, errors=(401,), also=(503,)))
async def health(request: Request) -> Response:
    state = _state(request)
    if state.ready and not state.draining:
        engine, slots = state.engine, state.router.slots
        models = {"models": {name: slot.status for name, slot in slots.items()}} if len(slots) > 1 else {}
        default = {**engine.stats(), **engine.server_info(), "kv_cache_resident_bytes": engine.kv_cache_resident_bytes()} if engine else {}
        return _json({"status": "ok", "model": state.served_name, **default, **models})
    reason = "shutting down" if state.draining else state.load_error or (state.engine and state.engine.dead_reason) or "loading"
    return _json({"status": "unavailable", "reason": reason}, status=503)


@get("/v1/server_info", operation_class=documented(SERVER_INFO, errors=(401, 503)))
async def server_info(request: Request) -> Response:
    """The engine's configuration as resolved at start-up (vLLM serves one too): what each `auto` became."""
    state = _state(request)
    state.require_ready()
    return _json({"model": state.served_name, **state.engine.server_info()})


@get("/metrics", operation_class=documented({"type": "string"}, media_type=METRICS_CONTENT_TYPE, errors=(401,)))
async def metrics(request: Request) -> Response:
    # the header given whole: Litestar would append a second `charset` to a `text/` media type that has one
    return Response(content=_state(request).render_metrics(), headers={"content-type": METRICS_CONTENT_TYPE})


ROUTES = [
    chat_completions, completions, tokenize_route, detokenize_route, list_models, retrieve_model, health, server_info, metrics,
]


async def unless_disconnected(request: Request, work) -> bytes:
    """Await `work`; if the client disconnects first, cancel it (which cancels its engine request at once).

    Litestar does not cancel a handler whose client went away, so a non-streaming request would otherwise
    keep its batch slot until its last token.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the connection", "invalid_request_error", None, "client_closed_request")
    return task.result()


async def _disconnect(request: Request) -> None:
    """Returns once the ASGI server reports that the client is gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
