"""`POST /models/load` and `POST /models/unload` (llama-server's router shapes: body `{"model": "<id>"}`; served only
with several models), a request's
`model` and `keep_alive` read before its service decodes it, and the router's metrics (api/model_router.py).

The endpoints are guarded as the LoRA ones are (lora_routes.py): with API keys configured they take an admin key.
"""

from __future__ import annotations

import re

import msgspec
from litestar import Request, Response, post
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .errors import decode_body, invalid_request, model_not_found
from .lora_routes import require_admin
from .openapi import documented
from .protocol import encoder

JSON = "application/json"


class ModelRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str


class ModelStatus(msgspec.Struct):
    success: bool
    model: str
    status: str
    """`loaded` or `unloaded`."""


class _Routing(msgspec.Struct):
    model: str | None = None
    keep_alive: float | str | None = None


_model_decoder = msgspec.json.Decoder(ModelRequest)
_routing_decoder = msgspec.json.Decoder(_Routing)
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def routing_of(body: bytes) -> tuple[str | None, float | None]:
    """A body's `model` and `keep_alive` (seconds), as far as it says them: a body that does not decode routes to
    the default model, whose service then answers its 400. A bad `keep_alive` is a 400 here."""
    try:
        routing = _routing_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None, None
    return routing.model, keep_alive_seconds(routing.keep_alive)


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's `keep_alive`: seconds, or a duration ("10m", "1h", "30s"); negative: for ever."""
    if value is None or isinstance(value, (int, float)):
        return value
    match = _DURATION.match(value.strip())
    if match is None:
        raise invalid_request(f"`keep_alive` must be seconds or a duration such as \"5m\", not {value!r}", "keep_alive")
    return float(match[1]) * _UNIT[match[2]]


def _slot(request: Request, body: ModelRequest):
    state = request.app.state.server
    slot = state.router.slots.get(body.model)
    if slot is None:
        raise model_not_found(body.model, ", ".join(state.router.slots))
    return slot


async def _admin_body(request: Request) -> ModelRequest:
    state = request.app.state.server
    require_admin(state.settings, request, "Loading and unloading models")
    state.require_started()
    return decode_body(_model_decoder, await request.body())


@post("/models/load", status_code=200, operation_class=documented(ModelStatus, request=ModelRequest, errors=(400, 401, 403, 404, 503)))
async def load_model(request: Request) -> Response:
    body = await _admin_body(request)
    slot = _slot(request, body)
    slot.pending += 1  # not unloaded between its load and this answer
    try:
        await request.app.state.server.ensure_loaded(slot)
    finally:
        slot.pending -= 1
    return Response(encoder.encode(ModelStatus(True, slot.name, slot.status)), media_type=JSON)


@post("/models/unload", status_code=200, operation_class=documented(ModelStatus, request=ModelRequest, errors=(400, 401, 403, 404, 503)))
async def unload_model(request: Request) -> Response:
    body = await _admin_body(request)
    slot = _slot(request, body)
    await request.app.state.server.router.unload(slot, "request")
    return Response(encoder.encode(ModelStatus(True, slot.name, slot.status)), media_type=JSON)


def model_routes(models: int) -> list:
    """The endpoints, when several models are served (llama-server's router mode); else they are not there (404)."""
    return [load_model, unload_model] if models > 1 else []


class _RouterCollector:
    def __init__(self, router):
        self.router = router

    def collect(self):
        slots = list(self.router.slots.values())
        for name, doc, value in (
            ("oai_gemma:model_loaded", "1 while the model is loaded.", lambda s: float(s.engine is not None)),
            ("oai_gemma:model_load_waiting", "Requests waiting for the model to load.", lambda s: s.waiting),
            ("oai_gemma:model_memory_bytes", "Weights plus KV cache, by the engine's count (last load).", lambda s: s.footprint),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            for slot in slots:
                gauge.add_metric([slot.name], value(slot))
            yield gauge
        loads = CounterMetricFamily("oai_gemma:model_loads", "Loads of the model.", labels=["model_name"])
        unloads = CounterMetricFamily("oai_gemma:model_unloads", "Unloads, by reason (idle, evicted, request).", labels=["model_name", "reason"])
        for slot in slots:
            loads.add_metric([slot.name], slot.loads)
            for reason, count in slot.unloads.items():
                unloads.add_metric([slot.name, reason], count)
        yield loads
        yield unloads


def router_metrics(router):
    """The router's series, rendered at scrape time."""
    registry = CollectorRegistry()
    registry.register(_RouterCollector(router))
    return lambda: generate_latest(registry)

