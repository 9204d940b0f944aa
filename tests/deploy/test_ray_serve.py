"""A real two-replica Ray Serve run (`oai-gemma serve --replicas 2`) with the embedded model: one Ray cluster for
the whole module, each replica one engine on one CPU with a small KV cache; each replica also serves the embedded
model a second time as `second` (several models, loaded on request)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="the Ray Serve tests need the `ray` extra")

from conftest import LOG as SERVER_LOG, MODEL, ServerProcess, user, wait_for

pytestmark = pytest.mark.slow

REPLICA, SECOND = "x-oai-gemma-replica", "second"
LOG = SERVER_LOG.with_suffix(".ray.log")


@pytest.fixture(scope="module")
def ray_server():
    proc = ServerProcess(
        "--replicas", "2", "--replica-cpus", "1", "--max-num-seqs", "4", "--routing", "prefix", log=LOG,
        *("--model", f"{MODEL}=embedded", "--model", f"{SECOND}=embedded"),
        env={"RAY_DEDUP_LOGS": "0"},
    )
    with proc:
        yield proc


def replica_pids() -> set[int]:
    """The engine replicas' processes (Ray titles them `ray::ServeReplica:<app>:<deployment>`)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::ServeReplica:oai-gemma:Engine"):
                pids.add(int(entry.name))
        except OSError:
            pass
    return pids


def busiest(pids: set[int], window: float = 0.5) -> int:
    """The process that used the most CPU over `window` seconds: a replica with running streams, where a kill
    is sure to hit one (the router may well have put every stream on the same replica)."""

    def cpu_ticks(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = {pid: cpu_ticks(pid) for pid in pids}
    time.sleep(window)
    return max(pids, key=lambda pid: cpu_ticks(pid) - before[pid])


async def stream(client: httpx.AsyncClient, text: str, max_tokens: int = 24, started=None, **extra) -> tuple[str, bytes]:
    """One streamed chat completion: (the replica that served it, the raw SSE body); `started()` at its first token."""
    body = {"model": MODEL, "messages": user(text), "max_tokens": max_tokens, "stream": True, "temperature": 0, **extra}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        chunks = []
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            if started and len(chunks) == 2:
                started()
        return response.headers.get(REPLICA, ""), b"".join(chunks)


def run_streams(url: str, texts: list[str], **kw) -> list[tuple[str, bytes]]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(stream(client, t, **kw) for t in texts))

    return asyncio.run(main())


def test_concurrent_streams_reach_both_replicas(ray_server):
    """12 at once: a burst can reach the router before either replica's queue length is known, and each such request
    then goes to a replica at random (6 all went to one once in a loaded run: a 1-in-32 chance; 12: 1 in 2,048)."""
    results = run_streams(ray_server.url, [f"{i}: name a colour." for i in range(12)], max_tokens=12)
    assert len({replica for replica, _ in results}) == 2
    assert all(body.endswith(b"data: [DONE]\n\n") for _, body in results)


