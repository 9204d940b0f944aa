"""A long mixed soak against a real server (issue 29; a benchmark, not CI).

    python benchmarks/soak.py --duration 1800 --concurrency 32          # starts `oai-gemma serve` (embedded model)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234    # an already running server
    python benchmarks/soak.py --duration 150 --concurrency 8 --server-arg=--max-num-seqs=8   # the short check

Clients loop over a mix: chat streamed and not, a tool call, a JSON-schema answer, an image (where the model takes
images; else reported as not served), Responses with `store: true`; 1% of them disconnect at a random moment. At the
end it prints (and with --json writes) the outcomes per kind, the 5xx count, the server's anonymous resident memory
sampled every 10 s, with and without the KV cache's written pages (the cache grows by design, up to its configured
size, as prefix caching hands out never-used blocks first; flat means: within 5% from the end of the first quarter,
or of the first 5 minutes, to the end),
and whether the server's `oai_gemma:request_success_total` (every outcome: stop, length, tool_calls, cancelled,
error, rejected) grew by the number of generation requests sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter

import httpx

MODEL = "gemma-3-270m"
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "degrees": {"type": "integer"}},
    "required": ["city", "degrees"], "additionalProperties": False}}}
KINDS = ("chat_stream", "chat", "tools", "json_schema", "image", "responses_store")


def body(kind: str, i: int) -> tuple[str, dict]:
    text = [{"role": "user", "content": f"Say something about the number {i % 97}."}]
    chat = {"model": MODEL, "messages": text, "max_tokens": 24, "temperature": 0.7}
    if kind == "chat_stream":
        return "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "tools":
        return "/v1/chat/completions", {**chat, "tools": [TOOL], "tool_choice": "required"}
    if kind == "json_schema":
        return "/v1/chat/completions", {**chat, "response_format": SCHEMA, "max_tokens": 48}
    if kind == "image":
        parts = [{"type": "text", "text": "What is in this image?"}, {"type": "image_url", "image_url": {"url": PIXEL}}]
        return "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": parts}]}
    if kind == "responses_store":
        return "/v1/responses", {"model": MODEL, "input": text[0]["content"], "max_output_tokens": 24, "store": True}
    return "/v1/chat/completions", chat


class Soak:
    def __init__(self, url: str, pid: int | None, duration: float, concurrency: int, leave_rate: float, seed: int):
        self.url, self.pid, self.duration, self.concurrency, self.leave_rate = url, pid, duration, concurrency, leave_rate
        self.random = random.Random(seed)
        self.outcomes: dict[str, Counter] = {kind: Counter() for kind in KINDS}
        self.sent = 0
        self.rss: list[tuple[float, int]] = []
        self.kinds = list(KINDS)

    async def run(self) -> dict:
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=httpx.Limits(max_connections=self.concurrency * 2)) as http:
            if (await self._request(http, "image", 0, leave=False)) == "400":  # a text-only model: no image requests
                self.kinds.remove("image")
                self.outcomes["image"] = Counter(not_served=1)
            before = await self._counted(http)
            self.sent = 0
            started = time.monotonic()
            sampler = asyncio.create_task(self._sample_rss(started))
            await asyncio.gather(*[self._client(http, c, started + self.duration) for c in range(self.concurrency)])
            sampler.cancel()
            await asyncio.sleep(1.0)  # the last outcomes are counted as their exchanges end
            counted = await self._counted(http) - before
        return self._report(counted)

    async def _client(self, http: httpx.AsyncClient, client: int, until: float) -> None:
        i = client
        while time.monotonic() < until:
            kind = self.kinds[i % len(self.kinds)]
            outcome = await self._request(http, kind, i, leave=self.random.random() < self.leave_rate)
            self.outcomes[kind][outcome] += 1
            i += self.concurrency

    async def _request(self, http: httpx.AsyncClient, kind: str, i: int, leave: bool) -> str:
        path, payload = body(kind, i)
        self.sent += 1
        try:
            if leave:  # disconnect at a random moment: the response may or may not have started
                await asyncio.wait_for(http.post(path, json=payload), timeout=self.random.uniform(0.01, 2.0))
                return "ok (did not leave in time)"
            if payload.get("stream"):
                async with http.stream("POST", path, json=payload) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                    if response.status_code != 200:
                        return str(response.status_code)
                    return "ok" if lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines[-2:]) else "broken stream"
            response = await http.post(path, json=payload)
            return "ok" if response.status_code == 200 else str(response.status_code)
        except (TimeoutError, asyncio.TimeoutError):
            return "left"
        except httpx.HTTPError as exc:
            return f"transport error {type(exc).__name__}"

    async def _counted(self, http: httpx.AsyncClient) -> float:
        text = (await http.get("/metrics")).text
        return sum(float(v) for v in re.findall(r"^oai_gemma:request_success_total\{[^}]*\} (\S+)$", text, re.M))

    async def _sample_rss(self, started: float) -> None:
        """Every 10 s: the server's anonymous memory, and that less its KV cache's written pages (`/health`): the
        cache grows by design up to `engine.kv_cache_gib` as prefix caching hands out never-used blocks first."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            while self.pid:
                kv = (await http.get("/health")).json().get("kv_cache_resident_bytes", 0) // 1024
                anon = anonymous_rss_kib(self.pid)
                self.rss.append((time.monotonic() - started, anon, anon - kv))
                await asyncio.sleep(10)

    def _report(self, counted: float) -> dict:
        statuses = Counter()
        for counts in self.outcomes.values():
            statuses.update(counts)
        report = {
            "duration_s": self.duration, "concurrency": self.concurrency, "requests_sent": self.sent,
            "outcomes": {kind: dict(counts) for kind, counts in self.outcomes.items()},
            "responses_5xx": sum(n for status, n in statuses.items() if status.startswith("5")),
            "request_success_total_delta": counted,
        }
        if self.rss:
            settle = min(300.0, self.duration / 4)
            for column, name in ((1, "rss_anon"), (2, "rss_anon_without_kv_cache")):
                base = next((sample[column] for sample in self.rss if sample[0] >= settle), self.rss[-1][column])
                report[f"{name}_mib"] = {"after_settling": base // 1024, "end": self.rss[-1][column] // 1024,
                                         "max": max(sample[column] for sample in self.rss) // 1024}
                report[f"{name}_change_pct"] = round(100 * (self.rss[-1][column] - base) / base, 1)
        return report


def anonymous_rss_kib(pid: int) -> int:
    """Heap, tensors and KV cache (where a leak shows), not the page cache of the mapped weights."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["RssAnon"].split()[0]) + int(fields["RssShmem"].split()[0])


def start_server(port: int, log: str, extra: list[str]) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "oai_gemma.cli", "serve", "--port", str(port), *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(1)
    server.kill()
    sys.exit("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (else one is started on --port)")
    parser.add_argument("--pid", type=int, help="the running server's process id, for its memory")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--duration", type=float, default=1800)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--leave-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--log", default="/tmp/oai-gemma-soak-server.log")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to the started `oai-gemma serve` (repeat)")
    args = parser.parse_args()
    server = None if args.url else start_server(args.port, args.log, args.server_arg)
    url = args.url or f"http://127.0.0.1:{args.port}"
    try:
        report = asyncio.run(Soak(url, args.pid or (server and server.pid), args.duration, args.concurrency, args.leave_rate, args.seed).run())
        print(json.dumps(report, indent=2))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=2)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
