"""Prometheus `/metrics` and the JSON access log, on the session server (and pure pieces alone)."""

import asyncio
import json
import re
import time
import uuid

import httpx
from litestar.testing import TestClient

from conftest import MODEL, user
from metrics_scrape import Scrape, delta, scrape
from oai_gemma.api.access_log import AccessRecord, GenerationStats, access_log_middleware
from oai_gemma.api.exchange import exchange_of
from oai_gemma.api.app import create_app
from oai_gemma.api.metrics import ServerMetrics
from oai_gemma.engine.types import GenerationRequest, SamplingParams, TokenEvent
from oai_gemma.settings import load_settings

M = "oai_gemma:"
LOG_FIELDS = {
    "time", "request_id", "method", "path", "status", "model", "prompt_tokens", "completion_tokens", "ttft_s",
    "duration_s", "outcome",
}


def eventually(check, timeout: float = 10.0):
    """Outcomes and log lines land when the response is over, a moment after its last byte reached us."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def greedy(client, text, **kw):
    return client.chat.completions.create(model=MODEL, messages=user(text), temperature=0, **kw)


def long_stream(http: httpx.Client):
    body = {"model": MODEL, "messages": user("Write a long story."), "max_tokens": 500, "stream": True, "ignore_eos": True}
    return http.stream("POST", "/v1/chat/completions", json=body)


def read_to_first_token(stream):
    """Read the stream up to its first token (the role chunk before it comes even while still waiting).

    Returns the line iterator: keep it, dropping it closes the response."""
    data = (line for line in stream.iter_lines() if line.startswith("data: "))
    next(data)
    next(data)
    return data


ACCESS_LINE = re.compile(r"\S+ \S+ INFO oai_gemma\.access: (\S+) (\S+) (\d+)((?: \w+=\S+)*)$")


def access_line(server, request_id: str) -> dict:
    """The console's access line (`POST /path 200 key=value ...`) as a dict; unset fields are not on it."""
    for line in server.log_path.read_text().splitlines():
        if f"request_id={request_id}" in line:
            method, path, status, rest = ACCESS_LINE.fullmatch(line).groups()
            pairs = dict(pair.split("=", 1) for pair in rest.split())
            return {"method": method, "path": path, "status": int(status), **{k: _value(v) for k, v in pairs.items()}}
    raise AssertionError(f"no access-log line for {request_id}")


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- /metrics on the session server ----------------------------------------------------------------


def test_token_counters_grow_by_the_usage_of_every_request(server, client):
    before = scrape(server.url)
    plain = greedy(client, "Name a fruit.", max_tokens=4).usage
    chunks = greedy(client, "Name a color.", max_tokens=4, stream=True, stream_options={"include_usage": True})
    streamed = [c.usage for c in chunks if c.usage][0]
    after = scrape(server.url)
    assert delta(before, after, M + "generation_tokens_total") == plain.completion_tokens + streamed.completion_tokens
    assert delta(before, after, M + "prompt_tokens_total") == plain.prompt_tokens + streamed.prompt_tokens


