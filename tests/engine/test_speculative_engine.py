"""Speculative decoding on the real model, through the engine: greedy and seeded outputs equal with speculation on
and off (batch-invariant mode: float32), stop strings and max_tokens landing inside accepted runs, cancellation,
every KV block back after rejections, and no prefix-cache block holding a rejected position."""

import asyncio
from dataclasses import replace

import pytest
import torch

from oai_gemma.chat import render_chat
from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.speculative.planner import Speculator
from oai_gemma.engine.types import GenerationRequest, SamplingParams

from conftest import embedded_float32

pytestmark = pytest.mark.slow

CODE = '''def parse_pairs(text, separator="="):
    pairs = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(separator)
        pairs[key.strip()] = value.strip()
    return pairs
'''
EDIT = f"Rename the function parse_pairs to read_pairs. Reply with the whole code only.\n\n```python\n{CODE}```"
FREE = "Write a short poem about the sea and the wind, in four lines."
LOOP = "Repeat the word 'banana' twenty times, separated by commas."


def loaded():
    return embedded_float32()  # conftest: one load for the session


class Engines:
    """The same model served with speculation on and off."""

    def __init__(self, batch_invariant: str = "auto"):
        config = EngineConfig(model=ModelConfig(max_model_len=1024, batch_invariant=batch_invariant),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_prefill_tokens=256))
        self.loop = asyncio.new_event_loop()
        self.on = Engine(loaded(), config)
        self.off = Engine(loaded(), replace(config, speculative=SpeculativeConfig(method="off")))
        for engine in (self.on, self.off):
            engine.start(self.loop)
        self.counter = 0

    def prompt(self, text: str) -> list[int]:
        return self.on.encode(render_chat([{"role": "user", "content": text}]).prompt)

    def generate(self, engine: Engine, text: str, **params):
        """Every event of one request (params: SamplingParams fields; `prediction`: a text)."""
        self.counter += 1
        prediction = tuple(engine.encode(params.pop("prediction"))) if "prediction" in params else ()
        request = GenerationRequest(
            f"s{self.counter}", self.prompt(text), SamplingParams(**{"max_tokens": 96, "temperature": 0.0, **params}),
            prediction=prediction,
        )

        async def main():
            return [event async for event in engine.generate(request)]

        return self.loop.run_until_complete(main())

    def close(self) -> None:
        for engine in (self.on, self.off):
            engine.shutdown()
        self.loop.close()


def text(events) -> str:
    return "".join(event.text for event in events)


def tokens(events) -> list[int]:
    return [event.token_id for event in events if event.token_id is not None]


@pytest.fixture(scope="module")
def engines():
    engines = Engines()
    assert engines.on.core.runner.batch_invariant, "float32: batch-invariant mode, where on and off must agree"
    yield engines
    engines.close()


CASES = (
    (EDIT, {"max_tokens": 64}),  # drafts mostly accepted (the code is copied)
    (LOOP, {"max_tokens": 40}),  # the output repeats itself
    (EDIT, {"max_tokens": 40, "temperature": 1.0, "seed": 7}),
    (FREE, {"max_tokens": 32, "temperature": 0.8, "top_p": 0.9, "seed": 3, "presence_penalty": 0.3}),  # drafts mostly rejected
)


def test_greedy_and_seeded_outputs_are_the_same_with_speculation_on_and_off(engines):
    spec = engines.on.core.speculator
    for prompt, params in CASES:
        on, off = engines.generate(engines.on, prompt, **params), engines.generate(engines.off, prompt, **params)
        assert tokens(on) == tokens(off), (prompt, params)
        assert text(on) == text(off) and on[-1].finish_reason == off[-1].finish_reason
        if params.get("max_tokens") == 64:
            reference = off
    assert spec.num_accepted_tokens > 30, "the edit and the loop should copy: otherwise this test proves little"
    assert spec.num_draft_tokens > spec.num_accepted_tokens, "some drafts should have been rejected"
    with_prediction = engines.generate(engines.on, EDIT, prediction=CODE, max_tokens=64)
    assert tokens(with_prediction) == tokens(reference)
    accepted, rejected = with_prediction[-1].accepted_prediction_tokens, with_prediction[-1].rejected_prediction_tokens
    assert accepted > 20 and accepted + rejected == len(engines.on.encode(CODE))
    assert any(event.drafted for event in with_prediction)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"],
}


GARDEN = ("Describe this garden as a JSON record: the garden has tomatoes, carrots and beans along the south fence, "
          "with a small pond in the middle.")
