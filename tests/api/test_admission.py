"""Admission under pressure (issue 18 items 1 and 2), on a small server: 2 batch slots and 2 waiting places.

A request that cannot take its place is a 429 before the status line, for streams as for non-streams (a client
can retry a 429, not an error event inside a 200); and however a request ends, the engine's running / waiting
counts (`/health`, the gauges) and its free places come back to exact.
"""

import asyncio
import json
import time

import httpx
import pytest

from conftest import ServerProcess, user
from metrics_scrape import scrape

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
SLOTS, WAITING = 2, 2
CAPACITY = SLOTS + WAITING
TIMEOUT_S = 8  # 1,900 tokens run past it on any CPU (the shorter, the surer); what it ends first gives its places back too


def small_server(tmp_path_factory, name: str, request_timeout: float):
    env = {"OAI_GEMMA_ENGINE__MAX_WAITING": str(WAITING), "OAI_GEMMA_SERVER__REQUEST_TIMEOUT": str(request_timeout)}
    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    # speculation off: these tests need requests that run for seconds (a repetitive greedy story is mostly drafts)
    return ServerProcess("--max-num-seqs", str(SLOTS), "--speculative", "off", env=env, log=log)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The default request timeout (600 s): however slow a busy machine is, no admitted request can time out."""
    with small_server(tmp_path_factory, "small-server", 600) as proc:
        yield proc


@pytest.fixture(scope="module")
def timing_out(tmp_path_factory):
    """The same server with an 8 s request timeout, for the one test that wants requests to run past it."""
    with small_server(tmp_path_factory, "timing-out-server", TIMEOUT_S) as proc:
        yield proc


def body(max_tokens: int, stream: bool, **extra) -> dict:
    return {"model": MODEL, "messages": user("Tell me a story."), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "temperature": 0, **extra}


async def one(client: httpx.AsyncClient, payload: dict, path: str = "/v1/chat/completions") -> tuple[int, list[str]]:
    """(status, the SSE `data:` payloads or the JSON body) of one request, read to its end."""
    async with client.stream("POST", path, json=payload) as response:
        if not payload["stream"] or response.status_code != 200:
            return response.status_code, [(await response.aread()).decode()]
        return 200, [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


async def burst(url: str, payloads: list[dict], path: str = "/v1/chat/completions") -> list[tuple[int, list[str]]]:
    limits = httpx.Limits(max_connections=len(payloads) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(client, p, path) for p in payloads))


def counts_are_zero(url: str) -> None:
    """`/health` and the gauges say nothing runs or waits, and the engine holds no place (`in_flight`, one per
    admitted choice), within a few seconds (the engine thread catches up)."""
    deadline = time.monotonic() + 15
    while True:
        health = httpx.get(url + "/health").json()
        metrics = scrape(url)
        seen = (health["running"], health["waiting"], metrics.value("oai_gemma:num_requests_running"),
                metrics.value("oai_gemma:num_requests_waiting"), health["in_flight"])
        if seen == (0, 0, 0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen == (0, 0, 0, 0, 0), f"running/waiting on /health and the gauges, places held: {seen}"


def every_place_is_free(url: str) -> None:
    """The engine's admission count is back too: a full load of streams is admitted again, no 429."""
    results = asyncio.run(burst(url, [body(2, True) for _ in range(CAPACITY)]))
    assert [status for status, _ in results] == [200] * CAPACITY


@pytest.mark.parametrize("stream", [True, False], ids=["streams", "non-streams"])
def test_overflow_of_a_burst_is_exactly_the_429s_and_every_admitted_request_completes(small, stream):
    overflow = 8
    results = asyncio.run(burst(small.url, [body(8, stream) for _ in range(CAPACITY + overflow)]))
    statuses = sorted(status for status, _ in results)
    assert statuses == [200] * CAPACITY + [429] * overflow
    for status, data in results:
        if status == 429:
            assert json.loads(data[0])["error"]["code"] == "rate_limit_exceeded"
        elif stream:
            assert data[-1] == "[DONE]"
            assert not any('"error"' in d for d in data[:-1]), data
        else:
            assert json.loads(data[0])["choices"][0]["finish_reason"] == "length"
    counts_are_zero(small.url)


