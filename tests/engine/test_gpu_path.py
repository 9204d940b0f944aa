"""The GPU path's static-shape decode step, checked on CPU in float32 against the dynamic path it replaces.

On CPU the static step runs eagerly (no CUDA graph); the logic a graph would replay is the same function.
Tests that need CUDA skip without it.
"""

import asyncio

import pytest
import torch

from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.runner import ModelRunner, StepItem
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.engine.model.buckets import span_buckets
from oai_gemma.engine.model.gemma3 import post_attention, pre_attention
from oai_gemma.engine.model.static_decode import DecodeGraph
from oai_gemma.settings import ModelSettings

pytestmark = pytest.mark.slow

MAX_LEN = 1024
SLOTS = 6
WINDOW = 512  # gemma-3-270m's sliding window


@pytest.fixture(scope="module")
def loaded():
    return load(ModelSettings(dtype="float32"))


@pytest.fixture(scope="module")
def model(loaded):
    return loaded.model


def make_runner(model, static: bool) -> ModelRunner:
    return ModelRunner.of(model, EngineConfig(
        model=ModelConfig(max_model_len=MAX_LEN, static_decode=static),
        scheduler=SchedulerConfig(max_num_seqs=SLOTS, max_prefill_tokens=640 - SLOTS),
    ))


