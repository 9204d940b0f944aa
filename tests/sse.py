"""Read a raw SSE stream from the server, byte for byte (tests only)."""

from __future__ import annotations

import json
import time

import httpx


class RawStream:
    def __init__(self, status: int, headers: httpx.Headers, body: bytes, arrivals: list[tuple[float, bytes]]):
        self.status = status
        self.headers = headers
        self.body = body
        self.arrivals = arrivals

    @property
    def events(self) -> list[bytes]:
        """The `data: ...` payloads, split on the blank line that ends each event."""
        assert self.body.endswith(b"\n\n"), self.body[-40:]
        return [e for e in self.body[:-2].split(b"\n\n")]

    @property
    def chunks(self) -> list[dict]:
        return [json.loads(e[len(b"data: "):]) for e in self.events if e != b"data: [DONE]"]

    def content(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))


def post_stream(http: httpx.Client, payload: dict, path: str = "/v1/chat/completions") -> RawStream:
    arrivals = []
    with http.stream("POST", path, json=payload) as response:
        for raw in response.iter_raw():
            arrivals.append((time.perf_counter(), raw))
        return RawStream(response.status_code, response.headers, b"".join(r for _, r in arrivals), arrivals)
