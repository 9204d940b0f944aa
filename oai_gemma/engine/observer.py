"""A hook for whoever watches requests go through the engine (the API layer's metrics and access log).

The engine calls it on the event loop, where a request's events are consumed, so an observer needs no
locks; it stays free of any metrics library.
"""

from __future__ import annotations

from .types import GenerationRequest, TokenEvent


class RequestObserver:
    """Does nothing; subclass and set `engine.observer` to watch."""

    def on_event(self, request: GenerationRequest, event: TokenEvent) -> None:
        """An event of the request was taken off its queue (a token, and/or its end)."""

    def on_close(self, request: GenerationRequest, cancelled: bool) -> None:
        """The request gave its place back: after its last event, or `cancelled` before it."""

    def on_reject(self, reason: str) -> None:
        """A request was refused before it started: `busy` (no place) or `dead` (no engine)."""

    def on_backlog_full(self, request: GenerationRequest) -> None:
        """The request's consumer fell `engine.max_backlog` events behind (a client not reading): it was cancelled."""
