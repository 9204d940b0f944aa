"""One request's events on the event loop: an async iterator over its asyncio queue, with its time limits."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .types import GenerationRequest, TokenEvent

if TYPE_CHECKING:
    from .engine import Engine


class Submission:
    """One request's events as an async iterator, and its place in the engine until closed.

    A class, not an async generator: closing must free the place even if iteration never started.
    A request that runs past its total time, or waits too long for its next event, ends with a last
    event of finish_reason `timeout` (and is cancelled in the engine). One whose consumer falls `max_backlog`
    events behind (a stream to a client that stopped reading) is cancelled and closed at once, so its KV and its
    place are freed and its memory bounded; its consumer, should it ever read on, gets the backlog, then an `error`."""

    def __init__(
        self, engine: Engine, request: GenerationRequest, timeout: float = 0.0, idle_timeout: float = 0.0, max_backlog: int = 0,
    ):
        self.engine = engine
        self.request = request
        self.events: asyncio.Queue[TokenEvent] = _Backlog(self, max_backlog) if max_backlog else asyncio.Queue()
        self.overflowed = False
        self.unfinished = request.n
        """Choices still generating: the submission ends with the last one's last event."""
        self.finished = False
        self.closed = False
        self.deadline = request.arrival_time + timeout if timeout else None
        self.idle_timeout = idle_timeout or None

    def __aiter__(self) -> "Submission":
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        limit, wait = "idle", self.idle_timeout  # whichever limit comes first is the one armed
        if self.deadline is not None:
            left = self.deadline - time.perf_counter()
            if wait is None or left < wait:
                limit, wait = "total", left
        if not self.events.empty():
            event = self.events.get_nowait()
        elif wait is None:
            event = await self.events.get()
        else:
            try:
                event = await asyncio.wait_for(self.events.get(), max(wait, 0.0))
            except TimeoutError:
                event = self._timed_out(limit)
                self.engine.cancel(self.request.request_id)
                self.unfinished = 1  # the timeout ends every choice
        if event.finish_reason is not None and self.overflowed:
            self.unfinished = 1  # the backlog's end ends every choice
        if not self.closed:  # (a backlog read after an overflow closed the submission is not observed)
            self.engine.observer.on_event(self.request, event)
        if event.finish_reason is not None:
            self.unfinished -= 1
            if not self.unfinished:
                self.finished = True
                self.close()
        return event

    def _timed_out(self, limit: str) -> TokenEvent:
        why = (
            f"the request ran past the server's request timeout ({self.deadline - self.request.arrival_time:g} s)"
            if limit == "total" else f"no token for {self.idle_timeout:g} s (the server's idle timeout)"
        )
        return TokenEvent(self.request.request_id, None, "", time.perf_counter(), "timeout", error=why)

    def overflow(self) -> TokenEvent:
        """The consumer is `max_backlog` events behind: cancel the request and give its place back (its client may
        hold the connection without reading for good); the event that ends its stream."""
        self.overflowed = True
        self.engine.observer.on_backlog_full(self.request)
        self.close()
        why = f"the client fell {self.events.limit} events behind the stream (not reading): the request was cancelled"
        return TokenEvent(self.request.request_id, None, "", time.perf_counter(), "error", error=why)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.in_flight -= self.request.n
        if not self.finished:
            self.engine.cancel(self.request.request_id)
        self.engine.observer.on_close(self.request, cancelled=not self.finished)

    async def __aenter__(self) -> "Submission":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class _Backlog(asyncio.Queue):
    """A submission's events, at most `maxsize` waiting: the event that would pass it ends the request instead
    (`Submission.overflow`); whatever the engine still sends before the cancel lands is dropped."""

    def __init__(self, submission: Submission, limit: int):
        super().__init__()
        self.submission, self.limit = submission, limit

    def put_nowait(self, event: TokenEvent) -> None:
        if self.submission.overflowed:
            return
        if self.qsize() >= self.limit:
            event = self.submission.overflow()
        super().put_nowait(event)
