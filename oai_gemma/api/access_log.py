"""One structured access-log line per HTTP request (key=value text, or JSON with `server.log_format = "json"`), and the request id that names it.

The line says who asked what of whom and how it went (method, path, status, model, tokens, time to first
token, duration, outcome), never the prompt or the output text unless `server.log_request_text` is set.
What happened inside the engine reaches the line through `current_record()`: the record of the HTTP
request being served, which the engine observer (`metrics.py`) fills.
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..logs import ACCESS_FIELDS, access_message

log = logging.getLogger("oai_gemma.access")

REQUEST_ID_HEADER = b"x-request-id"
SCOPE_KEY = "oai_gemma.access_record"
_MAX_CLIENT_ID = 128


@dataclass
class GenerationStats:
    """One engine request (one choice) as the metrics and the access log see it."""

    arrival: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token_time: float | None = None
    last_token_times: dict[int, float] = field(default_factory=dict)
    """Per choice (n > 1): when its latest token came, so inter-token latency is measured within each choice."""
    outcome: str | None = None
    """`stop`, `length`, `tool_calls`, `cancelled` or `error` once the request is over."""
    finish_time: float | None = None
    text: list[str] | None = None
    """The output pieces, kept only when the request text may be logged."""


@dataclass
class AccessRecord:
    request_id: str
    method: str
    path: str
    start: float
    status: int | None = None
    model: str | None = None
    generations: dict[str, GenerationStats] = field(default_factory=dict)
    """By engine request id."""
    rejected: bool = False
    body: bytearray | None = None
    """The request body, kept only when the request text may be logged."""
    done: bool = False
    """The line is written: engine news arriving later (a stream closed after the response) goes to the metrics only."""

    def refine(self, request_id: str, reason: str) -> None:
        """The API layer's finish reason for an engine request (`stop` -> `tool_calls`), counted instead of the
        engine's once the response is over."""
        stats = self.generations.get(request_id)
        if stats is not None:
            stats.outcome = reason

    def outcomes(self) -> list[str]:
        found = [g.outcome for g in self.generations.values() if g.outcome]
        return found + ["rejected"] if self.rejected else found

    def line(self, now: float) -> dict:
        gens = list(self.generations.values())
        first = [g.first_token_time - g.arrival for g in gens if g.first_token_time is not None]
        entry = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "model": self.model,
            "prompt_tokens": max((g.prompt_tokens for g in gens), default=None),
            "completion_tokens": sum(g.output_tokens for g in gens) if gens else None,
            "ttft_s": round(min(first), 4) if first else None,
            "duration_s": round(now - self.start, 4),
            "outcome": ",".join(self.outcomes()) or None,
        }
        if self.body is not None:
            entry["request_body"] = self.body.decode("utf-8", "replace")
            entry["output"] = ["".join(g.text or ()) for g in gens]
        return entry


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("oai_gemma_access", default=None)


def current_record() -> AccessRecord | None:
    """The record of the HTTP request this code runs for (None outside one)."""
    return _current.get()


def record_of(scope) -> AccessRecord | None:
    """The record of the HTTP request whose ASGI `scope` this is (a route hands it to the service)."""
    return scope.get(SCOPE_KEY)


def request_id_from(headers) -> str:
    """The client's `X-Request-Id` if it sent a sane one, else a new one."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if 0 < len(text) <= _MAX_CLIENT_ID and text.isprintable() and text.isascii():
                return text
    return uuid.uuid4().hex


def access_log_middleware(
    app, on_done: Callable[[AccessRecord], None], keep_body: bool = False, quiet_paths: frozenset[str] = frozenset(),
):
    """Wrap an ASGI app: a request id per HTTP request (also sent back as `X-Request-Id`), the record that
    collects the engine's news, `on_done(record)` and the log line once the response is over (none for the
    `quiet_paths`: probes that would bury the other lines)."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        record = AccessRecord(
            request_id_from(scope.get("headers", ())), scope["method"], scope["path"], time.perf_counter(),
            body=bytearray() if keep_body else None,
        )
        token = _current.set(record)
        scope = {**scope, SCOPE_KEY: record}

        async def receive_and_keep():
            message = await receive()
            if message["type"] == "http.request":
                record.body += message.get("body", b"")
            return message

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = list(message.get("headers", ()))
                headers.append((REQUEST_ID_HEADER, record.request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await app(scope, receive_and_keep if keep_body else receive, send_with_id)
        finally:
            _current.reset(token)
            record.done = True
            if record.status is None:  # the app raised before answering: the server answers 500
                record.status = 500
            on_done(record)
            if record.path not in quiet_paths:
                entry = record.line(time.perf_counter())
                log.info("%s", access_message(entry), extra={ACCESS_FIELDS: entry})

    return middleware
