"""The Responses API's routes (`/v1/responses`): each reads its request, asks `ResponsesService` and answers.

Stored responses belong to the API key that made them (one owner for all on a server without keys).
"""

from __future__ import annotations

import time

from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from ..exchange import exchange_of
from ..openapi import documented
from .protocol import DeletedResponse, ItemList, ResponsesRequest
from .protocol import Response as ResponseObject
from .store import owner_of
from .events import STREAM_EVENTS
from ..routes import JSON, SSE_HEADERS, unless_disconnected


def _service(request: Request):
    return request.app.state.server.require_ready().responses


def _owner(request: Request) -> str:
    """Whose stored responses a request reads and writes: its API key's (all one owner on an open server)."""
    if not request.app.state.server.settings.server.api_keys:
        return ""
    return owner_of(request.headers.get("authorization", "").partition(" ")[2].strip())


@post("/v1/responses", status_code=200, operation_class=documented(ResponseObject, request=ResponsesRequest, stream=STREAM_EVENTS))
async def create_response(request: Request) -> Response:
    arrival, body, state = time.perf_counter(), await request.body(), request.app.state.server
    async with state.use(body) as services:  # the model `model` names, loaded if need be
        service = services.responses
        prepared = await service.prepare(body, arrival, _owner(request), state.cache_scope(request))
        exchange = exchange_of(request.scope)
        if prepared.request.stream:
            return Stream(service.stream(prepared, exchange), media_type="text/event-stream", headers=SSE_HEADERS)
        return Response(content=await unless_disconnected(request, service.complete(prepared, exchange)), media_type=JSON)


@get("/v1/responses/{response_id:str}", operation_class=documented(ResponseObject, errors=(401, 404)))
async def retrieve_response(request: Request, response_id: str) -> Response:
    return Response(content=await _service(request).retrieve(_owner(request), response_id), media_type=JSON)


@delete("/v1/responses/{response_id:str}", status_code=200, operation_class=documented(DeletedResponse, errors=(401, 404)))
async def delete_response(request: Request, response_id: str) -> Response:
    return Response(content=await _service(request).delete(_owner(request), response_id), media_type=JSON)


@get("/v1/responses/{response_id:str}/input_items", operation_class=documented(ItemList, errors=(400, 401, 404)))
async def response_input_items(
    request: Request, response_id: str, order: str = "desc", after: str | None = None, limit: int = 20
) -> Response:
    items = await _service(request).input_items(_owner(request), response_id, order, after, limit)
    return Response(content=items, media_type=JSON)


RESPONSES_ROUTES = [create_response, retrieve_response, delete_response, response_input_items]
