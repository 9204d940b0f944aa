"""The OpenAPI document (`/schema/openapi.json`) describes the bodies the routes really read and write.

The routes decode the raw body themselves with msgspec (one pass, our own error envelope), so Litestar sees no
`data` parameter and would document no request body and an empty response. Instead each route names its wire
types once, in its decorator:

    @post("/v1/chat/completions", operation_class=documented(ChatCompletion, request=ChatCompletionRequest,
                                                               stream=ChatCompletionChunk))

and `add_wire_components(app)` puts the msgspec Structs' own JSON schemas (exactly what the decoder accepts
and the encoder writes) into the document's `components/schemas`, where those operations point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar
from litestar.openapi.spec import OpenAPIHeader, OpenAPIMediaType, OpenAPIResponse, Operation, RequestBody

from ..settings import QUANTIZATIONS
from .protocol import ErrorResponse

JSON = "application/json"
SSE = "text/event-stream"
REF = "#/components/schemas/{name}"

ERRORS = {
    400: "Invalid request: malformed JSON, a value out of range, `context_length_exceeded`, an unsupported parameter",
    401: "Missing or wrong API key (only when the server is started with API keys)",
    403: "`permission_denied`: the endpoint needs an admin API key (`server.admin_api_keys`)",
    404: "`model_not_found`: the request names a model this server does not serve",
    413: "The request body is larger than `server.max_body_bytes`",
    429: "`rate_limit_exceeded`: the batch and its waiting line are full; retry after `Retry-After` seconds",
    503: "`not_ready`: the model is still loading, or the engine stopped",
}
"""Every status a model-serving route may answer besides 200, always in OpenAI's error envelope."""


def _ref(wire_type: Any) -> dict[str, str] | Any:
    """A Struct is referenced by name; anything else (a plain JSON schema dict) is used as it is."""
    return {"$ref": REF.format(name=wire_type.__name__)} if isinstance(wire_type, type) else wire_type


def documented(
    response: Any, *, request: type | None = None, stream: type | None = None, errors: tuple[int, ...] = tuple(s for s in ERRORS if s != 403),
    also: tuple[int, ...] = (), media_type: str = JSON,
) -> type[Operation]:
    """An `operation_class` for a route: its request body, its 200 (JSON, and SSE chunks when it streams), its errors.

    `response` is a Struct or a plain JSON schema dict; `stream`, when set, is the Struct each SSE `data:` event holds;
    `also` are statuses answered with `response`'s schema too (`/health`'s 503); `media_type`, the 200's (`/metrics`'s text).
    """
    events = stream if isinstance(stream, tuple) else (stream,)
    wire_types = tuple(t for t in (request, response, *events, ErrorResponse) if isinstance(t, type))

    @dataclass
    class WireOperation(Operation):
        def __post_init__(self) -> None:
            self.wire_types = wire_types
            if request is not None:
                self.request_body = RequestBody(content={JSON: OpenAPIMediaType(schema=_ref(request))}, required=True)
            ok = {media_type: OpenAPIMediaType(schema=_ref(response))}
            if stream is not None:
                ok[SSE] = OpenAPIMediaType(schema=sse_event(stream))
            self.responses = {"200": OpenAPIResponse(description="OK", content=ok)}
            for status in also:
                self.responses[str(status)] = OpenAPIResponse(description="see the body", content={media_type: ok[media_type]})
            for status in errors:
                headers = {"Retry-After": OpenAPIHeader(schema={"type": "string"})} if status == 429 else None
                self.responses[str(status)] = OpenAPIResponse(
                    description=ERRORS[status], headers=headers, content={JSON: OpenAPIMediaType(schema=_ref(ErrorResponse))}
                )

    return WireOperation


