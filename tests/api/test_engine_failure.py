"""The engine dies, the process says so (issue 29 item 4), on real servers whose KV allocation runs out of memory
on demand (tests/fault_server.py): open streams end with an error event and `[DONE]`, `/health` is 503 with the
reason, new requests get 503, and by default the process then exits non-zero so its supervisor restarts it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from conftest import FAULT_SERVER, MODEL, NO_TIMEOUTS, ServerProcess, user, wait_for

pytestmark = pytest.mark.slow

SMALL = ("--max-num-seqs", "2", "--max-prefill-tokens", "64", "--max-model-len", "1024", "--batch-invariant", "off")  # a short warm-up
STREAM = {"model": MODEL, "messages": user("Tell me a long story."), "max_tokens": 200, "ignore_eos": True, "stream": True}


def fault_server(tmp_path: Path, **env: str) -> tuple[ServerProcess, Path]:
    trigger = tmp_path / "kv-oom"
    server = ServerProcess(*SMALL, env={"OAI_GEMMA_FAULT_KV_OOM": str(trigger), **NO_TIMEOUTS, **env}, log=tmp_path / "server.log", launcher=FAULT_SERVER)
    return server, trigger


def stream_through_the_fault(server: ServerProcess, trigger: Path) -> list:
    """Open a stream, pull the trigger once tokens flow, read the stream to its end: its `data:` payloads."""
    events = []
    with httpx.Client(base_url=server.url, timeout=120) as http, http.stream("POST", "/v1/chat/completions", json=STREAM) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if len(events) == 3:
                trigger.touch()  # the next step's KV allocation fails
    return events


def assert_ended_with_an_error(events: list) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "OutOfMemoryError" in error["message"] and "engine loop died" in error["message"], error
    assert len(events) < 200  # ended by the failure, not by max_tokens


def test_a_dead_engine_ends_streams_with_an_error_and_answers_503_with_the_reason(tmp_path):
    server, trigger = fault_server(tmp_path, OAI_GEMMA_SERVER__EXIT_ON_ENGINE_FAILURE="false")
    with server:
        other: list = []
        second = threading.Thread(target=lambda: other.extend(_plain_stream(server)))  # a second stream at the time
        second.start()
        assert wait_for(lambda: httpx.get(server.url + "/health", timeout=10).json()["running"] == 1, 120)
        assert_ended_with_an_error(stream_through_the_fault(server, trigger))
        second.join(timeout=120)
        assert other[-1] == "[DONE]" and "error" in other[-2]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "OutOfMemoryError" in health.json()["reason"]
        refused = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": user("hi")}, timeout=10)
        assert refused.status_code == 503 and "OutOfMemoryError" in refused.json()["error"]["message"]
        assert server.proc.poll() is None  # told not to exit


def _plain_stream(server: ServerProcess) -> list:
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=STREAM, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_by_default_the_process_exits_non_zero_once_the_streams_have_ended(tmp_path):
    server, trigger = fault_server(tmp_path)
    with server:
        assert_ended_with_an_error(stream_through_the_fault(server, trigger))
        try:
            code = server.proc.wait(timeout=60)
        except Exception:
            pytest.fail(f"the server did not exit after its engine died; see {server.log_path}")
        assert code != 0
        assert "the engine died" in server.log_path.read_text()
