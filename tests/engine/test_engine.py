"""The engine without HTTP, in float32 so its greedy tokens can be held against transformers' own generate."""

import asyncio

import pytest
import torch

from oai_gemma.chat import render_chat
from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings

from conftest import embedded_float32


class EngineHarness:
    def __init__(self):
        self.loaded = embedded_float32()  # conftest: one load for the session
        self.engine = Engine(self.loaded, EngineConfig(
            model=ModelConfig(max_model_len=1024),
            scheduler=SchedulerConfig(max_num_seqs=4, max_prefill_tokens=256),
        ))
        self.loop = asyncio.new_event_loop()
        self.engine.start(self.loop)
        self.counter = 0

    def prompt(self, text: str) -> list[int]:
        return self.engine.encode(render_chat([{"role": "user", "content": text}]).prompt)

    async def _collect(self, ids, max_tokens, **kw):
        self.counter += 1
        request = GenerationRequest(f"t{self.counter}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))
        events = [e async for e in self.engine.generate(request)]
        return [e.token_id for e in events if e.token_id is not None], events[-1]

    def run(self, *prompts, max_tokens=12, **kw):
        """Generate for all prompts at once (one batch); returns [(token ids, last event)]."""
        async def main():
            return await asyncio.gather(*[self._collect(p, max_tokens, **kw) for p in prompts])
        return self.loop.run_until_complete(main())

    def reference(self, ids, max_tokens=12) -> list[int]:
        """transformers' own greedy generate on the same weights."""
        with torch.inference_mode():
            out = self.loaded.model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=list(self.loaded.eos_token_ids), pad_token_id=0,
            )
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def harness():
    h = EngineHarness()
    yield h
    h.engine.shutdown()
    h.loop.close()


def test_greedy_matches_transformers_generate(harness):
    ids = harness.prompt("Write about the ocean.")
    (tokens, last), = harness.run(ids)
    assert tokens == harness.reference(ids)[: len(tokens)]
    assert last.finish_reason in ("stop", "length")


def test_greedy_output_is_the_same_alone_or_in_a_batch(harness):
    prompts = [harness.prompt(t) for t in ("Tell me a joke.", "List some fruits.", "Describe Paris in detail.")]
    alone = [harness.run(p)[0][0] for p in prompts]
    together = [tokens for tokens, _ in harness.run(*prompts)]
    assert together == alone


def test_long_prompt_chunked_prefill_and_sliding_window_match_transformers(harness):
    # 700 tokens: several 256-token prefill chunks, and past the 512-token sliding window
    ids = harness.prompt(" ".join(f"item {i} is {i * 7 % 13}." for i in range(120)))
    assert len(ids) > 600
    (tokens, _), = harness.run(ids, max_tokens=8)
    assert tokens == harness.reference(ids, max_tokens=8)[: len(tokens)]


def test_multi_turn_resend_reuses_the_cached_prefix_and_keeps_the_output(harness):
    first = harness.prompt("Write a story about a fox.")
    (reply, _), = harness.run(first, max_tokens=10)
    follow_up = first + reply + harness.engine.encode("<end_of_turn>\n<start_of_turn>user\nAnd then?<end_of_turn>\n<start_of_turn>model\n")
    (tokens, last), = harness.run(follow_up, max_tokens=8)
    assert last.num_cached_tokens >= len(first) // 16 * 16  # every full block of it
    assert tokens == harness.reference(follow_up, max_tokens=8)[: len(tokens)]


def test_unrelated_prompt_gets_no_cache_hit(harness):
    (_, last), = harness.run(harness.prompt("Completely different request about trains."), max_tokens=2)
    # only the shared template head (<bos><start_of_turn>user\n) matches: less than one 16-token block
    assert last.num_cached_tokens == 0


def test_a_stop_token_ends_generation_with_stop_and_no_text(harness):
    ids = harness.prompt("Say hi.")
    (tokens, _), = harness.run(ids, max_tokens=6)
    saved = harness.engine.eos_token_ids
    harness.engine.eos_token_ids = frozenset({tokens[2]})  # pretend the third token is <end_of_turn>
    try:
        (stopped, last), = harness.run(ids, max_tokens=6)
    finally:
        harness.engine.eos_token_ids = saved
    assert stopped == tokens[:3]
    assert last.finish_reason == "stop"
    assert last.num_output_tokens == 3


def test_ignore_eos_keeps_generating_through_stop_tokens(harness):
    ids = harness.prompt("Say hi.")
    (tokens, _), = harness.run(ids, max_tokens=6)
    saved = harness.engine.eos_token_ids
    harness.engine.eos_token_ids = frozenset({tokens[2]})
    try:
        (kept, last), = harness.run(ids, max_tokens=6, ignore_eos=True)
    finally:
        harness.engine.eos_token_ids = saved
    assert last.finish_reason == "length"
    assert kept == tokens


