"""Requests end cleanly however they end: a client that leaves, a timeout, a graceful shutdown."""

import json
import signal
import threading
import time

import httpx
import pytest

from conftest import MODEL, ServerProcess, user, wait_for
from openai_schema import validate

LONG = {"model": MODEL, "messages": user("Write a very long story."), "max_tokens": 1500, "ignore_eos": True}


def sse_events(lines) -> list:
    """Every `data:` payload of a stream's lines, `[DONE]` as the string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def running(url: str) -> int:
    body = httpx.get(url + "/health").json()
    return body["running"] + body["waiting"]


def test_a_non_streaming_client_that_disconnects_frees_its_slot_at_once(server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=1.0)
    # uncancelled, 1500 tokens would keep the batch slot for a minute or more
    assert wait_for(lambda: running(server.url) == 0, 10.0)


# ---- timeouts ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    env = {"OAI_GEMMA_SERVER__REQUEST_TIMEOUT": "6", "OAI_GEMMA_SERVER__IDLE_TIMEOUT": "3"}
    log = tmp_path_factory.mktemp("logs") / "timed-server.log"
    with ServerProcess("--max-num-seqs", "1", env=env, log=log) as proc:
        yield proc


@pytest.mark.slow
def test_a_stream_past_the_request_timeout_ends_with_an_error_event_then_done(timed):
    started = time.monotonic()
    with httpx.stream("POST", timed.url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as response:
        events = sse_events(response.iter_lines())
    assert 5.5 < time.monotonic() - started < 20
    assert events[-1] == "[DONE]"
    error = events[-2]
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "timeout"
    assert "request timeout" in error["error"]["message"]
    assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-2])  # it did stream first
    assert wait_for(lambda: running(timed.url) == 0, 10.0)


@pytest.mark.slow
def test_a_non_stream_past_the_request_timeout_is_504_in_the_envelope(timed):
    response = httpx.post(timed.url + "/v1/chat/completions", json=LONG, timeout=30)
    assert response.status_code == 504, response.text
    validate("ErrorResponse", response.json())
    assert response.json()["error"]["code"] == "timeout"
    assert "request timeout" in response.json()["error"]["message"]
    assert wait_for(lambda: running(timed.url) == 0, 10.0)


@pytest.mark.slow
def test_a_request_that_waits_past_the_idle_timeout_ends_with_timeout(timed):
    # the only batch slot is taken by a long stream, so the second request waits without a token
    with httpx.stream("POST", timed.url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as first:
        lines = first.iter_lines()  # keep it: a dropped iterator closes the response
        next(lines)
        started = time.monotonic()
        second = httpx.post(timed.url + "/v1/chat/completions", json={**LONG, "max_tokens": 5}, timeout=30)
        waited = time.monotonic() - started
        del lines
    assert second.status_code == 504, second.text
    assert "idle timeout" in second.json()["error"]["message"]
    assert waited > 2.7


# ---- graceful shutdown ---------------------------------------------------------------------------


class Shutdown:
    """One server taken through SIGTERM with a short grace: a short stream that finishes inside it, a long
    one that does not, and new requests arriving while it drains."""

    def __init__(self, tmp_path_factory):
        log = tmp_path_factory.mktemp("logs") / "shutdown-server.log"
        # a grace a short stream finishes within on a slow 2-core CPU (float32 on AVX2), the long one (1,500 tokens) not
        self.server = ServerProcess(env={"OAI_GEMMA_SERVER__SHUTDOWN_GRACE": "8"}, log=log).__enter__()
        self.streams: dict[str, list] = {}
        short = {**LONG, "max_tokens": 10, "stream": True}
        long = {**LONG, "stream": True}
        started = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=self._stream, args=(name, body, flag))
            for (name, body), flag in zip((("short", short), ("long", long)), started)
        ]
        for thread in threads:
            thread.start()
        assert all(flag.wait(60) for flag in started)
        self.server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        self.health = httpx.get(self.server.url + "/health")
        self.new_request = httpx.post(self.server.url + "/v1/chat/completions", json={**LONG, "max_tokens": 2})
        for thread in threads:
            thread.join(30)
        self.exit_code = self.server.proc.wait(20)
        self.server.stop()

    def _stream(self, name: str, body: dict, started: threading.Event) -> None:
        with httpx.stream("POST", self.server.url + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            started.set()
            self.streams[name] = sse_events([first, *lines])


@pytest.fixture(scope="module")
def shutdown(tmp_path_factory):
    return Shutdown(tmp_path_factory)


@pytest.mark.slow
def test_while_draining_new_requests_get_503_and_health_says_so(shutdown):
    assert shutdown.health.status_code == 503
    assert shutdown.new_request.status_code == 503
    validate("ErrorResponse", shutdown.new_request.json())
    assert shutdown.new_request.json()["error"]["code"] == "server_shutting_down"


@pytest.mark.slow
def test_a_stream_that_ends_within_the_grace_finishes_normally(shutdown):
    events = shutdown.streams["short"]
    assert "[DONE]" in events
    finishes = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
    assert "length" in finishes


@pytest.mark.slow
def test_a_stream_still_running_after_the_grace_ends_with_an_error_event_then_done(shutdown):
    events = shutdown.streams["long"]
    assert events[events.index("[DONE]") - 1]["error"]["code"] == "server_shutting_down"


@pytest.mark.slow
def test_the_process_exits_0_after_a_drained_shutdown(shutdown):
    assert shutdown.exit_code == 0


class DeadEngine:
    """What a served engine looks like once its step loop has died (`Engine.alive` false, the reason kept);
    the engine side of that is `test_a_dead_engine_loop_fails_every_request_and_refuses_new_ones`."""

    alive = False
    dead_reason = "engine loop died: RuntimeError('boom')"


def test_health_is_503_and_requests_are_refused_once_the_engine_loop_died():
    from litestar.testing import TestClient

    from oai_gemma.api.app import create_app
    from oai_gemma.settings import load_settings

    app = create_app(load_settings(environ={}))
    client = TestClient(app)  # not entered: no lifespan, so no model is loaded; the state is set by hand
    app.state.server.chat, app.state.server.engine = object(), DeadEngine()
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "unavailable", "reason": DeadEngine.dead_reason}
    refused = client.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hi")})
    assert refused.status_code == 503
    validate("ErrorResponse", refused.json())
    assert refused.json()["error"]["code"] == "not_ready" and "engine loop died" in refused.json()["error"]["message"]
