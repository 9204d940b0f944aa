"""Clients that hold a connection without finishing their request or without reading their response: a header
timeout and a send buffer size in the HTTP protocol, a body timeout around the ASGI app.

uvicorn closes a kept-alive connection that stays silent for `timeout_keep_alive`, but a connection that trickles
its headers (a byte a second: slowloris), one that never sends anything, and a body that stops half way are held
without limit. `server.header_timeout` closes a connection whose request headers are not complete in time (counted
from the connection, or on a kept-alive one from the request's first byte); `server.body_timeout` answers 408 when
the next part of a body does not come in time, before any engine work. `server.send_buffer_bytes` caps the kernel's
send buffer of each connection (Linux grows it to megabytes), so a client that stops reading holds little there
and its stream's backlog soon shows (`Submission`'s `max_backlog`).
"""

from __future__ import annotations

import asyncio
import socket

from .errors import APIError


def http_protocol(header_timeout: float, send_buffer: int = 0) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11), closing a connection whose headers are late,
    with a send buffer of `send_buffer` bytes (0: the OS's own sizing)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        _headers_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if send_buffer and sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            self._expect_headers()  # uvicorn alone keeps a connection that never sends a byte forever

        def data_received(self, data: bytes) -> None:
            # the first bytes of a request (an idle kept-alive connection is uvicorn's keep-alive timer's)
            if self._headers_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._expect_headers()
            super().data_received(data)

        def _expect_headers(self) -> None:
            if header_timeout > 0:
                self._headers_timer = self.loop.call_later(header_timeout, self._headers_due, self.cycle)

        def _headers_due(self, cycle) -> None:
            self._headers_timer = None
            # a request whose headers completed since has a new cycle; the same one means none did
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def body_timeout_middleware(app, timeout: float, min_rate: float = 0):
    """Wrap an ASGI app: a request body must keep coming (no wait for its next part longer than `timeout`) and be
    whole by a deadline: `timeout` after the request's headers, plus a second for every `min_rate` bytes received
    (Apache mod_reqtimeout's `body=timeout,MinRate=min_rate`). A body that trickles in a byte at a time so as never
    to pause long is cut off by the deadline; a large body that arrives at `min_rate` or faster never is. Past
    either limit, a 408 and the connection closes."""
    if timeout <= 0:
        return app

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        started, received, whole = loop.time(), 0, False

        async def timed_receive():
            nonlocal received, whole
            if whole:  # after the body only a disconnect can come: no limit on waiting for that
                return await receive()
            left = started + timeout + (received / min_rate if min_rate else float("inf")) - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), min(timeout, left))
            except TimeoutError:
                why = (f"nothing for {timeout:g} s (the server's body timeout)" if left > timeout else
                       f"{received} bytes in {loop.time() - started:.0f} s, slower than the server's minimum body rate "
                       f"({min_rate:g} bytes/s after the first {timeout:g} s)")
                raise APIError(408, f"the request body stopped arriving: {why}", "invalid_request_error", None,
                               "request_timeout", {"Connection": "close"}) from None
            received += len(message.get("body", b""))
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await app(scope, timed_receive, send)

    return middleware