@pytest.fixture(scope="module")
def runners(model):
    return make_runner(model, static=False), make_runner(model, static=True)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(10, 20000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def fill(runners, slots_and_lengths) -> dict[int, int]:
    """Prefill the same prompts into the same slots of both runners; returns slot -> next position."""
    for index, length in slots_and_lengths:
        for runner in runners:
            runner.forward([StepItem(runner.sequence_blocks(index), prompt(length, seed=index), 0)], [])
    return dict(slots_and_lengths)


def assert_same_logits(static, dynamic):
    """Equal up to float32 rounding: the static step sums in another order (plain F.linear instead of the
    pre-packed oneDNN weights, a longer span of masked cache entries); logits are ~10-30 in size."""
    torch.testing.assert_close(static, dynamic, atol=5e-4, rtol=1e-4)


def decode_both(runners, order: list[int], positions: dict[int, int], steps: int):
    """Decode `steps` tokens for the slots in `order` on both runners; yields both runners' logits each step."""
    for step in range(steps):
        items = [StepItem(runners[0].sequence_blocks(index), [100 + index + step], positions[index]) for index in order]
        yield tuple(runner.forward([], items) for runner in runners)
        for index in order:
            positions[index] += 1


def test_static_decode_matches_dynamic_for_mixed_slots_and_positions_out_of_slot_order(runners):
    positions = fill(runners, [(3, 5), (0, 40), (2, 17)])
    for dynamic, static in decode_both(runners, [3, 0, 2], positions, steps=2):
        assert static.shape == dynamic.shape == (3, dynamic.shape[1])
        assert_same_logits(static, dynamic)


def test_static_decode_matches_dynamic_as_the_sliding_window_moves_on(runners):
    # sequence 1 decodes positions 511, 512, 513: its sliding layers' window (512) starts to leave position 0, then 1
    positions = fill(runners, [(1, WINDOW - 1), (4, 9)])
    for dynamic, static in decode_both(runners, [4, 1], positions, steps=3):
        assert_same_logits(static, dynamic)
    assert positions[1] == WINDOW + 2


@pytest.fixture
def static_runner(runners):
    """The module's static runner, its cache restored after the test."""
    runner = runners[1]
    saved = [t.clone() for t in runner.cache.k + runner.cache.v]
    yield runner
    for tensor, old in zip(runner.cache.k + runner.cache.v, saved):
        tensor.copy_(old)


def test_padded_rows_leave_every_real_block_untouched(static_runner):
    runner = static_runner
    cache = runner.cache
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.k + cache.v:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    before = [t.clone() for t in cache.k + cache.v]
    items = [StepItem(runner.sequence_blocks(2), [7], 30), StepItem(runner.sequence_blocks(0), [8], 600), StepItem(runner.sequence_blocks(5), [9], 3)]
    assert runner.static.shape_for(items)[0] == 4  # 3 rows: bucket 4, one padded row
    runner.forward([], items)
    size = cache.block_size
    for old, new in zip(before, cache.k + cache.v):
        expected = old.clone()
        for it in items:  # the only entries a step may change: each row's own position
            block, row = it.blocks[it.start // size], it.start % size
            expected[block, row] = new[block, row]
        torch.testing.assert_close(new[: cache.scratch], expected[: cache.scratch], atol=0, rtol=0)
    assert not torch.equal(before[0][cache.scratch], cache.k[0][cache.scratch]), "the padded row wrote nowhere"


def test_row_bucket_is_the_smallest_that_holds_the_batch(runners):
    static = runners[1].static
    assert static.row_buckets == [1, 2, 4, 8]
    for n, rows in [(1, 1), (2, 2), (3, 4), (5, 8), (6, 8)]:
        assert static.shape_for([StepItem(runners[1].sequence_blocks(s % SLOTS), [0], 0) for s in range(n)])[0] == rows


def test_span_bucket_covers_the_longest_row(runners):
    static = runners[1].static
    assert span_buckets(MAX_LEN) == [256, 512, 1024]
    for longest_start, span in [(0, 256), (255, 256), (256, 512), (600, 1024), (MAX_LEN - 1, MAX_LEN)]:
        items = [StepItem(runners[1].sequence_blocks(0), [0], 3), StepItem(runners[1].sequence_blocks(1), [0], longest_start)]
        assert static.shape_for(items)[1] == span


def test_warm_up_builds_every_row_and_span_bucket(runners):
    runner = runners[1]
    runner.capture_decode_graphs()
    assert set(runner.static.graphs) == {(r, s) for r in [1, 2, 4, 8] for s in [256, 512, 1024]}


def test_graph_wrapper_without_cuda_runs_the_step_eagerly_on_its_static_buffer():
    calls = []

    def step(inputs):
        calls.append(inputs)
        return inputs.sum(dim=0, keepdim=True).float()

    graph = DecodeGraph(step, torch.zeros(3, 4, dtype=torch.long), use_graph=False)
    out = graph(torch.arange(12).view(3, 4))
    assert out.tolist() == [[12.0, 15.0, 18.0, 21.0]]
    assert calls[0] is graph.inputs and graph.inputs.tolist() == torch.arange(12).view(3, 4).tolist()


def test_layer_functions_compile_as_one_graph_each(runners):
    """torch.compile(fullgraph=True) must trace them without a graph break (checked with the eager backend)."""
    static = runners[1].static
    w = static.weights[0]
    hidden = torch.randn(2, runners[1].text_shape.hidden)
    cos, sin = (t[:2][:, None, :] for t in static.rope[runners[1].layer_types[0], torch.device("cpu")])
    pre = torch.compile(pre_attention, backend="eager", fullgraph=True)
    post = torch.compile(post_attention, backend="eager", fullgraph=True)
    q, k, v = pre(hidden, w, cos, sin, static.eps, *static.shape)
    out = post(hidden, q, w, static.eps)
    assert out.shape == hidden.shape and torch.isfinite(out).all()


def test_engine_with_static_decode_generates_what_transformers_generates(loaded):
    engine = Engine(loaded, EngineConfig(
        model=ModelConfig(max_model_len=256, static_decode=True),
        scheduler=SchedulerConfig(max_num_seqs=2, max_prefill_tokens=64),
    ))
    loop = asyncio.new_event_loop()
    engine.start(loop)

    async def tokens(request_id, ids):
        request = GenerationRequest(request_id, ids, SamplingParams(max_tokens=6, temperature=0.0))
        return [e.token_id async for e in engine.generate(request) if e.token_id is not None]

    async def both(prompts):
        return await asyncio.gather(*(tokens(f"r{i}", ids) for i, ids in enumerate(prompts)))

    prompts = [[2] + prompt(9, seed=1), [2] + prompt(20, seed=2)]  # two rows: a static bucket of 2
    try:
        got = loop.run_until_complete(both(prompts))
    finally:
        engine.shutdown()
        loop.close()
    with torch.inference_mode():
        for ids, ours in zip(prompts, got):
            reference = loaded.model.generate(
                torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=list(loaded.eos_token_ids), pad_token_id=0
            )
            assert ours and ours == reference[0, len(ids) :].tolist()[: len(ours)]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_graph_replay_matches_the_dynamic_path_on_the_gpu(model):
    gpu_model = model.to("cuda")
    try:
        runners = (make_runner(gpu_model, static=False), make_runner(gpu_model, static=True))
        assert runners[1].static.use_graphs
        runners[1].capture_decode_graphs()
        positions = fill(runners, [(3, 5), (0, WINDOW - 2)])
        for dynamic, static in decode_both(runners, [0, 3], positions, steps=4):
            torch.testing.assert_close(static, dynamic, atol=1e-3, rtol=1e-3)
    finally:
        model.to("cpu")
