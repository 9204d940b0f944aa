"""Same request, same answer, through a server at its default settings (issue 40 item 4): dtype, quantization,
batch-invariant mode and speculation all `auto`/default, the default context; only an adapter is added (LoRA's
mixed batches). Each check sends requests one at a time, then the same requests at once beside others, and wants
the same text bit for bit: greedy and seeded chat, n > 1, a multi-prompt /v1/completions (prompt i alone vs in the
list), a prefix-cache hit vs the miss, drafted tokens (a Predicted Output) vs none, and an adapter's rows beside the
base model's. Also what start-up says of the mode (issue 40 item 3): its log line and `/v1/server_info`."""

import asyncio
import re

import openai
import pytest

from conftest import NO_TIMEOUTS

pytestmark = pytest.mark.slow

DEFAULTS = ("--dtype", "auto", "--quantization", "auto", "--max-model-len", "8192")
"""What tests/conftest.py's ServerProcess pins (float32, unquantized, 2048 tokens) set back to the defaults."""
ADAPTER = "repro-lora"
PROMPTS = [
    "Write a haiku about rain.", "Name three rivers in Europe.", "What is 17 times 3?", "Describe a cat in one line.",
    "Give a synonym for happy.", "Count from one to ten in French.",
]
LONG = "Summarise this: " + "The committee met on Tuesday and agreed to postpone the vote until spring. " * 25
TOKENS = 12


@pytest.fixture(scope="module")
def server(shared_servers, tmp_path_factory):
    from oai_gemma.bench.lora import make_adapter
    from oai_gemma.engine.model.loader import embedded_model_dir

    adapter = make_adapter(tmp_path_factory.mktemp("repro") / ADAPTER, str(embedded_model_dir()), rank=4, seed=7)
    return shared_servers.get(*DEFAULTS, "--lora-modules", f"{ADAPTER}={adapter}", env=NO_TIMEOUTS, name="reproducible")


def run(server, main):
    """`main(client)` in a fresh event loop, with an async client of its own (a client is bound to its loop)."""
    async def go():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900) as client:
            return await main(client)
    return asyncio.run(go())


async def chat(client, prompt: str, model: str = "gemma-3-270m", **params) -> list[str]:
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, **params)
    return [choice.message.content for choice in response.choices]


def alone_and_together(server, requests, beside=()) -> tuple[list, list]:
    """Each of `requests` (coroutine factories taking the client) one at a time, then all at once beside `beside`'s."""
    async def main(client):
        alone = [await make(client) for make in requests]
        together = await asyncio.gather(*[make(client) for make in requests], *[make(client) for make in beside])
        return alone, list(together[: len(requests)])
    return run(server, main)


def base_info(server) -> dict:
    import httpx

    return httpx.get(server.url + "/v1/server_info", timeout=30).json()


def test_the_defaults_turn_the_mode_on_and_start_up_says_what_it_costs(server):
    info = base_info(server)
    assert info["engine_config"]["speculative"] != "off", "speculation is on by default: drafted tokens are under test"
    assert info["batch_invariant"] is True, f"batch-invariant mode is off at the defaults here: {info['engine_config']}"
    cost = info["batch_invariant_cost"]
    assert isinstance(cost, float) and -1 < cost < 100, cost
    log = server.log_path.read_text()  # by role (float32's int8, bf16's per-step) or every row in the kernel (q8, q4)
    assert re.search(r"batch-invariant mode on \(auto\): measured cost [+-]\d+\.\d% on the linears of (?:a step of 504 prompt rows beside 8 decode rows \(linears: prompts of 64\+ tokens dequantized, shorter ones and decode rows in the row-exact kernel|a 512-token prefill chunk \(linears: their own kernels at any row count); decode spans (?:[\d/]+ or )?padded to \d+", log), log[-3000:]


def test_greedy_and_seeded_chat_are_the_same_alone_and_concurrent(server):
    greedy = [lambda c, p=p: chat(c, p, temperature=0) for p in PROMPTS]
    seeded = [lambda c, p=p, s=s: chat(c, p, temperature=1.0, seed=s) for s, p in enumerate(PROMPTS)]
    beside = [lambda c: chat(c, LONG, temperature=0.8, seed=99)]
    alone, together = alone_and_together(server, greedy + seeded, beside)
    assert together == alone
    assert len({tuple(texts) for texts in alone[len(PROMPTS):]}) > 1


def test_n_choices_are_the_same_alone_and_concurrent(server):
    requests = [lambda c: chat(c, PROMPTS[0], temperature=1.0, seed=5, n=3), lambda c: chat(c, PROMPTS[1], temperature=0, n=2)]
    beside = [lambda c, p=p: chat(c, p, temperature=0.7, seed=1) for p in PROMPTS[2:]]
    alone, together = alone_and_together(server, requests, beside)
    assert together == alone
    assert len(set(alone[0])) > 1, "seeded choices differ from each other"


def test_each_prompt_of_a_multi_prompt_completion_is_its_text_alone(server):
    async def main(client):
        listed = await client.completions.create(model="gemma-3-270m", prompt=PROMPTS, max_tokens=TOKENS, temperature=0)
        alone = [await client.completions.create(model="gemma-3-270m", prompt=p, max_tokens=TOKENS, temperature=0) for p in PROMPTS]
        return [c.text for c in sorted(listed.choices, key=lambda c: c.index)], [r.choices[0].text for r in alone]
    listed, alone = run(server, main)
    assert listed == alone


def test_a_prefix_cache_hit_answers_as_the_miss_did(server):
    prompt = "Repeat after me, then continue: " + "a quiet harbour town at dawn, gulls over the boats, " * 6

    async def main(client):
        answers = []
        for _ in range(2):
            response = await client.chat.completions.create(
                model="gemma-3-270m", messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=1.0, seed=3)
            details = response.usage.prompt_tokens_details
            answers.append((response.choices[0].message.content, details.cached_tokens if details else 0))
        return answers
    (first, _), (second, cached) = run(server, main)
    assert cached > 0, "the second request should be served from the prefix cache"
    assert second == first


def test_drafted_tokens_do_not_change_the_text(server):
    """Speculation is on by default: the prompt's n-grams and a Predicted Output draft tokens (some accepted, some
    not); the text equals the same request's with speculation off for it (`speculative: false`), greedy and
    seeded, alone and beside others."""
    prompt = "Copy this sentence exactly, twice: the old lighthouse keeper counted ships every night."
    off = {"extra_body": {"speculative": False}}
    guess = {"prediction": {"type": "content", "content": "the old lighthouse keeper counted ships every night. the old"}}
    variants = [lambda c, kw: chat(c, prompt, temperature=0, **kw), lambda c, kw: chat(c, prompt, temperature=1.0, seed=4, **kw)]
    without, _ = alone_and_together(server, [lambda c, make=make: make(c, off) for make in variants])
    for extra in ({}, guess):
        drafted = [lambda c, make=make, extra=extra: make(c, extra) for make in variants]
        beside = [lambda c, p=p: chat(c, p, temperature=0) for p in PROMPTS[:3]]
        alone, together = alone_and_together(server, drafted, beside)
        assert alone == without, extra
        assert together == without, extra


def test_adapter_rows_and_base_rows_in_one_batch_are_their_texts_alone(server):
    requests = [lambda c, p=p, m=m: chat(c, p, model=m, temperature=1.0, seed=2)
                for p in PROMPTS[:3] for m in ("gemma-3-270m", ADAPTER)]
    alone, together = alone_and_together(server, requests)
    assert together == alone
    assert alone[0] != alone[1] or alone[2] != alone[3], "the adapter should change some text"
