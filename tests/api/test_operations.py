"""API keys, body-size cap and admission control, on a second server configured for them."""

import time

import httpx
import openai
import pytest

from conftest import ServerProcess, user
from metrics_scrape import delta, scrape
from openai_schema import validate

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")
MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    env = {"OAI_GEMMA_API_KEYS": ",".join(KEYS), "OAI_GEMMA_SERVER__MAX_BODY_BYTES": "100000", "OAI_GEMMA_ENGINE__MAX_WAITING": "0"}
    log = tmp_path_factory.mktemp("logs") / "guarded-server.log"
    with ServerProcess("--max-num-seqs", "1", env=env, log=log) as proc:
        yield proc


def error(response, status):
    assert response.status_code == status, response.text
    validate("ErrorResponse", response.json())
    return response.json()["error"]


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Bearer key-one-but-longer", "Basic key-one", "key-one"])
def test_missing_or_wrong_key_is_401_invalid_api_key(guarded, header):
    headers = {"Authorization": header} if header else {}
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 1}
    err = error(httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=headers), 401)
    assert err["code"] == "invalid_api_key"
    error(httpx.get(guarded.url + "/v1/models", headers=headers), 401)


def test_every_configured_key_works_with_the_openai_client(guarded):
    for key in KEYS:
        client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=key, max_retries=0)
        assert client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1).usage.completion_tokens == 1


def test_health_stays_open_with_keys(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_body_over_the_cap_is_413_in_the_envelope(guarded):
    body = {"model": MODEL, "messages": user("x" * 200_000)}
    response = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-one"})
    error(response, 413)


def test_a_full_batch_and_waiting_line_answer_429_with_retry_after(guarded):
    headers = {"Authorization": "Bearer key-one"}
    long = {"model": MODEL, "messages": user("Write a long story."), "max_tokens": 200, "stream": True, "ignore_eos": True}
    short = {"model": MODEL, "messages": user("hi"), "max_tokens": 1}
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as own:
        with own.stream("POST", "/v1/chat/completions", json=long) as stream:
            lines = stream.iter_lines()  # keep it: a dropped iterator closes the response
            assert next(lines).startswith("data: ")
            second = own.post("/v1/chat/completions", json=short)
            err = error(second, 429)
            assert err["code"] == "rate_limit_exceeded"
            assert second.headers["retry-after"] == "1"
        # the dropped stream gives its place back
        deadline = time.monotonic() + 10
        while (status := own.post("/v1/chat/completions", json=short).status_code) == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200


def test_metrics_stay_open_with_keys(guarded):
    assert scrape(guarded.url).value("oai_gemma:num_requests_running") == 0


def test_a_429_counts_as_rejected(guarded):
    headers = {"Authorization": "Bearer key-one"}
    long = {"model": MODEL, "messages": user("Write a long story."), "max_tokens": 200, "stream": True, "ignore_eos": True}
    before = scrape(guarded.url)
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as own:
        with own.stream("POST", "/v1/chat/completions", json=long) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            short = {"model": MODEL, "messages": user("hi"), "max_tokens": 1}
            assert own.post("/v1/chat/completions", json=short).status_code == 429
            during = scrape(guarded.url)
    assert delta(before, during, "oai_gemma:request_success_total", finished_reason="rejected") == 1
