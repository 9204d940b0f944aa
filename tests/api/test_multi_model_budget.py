"""Eviction by the memory budget (issue 41's target: a budget that fits two of three models, nothing in flight lost),
on one real server of three copies of the embedded 270M (int8). Each model's KV cache is 1.5 GiB (allocated, never
touched: the machine's memory is not used), so its footprint (weights plus KV cache, the engine's own count) is
about 1.7 GiB, and `router.memory_budget_gib = 4.5` holds two of them, not three; `max_loaded` is unset, so only the
budget evicts."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from conftest import NO_TIMEOUTS, ServerProcess, stream_count, user, wait_for

pytestmark = pytest.mark.slow  # its own server (docs/testing.md: the fast subset starts none)

MODELS = ("a", "b", "c")
GIB = 2**30


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    folder = tmp_path_factory.mktemp("budget")
    config = folder / "models.toml"
    tables = "".join(f'\n[models.{name}]\nsource = "embedded"\nquantization = "int8"\nkv_cache_gib = 1.5\n' for name in MODELS)
    config.write_text(f"[router]\nmemory_budget_gib = 4.5\nload_wait = 2\n{tables}")
    with ServerProcess("--config", str(config), "--max-num-seqs", "2", "--speculative", "off", env=NO_TIMEOUTS,
                       log=folder / "server.log") as proc:
        yield proc


def statuses(proc) -> dict[str, str]:
    return {c["id"]: c["status"]["value"] for c in httpx.get(proc.url + "/v1/models").json()["data"]}


def metric(proc, name: str, model: str, extra: str = "") -> float:
    text = httpx.get(proc.url + "/metrics").text
    match = re.search(rf'^{re.escape(name)}{{model_name="{re.escape(model)}"{extra}}} (\S+)$', text, re.M)
    return float(match[1]) if match else 0.0


def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=600)


def test_a_third_model_evicts_the_idle_one_by_the_budget_never_the_streaming_one(budget):
    client(budget).chat.completions.create(model="b", messages=user("Hi."), max_tokens=2)  # loads b beside a
    footprints = [metric(budget, "oai_gemma:model_memory_bytes", name) for name in ("a", "b")]
    assert all(1.5 * GIB < f < 2.25 * GIB for f in footprints), footprints  # two fit the budget, three do not
    assert statuses(budget) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    times, usage = [], []
    streaming = threading.Thread(target=stream_count, args=(client(budget), "a", 80, times, usage))
    streaming.start()
    assert wait_for(lambda: len(times) >= 3, 300)
    answer = client(budget).chat.completions.create(model="c", messages=user("Hi."), max_tokens=2)
    streaming.join()
    assert answer.model == "c" and usage == [80]  # the stream beside the load and the eviction lost nothing
    assert statuses(budget) == {"a": "loaded", "b": "unloaded", "c": "loaded"}  # b was idle, a streamed
    assert metric(budget, "oai_gemma:model_unloads_total", "b", ',reason="evicted"') == 1
    assert metric(budget, "oai_gemma:model_unloads_total", "a", ',reason="evicted"') == 0
