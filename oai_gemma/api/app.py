"""The Litestar app: the routes (`routes.py`), API keys, the OpenAI error envelope for every failure, and model
loading in the background so `/health` can answer 503 while loading and 200 once the warmed-up engine is ready."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException

from ..cpu import compute_thread
from ..engine.config import ConfigError
from ..engine.engine import Engine
from ..engine.factory import explain_load_failure, load_engine
from ..settings import Settings
from .access_log import access_log_middleware
from .exchange import exchange_middleware
from .lora_routes import lora_routes
from .connections import body_timeout_middleware
from .errors import APIError
from .metrics import ServerMetrics
from .openapi import add_wire_components
from .playground import playground_paths, playground_routes
from .responses.store import ResponseStore, owner_of
from .routes import JSON, ROUTES
from .responses.routes import RESPONSES_ROUTES
from .services import Services

log = logging.getLogger("oai_gemma.server")


class ServerState:
    """What the routes need: the engine once it is ready, or why it is not."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.served_name = settings.served_model_name
        self.created = int(time.time())
        self.engine: Engine | None = None
        self.services: Services | None = None
        self.load_error: str | None = None
        self.fatal = False
        """Start-up failed for a setting this machine cannot honour (engine/config.py's ConfigError), or the engine
        died (`server.exit_on_engine_failure`)."""
        self.on_fatal = lambda: None
        """Called then (from the loader thread, or the event loop): `serve` stops the server and exits non-zero."""
        self.draining = False
        scope = settings.engine.prefix_cache_scope
        self.cache_per_key = scope == "key" or (scope == "auto" and bool(settings.server.api_keys))
        self.metrics = ServerMetrics(
            self.served_name, lambda: self.engine.stats() if self.engine else None, settings.server.log_request_text,
            settings.server.metrics_vllm_names, lambda: self.engine.cache_config() if self.engine else None,
            lambda: self.engine.lora_stats() if self.engine else None,
        )
        responses = settings.responses
        self.store = ResponseStore(responses.path, responses.max_stored, responses.max_age, self.metrics.store_errors.inc)

    @property
    def ready(self) -> bool:
        return self.services is not None and self.engine is not None and self.engine.alive

    def require_ready(self) -> Services:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", None, "server_shutting_down")
        if not self.ready:
            reason = self.load_error or (self.engine and self.engine.dead_reason) or "the model is still loading"
            raise APIError(503, f"server not ready: {reason}", "server_error", None, "not_ready")
        return self.services

    def cache_scope(self, request: Request) -> str:
        """Whose cached prefixes a request may share (`engine.prefix_cache_scope`): its API key's, or everyone's ("")."""
        if self.cache_per_key:
            return owner_of(request.headers.get("authorization", "").partition(" ")[2].strip())
        return ""

    def start_loading(self, loop: asyncio.AbstractEventLoop) -> None:
        compute_thread(lambda: self._load(loop), "oai-gemma-loader").start()  # loading and warm-up use every core

    def _load(self, loop: asyncio.AbstractEventLoop) -> None:
        started = time.monotonic()
        try:
            engine = load_engine(self.settings)
        except ConfigError as exc:  # no use answering 503 for ever: the operator must change a setting
            self._fail_start(f"bad settings: {exc}", exit_anyway=True)
            return
        except Exception as exc:
            log.debug("loading the model failed", exc_info=exc)
            self._fail_start(explain_load_failure(exc, self.settings.model.source))
            return
        engine.observer = self.metrics
        engine.start(loop)
        self.engine = engine
        self.services = Services.build(engine, self.settings, self.store)
        asyncio.run_coroutine_threadsafe(self._watch(engine), loop)
        log.info("ready: %s (%s) in %.1f s; %s", self.served_name, engine.description, time.monotonic() - started, self.where())

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

    async def _watch(self, engine: Engine) -> None:
        """Once the engine thread has died (its requests already failed): say so, and with
        `server.exit_on_engine_failure` exit non-zero once the streams have sent their error events."""
        while engine.alive:
            await asyncio.sleep(0.5)
        if self.draining:
            return
        log.error("the engine died: %s; /health and new requests answer 503", engine.dead_reason)
        if self.settings.server.exit_on_engine_failure:
            await _until(lambda: engine.in_flight == 0, 10.0)
            log.error("exiting (server.exit_on_engine_failure), so that the supervisor restarts the server")
            self.fatal = True
            self.on_fatal()

    async def drain(self, grace: float) -> None:
        """Graceful shutdown: refuse new requests (503), give running ones `grace` seconds, then end the rest."""
        self.draining = True
        engine = self.engine
        if engine is None:
            return
        engine.stop_admitting()
        log.warning("shutting down: %d request(s) in flight get up to %g s to finish", engine.in_flight, grace)
        if not await _until(lambda: engine.in_flight == 0, grace):
            log.warning("shutting down: ending %d request(s) still running", engine.in_flight)
            engine.abort_all("the server is shutting down")
            await _until(lambda: engine.in_flight == 0, 5.0)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.store.close()


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
        route_handlers=[*ROUTES, *RESPONSES_ROUTES, *playground_routes(settings), *lora_routes(settings)],
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
    app.asgi_handler = access_log_middleware(handler, state.metrics.count_outcomes, settings.server.log_request_text, quiet)
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
