"""Carry one HTTP request from the Ray Serve ingress to an engine replica's own Litestar app, and its response back.

The ingress reads the request body (small: a JSON document), sends it to a replica as an `HTTPCall` through a
streaming deployment handle, and writes each ASGI message the replica's app sends straight to the client: SSE
chunks are forwarded as they are produced, never buffered. The replica runs the very app `oai-gemma serve`
runs (`create_app`), so the routes, errors and streams are the same code. Carrying the body in the call is
also what lets a request router see the prompt (`prefix`) and send a conversation back to the replica that
holds it in its KV cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

REPLICA_HEADER = b"x-oai-gemma-replica"
PREFIX_BYTES = 4096
"""The prompt's first bytes the router matches on; enough to tell conversations apart, cheap to hash."""


@dataclass
class HTTPCall:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prefix: bytes = b""
    """The start of the prompt (chat messages or completion prompt, canonical JSON); empty when there is none."""
    client: tuple[str, int] | None = None

    def scope(self) -> dict:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "root_path": "", "query_string": self.query_string, "headers": self.headers, "client": self.client,
            "server": None, "state": {},
        }


class _Prompt(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()


def prompt_prefix(body: bytes) -> bytes:
    """The prompt's leading bytes as the client sent them (`messages`, `prompt` or `input`), for prefix routing."""
    try:
        parsed = msgspec.json.decode(body, type=_Prompt)
    except msgspec.DecodeError:
        return b""
    raw = next((r for r in (parsed.messages, parsed.prompt, parsed.input) if len(r)), b"")
    return bytes(raw)[:PREFIX_BYTES]


async def serve_call(app, call: HTTPCall, replica: str) -> AsyncIterator[list[dict]]:
    """Run `call` through the ASGI `app`; yields its ASGI messages in batches (whatever is ready at once).

    The response start carries an `x-oai-gemma-replica` header. Closing the generator (the client went away,
    or Ray cancelled the call) tells the app the client disconnected and cancels it, which cancels the engine
    request."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica.encode())]}
        elif not message.get("more_body", False):
            gone.set()  # the response is complete: from now on `receive` says so, as an ASGI server does
        out.put_nowait(message)

    task = asyncio.ensure_future(app(call.scope(), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while True:
            batch = [await out.get()]
            while not out.empty():
                batch.append(out.get_nowait())
            done = batch[-1] is None
            if done:
                batch.pop()
            if batch:
                yield batch
            if done:
                break
        task.result()
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