def test_a_responses_stream_past_capacity_is_a_429_before_its_status_line(small):
    # as for chat: a full engine is a 429 answer, never a `response.failed` event inside a 200
    overflow = 4
    payload = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 8, "stream": True, "temperature": 0}
    results = asyncio.run(burst(small.url, [payload] * (CAPACITY + overflow), "/v1/responses"))
    assert sorted(status for status, _ in results) == [200] * CAPACITY + [429] * overflow
    for status, data in results:
        if status == 429:
            assert json.loads(data[0])["error"]["code"] == "rate_limit_exceeded"
        else:
            assert json.loads(data[-1])["type"] in ("response.completed", "response.incomplete"), data[-1]
    counts_are_zero(small.url)


async def drop(client: httpx.AsyncClient, path: str, payload: dict, after_events: int) -> None:
    """A stream read for `after_events` events and one more, then left (the connection closes mid-stream)."""
    async with client.stream("POST", path, json=payload) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen > after_events:
                return


def test_counts_are_exact_after_streams_dropped_after_their_first_event_and_mid_way(small):
    def chat(after_events: int) -> tuple:
        return "/v1/chat/completions", body(400, True, n=2 if after_events else 1), after_events

    async def run() -> None:
        async with httpx.AsyncClient(base_url=small.url, timeout=120) as client:
            await asyncio.gather(drop(client, *chat(0)), drop(client, *chat(3)))

    asyncio.run(run())
    counts_are_zero(small.url)
    every_place_is_free(small.url)


def test_counts_are_exact_after_a_non_stream_whose_client_went_away(small):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small.url + "/v1/chat/completions", json=body(400, False), timeout=3)
    counts_are_zero(small.url)
    every_place_is_free(small.url)


def test_counts_are_exact_after_timeouts_while_running_and_in_the_queue(timing_out):
    """Two long requests run past the request timeout; a third times out waiting for a slot."""
    results = asyncio.run(burst(timing_out.url, [body(1900, True) for _ in range(SLOTS + 1)]))
    for status, data in results:
        assert status == 200 and data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "timeout"
    counts_are_zero(timing_out.url)
    every_place_is_free(timing_out.url)


def in_flight(url: str) -> int:
    return httpx.get(url + "/health").json()["in_flight"]


def completion(prompts: list[str], n: int, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": prompts, "n": n, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "temperature": 0}


def test_one_admission_takes_a_place_per_choice_of_every_prompt_all_or_none(small):
    # one long stream holds 1 of the 4 places: 2 prompts x n=2 need 4 (refused, nothing taken); 3 x 1 fit
    with httpx.Client(base_url=small.url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body(400, True)) as held:
            assert held.status_code == 200 and in_flight(small.url) == 1
            refused = client.post("/v1/completions", json=completion(["Once", "Twice"], 2, 4))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert "4 choices but 3 free places" in refused.json()["error"]["message"]
            assert in_flight(small.url) == 1
            chat = client.post("/v1/chat/completions", json=body(2, False, n=2))
            assert chat.status_code == 200 and len(chat.json()["choices"]) == 2
            taken = client.post("/v1/completions", json=completion(["Once", "Twice", "Thrice"], 1, 2))
            assert taken.status_code == 200 and [c["index"] for c in taken.json()["choices"]] == [0, 1, 2]
    counts_are_zero(small.url)
    every_place_is_free(small.url)


def test_places_sum_to_zero_after_cancels_disconnects_refusals_and_timeouts(timing_out):
    """Every way a request can end but finishing, one after the other, each checked to give every place back: a chat
    stream of n=2 dropped after its first event, a completions stream of two prompts with n=2 dropped mid-way, a
    non-stream whose client gave up, an admission refused whole for want of places, and a chat stream of n=2 and
    a completions stream of two prompts that together fill the engine and run past the request timeout."""

    async def settle(client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 15
        while (await client.get("/health")).json()["in_flight"]:
            assert time.monotonic() < deadline, "places still held after the request ended"
            await asyncio.sleep(0.1)

    async def run():
        async with httpx.AsyncClient(base_url=timing_out.url, timeout=120) as client:
            await drop(client, "/v1/chat/completions", body(400, True, n=2), 1)
            await settle(client)
            await drop(client, "/v1/completions", completion(["Once", "Twice"], 2, 400, True), 3)
            await settle(client)
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/chat/completions", json=body(400, False), timeout=2)
            await settle(client)
            refused = await client.post("/v1/completions", json=completion(["Once", "Twice", "Thrice"], 2, 4))
            assert refused.status_code == 429
            await settle(client)
            return await asyncio.gather(
                one(client, body(1900, True, n=2)), one(client, completion(["Once", "Twice"], 1, 1900, True), "/v1/completions")
            )

    for status, data in asyncio.run(run()):
        assert status == 200 and data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "timeout"
    counts_are_zero(timing_out.url)
    every_place_is_free(timing_out.url)
