"""Memory stays flat under traffic, and a multi-turn conversation reuses its cached prefix."""

import asyncio
from pathlib import Path

import openai
import pytest

from conftest import MODEL, user


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def burst(server, count: int, offset: int) -> None:
    async def main():
        semaphore = asyncio.Semaphore(16)

        async def one(i):
            async with semaphore:
                await async_client.chat.completions.create(
                    model=MODEL, messages=user(f"Request {i % 64}: tell me about number {i % 64 * 37}."), max_tokens=3, temperature=0
                )

        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as async_client:
            await asyncio.gather(*[one(offset + i) for i in range(count)])

    asyncio.run(main())


@pytest.mark.slow
def test_memory_after_200_requests_equals_memory_after_64(server):
    # the next 136 requests resend the first 64 prompts: the prefix cache holds their blocks already (the cache
    # growing with distinct prompts, up to engine.kv_cache_gib, is its job, not a leak), so what grows is a leak
    burst(server, 64, 0)
    after_64 = rss_mib(server.proc.pid)
    burst(server, 136, 64)
    after_200 = rss_mib(server.proc.pid)
    assert after_200 - after_64 < 0.02 * after_64 + 16, (after_64, after_200)


def test_multi_turn_conversation_reports_cached_prompt_tokens(client, http):
    messages = user("Write one sentence about lighthouses.")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens <= 4  # at most the shared template head
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now one about boats."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16  # its full blocks
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    health = http.get("/health").json()  # finished, the conversation's blocks stay cached: /health shows their share
    assert health["kv_cache_usage"] == 0 and 0 < health["prefix_cache_usage"] < 1
    # the written blocks are backed by memory, at most the whole configured cache (benchmarks/soak.py subtracts it):
    # gemma-3-270m in float32 keeps 18 layers x 1 KV head x 256 x (K, V) x 4 bytes a position; +1 scratch block
    per_block = 16 * 18 * 256 * 2 * 4
    assert 0 < health["kv_cache_resident_bytes"] <= (health["engine_config"]["kv_blocks"] + 1) * per_block