def test_sse_bytes_through_the_proxy_equal_a_direct_servers(ray_server, server):
    """Same bytes, chunk framing included, but for each response's own id and creation time."""
    text = "Count from one to five in words."
    ((_, proxied),) = run_streams(ray_server.url, [text], max_tokens=16)
    ((_, direct),) = run_streams(server.url, [text], max_tokens=16)

    def normal(body: bytes) -> bytes:
        return re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"chatcmpl-[0-9a-f]+"', b'"id":"x"', body))

    assert normal(proxied) == normal(direct)
    assert proxied.count(b"data: ") >= 8


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix(ray_server):
    client = openai.OpenAI(base_url=ray_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for topic in ("lighthouses", "volcanoes", "glaciers", "deserts"):
        messages = user(f"Write one short sentence about {topic}, please, in plain words for a child to read.")
        first = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        reply = first.parse()
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Another one."}]
        second = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        assert second.headers[REPLICA] == first.headers[REPLICA], topic
        assert second.parse().usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens // 16 * 16, topic


def test_metrics_carry_every_replica_with_a_replica_label(ray_server):
    served = {replica for replica, _ in run_streams(ray_server.url, [f"{i}: a fruit?" for i in range(4)], max_tokens=4)}
    deadline = time.monotonic() + 30
    while True:  # replicas push their series every 2 s
        text = httpx.get(ray_server.url + "/metrics", timeout=30).text
        tokens = {
            s.labels["replica"]: s.value
            for f in text_string_to_metric_families(text) if f.name == "oai_gemma:generation_tokens"
            for s in f.samples if s.labels["model_name"] == MODEL  # `second`'s series beside it
        }
        if served <= {r for r, v in tokens.items() if v > 0} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(tokens) == 2 and served <= {r for r, v in tokens.items() if v > 0}, tokens
    assert "vllm:num_requests_waiting{" in text


def test_a_killed_replica_is_replaced_and_no_request_is_lost_or_hung(ray_server):
    before = replica_pids()
    assert len(before) == 2

    async def main():
        under_way = asyncio.Semaphore(0)
        async with httpx.AsyncClient(base_url=ray_server.url, timeout=120) as client:
            streams = [
                # speculation off: the streams must still run when the kill lands (a repetitive story is mostly drafts)
                asyncio.ensure_future(stream(client, f"{i}: tell a long story.", 120, under_way.release, ignore_eos=True,
                                             speculative=False))
                for i in range(6)
            ]
            plain = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": user(f"{i}: a word?"), "max_tokens": 30, "ignore_eos": True, "speculative": False,
                })) for i in range(4)
            ]
            for _ in streams:  # every stream is under way before the kill
                await asyncio.wait_for(under_way.acquire(), 120)
            victim = await asyncio.to_thread(busiest, before)
            os.kill(victim, signal.SIGKILL)
            return victim, await asyncio.wait_for(asyncio.gather(*streams), 120), await asyncio.wait_for(asyncio.gather(*plain), 120)

    victim, streams, plain = asyncio.run(main())
    for _, body in streams:  # each stream ends: complete, or an error event; then [DONE] either way
        assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
        events = [line for line in body.split(b"\n\n") if line.startswith(b"data: {")]
        assert b'"finish_reason":"length"' in events[-1] or b'"code":"replica_lost"' in events[-1], events[-1]
    assert any(b"replica_lost" in body for _, body in streams)  # the kill did hit running streams
    for response in plain:  # retried elsewhere when nothing was sent, else a clean 503
        assert response.status_code in (200, 503), response.text
        assert response.json()["choices" if response.status_code == 200 else "error"]
    deadline = time.monotonic() + 240
    while len(replica_pids() - {victim}) < 2:  # Ray starts a new replica in its place
        assert time.monotonic() < deadline, "the dead replica was not replaced"
        time.sleep(1)
    while True:  # and it serves once its engine is ready
        served = {replica for replica, _ in run_streams(ray_server.url, [f"{i}: hi" for i in range(4)], max_tokens=2)}
        if len(served) == 2 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(served) == 2


def test_models_load_and_unload_reach_every_replica(ray_server):
    """One replica answers `/models/load`; the others follow the order the ingress leaves in the hub."""

    def loaded() -> dict[str, float]:
        text = httpx.get(ray_server.url + "/metrics", timeout=30).text
        return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) if f.name == "oai_gemma:model_loaded"
                for s in f.samples if s.labels["model_name"] == SECOND}

    assert wait_for(lambda: len(loaded()) == 2, 120) and set(loaded().values()) == {0.0}
    answer = httpx.post(ray_server.url + "/models/load", json={"model": SECOND}, timeout=300)
    assert answer.status_code == 200 and answer.json()["status"] == "loaded", answer.text
    assert wait_for(lambda: list(loaded().values()) == [1.0, 1.0], 180), loaded()
    assert httpx.post(ray_server.url + "/models/load", json={"model": "no-such-model"}, timeout=60).status_code == 404
    answer = httpx.post(ray_server.url + "/models/unload", json={"model": SECOND}, timeout=300)
    assert answer.status_code == 200 and answer.json()["status"] == "unloaded", answer.text
    assert wait_for(lambda: list(loaded().values()) == [0.0, 0.0], 180), loaded()
