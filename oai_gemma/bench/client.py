"""The load generator: streamed chat requests over raw SSE (httpx), at most C in flight, every chunk timed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .edits import edit_prediction
from .prompts import messages_for, response_format_for


@dataclass
class RequestResult:
    """One request's timings, all `time.perf_counter()` seconds."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried non-empty content."""
    usage_tokens: int | None = None
    """`usage.completion_tokens` of the final chunk, when the server sent it."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1), as vLLM defines it."""
        tokens = self.output_tokens
        return (self.end - self.chunk_times[0]) / (tokens - 1) if tokens > 1 else None


@dataclass
class LevelRun:
    concurrency: int
    wall_s: float
    results: list[RequestResult]


def request_body(model: str, index: int, max_tokens: int, prompts: str = "short", prediction: bool = False) -> dict:
    """`prediction`: the edit set's original function as Predicted Outputs."""
    body = {
        "model": model,
        "messages": messages_for(index, prompts),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prediction:
        body["prediction"] = {"type": "content", "content": edit_prediction(index)}
    if (response_format := response_format_for(prompts)) is not None:
        body["response_format"] = response_format
    return body


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if chunk.get("error"):
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return result
                if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or ()):
                    result.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.usage_tokens = int(usage["completion_tokens"])
        if not result.chunk_times:
            result.error = "no content in the stream"
    except Exception as exc:  # noqa: BLE001 - a refused connection or a malformed chunk fails this request only
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
    return result


def make_client(concurrency: int, timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, trust_env=False)


async def run_level(
    base_url: str,
    model: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    prompts: str = "short",
    first: int = 0,
    route: Callable[[int, dict], dict] | None = None,
    prediction: bool = False,
) -> LevelRun:
    """Send `num_requests` requests (request i uses prompt i, from `first` on) with at most `concurrency` in flight;
    `route(i, body)`: request i's body as sent (its LoRA adapter: bench/lora.py)."""
    url = base_url.rstrip("/") + "/chat/completions"
    gate = asyncio.Semaphore(concurrency)

    async with make_client(concurrency, timeout_s, api_key) as client:

        async def one(index: int) -> RequestResult:
            body = request_body(model, index, max_tokens, prompts, prediction)
            async with gate:
                return await stream_one(client, url, route(index, body) if route else body)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(first, first + num_requests)))
        wall = time.perf_counter() - started
    return LevelRun(concurrency, wall, list(results))


async def warm_up(base_url: str, model: str, max_tokens: int, timeout_s: float, api_key: str | None,
                  prompts: str = "short", route: Callable[[int, dict], dict] | None = None, count: int = 1,
                  prediction: bool = False) -> RequestResult:
    """`count` untimed requests (one per LoRA adapter with `route`), so lazy first-request work (CB init, caches,
    kernels) is not counted in the sweep; the first failure, else the last result."""
    url = base_url.rstrip("/") + "/chat/completions"
    async with make_client(1, timeout_s, api_key) as client:
        for index in range(count):
            body = request_body(model, 0, max_tokens, prompts, prediction)
            result = await stream_one(client, url, route(index, body) if route else body)
            if result.error:
                break
        return result
