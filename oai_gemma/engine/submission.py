"""One admission's events on the event loop: an async iterator over its asyncio queue, with its time limits.

It knows nothing of the engine: its places go back through the one `release` callback it was given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from .observer import RequestObserver
from .types import GenerationRequest, TokenEvent

Release = Callable[[int, list[str]], None]
"""`release(places, running)`: give `places` back and cancel the request ids in `running` (still generating)."""


class Submission:
    """The events of one admission (one request or several, every choice of each) as one async iterator, and
    their places in the engine until it ends.

    A class, not an async generator: closing must give the places back even if iteration never started.
    It ends once every choice's last event was taken, or when closed early (the consumer went away); either
    way `release` is called exactly once. A submission that runs past its total time, or waits too long for
    its next event, ends each request still running with a last event of finish_reason `timeout`. One whose
    consumer falls `max_backlog` events behind (a stream to a client that stopped reading) is cancelled and closed
    at once, so its KV and its places are freed and its memory bounded; its consumer, should it ever read on, gets
    the backlog, then an `error` for each request.
    """

    def __init__(
        self, requests: Sequence[GenerationRequest], release: Release, observer: RequestObserver,
        timeout: float = 0.0, idle_timeout: float = 0.0, max_backlog: int = 0,
        worked_at: Callable[[str], float | None] = lambda request_id: None,
    ):
        self.requests = {request.request_id: request for request in requests}
        self.places = sum(request.n for request in requests)
        """Every choice of every request holds one place."""
        self.events: asyncio.Queue[TokenEvent] = _Backlog(self, max_backlog) if max_backlog else asyncio.Queue()
        self.overflowed = False
        self.release = release
        self.observer = observer
        self.live = {request.request_id: request.n for request in requests}
        """Per request, its choices whose last event has not been taken yet."""
        self.overdue: list[TokenEvent] = []
        """Past a time limit: the `timeout` events still to hand out, one per request that was running."""
        self.cut: list[str] = []
        """Requests ended by a timeout: over for the consumer, still to cancel in the engine."""
        self.closed = False
        arrival = min((request.arrival_time for request in requests), default=0.0)
        self.deadline = arrival + timeout if timeout else None
        self.timeout = timeout
        self.idle_timeout = idle_timeout or None
        self.worked_at = worked_at
        """When the engine last worked for a request without a token to show (its image's encode), or None: the
        idle timeout counts from then, so a long encode is not taken for a request gone quiet."""

    def __aiter__(self) -> "Submission":
        return self

    async def __anext__(self) -> TokenEvent:
        if not self.live:
            self.close()
            raise StopAsyncIteration
        event = self.overdue.pop(0) if self.overdue else await self._next()
        request = self.requests[event.request_id]
        if not self.closed:  # (a backlog read after an overflow closed the submission is not observed)
            self.observer.on_event(request, event)
        if event.finish_reason is not None:
            self._choice_ended(request, timed_out=event.finish_reason == "timeout")
        return event

    async def _next(self) -> TokenEvent:
        idle = self.idle_timeout
        while True:
            limit, wait = "idle", idle  # whichever limit comes first is the one armed
            if self.deadline is not None:
                left = self.deadline - time.perf_counter()
                if wait is None or left < wait:
                    limit, wait = "total", left
            if not self.events.empty():
                return self.events.get_nowait()
            if wait is None:
                return await self.events.get()
            try:
                return await asyncio.wait_for(self.events.get(), max(wait, 0.0))
            except TimeoutError:
                worked = max((at for at in map(self.worked_at, self.live) if at is not None), default=None)
                since = None if worked is None else time.perf_counter() - worked
                if limit == "idle" and since is not None and since < self.idle_timeout:
                    idle = self.idle_timeout - since  # worked on meanwhile: quiet only from then
                    continue
                self.overdue = [self._timed_out(limit, request_id) for request_id in self.live]
                return self.overdue.pop(0)

    def _timed_out(self, limit: str, request_id: str) -> TokenEvent:
        why = (
            f"the request ran past the server's request timeout ({self.timeout:g} s)"
            if limit == "total" else f"no token for {self.idle_timeout:g} s (the server's idle timeout)"
        )
        return TokenEvent(request_id, None, "", time.perf_counter(), "timeout", error=why)

    def _choice_ended(self, request: GenerationRequest, timed_out: bool) -> None:
        """A timeout, or the backlog's end, ends every choice of its request at once."""
        request_id = request.request_id
        self.live[request_id] = 0 if timed_out or self.overflowed else self.live[request_id] - 1
        if self.live[request_id]:
            return
        del self.live[request_id]
        if self.closed:  # after an overflow: its places went back and its requests were cancelled then
            return
        if timed_out:
            self.cut.append(request_id)
        self.observer.on_close(request, cancelled=False)
        if not self.live:
            self.close()

    def overflow(self) -> list[TokenEvent]:
        """The consumer is `max_backlog` events behind: cancel the requests and give the places back (its client may
        hold the connection without reading for good); the events that end each request's stream."""
        self.overflowed = True
        for request_id in self.live:
            self.observer.on_backlog_full(self.requests[request_id])
        ending = list(self.live)
        self.close()
        why = f"the client fell {self.events.limit} events behind the stream (not reading): the request was cancelled"
        return [TokenEvent(request_id, None, "", time.perf_counter(), "error", error=why) for request_id in ending]

    def close(self) -> None:
        """Give the places back (once); requests whose last event was not taken are cancelled in the engine."""
        if self.closed:
            return
        self.closed = True
        self.release(self.places, self.cut + list(self.live))
        for request_id in self.live:
            self.observer.on_close(self.requests[request_id], cancelled=True)

    async def __aenter__(self) -> "Submission":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class _Backlog(asyncio.Queue):
    """A submission's events, at most `limit` waiting: the event that would pass it ends the requests instead
    (`Submission.overflow`); whatever the engine still sends before the cancel lands is dropped."""

    def __init__(self, submission: Submission, limit: int):
        super().__init__()
        self.submission, self.limit = submission, limit

    def put_nowait(self, event: TokenEvent) -> None:
        if self.submission.overflowed:
            return
        if self.qsize() < self.limit:
            super().put_nowait(event)
            return
        for ending in self.submission.overflow():
            super().put_nowait(ending)