def sse_event(stream: type | tuple[type, ...]) -> dict[str, Any]:
    """One Server-Sent Event of a stream (`schema` describes each event before OpenAPI 3.2): its `data` is a chunk,
    an error envelope (a failure after the first byte), or the final `[DONE]`. A tuple of Structs: named events
    (the Responses API's `event: <type>` line, then `data:` one of them; no `[DONE]`)."""
    if isinstance(stream, tuple):
        data = {"type": "string", "contentMediaType": JSON, "contentSchema": {"anyOf": [_ref(t) for t in stream]}}
        return {
            "type": "object",
            "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": data},
            "description": "with `stream: true`: each event named by its `type` (`event:`), its JSON in `data:`",
        }
    chunk = {"anyOf": [_ref(stream), _ref(ErrorResponse)]}
    json_data = {"type": "string", "contentMediaType": JSON, "contentSchema": chunk}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        "description": f"with `stream: true`: each `data:` a {stream.__name__}, then `data: [DONE]`",
    }


def add_wire_components(app: Litestar) -> None:
    """Put the JSON schemas of every wire type the documented operations name into `components/schemas`."""
    openapi = app.openapi_schema  # built once and cached by Litestar: what is added here is served
    wire_types: dict[str, type] = {}
    for path_item in (openapi.paths or {}).values():
        for method in ("get", "put", "post", "delete", "options", "head", "patch", "trace"):
            for wire_type in getattr(getattr(path_item, method), "wire_types", ()):
                wire_types[wire_type.__name__] = wire_type
    if not wire_types:
        return
    _, components = msgspec.json.schema_components(list(wire_types.values()), ref_template=REF)
    openapi.components.schemas.update(components)


COST_NOTE = ("what batch-invariant mode costs (on) or would cost (off) a 512-token prefill chunk's linears, as a "
             "fraction of their time without it, measured at start-up (0.021: 2.1% slower); null: not measured")
HEALTH = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "unavailable"]},
        "model": {"type": "string"},
        "running": {"type": "integer", "minimum": 0},
        "waiting": {"type": "integer", "minimum": 0},
        "in_flight": {"type": "integer", "minimum": 0},
        "kv_cache_usage": {"type": "number", "minimum": 0, "maximum": 1},
        "prefix_cache_usage": {"type": "number", "minimum": 0, "maximum": 1},
        "steps": {"type": "integer", "minimum": 0},
        "step_seconds": {"type": "number", "minimum": 0},
        "vision_encodes": {"type": "integer", "minimum": 0},
        "vision_seconds": {"type": "number", "minimum": 0},
        "loop_turns": {"type": "integer", "minimum": 0, "description": "turns of the engine loop (it sleeps while nothing can run)"},
        "kv_cache_resident_bytes": {"type": "integer", "minimum": 0},
        "weight_bytes": {"type": "integer", "minimum": 0},
        "decode_bytes": {"type": "integer", "minimum": 0},
        "quantization": {"enum": list(QUANTIZATIONS)},
        "batch_invariant": {"type": "boolean"},
        "batch_invariant_cost": {"type": ["number", "null"], "description": COST_NOTE},
        "engine_config": {"type": "object"},
        "reason": {"type": "string"},
    },
    "required": ["status"],
}
"""`/health`: 200 with the engine's load when ready, 503 (`unavailable`, with the reason) while loading."""

SERVER_INFO = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "version": {"type": "string", "description": "oai-gemma's version"},
        "git_commit": {"type": ["string", "null"], "description": "the checkout's commit; null when installed from a wheel"},
        "torch_version": {"type": "string"},
        "cpu_capability": {"type": "string", "description": "the instruction set torch's CPU kernels use (AVX512, AVX2, ...)"},
        "kernel_isa": {"enum": ["avx512-vnni", "avx512", "avx2-vnni", "avx2", "none"], "description": "the native CPU kernels' instruction set"},
        "engine_config": {"type": "object", "description": "engine/config.py's EngineConfig as resolved: every `auto` decided"},
        "weight_bytes": {"type": "integer", "minimum": 0},
        "decode_bytes": {"type": "integer", "minimum": 0},
        "quantization": {"enum": list(QUANTIZATIONS)},
        "batch_invariant": {"type": "boolean"},
        "batch_invariant_cost": {"type": ["number", "null"], "description": COST_NOTE},
    },
    "required": ["model", "version", "git_commit", "torch_version", "cpu_capability", "kernel_isa", "engine_config"],
}
"""`/v1/server_info`: what runs (version, commit, torch, kernels) and what the engine runs with."""
