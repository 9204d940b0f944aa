"""oai-gemma on Ray Serve: N engine replicas behind Ray Serve's HTTP proxy, one OpenAI endpoint.

    client -> Ray Serve proxy -> Ingress (reads the body; /metrics of all replicas) -> Engine replica (one engine,
    the same Litestar app as `oai-gemma serve`) -> tokens stream back through both, chunk by chunk

Two ways in: `oai-gemma serve --replicas N` (or `--min-replicas/--max-replicas`) starts a local Ray cluster or
joins one (`--ray-address`), or `serve run deploy/ray/serve-config.yaml` builds the app with `build(args)`.

Routing: `prefix` (default) sends a request to the replica that already served its prompt's prefix unless that
replica is clearly busier, else to the least loaded one; `least-ongoing` only looks at load (ray_router.py).
A replica that dies is replaced by Ray; a request that had not received a byte from it is retried on another
replica, a stream that had gets an error event then `data: [DONE]`, and nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import msgspec
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError

from ..api.app import create_app
from ..api.errors import APIError
from ..cpu import configure_cpu
from ..settings import Settings, load_settings
from .ray_asgi import HTTPCall, prompt_prefix, serve_call
from .ray_metrics import hub, merge, push_forever

log = logging.getLogger("oai_gemma.ray")

APP_NAME = "oai-gemma"
ROUTERS = {
    "prefix": "oai_gemma.deploy.ray_router:PrefixAffinityRouter",
    "least-ongoing": "oai_gemma.deploy.ray_router:LeastOngoingRouter",
}
RETRIES = 3
"""Tries for a request whose replica died before sending anything (the router may still list the dead one)."""
ORDERS = {("POST", "/models/load"): "load", ("POST", "/models/unload"): "unload"}
"""Requests that one replica answers and every replica then carries out (ray_metrics.py's hub keeps the order)."""


class Lifespan:
    """Runs an ASGI app's lifespan startup / shutdown (the Litestar app starts loading its model on startup)."""

    def __init__(self, app):
        self.app = app
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def _step(self, kind: str) -> None:
        await self.inbox.put({"type": f"lifespan.{kind}"})
        reply = await self.replies.get()
        if reply["type"] != f"lifespan.{kind}.complete":
            raise RuntimeError(f"lifespan {kind} failed: {reply.get('message')}")

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self.replies.put))
        await self._step("startup")

    async def shutdown(self) -> None:
        if self.task is not None and not self.task.done():
            await self._step("shutdown")


class EngineReplica:
    """One engine and its Litestar app; ready (and so given requests) once the model is loaded and warmed up."""

    async def __init__(self, settings: dict):
        self.settings = msgspec.convert(settings, Settings)
        configure_cpu(self.settings.engine)  # torch threads (the wait policy only if torch is not loaded yet)
        self.app = create_app(self.settings)
        self.state = self.app.state.server
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        while not self.state.ready:
            if self.state.load_error:
                raise RuntimeError(self.state.load_error)
            await asyncio.sleep(0.1)
        context = serve.get_replica_context()
        self.replica, self.app_name = context.replica_id.unique_id, context.app_name
        self.followed: dict[str, int] = {}
        """Model id -> the number of the last hub order (ray_metrics.py) carried out for it here."""
        self.pusher = asyncio.ensure_future(push_forever(self.app_name, self.replica, self.state.render_metrics, self.follow))

    def follow(self, orders: dict[str, tuple[int, str]]) -> None:
        """Carry out the model load and unload orders not carried out here yet, each on a task of its own (the
        router does one at a time)."""
        for model, (number, action) in orders.items():
            slot = self.state.router.slots.get(model)
            if slot is not None and self.followed.get(model) != number:
                self.followed[model] = number
                asyncio.ensure_future(self._carry_out(slot, action))

    async def _carry_out(self, slot, action: str) -> None:
        try:
            if action == "unload":
                await self.state.router.unload(slot, "request")
                return
            slot.pending += 1
            try:
                await self.state.ensure_loaded(slot)
            finally:
                slot.pending -= 1
        except APIError as exc:
            log.warning("%s of %s ordered on every replica failed here: %s", action, slot.name, exc.message)

    async def handle(self, call: HTTPCall):
        async for batch in serve_call(self.app, call, self.replica):
            yield batch

    def check_health(self) -> None:
        """Ray replaces a replica whose engine died."""
        if not self.state.ready:
            raise RuntimeError(self.state.load_error or (self.state.engine and self.state.engine.dead_reason) or "engine down")

    async def __del__(self) -> None:
        """Ray stops sending requests, waits for ongoing ones (graceful_shutdown_timeout_s), then calls this."""
        self.pusher.cancel()
        hub(self.app_name).forget.remote(self.replica)  # off /metrics now, not once its series go stale
        await self.state.drain(1.0)
        await self.lifespan.shutdown()


