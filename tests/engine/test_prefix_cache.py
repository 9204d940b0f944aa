"""The prefix cache on the real model (issue 12): in float32 (where batch-invariant mode is on), greedy and
seeded outputs with the cache equal those without it, token for token, for a shared system prompt longer than
the sliding window, a multi-turn conversation past the window, n > 1 and structured output; and concurrent
arrivals behind one prefix compute it once. (Images: tests/chat/test_vision.py.)"""

import asyncio

import pytest

from oai_gemma.chat import render_chat
from oai_gemma.engine.config import EngineConfig, CacheConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.types import GenerationRequest, SamplingParams

from conftest import embedded_float32

pytestmark = pytest.mark.slow

BLOCK = 16
SYSTEM = "You are the support desk of a lighthouse museum. " + "Visitors ask about tides, lamps and the keepers' lives. " * 60
QUESTIONS = ("When does the museum open?", "How tall is the tower?", "Can I bring my dog?", "Who was the last keeper?")


def loaded():
    return embedded_float32()  # conftest: one load for the session


@pytest.fixture(scope="module")
def engines():
    """The same engine with the prefix cache on and off, prefilling 128 tokens per step."""
    loop = asyncio.new_event_loop()
    pair = {
        caching: Engine(loaded(), EngineConfig(
            model=ModelConfig(max_model_len=2048),
            cache=CacheConfig(prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_seqs=8, max_prefill_tokens=128),
        ))
        for caching in (True, False)
    }
    for engine in pair.values():
        assert engine.core.runner.batch_invariant, "float32 turns batch-invariant mode on: else equality is luck"
        engine.start(loop)
    yield loop, pair
    for engine in pair.values():
        engine.shutdown()
    loop.close()


def prompt(engine: Engine, messages: list[dict]) -> list[int]:
    return engine.encode(render_chat(messages).prompt)


class Runs:
    def __init__(self, engines):
        self.loop, self.pair = engines
        self.count = 0

    async def one(self, caching: bool, ids: list[int], max_tokens: int = 16, **fields):
        """{choice index: tokens}, cached prompt tokens."""
        self.count += 1
        sampling = SamplingParams(max_tokens=max_tokens, temperature=fields.pop("temperature", 0.0), seed=fields.pop("seed", None))
        request = GenerationRequest(f"r{self.count}", ids, sampling, **fields)
        tokens: dict[int, list[int]] = {}
        async for event in self.pair[caching].generate(request):
            if event.token_id is not None:
                tokens.setdefault(event.index, []).append(event.token_id)
            last = event
        assert last.finish_reason in ("stop", "length"), last
        return tokens, last.num_cached_tokens

    def run(self, caching: bool, ids: list[int], **fields):
        return self.loop.run_until_complete(self.one(caching, ids, **fields))

    def together(self, caching: bool, prompts: list[list[int]], **fields):
        async def main():
            return await asyncio.gather(*[self.one(caching, ids, **fields) for ids in prompts])
        return self.loop.run_until_complete(main())


@pytest.fixture
def runs(engines):
    return Runs(engines)


def test_concurrent_questions_behind_one_long_system_prompt_compute_it_once_and_answer_as_without_cache(runs):
    prompts = [prompt(runs.pair[True], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]
    system_tokens = len(prompt(runs.pair[True], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ""}]))
    assert system_tokens > 600, "longer than the 512-token sliding window"
    without = [runs.run(False, ids) for ids in prompts]
    assert all(cached == 0 for _, cached in without)
    with_cache = runs.together(True, prompts)  # all four arrive at once
    assert [tokens for tokens, _ in with_cache] == [tokens for tokens, _ in without]
    # computed once: the first computes all of it (in six 128-token chunks); the others, arriving with it, wait
    # for its blocks instead of computing the same ones beside it, then compute only their own last blocks
    cached = sorted(cached for _, cached in with_cache)
    assert cached[0] == 0 and all(c >= system_tokens - 2 * BLOCK for c in cached[1:]), cached


def test_a_conversation_longer_than_the_window_reuses_its_history_and_answers_as_without_cache(runs):
    history = [{"role": "user", "content": SYSTEM + " Summarise this in one line."}]
    first = prompt(runs.pair[True], history)
    assert len(first) > 600
    reply, _ = runs.run(True, first, max_tokens=24)
    history += [
        {"role": "assistant", "content": runs.pair[True].tokenizer.decode(reply[0], skip_special_tokens=True)},
        {"role": "user", "content": "And now in French?"},
    ]
    second = prompt(runs.pair[True], history)
    assert second[: len(first)] == first
    tokens, cached = runs.run(True, second)
    assert cached >= len(first) - BLOCK
    assert tokens == runs.run(False, second)[0]


def test_n_seeded_choices_from_a_cached_prefix_equal_those_without_cache(runs):
    ids = prompt(runs.pair[True], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a story."}])
    runs.run(True, ids, max_tokens=1)  # the prompt is cached now
    tokens, cached = runs.run(True, ids, n=3, temperature=1.0, seed=7)
    assert cached > 600 and len(tokens) == 3 and len({tuple(t) for t in tokens.values()}) > 1
    assert tokens == runs.run(False, ids, n=3, temperature=1.0, seed=7)[0]


def test_structured_output_from_a_cached_prefix_equals_it_without_cache(runs):
    ids = prompt(runs.pair[True], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Opening hours as JSON."}])
    runs.run(True, ids, max_tokens=1)
    grammar = runs.pair[True].grammars.json_object()
    tokens, cached = runs.run(True, ids, max_tokens=24, grammar=grammar)
    assert cached > 600 and runs.pair[True].tokenizer.decode(tokens[0]).lstrip().startswith("{")
    assert tokens == runs.run(False, ids, max_tokens=24, grammar=runs.pair[False].grammars.json_object())[0]


def test_with_every_block_hash_colliding_no_prompt_gets_another_prompts_kv(runs, monkeypatch):
    """Issue 29 item 1: the hash is replaced by a constant (a crafted collision for every block). A hit needs the
    block's tokens and predecessor to match, so another prompt's blocks are never taken and outputs stay exact."""
    import oai_gemma.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "block_hashes", lambda keys, size, parent=None: [0] * (len(keys) // size))
    engine = runs.pair[True]
    first = prompt(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp room?"}])
    second = prompt(engine, [{"role": "system", "content": SYSTEM.upper()}, {"role": "user", "content": "Where is the lamp room?"}])
    assert len(first) > 4 * BLOCK and first[1:BLOCK] != second[1:BLOCK]
    assert runs.run(True, first)[1] == 0
    tokens, cached = runs.run(True, second)
    assert cached == 0  # every hash points at `first`'s block; its tokens differ
    assert tokens == runs.run(False, second)[0]
    again, cached = runs.run(True, first)
    assert cached == BLOCK  # only the chain's first block is findable at all (the index holds one entry per hash)
    assert again == runs.run(False, first)[0]
