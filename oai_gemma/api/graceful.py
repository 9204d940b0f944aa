"""Graceful shutdown on SIGTERM/SIGINT, on top of uvicorn.

uvicorn alone closes the listening socket at the first signal, waits a fixed time for open
connections, cancels what is left without a word, and finally re-raises the signal (so the process
does not exit 0). Here the first signal starts a drain instead: the socket stays open and answers 503
(so a load balancer sees the state rather than refused connections), running requests get
`server.shutdown_grace` seconds, the rest are ended with a proper error (a stream gets an error event
then `[DONE]`), and only then does uvicorn close and the process exit 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain, grace: float):
        super().__init__(config)
        self._drain = drain
        """async (grace) -> None: stop admitting, wait for running requests, end the rest."""
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """Like uvicorn's, minus re-raising the signal at the end: a drained shutdown exits 0."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self._loop is None:  # second signal, or not serving yet: stop now
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain(self._grace)
        finally:
            self.should_exit = True