class Ingress:
    """Ray Serve's HTTP entry deployment; its ASGI app is an IngressApp."""

    def __init__(self, engine, first_message_timeout: float | None):
        self.forwarder = IngressApp(engine.options(stream=True), serve.get_replica_context().app_name, first_message_timeout)

    def __serve_build_asgi_app__(self):
        return self.forwarder


class IngressApp:
    """Forwards each request to an engine replica; serves `/metrics` of all of them."""

    def __init__(self, engine, app_name: str, first_message_timeout: float | None):
        self.engine = engine
        self.app_name = app_name
        self.first_message_timeout = first_message_timeout
        """Longest wait for a replica's first message (None: no limit): past it a 504, never an endless wait."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            await self._metrics(scope, send, body)
            return
        call = HTTPCall(
            scope["method"], scope["path"], scope.get("query_string", b""), list(scope.get("headers", [])), body,
            prompt_prefix(body) if scope["method"] == "POST" else b"", tuple(scope["client"]) if scope.get("client") else None,
        )
        status = await self._forward(call, send)
        action = ORDERS.get((scope["method"], scope["path"]))
        if action and status == 200:  # one replica did it (the key and the body checked there): now every replica
            await hub(self.app_name).order.remote(msgspec.json.decode(body)["model"], action)

    async def _forward(self, call: HTTPCall, send) -> int | None:
        """The replica's answer sent on; its status (None when none came)."""
        status = None
        for attempt in range(RETRIES):
            stream = None
            responses = self.engine.handle.remote(call)
            try:
                # the first message waits for a replica (Ray queues requests while all are full or none is up yet)
                batch = await asyncio.wait_for(anext(responses, None), self.first_message_timeout)
                while batch is not None:
                    for message in batch:
                        if message["type"] == "http.response.start":
                            stream, status = _is_event_stream(message), message["status"]
                            message = _without_request_id(message)
                        await send(message)
                    batch = await anext(responses, None)
                return status
            except TimeoutError:
                responses.cancel()
                await _send_error(send, APIError(504, "no engine replica took the request in time", "server_error", None, "timeout"))
                return
            except BackPressureError:
                await _send_error(send, APIError(
                    429, "every replica and the queue before them are full; retry shortly", "requests", None,
                    "rate_limit_exceeded", {"Retry-After": "1"},
                ))
                return
            except (RayActorError, ActorUnavailableError) as exc:
                if stream is not None:  # the client has the start of a response: end it cleanly, no retry
                    log.warning("replica lost mid-response: %r", exc)
                    await _end_broken(send, stream)
                    return
                log.warning("replica lost before responding (try %d of %d): %r", attempt + 1, RETRIES, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        await _send_error(send, APIError(503, "no engine replica could take the request; retry shortly", "server_error", None, "replica_unavailable"))

    async def _metrics(self, scope, send, body: bytes) -> None:
        # the key check (server.metrics_requires_key) stays with the replicas: ask one before answering
        probe = HTTPCall("GET", "/metrics", b"", list(scope.get("headers", [])), body)
        status = 503
        try:
            async with asyncio.timeout(10):  # no replica up: a 503, not a scrape that hangs
                async for batch in self.engine.handle.remote(probe):
                    status = next((m["status"] for m in batch if m["type"] == "http.response.start"), status)
        except TimeoutError:
            pass
        if status != 200:
            await _send_error(send, APIError(status, "metrics unavailable", "server_error" if status >= 500 else "invalid_request_error"))
            return
        texts = await hub(self.app_name).get.remote()
        text = merge(texts)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": text})


def _without_request_id(start: dict) -> dict:
    """Ray's proxy sets `x-request-id` on the request (the replica's access log keeps it) and on the response."""
    return {**start, "headers": [(k, v) for k, v in start.get("headers", []) if k.lower() != b"x-request-id"]}


def _is_event_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))