def test_latency_histograms_count_each_request_and_each_later_token(server, client):
    before = scrape(server.url)
    usages = [greedy(client, f"Count to {n}.", max_tokens=3).usage for n in (3, 4)]
    after = scrape(server.url)
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds"):
        assert delta(before, after, M + name + "_count") == 2, name
    assert delta(before, after, M + "inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert delta(before, after, M + "time_to_first_token_seconds_sum") > 0


def test_finish_reasons_are_counted_per_request(server, client, tokenizer):
    before = scrape(server.url)
    end_at_once = {str(tokenizer.eos_token_id): 100}  # a stop in one token, however busy the machine
    reasons = [
        greedy(client, "Say hi.", max_tokens=4, logit_bias=end_at_once).choices[0].finish_reason,
        greedy(client, "Write a long essay about rivers.", max_tokens=2).choices[0].finish_reason,
    ]
    assert sorted(reasons) == ["length", "stop"]

    def counted():
        after = scrape(server.url)
        for reason in ("stop", "length", "cancelled", "error", "rejected"):
            assert delta(before, after, M + "request_success_total", finished_reason=reason) == reasons.count(reason), reason

    eventually(counted)


def test_a_stream_closed_early_counts_as_cancelled(server):
    before = scrape(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with long_stream(own) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")

    def counted():
        after = scrape(server.url)
        assert delta(before, after, M + "request_success_total", finished_reason="cancelled") == 1
        assert delta(before, after, M + "e2e_request_latency_seconds_count") == 1

    eventually(counted)


def test_gauges_show_a_running_request_and_its_kv_cache_blocks(server):
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with long_stream(own) as stream:
            lines = read_to_first_token(stream)
            during = scrape(server.url)
            assert next(lines)  # still streaming when scraped
    assert during.value(M + "num_requests_running") == 1
    assert during.value(M + "num_requests_waiting") == 0
    assert 0 < during.value(M + "kv_cache_usage_perc") < 0.01  # a few 16-token blocks of the pool

    def freed():
        after = scrape(server.url)
        assert after.value(M + "num_requests_running") == 0
        assert after.value(M + "kv_cache_usage_perc") == 0

    eventually(freed)


# ---- the access log ------------------------------------------------------------------------------


def test_access_log_line_has_the_request_fields_and_never_the_text(server, http):
    request_id = f"test-{uuid.uuid4().hex}"
    secret = f"zebracorn{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": user(f"Repeat this word: {secret}"), "max_tokens": 4, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == request_id
    usage, choice = response.json()["usage"], response.json()["choices"][0]

    line = eventually(lambda: access_line(server, request_id))
    assert set(line) == LOG_FIELDS - {"time"}  # the line's own time is the console's
    assert (line["method"], line["path"], line["status"], line["model"]) == ("POST", "/v1/chat/completions", 200, MODEL)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert line["outcome"] == choice["finish_reason"]
    assert 0 < line["ttft_s"] <= line["duration_s"]
    assert secret not in server.log_path.read_text()
    assert choice["message"]["content"] not in json.dumps(line)


def test_access_log_records_an_unknown_route(server, http):
    request_id = f"test-{uuid.uuid4().hex}"
    assert http.get("/no/such/route", headers={"X-Request-Id": request_id}).status_code == 404
    line = eventually(lambda: access_line(server, request_id))
    assert (line["path"], line["status"], line.get("model")) == ("/no/such/route", 404, None)


def test_each_response_gets_a_fresh_request_id_when_none_was_sent(http):
    ids = {http.get("/v1/models").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)


# ---- pieces alone (no model) ---------------------------------------------------------------------


def test_metrics_need_a_key_when_switched_to():
    settings = load_settings(overrides={"server": {"api_keys": ["k"], "metrics_requires_key": True}}, environ={})
    client = TestClient(create_app(settings))  # not entered: no lifespan, so no model is loaded
    assert client.get("/metrics").status_code == 401
    assert client.get("/health").status_code == 503  # still open (and loading)
    with_key = client.get("/metrics", headers={"Authorization": "Bearer k"})
    assert with_key.status_code == 200
    assert Scrape(with_key.text).value(M + "num_requests_running") == 0


def test_request_text_is_logged_only_when_asked():
    def record(keep: bool) -> AccessRecord:
        rec = AccessRecord("id", "POST", "/v1/chat/completions", 0.0, 200, body=bytearray(b'{"x": "the prompt"}') if keep else None)
        rec.generations["g"] = GenerationStats(0.0, text=["the ", "output"] if keep else None)
        return rec

    assert "request_body" not in record(False).line(1.0)
    line = record(True).line(1.0)
    assert (line["request_body"], line["output"]) == ('{"x": "the prompt"}', ["the output"])


def test_a_finish_reason_the_api_refines_is_counted_instead_of_the_engines():
    metrics = ServerMetrics(MODEL, lambda: None)
    request = GenerationRequest("gen-1", [1, 2], SamplingParams(max_tokens=4), arrival_time=time.perf_counter())

    async def endpoint(scope, receive, send):  # what a route does: consume the engine's events, then answer
        metrics.on_event(request, TokenEvent("gen-1", 7, "{}", time.perf_counter(), "stop", 2, 1))
        metrics.on_close(request, cancelled=False)
        exchange_of(scope).refine("gen-1", "tool_calls")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def call():
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await access_log_middleware(endpoint, metrics.count_outcomes)(scope, receive, send)

    asyncio.run(call())
    counts = Scrape(metrics.render().decode())
    assert counts.value(M + "request_success_total", finished_reason="tool_calls") == 1
    assert counts.value(M + "request_success_total", finished_reason="stop") == 0


def test_inter_token_latency_is_measured_within_each_of_n_choices():
    """Two choices whose tokens interleave: each gap is the time since that choice's own last token."""
    metrics = ServerMetrics(MODEL, lambda: None)
    request = GenerationRequest("gen-n", [1, 2], SamplingParams(max_tokens=4), arrival_time=0.0, n=2)
    for timestamp, index in ((1.0, 0), (1.001, 1), (1.1, 0), (1.101, 1)):
        metrics.on_event(request, TokenEvent("gen-n", 7, "x", timestamp, index=index, num_prompt_tokens=2))
    counts = Scrape(metrics.render().decode())
    assert counts.value(M + "inter_token_latency_seconds_count") == 2
    assert abs(counts.value(M + "inter_token_latency_seconds_sum") - 0.2) < 1e-9
    assert counts.value(M + "time_to_first_token_seconds_count") == 1


def test_tool_call_answers_are_counted_as_tool_calls(server, client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    before = scrape(server.url)
    response = client.chat.completions.create(
        model=MODEL, messages=user("Weather in Paris?"), tools=[tool], tool_choice="required", temperature=0, max_tokens=60,
    )
    assert response.choices[0].finish_reason == "tool_calls"

    def counted():
        after = scrape(server.url)
        assert delta(before, after, M + "request_success_total", finished_reason="tool_calls") == 1
        assert delta(before, after, M + "request_success_total", finished_reason="stop") == 0

    eventually(counted)
