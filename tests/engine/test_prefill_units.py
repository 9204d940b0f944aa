"""An image's prefill chunk run as units between steps (engine/model/prefill_units.py) gives the one-call step's bits:
the tiny vision model's text side (the 270M's), batch-invariant mode on (this machine's default), the chunk's units
interleaved with other sequences' decode steps as the engine runs them."""

import functools
import time

import pytest
import torch

from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.model.invariance_check import measure_invariance
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.prefill_units import PrefillUnits
from oai_gemma.engine.model.runner import ModelRunner, StepItem, load_weights
from oai_gemma.settings import ModelSettings
from oai_gemma.testing.tiny_vision import BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID, MM_TOKENS_PER_IMAGE

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

LAYERS = 6
"""Decoder layers run: five sliding, one global."""


@functools.cache
def built(directory: str, mode: str) -> ModelRunner:
    loaded = load(ModelSettings(source=directory, dtype="float32"))
    config = EngineConfig(model=ModelConfig(dtype="float32", batch_invariant=mode, max_model_len=1024),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_prefill_tokens=512))
    weights = load_weights(loaded, config.model)
    invariance, _ = measure_invariance(weights, config)
    runner = ModelRunner(weights, config, loaded.model, invariance)
    runner.weights = runner.weights[:LAYERS]
    return runner


def image_item(runner: ModelRunner, slot: int, text_before: int = 5) -> StepItem:
    """Text, an image block (random features in place of the tower's) and text: one chunk, as the scheduler cuts it."""
    ids = [2, *range(300, 300 + text_before), BOI_TOKEN_ID, *[IMAGE_TOKEN_ID] * MM_TOKENS_PER_IMAGE, EOI_TOKEN_ID, *range(400, 412)]
    first = ids.index(IMAGE_TOKEN_ID)
    span = (first, first + MM_TOKENS_PER_IMAGE)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(MM_TOKENS_PER_IMAGE, runner.text_shape.hidden, generator=g)
    embeds = (torch.arange(*span), features)
    return StepItem(runner.sequence_blocks(slot), ids, 0, True, (span,), embeds)


def decode_beside(runner: ModelRunner, position: int) -> list[StepItem]:
    return [StepItem(runner.sequence_blocks(3), [7 + position % 5], position)]


def kv_of(runner: ModelRunner, item: StepItem) -> list[torch.Tensor]:
    table = torch.tensor(item.blocks)
    return [torch.cat(runner.cache.positions(li, table, 0, len(item.token_ids))) for li in range(LAYERS)]