def test_incremental_detokenizer_emits_whole_characters_once(harness):
    from oai_gemma.engine.sampling.detokenizer import IncrementalDetokenizer

    text = "你好，世界！🙂 🦩ꙮ𓀀 Привет, naïve café"  # 🦩, ꙮ and 𓀀 are not in the vocabulary: byte tokens
    ids = harness.engine.encode(text)
    assert all(len(harness.engine.encode(ch)) >= 3 for ch in "🦩ꙮ𓀀"), "these must split into UTF-8 byte tokens"
    detok = IncrementalDetokenizer(harness.loaded.tokenizer, harness.prompt("hi"))
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_step_that_fails_on_a_new_prompt_fails_that_request_alone(harness):
    """E.g. out of memory on a huge prompt: the running stream beside it goes on, token for token."""
    steady = harness.prompt("Describe a long walk in the mountains.")
    doomed = harness.prompt("This prompt breaks the model.")
    (alone, _), = harness.run(steady, max_tokens=16)
    runner = harness.engine.core.runner
    real_forward = runner.forward

    def forward(prefills, decodes):
        if any(item.token_ids[-4:] == doomed[-4:] for item in prefills):
            raise RuntimeError("out of memory (injected)")
        return real_forward(prefills, decodes)

    async def main():
        harness.counter += 1
        first = harness.engine.generate(GenerationRequest("steady", steady, SamplingParams(max_tokens=16, temperature=0.0)))
        events = [await first.__anext__()]  # it is decoding now
        failed = [e async for e in harness.engine.generate(GenerationRequest("doomed", doomed, SamplingParams(max_tokens=4)))]
        events += [e async for e in first]
        return events, failed

    runner.forward = forward
    try:
        events, failed = harness.loop.run_until_complete(main())
    finally:
        runner.forward = real_forward
    assert failed[-1].finish_reason == "error" and "out of memory" in failed[-1].error
    assert [e.token_id for e in events if e.token_id is not None] == alone
    assert events[-1].finish_reason == "length"
    assert harness.engine.alive


def test_a_dead_engine_loop_fails_every_request_and_refuses_new_ones(harness):
    from oai_gemma.engine.engine import EngineDeadError

    engine = Engine(harness.loaded, EngineConfig(
        model=ModelConfig(max_model_len=256),
        scheduler=SchedulerConfig(max_num_seqs=2, max_prefill_tokens=64),
    ))

    class Broken(BaseException):
        pass

    def step():
        raise Broken("the loop itself broke (injected)")

    engine.core._step = step
    loop = asyncio.new_event_loop()
    engine.start(loop)

    async def main():
        request = GenerationRequest("victim", harness.prompt("hi"), SamplingParams(max_tokens=4))
        return [e async for e in engine.generate(request)]

    try:
        events = loop.run_until_complete(asyncio.wait_for(main(), 30))
        assert events[-1].finish_reason == "error" and "loop died" in events[-1].error
        assert not engine.alive
        assert "Broken" in engine.dead_reason
        with pytest.raises(EngineDeadError):
            engine.generate(GenerationRequest("late", harness.prompt("hi"), SamplingParams(max_tokens=1)))
    finally:
        engine.shutdown()
        loop.close()


def test_n_choices_prefill_the_prompt_once(harness):
    ids = harness.prompt("A prompt that only this test sends, about seven green kites.")
    runner = harness.engine.core.runner
    real_forward = runner.forward
    prefilled = []

    def forward(prefills, decodes):
        prefilled.extend(len(item.token_ids) for item in prefills)
        return real_forward(prefills, decodes)

    async def main():
        request = GenerationRequest("forked", ids, SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True), n=3)
        return [e async for e in harness.engine.generate(request)]

    runner.forward = forward
    try:
        events = harness.loop.run_until_complete(main())
    finally:
        runner.forward = real_forward
    last = [e for e in events if e.finish_reason]
    assert sorted(e.index for e in last) == [0, 1, 2]
    assert all(e.finish_reason == "length" and e.num_output_tokens == 5 for e in last)
    assert sum(prefilled) == len(ids) - last[0].num_cached_tokens  # once, not three times


@pytest.mark.slow  # fast subset (issue 36.4): the same subsystem is covered by its lighter tests
def test_the_servers_own_module_tree_generates_what_transformers_modules_do(harness):
    """The server builds Gemma-3's modules itself (engine/model/lean.py, `load(lean=True)`); an engine on that tree
    gives the same tokens and logprobs as one on transformers' tree, past the sliding window and across chunks."""
    lean = Engine(load(ModelSettings(dtype="float32"), lean=True), EngineConfig(
        model=ModelConfig(max_model_len=1024),
        scheduler=SchedulerConfig(max_num_seqs=4, max_prefill_tokens=256),
    ))
    assert "Gemma3" not in type(lean.core.runner.model).__name__
    loop = asyncio.new_event_loop()
    lean.start(loop)

    async def collect(engine, ids):
        request = GenerationRequest("lean", ids, SamplingParams(max_tokens=10, temperature=0.0, logprobs=3))
        return [(e.token_id, e.logprob, e.top_logprobs) async for e in engine.generate(request) if e.token_id is not None]

    try:
        for text in ("Name three rivers.", " ".join(f"item {i} is {i * 7 % 13}." for i in range(120))):
            ids = harness.prompt(text)
            ours = loop.run_until_complete(collect(lean, ids))
            assert len(ours) == 10 and ours == harness.loop.run_until_complete(collect(harness.engine, ids)), text[:20]
    finally:
        lean.shutdown()
        loop.close()
