"""The Litestar app: the routes (`routes.py`), API keys, the OpenAI error envelope for every failure, and model
loading in the background so `/health` can answer 503 while loading and 200 once the warmed-up engine is ready."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException

from ..engine.config import ConfigError
from ..engine.engine import Engine
from ..engine.factory import explain_load_failure
from ..settings import Settings, served_models
from .access_log import access_log_middleware
from .exchange import exchange_middleware
from .lora_routes import lora_routes
from .connections import body_timeout_middleware
from .errors import APIError
from .metrics import ServerMetrics, merge_expositions
from .model_router import ModelRouter, ModelSlot, assign_adapters
from .model_routes import model_routes, router_metrics, routing_of
from .openapi import add_wire_components
from .playground import playground_paths, playground_routes
from .responses.store import ResponseStore, owner_of
from .routes import JSON, ROUTES
from .responses.routes import RESPONSES_ROUTES
from .services import Services

log = logging.getLogger("oai_gemma.server")


class ServerState:
    """What the routes need: the models (api/model_router.py) and their services once loaded, or why they are not."""

    def __init__(self, settings: Settings):
        self.settings = settings
        models = assign_adapters(served_models(settings))
        self.served_name = next(iter(models))
        """The default model: the first configured (`/health`, `/v1/server_info`, a request that names none)."""
        self.created = int(time.time())
        self.started = False
        """The default model's first load is done: the server answers."""
        self.load_error: str | None = None
        self.fatal = False
        """Start-up failed for a setting this machine cannot honour (engine/config.py's ConfigError), or the engine
        died (`server.exit_on_engine_failure`)."""
        self.on_fatal = lambda: None
        """Called then (from the event loop): `serve` stops the server and exits non-zero."""
        self.draining = False
        scope = settings.engine.prefix_cache_scope
        self.cache_per_key = scope == "key" or (scope == "auto" and bool(settings.server.api_keys))
        responses = settings.responses
        self.store = ResponseStore(responses.path, responses.max_stored, responses.max_age, self._store_error)
        slots = [ModelSlot(name, own, keep_alive) for name, (own, keep_alive) in models.items()]
        for slot in slots:
            slot.metrics = _metrics(slot, settings)
        self.router = ModelRouter(slots, settings.router, self.store, self._engine_died)
        self.router_metrics = router_metrics(self.router)

    @property
    def engine(self) -> Engine | None:
        """The default model's engine, None while it is not loaded."""
        return self.router.default.engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self.router.default.engine = engine

    @property
    def services(self) -> Services | None:
        return self.router.default.services

    @property
    def metrics(self) -> ServerMetrics:
        return self.router.default.metrics

    def _store_error(self) -> None:
        self.metrics.store_errors.inc()

    @property
    def ready(self) -> bool:
        return self.started and not self.fatal and all(s.engine is None or s.engine.alive for s in self.router.slots.values())

    def require_started(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", None, "server_shutting_down")
        if not self.ready:
            dead = next((s.engine.dead_reason for s in self.router.slots.values() if s.engine and not s.engine.alive), None)
            reason = self.load_error or dead or "the model is still loading"
            raise APIError(503, f"server not ready: {reason}", "server_error", None, "not_ready")

    def require_ready(self) -> Services:
        """The default model's services (routes that name no model), or a 503."""
        self.require_started()
        if self.services is None:
            raise APIError(503, f"{self.served_name} is not loaded; a request naming it loads it", "server_error", None, "not_ready")
        return self.services

    @asynccontextmanager
    async def use(self, body: bytes) -> AsyncIterator[Services]:
        """The services of the model a request body names (loaded first if need be), held in use (never unloaded)
        until the block ends: the route admits its request into the engine inside it."""
        self.require_started()
        model, keep_alive = routing_of(body)
        slot = self.router.pick(model)
        slot.pending += 1
        try:
            services = await self.ensure_loaded(slot)
            if keep_alive is not None:
                slot.keep_alive_now = keep_alive
            yield services
        finally:
            slot.pending -= 1
            slot.last_used = time.monotonic()

    async def ensure_loaded(self, slot: ModelSlot) -> Services:
        """The model's services, loaded first if need be (the caller counts itself in `slot.pending`, so it is not
        unloaded before the caller is done); a load that fails is a 503 `model_load_failed` saying why."""
        try:
            return await self.router.ready(slot)
        except APIError:
            raise
        except Exception as exc:  # the server goes on serving the others
            log.debug("loading %s failed", slot.name, exc_info=exc)
            why = f"bad settings: {exc}" if isinstance(exc, ConfigError) else explain_load_failure(exc, slot.settings.model.source)
            log.error("cannot load %s: %s", slot.name, why)
            raise APIError(503, f"cannot load {slot.name}: {why}", "server_error", None, "model_load_failed") from None

    def cache_scope(self, request: Request) -> str:
        """Whose cached prefixes a request may share (`engine.prefix_cache_scope`): its API key's, or everyone's ("")."""
        if self.cache_per_key:
            return owner_of(request.headers.get("authorization", "").partition(" ")[2].strip())
        return ""

    def start_loading(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tasks = [loop.create_task(self._load()), loop.create_task(self.router.reap_idle())]

    async def _load(self) -> None:
        started, default = time.monotonic(), self.router.default
        try:
            await self.router.ready(default, first=True)
        except ConfigError as exc:  # no use answering 503 for ever: the operator must change a setting
            self._fail_start(f"bad settings: {exc}", exit_anyway=True)
            return
        except Exception as exc:
            log.debug("loading the model failed", exc_info=exc)
            self._fail_start(explain_load_failure(exc, self.settings.model.source))
            return
        self.started = True
        others = f" (and {len(self.router.slots) - 1} more, loaded on their first request)" if len(self.router.slots) > 1 else ""
        log.info("ready: %s (%s) in %.1f s%s; %s", self.served_name, self.engine.description, time.monotonic() - started, others, self.where())

    def _fail_start(self, reason: str, exit_anyway: bool = False) -> None:
        """One ERROR line saying what failed and what to do; then exit non-zero (a supervisor sees it and restarts
        or reports), unless `server.exit_on_engine_failure` is off, which keeps answering 503 with the reason."""
        self.load_error = reason
        if exit_anyway or self.settings.server.exit_on_engine_failure:
            log.error("oai-gemma: %s; exiting", reason)
            self.fatal = True
            self.on_fatal()
        else:
            log.error("oai-gemma: %s; /health answers 503 (server.exit_on_engine_failure is off)", reason)

    def where(self) -> str:
        """The URLs to open, for the "ready" line."""
        server = self.settings.server
        host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
        base = f"http://{f'[{host}]' if ':' in host else host}:{server.port}"
        playground = f"playground {base}/, " if server.playground else ""
        return f"{playground}API base URL {base}/v1"

    def _engine_died(self, slot: ModelSlot, engine: Engine) -> None:
        if not self.draining:
            asyncio.ensure_future(self._after_death(slot, engine))

    async def _after_death(self, slot: ModelSlot, engine: Engine) -> None:
        """Once an engine thread has died (its requests already failed): say so, and with
        `server.exit_on_engine_failure` exit non-zero once the streams have sent their error events."""
        log.error("the engine died: %s (model %s); /health and new requests answer 503", engine.dead_reason, slot.name)
        if self.settings.server.exit_on_engine_failure:
            await _until(lambda: engine.in_flight == 0, 10.0)
            log.error("exiting (server.exit_on_engine_failure), so that the supervisor restarts the server")
            self.fatal = True
            self.on_fatal()

    def _engines(self) -> list[Engine]:
        return [s.engine for s in self.router.slots.values() if s.engine is not None]

    async def drain(self, grace: float) -> None:
        """Graceful shutdown: refuse new requests (503), give running ones `grace` seconds, then end the rest."""
        self.draining = True
        engines = self._engines()
        for engine in engines:
            engine.stop_admitting()
        if not engines:
            return
        in_flight = lambda: sum(e.in_flight for e in engines)  # noqa: E731
        log.warning("shutting down: %d request(s) in flight get up to %g s to finish", in_flight(), grace)
        if not await _until(lambda: in_flight() == 0, grace):
            log.warning("shutting down: ending %d request(s) still running", in_flight())
            for engine in engines:
                engine.abort_all("the server is shutting down")
            await _until(lambda: in_flight() == 0, 5.0)

    def shutdown(self) -> None:
        for engine in self._engines():
            engine.shutdown()
        self.store.close()

    def render_metrics(self) -> bytes:
        """Every model's series (`model_name` = its id) and the router's, one exposition."""
        return merge_expositions([s.metrics.render() for s in self.router.slots.values()] + [self.router_metrics()])

    def count_outcomes(self, record) -> None:
        """The access log's `on_done`: counted by the model that served the request."""
        slot = self.router.slots.get(record.model or "", self.router.default)
        slot.metrics.count_outcomes(record)


def _metrics(slot: ModelSlot, settings: Settings) -> ServerMetrics:
    engine = lambda: slot.engine  # noqa: E731  (read at scrape time: None while unloaded)
    return ServerMetrics(
        slot.name, lambda: engine().stats() if engine() else None, settings.server.log_request_text,
        settings.server.metrics_vllm_names, lambda: engine().cache_config() if engine() else None,
        lambda: engine().lora_stats() if engine() else None,
    )


async def _until(condition, timeout: float) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def create_app(settings: Settings) -> Litestar:
    state = ServerState(settings)

    async def on_startup() -> None:
        state.start_loading(asyncio.get_running_loop())

    async def on_shutdown() -> None:
        state.shutdown()

    keys = settings.server.api_keys + settings.server.admin_api_keys  # an admin key is an API key too
    open_paths = open_without_key(settings) | playground_paths(settings)
    if keys:
        log.warning("API keys required (%d configured); open without one: %s", len(keys), ", ".join(sorted(open_paths)) or "nothing")
    else:
        log.warning("no API key configured: the server is open to anyone who can reach it")
    app = Litestar(
        before_request=_require_key(keys, open_paths) if keys else None,
        route_handlers=[*ROUTES, *RESPONSES_ROUTES, *playground_routes(settings), *lora_routes(settings), *model_routes(len(state.router.slots))],
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        request_max_body_size=settings.server.max_body_bytes,
        logging_config=None,  # the console's one format is set up by `oai_gemma.logs`, not Litestar's own
    )
    add_wire_components(app)
    app.state.server = state
    # around Litestar's router, not in `middleware=` (which runs per route), so 404s and 405s are logged too
    # the exchange inside the access log: what a request still holds in the engine is given back before its line
    handler = exchange_middleware(body_timeout_middleware(app.asgi_handler, settings.server.body_timeout, settings.server.body_min_rate))
    quiet = frozenset() if settings.server.log_probes else frozenset({"/health", "/metrics"})
    app.asgi_handler = access_log_middleware(handler, state.count_outcomes, settings.server.log_request_text, quiet)
    return app


def open_without_key(settings: Settings) -> frozenset[str]:
    """`/health` and `/metrics` answer without an API key unless their switch says otherwise."""
    server = settings.server
    return frozenset(path for path, closed in (("/health", server.health_requires_key), ("/metrics", server.metrics_requires_key)) if not closed)


def _api_error(_: Request, exc: APIError) -> Response:
    return Response(content=exc.encode(), media_type=JSON, status_code=exc.status, headers=exc.headers)


def _require_key(keys: tuple[str, ...], open_paths: frozenset[str]):
    """`Authorization: Bearer <key>` on every route but the open ones; compared in constant time."""
    encoded = [k.encode() for k in keys]

    async def check(request: Request) -> None:
        if request.url.path in open_paths:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # compare against every key, so the time taken says nothing about which one nearly matched
        matched = [hmac.compare_digest(given, key) for key in encoded]
        if scheme.lower() != "bearer" or not any(matched):
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    return check


def _http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    elif status == 413:
        most = request.app.state.server.settings.server.max_body_bytes
        message = f"The request body is larger than {most} bytes, the most this server takes (`server.max_body_bytes`)."
    else:
        message = exc.detail
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _api_error(request, APIError(status, message, kind, None, None, dict(exc.headers or {})))  # 405 keeps `Allow`


def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _api_error(request, APIError(500, "internal server error", "server_error", None, "internal_error"))