@pytest.mark.parametrize("mix_rows", [64, 100])
def test_an_image_chunk_in_units_between_decode_steps_is_bitwise_the_one_call_step(tiny_vision_dir, mix_rows):
    runner = built(str(tiny_vision_dir), "on")
    assert runner.batch_invariant
    runner.forward([StepItem(runner.sequence_blocks(3), list(range(500, 530)), 0, False)], [])  # a stream beside
    whole = image_item(runner, 0)
    one_call = runner.forward([whole], decode_beside(runner, 30))[0]

    item = image_item(runner, 1)
    units = PrefillUnits(runner, item, mix_rows=mix_rows)
    steps = 0
    while not units.run(0.0):  # one unit a call, another sequence's decode step between
        runner.forward([], decode_beside(runner, 31 + steps))
        steps += 1
    assert units.units_done == steps + 1 == LAYERS * (1 + -(-len(item.token_ids) // mix_rows)) + 1
    assert torch.equal(units.logits[0], one_call)
    for a, b in zip(kv_of(runner, whole), kv_of(runner, item)):
        assert torch.equal(a, b)


def test_the_check_sees_a_slice_that_misses_the_image_keys_after_it(tiny_vision_dir, monkeypatch):
    """The comparison above can fail: a slice whose queries see keys only up to its own last row (plain causal
    chunking, what splitting an image block by tokens would do) gives other logits."""
    from oai_gemma.engine.model import prefill_units

    runner = built(str(tiny_vision_dir), "on")
    one_call = runner.forward([image_item(runner, 0)], [])[0]
    real = prefill_units.prefill_attention

    def causal(cache, li, table, start, spans, q, scaling, invariant, end=None):
        return real(cache, li, table, start, spans, q, scaling, invariant, end=start + q.shape[0])

    monkeypatch.setattr(prefill_units, "prefill_attention", causal)
    units = PrefillUnits(runner, image_item(runner, 1), mix_rows=64)
    while not units.run(1.0):
        pass
    assert not torch.equal(units.logits[0], one_call)


def test_without_the_mode_the_units_match_the_one_call_step_closely(tiny_vision_dir):
    runner = built(str(tiny_vision_dir), "off")
    one_call = runner.forward([image_item(runner, 0)], [])[0]
    units = PrefillUnits(runner, image_item(runner, 1))
    while not units.run(0.0):
        pass
    torch.testing.assert_close(units.logits[0], one_call, rtol=1e-4, atol=1e-4)


def engine_run(tiny_vision_dir, apart: bool) -> tuple[list[int], list[int], int]:
    """A text stream, then an image request beside it, on an engine whose image chunks run apart (or in one step):
    (the image request's tokens, the text's, the text tokens made while the image's chunk ran as units)."""
    import asyncio
    import io

    from PIL import Image
    from transformers import AutoProcessor

    from oai_gemma.chat import render_chat
    from oai_gemma.chat.vision import expand_images
    from oai_gemma.engine.engine import Engine
    from oai_gemma.engine.types import GenerationRequest, SamplingParams

    loaded = load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"))
    engine = Engine(loaded, EngineConfig(model=ModelConfig(max_model_len=1024),
                                         scheduler=SchedulerConfig(max_num_seqs=2, vision_step_seconds=0.001)))
    apart_prefills = engine.core.apart
    apart_prefills.enabled = apart
    spans = []  # when each image chunk's job started and ended
    take, run = apart_prefills.take, apart_prefills.run
    apart_prefills.take = lambda step: (spans.append([time.perf_counter()]) if any(it.image_embeds is not None for it in step.prefills) and apart else None, take(step))[1]

    def timed_run(seconds):
        out = run(seconds)
        if out is not None:
            spans[-1].append(time.perf_counter())
        return out

    apart_prefills.run = timed_run
    buffer = io.BytesIO()
    Image.new("RGB", (320, 200), (30, 120, 200)).save(buffer, "PNG")
    content = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "What is it?"}]
    rendered = render_chat([{"role": "user", "content": content}]).prompt
    vision = expand_images(AutoProcessor.from_pretrained(tiny_vision_dir), rendered, [Image.open(buffer)], [False])
    loop = asyncio.new_event_loop()
    engine.start(loop)

    async def one(request: GenerationRequest):
        return [e async for e in engine.generate(request) if e.token_id is not None]

    async def main():
        text = asyncio.ensure_future(one(GenerationRequest("t", list(range(300, 320)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))))
        await asyncio.sleep(0.05)
        image = await one(GenerationRequest("i", vision.token_ids, SamplingParams(max_tokens=5, temperature=0.0),
                                            pixel_values=vision.pixel_values, crop_keys=tuple(vision.crop_keys)))
        return image, await text

    try:
        image, text = loop.run_until_complete(main())
    finally:
        engine.shutdown()
        loop.close()
    during = sum(1 for e in text for s in spans if len(s) == 2 and s[0] < e.timestamp < s[1])
    return [e.token_id for e in image], [e.token_id for e in text], during


def test_a_text_stream_keeps_streaming_while_an_image_chunk_prefills_and_the_image_gets_the_same_tokens(tiny_vision_dir):
    image, text, during = engine_run(tiny_vision_dir, apart=True)
    image_whole, text_whole, _ = engine_run(tiny_vision_dir, apart=False)
    assert image == image_whole and len(image) == 5
    assert text == text_whole
    assert during >= 3, during  # one step would give none (a unit a step at this budget: dozens)
