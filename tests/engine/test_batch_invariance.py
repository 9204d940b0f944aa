"""Batch-invariant mode on the real model: a greedy or seeded request gives the same tokens alone, batched with
others (20 at once through 8 slots, beside long prompts), with its prompt prefilled in 16-token chunks, and
served from the prefix cache; and a prompt's logits are bitwise the same however its prefill is chunked and
whatever decodes beside it. In float32 (where `auto` turns the mode on) and bf16 (`on`)."""

import asyncio
import functools
import random

import pytest
import torch

from oai_gemma.chat import render_chat
from oai_gemma.engine.config import EngineConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.runner import ModelRunner, StepItem
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings

pytestmark = pytest.mark.slow

SEEDS = range(20)
TOKENS = 24
COMPANIONS = ("Describe Paris in detail. " * 40, "List ten fruits with their colours.", "Count from one to fifty.")


@functools.cache
def loaded_model(dtype: str):
    return load(ModelSettings(dtype=dtype))


def runner_config(mode: str) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_model_len=2048, max_prefill_tokens=56, batch_invariant=mode)  # 64 tokens a step


class Engines:
    """Two engines on one loaded model: prompts prefilled whole (512-token chunks) with the prefix cache, and in
    16-token chunks without it."""

    def __init__(self, dtype: str, mode: str):
        loaded = loaded_model(dtype)
        self.loop = asyncio.new_event_loop()
        self.whole, self.chunked = (
            Engine(loaded, EngineConfig(max_num_seqs=8, max_prefill_tokens=chunk, max_model_len=2048, batch_invariant=mode, prefix_caching=caching))
            for chunk, caching in ((512, True), (16, False))
        )
        for engine in (self.whole, self.chunked):
            engine.start(self.loop)
        self.counter = 0

    def prompt(self, text: str) -> list[int]:
        return self.whole.encode(render_chat([{"role": "user", "content": text}]).prompt)

    async def _one(self, engine: Engine, ids: list[int], seed: int | None, max_tokens: int = TOKENS):
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0, seed=seed)
        events = [e async for e in engine.generate(GenerationRequest(f"r{self.counter}", ids, params))]
        return [e.token_id for e in events if e.token_id is not None], events[-1].num_cached_tokens

    def together(self, engine: Engine, ids: list[int], seeds) -> list[tuple[list[int], int]]:
        """Every seed's request at once, beside the companions; returns (tokens, cached prompt tokens) per seed."""
        async def main():
            companions = [self._one(engine, self.prompt(text), 99, 64) for text in COMPANIONS]
            return (await asyncio.gather(*[self._one(engine, ids, seed) for seed in seeds], *companions))[: len(seeds)]
        return self.loop.run_until_complete(main())

    def alone(self, engine: Engine, ids: list[int], seed: int | None) -> tuple[list[int], int]:
        return self.loop.run_until_complete(self._one(engine, ids, seed))

    def close(self) -> None:
        for engine in (self.whole, self.chunked):
            engine.shutdown()
        self.loop.close()


@pytest.mark.parametrize("dtype, mode", [("float32", "auto"), ("bfloat16", "on")])
def test_seeded_and_greedy_tokens_ignore_what_runs_beside_them(dtype, mode):
    engines = Engines(dtype, mode)
    try:
        for engine in (engines.whole, engines.chunked):
            assert engine.core.runner.batch_invariant, "the mode is on: otherwise this test proves nothing"
        ids = engines.prompt("Write a short poem about the sea and the wind, in four lines.")
        seeds = [None, *SEEDS]
        alone = [engines.alone(engines.chunked, ids, seed)[0] for seed in seeds]  # 16-token chunks, no prefix cache
        assert len({tuple(tokens) for tokens in alone}) > len(seeds) // 2, "seeds should give different texts"
        batched = engines.together(engines.whole, ids, seeds)  # whole prompts and prefix-cache hits, 20 through 8 slots
        assert [tokens for tokens, _ in batched] == alone
        whole_blocks = (len(ids) - 1) // 16 * 16
        assert any(cached == whole_blocks > 0 for _, cached in batched), "some request should be served from the prefix cache"
        assert [tokens for tokens, _ in engines.together(engines.chunked, ids, seeds)] == alone
    finally:
        engines.close()


def logits_under(runner: ModelRunner, splits: list[int], beside: list[int], rng: random.Random) -> list[torch.Tensor]:
    """The logits of a 23-token prompt (slot 0) prefilled in chunks of `splits` tokens, each step beside
    `beside[i]` decoding rows of random lengths (slots 1-7), then of 6 decode steps beside random rows."""
    lengths = {}
    for row in range(1, 8):
        lengths[row] = rng.choice((5, 40, 300))
        runner.forward([StepItem(runner.sequence_blocks(row), list(range(100, 100 + lengths[row])), 0)], [])

    def others(count: int) -> list[StepItem]:
        items = [StepItem(runner.sequence_blocks(row), [7], lengths[row]) for row in range(1, 1 + count)]
        for row in range(1, 1 + count):
            lengths[row] += 1
        return items

    prompt, start, out = list(range(2000, 2023)), 0, []
    for size, count in zip(splits, beside):
        logits = runner.forward([StepItem(runner.sequence_blocks(0), prompt[start : start + size], start, start + size == len(prompt))], others(count))
        start += size
    out.append(logits[0].clone())
    for position, token in enumerate(range(3000, 3006), start=len(prompt)):
        out.append(runner.forward([], [StepItem(runner.sequence_blocks(0), [token], position)] + others(rng.randint(0, 7)))[0].clone())
    return out


def chunkings(rng: random.Random, count: int):
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, 23), rng.randint(0, 3)))
        splits = [b - a for a, b in zip([0, *cuts], [*cuts, 23])]
        yield splits, [rng.randint(0, 7) for _ in splits]


@pytest.mark.parametrize("dtype, mode", [("float32", "auto"), ("bfloat16", "on")])
def test_logits_are_bitwise_equal_however_the_prompt_is_chunked_and_whatever_decodes_beside(dtype, mode):
    rng = random.Random(0)
    runner = ModelRunner(loaded_model(dtype).model, runner_config(mode))
    assert runner.batch_invariant
    alone = logits_under(runner, [23], [0], rng)
    for splits, beside in chunkings(rng, 12):
        assert all(torch.equal(a, b) for a, b in zip(logits_under(runner, splits, beside, rng), alone)), (splits, beside)


def test_without_the_mode_the_same_compositions_differ():
    """The check above can fail: the engine's own kernels, mode off, change a prompt's last bits."""
    rng = random.Random(0)
    runner = ModelRunner(loaded_model("float32").model, runner_config("off"))
    alone = logits_under(runner, [23], [0], rng)
    assert any(
        not all(torch.equal(a, b) for a, b in zip(logits_under(runner, splits, beside, rng), alone))
        for splits, beside in chunkings(rng, 12)
    )
