"""One HTTP exchange as the services see it: the access-log record to tell, and the engine places it holds.

A stream takes its place in the engine before its status line (so a full engine is a 429, never an error event
inside a 200); that place must be given back however the exchange ends: the stream ran to its end, the client
went away mid-stream, or the response never started. `exchange_middleware` gives back whatever is still held
once the exchange is over, so the engine's running / waiting counts come back to exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .access_log import AccessRecord, record_of

SCOPE_KEY = "oai_gemma.exchange"


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class Exchange:
    record: AccessRecord | None = None
    """The access-log record (None outside the access-log middleware, as in a unit test)."""
    held: list[Closable] = field(default_factory=list)

    def hold(self, place: Closable) -> None:
        """Give `place` back (`close()`, idempotent) when the exchange ends, if nothing did before."""
        self.held.append(place)

    def release(self) -> None:
        held, self.held = self.held, []
        for place in held:
            place.close()

    def refine(self, request_id: str, reason: str) -> None:
        """Tell the access record an engine request's finish reason as the client saw it (`tool_calls`)."""
        if self.record is not None:
            self.record.refine(request_id, reason)


def exchange_of(scope) -> Exchange:
    """The exchange of the request whose ASGI `scope` this is (a fresh one outside `exchange_middleware`)."""
    return scope.get(SCOPE_KEY) or Exchange(record_of(scope))


def exchange_middleware(app):
    """Wrap an ASGI app: each HTTP request gets an `Exchange`, released when the app is done with it."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        exchange = Exchange(record_of(scope))
        try:
            await app({**scope, SCOPE_KEY: exchange}, receive, send)
        finally:
            exchange.release()

    return middleware