async def _end_broken(send, stream: bool) -> None:
    """A replica died mid-response: a stream gets an error event then `[DONE]`; any body is closed."""
    tail = b""
    if stream:
        error = APIError(503, "the engine replica serving this request stopped", "server_error", None, "replica_lost")
        tail = b"data: " + error.encode() + b"\n\ndata: [DONE]\n\n"
    await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _send_error(send, error: APIError) -> None:
    headers = [(b"content-type", b"application/json"), *((k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.encode()})


@dataclass
class ReplicaOptions:
    replicas: int | None = None
    """A fixed number of engine replicas; None: autoscale between min_replicas and max_replicas."""
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 0
    """Ongoing requests per replica the autoscaler aims at; 0: half of engine.max_num_seqs."""
    cpus: float = 1.0
    """Ray CPUs per engine replica (fractions allowed); also its torch threads (at least 1) unless engine.threads is set."""
    gpus: float = 0.0
    routing: str = "prefix"


def engine_deployment(settings: Settings, options: ReplicaOptions):
    """The engine deployment: its scaling, resources, router and drain from the settings and options."""
    seqs = settings.engine.max_num_seqs
    scaling: dict = {"num_replicas": options.replicas} if options.replicas else {
        "autoscaling_config": {
            "min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_ongoing_requests or max(1, seqs // 2),
        },
    }
    return serve.deployment(
        EngineReplica, name="Engine",
        ray_actor_options={"num_cpus": options.cpus, "num_gpus": options.gpus},
        # a replica takes what its batch holds plus a short waiting line; more wait in the router, visible to the
        # autoscaler, and go to whichever replica frees up first
        max_ongoing_requests=seqs + max(1, seqs // 4),
        max_queued_requests=settings.engine.max_waiting,  # beyond: a 429, as one server answers
        graceful_shutdown_timeout_s=settings.server.shutdown_grace,
        health_check_period_s=5,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[options.routing]),
        **scaling,
    )


def build_app(settings: Settings, options: ReplicaOptions):
    if not settings.engine.threads:
        settings.engine.threads = max(1, int(options.cpus))
    engine = engine_deployment(settings, options).bind(msgspec.to_builtins(settings))
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    # a replica answers within request_timeout (its own 504); beyond that plus a margin, no replica took it
    timeout = settings.server.request_timeout
    return ingress.bind(engine, timeout + 10 if timeout else None)


def build(args: dict):
    """`serve run` entry (deploy/ray/serve-config.yaml): `args` has `config` (a TOML file), `settings` (a settings
    tree overriding it) and the ReplicaOptions fields. Ray's own config file can still override each deployment."""
    args = dict(args)
    settings = load_settings(args.pop("config", None), args.pop("settings", None))
    return build_app(settings, ReplicaOptions(**args))


def run(settings: Settings, options: ReplicaOptions, address: str | None = None) -> int:
    """`oai-gemma serve --replicas N`: start (or join) Ray, serve until SIGTERM/SIGINT, then drain and stop."""
    import signal

    import ray

    if address:
        ray.init(address=address)
    else:
        # a busy machine (the engines loading) can keep the proxy from answering Ray's 5 s readiness check
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray's memory monitor kills workers when the *machine* runs low, whoever uses the memory; on a host shared
        # with other processes that kills healthy replicas. Off for the local cluster (a node started with
        # `ray start` keeps Ray's default).
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        # Ray runs its workers (the engine replicas, the proxy) at nice 15, below its own daemons and anything else
        # on the host: the engine is the work here, so it runs at the priority a direct server has
        os.environ.setdefault("RAY_worker_niceness", "0")
        # a small object store: only requests and chunks travel through Ray here
        ray.init(include_dashboard=False, object_store_memory=128 * 2**20)
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda s, _: stop.update(signal=s))
    serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
    started = time.monotonic()
    serve.run(build_app(settings, options), name=APP_NAME, route_prefix="/", blocking=False)
    log.info("ready: Ray Serve on http://%s:%d in %.1f s", settings.server.host, settings.server.port, time.monotonic() - started)
    while stop["signal"] is None:
        time.sleep(0.2)
    log.warning("shutting down: Ray Serve drains the replicas (up to %g s)", settings.server.shutdown_grace)
    serve.shutdown()
    ray.shutdown()
    return 0