RECORD = {  # a short value, then a long one that copies the prompt and repeats itself
    "type": "object", "properties": {"name": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["name", "summary"], "additionalProperties": False,
}


@pytest.mark.parametrize("schema, prompt", [(SCHEMA, "Describe a person as JSON."), (RECORD, GARDEN)])
def test_a_grammar_drafts_its_forced_tokens_and_looked_up_values_and_the_document_is_the_same(engines, schema, prompt):
    spec = engines.on.core.speculator
    accepted = spec.num_accepted_tokens
    grammar = engines.on.grammars.json_schema(schema)
    for params in ({}, {"temperature": 0.8, "seed": 11}):
        runs = []
        for engine in (engines.on, engines.off):
            engines.counter += 1
            request = GenerationRequest(f"g{engines.counter}", engines.prompt(prompt),
                                        SamplingParams(**{"max_tokens": 100, "temperature": 0.0, **params}), grammar=grammar)

            async def main():
                return [event async for event in engine.generate(request)]

            runs.append(engines.loop.run_until_complete(main()))
        on, off = runs
        assert tokens(on) == tokens(off) and text(on) == text(off), params
        assert any(event.drafted for event in on), "the schema's keys should have come as accepted drafts"
        if schema is RECORD and not params:
            # the grammar forces keys and punctuation, never a space: a word of the summary was looked up
            assert any(event.drafted and " " in event.text for event in on), text(on)
    assert spec.num_accepted_tokens > accepted


def test_stop_strings_max_tokens_and_logprobs_inside_accepted_runs_are_exact(engines):
    full = text(engines.generate(engines.off, EDIT, max_tokens=64))
    stop = full[len(full) // 2 : len(full) // 2 + 8]  # a stop string in the middle of the (mostly copied) text
    for params in ({"stop": (stop,), "logprobs": 2, "max_tokens": 64}, {"max_tokens": 37}):
        on, off = engines.generate(engines.on, EDIT, **params), engines.generate(engines.off, EDIT, **params)
        assert text(on) == text(off) and on[-1].finish_reason == off[-1].finish_reason, params
        assert [(e.logprob, e.top_logprobs) for e in on] == [(e.logprob, e.top_logprobs) for e in off]
        assert any(event.drafted for event in on), "drafts should have been accepted in this run"
        if "stop" in params:
            assert stop not in text(on) and on[-1].finish_reason == "stop"
        else:
            assert len(tokens(on)) == 37 and on[-1].finish_reason == "length"


def test_cancelled_mid_run_and_after_rejections_every_block_comes_back(engines):
    core = engines.on.core
    pool = core.scheduler.pool
    free, drafts = pool.available, core.speculator.num_drafts
    engines.counter += 1
    request = GenerationRequest("cancel-me", engines.prompt(LOOP), SamplingParams(max_tokens=200, temperature=0.0))

    async def main():
        submission = engines.on.generate(request)
        seen = 0
        async for event in submission:
            seen += 1
            if seen == 12:
                break
        submission.close()
        for _ in range(200):  # the cancel lands between two steps
            if not core.scheduler.running:
                break
            await asyncio.sleep(0.01)

    engines.loop.run_until_complete(main())
    assert not core.scheduler.running and pool.available == free
    assert core.speculator.num_drafts > drafts, "the cancelled request should have run with drafts"


class WrongDrafts(Speculator):
    """Every decoding sequence drafts 8 copies of a token the model never writes here: all rejected."""

    def plan(self, decoding, max_len, prefill_tokens=0):
        for seq in decoding:
            cap = min(8, seq.sampling.max_tokens - len(seq.output_ids) - 1)
            seq.draft = [GARBAGE] * cap if seq.speculation is not None and cap > 0 else []


GARBAGE = 9999  # a rare token: the test checks that it was never accepted


def test_the_prefix_cache_never_serves_a_rejected_position():
    """Outside batch-invariant mode generated blocks are offered for reuse. With every draft rejected, each step
    writes rejected KV past the sequence's end; the blocks indexed must hold the KV of the tokens kept (as the
    engine without speculation computes them), never a rejected position's."""
    engines = Engines(batch_invariant="off")
    try:
        core = engines.on.core
        core.scheduler.speculator = core.speculator = WrongDrafts(core.speculator.config)
        on = engines.generate(engines.on, FREE, max_tokens=56)
        engines.generate(engines.off, FREE, max_tokens=56)  # the same tokens' KV, computed without drafts
        assert core.speculator.num_draft_tokens > 200 and core.speculator.num_accepted_tokens == 0
        assert GARBAGE not in tokens(on)
        pools = engines.on.core.scheduler.pool, engines.off.core.scheduler.pool
        caches = engines.on.core.runner.cache, engines.off.core.runner.cache
        prompt_blocks = len(engines.prompt(FREE)) // 16
        shared = [h for h in pools[1].block_of if h in pools[0].block_of]  # same process: the same hash secret
        assert len(shared) > prompt_blocks, "blocks of generated tokens should be indexed in both engines"
        for h in shared:
            a, b = pools[0].block_of[h], pools[1].block_of[h]
            for layer in range(len(caches[0].k)):
                assert torch.allclose(caches[0].k[layer][a], caches[1].k[layer][b], atol=1e-3), (layer, h)
                assert torch.allclose(caches[0].v[layer][a], caches[1].v[layer][b], atol=1e-3), (layer, h)
        assert pools[0].available == pools[0].num_blocks
    finally:
        engines.close()
