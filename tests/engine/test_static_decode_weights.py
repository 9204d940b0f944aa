"""The static decode step (engine/model/static_decode.py, the GPU's path) computes with the project's Gemma3Weights,
as the dynamic runner does: no module tree, nothing of transformers (issue 38.4). Checked on CPU, where it runs
eagerly, on a tiny random model built as weights only."""

from __future__ import annotations

import pytest
import torch

from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.model.gemma3 import LayerWeights
from oai_gemma.engine.model.layout import Layout
from oai_gemma.engine.model.runner import ModelRunner
from oai_gemma.engine.model.static_decode import plain_layers
from oai_gemma.engine.model.weights import PROJECTIONS, Gemma3Weights
from oai_gemma.engine.sequence import StepItem
from oai_gemma.engine.shape import FULL, SLIDING, Gemma3Shape, TextShape

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = TextShape(hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=320, sliding_window=16,
                 sliding=(True, False), rms_eps=1e-6, query_pre_attn_scalar=32, rope={SLIDING: (1e4, 1.0), FULL: (1e6, 8.0)})


def tiny_weights(layout: Layout) -> Gemma3Weights:
    """Random weights in `layout`'s float linears, as the loaders fill them (no module tree anywhere)."""
    g = torch.Generator().manual_seed(0)

    def linear(name, outputs, inputs):
        weight = torch.randn(outputs, inputs, generator=g) * inputs**-0.5
        return layout.make(name, lambda lo, hi: weight[lo:hi], (outputs, inputs))

    def scale(size):
        return 1.0 + 0.1 * torch.randn(size, generator=g)

    q, kv, h, i = TEXT.heads * TEXT.head_dim, TEXT.kv_heads * TEXT.head_dim, TEXT.hidden, TEXT.intermediate
    sizes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}
    layers = []
    for n in range(TEXT.layers):
        projections = {name: linear(f"projection.{7 * n + k}", *sizes[name]) for k, name in enumerate(PROJECTIONS)}
        layers.append(LayerWeights(
            input_norm=scale(h), q_norm=scale(TEXT.head_dim), k_norm=scale(TEXT.head_dim), post_attention_norm=scale(h),
            pre_feedforward_norm=scale(h), post_feedforward_norm=scale(h), **projections))
    embedding = torch.randn(TEXT.vocab, h, generator=g)
    return Gemma3Weights(Gemma3Shape(TEXT), torch.float32, embedding, layers, scale(h), linear("lm_head", TEXT.vocab, h))


def runner(static: bool) -> ModelRunner:
    config = EngineConfig(model=ModelConfig(max_model_len=64, static_decode=static),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_prefill_tokens=60))
    weights = tiny_weights(Layout("none", torch.float32, TEXT.layers, float_tensors=static))
    return ModelRunner(weights, config, model=None)


def test_the_static_step_takes_the_weights_own_tensors():
    static = runner(static=True)
    for mine, theirs in zip(static.static.weights, static.gemma.layers):
        for name in PROJECTIONS:
            assert getattr(mine, name) is getattr(theirs, name).weight  # no copy, no module
        assert mine.input_norm is theirs.input_norm


def test_static_decode_from_weights_alone_matches_the_dynamic_step():
    static, dynamic = runner(static=True), runner(static=False)
    prompts = {0: [5, 17, 42, 7, 99, 3, 250, 11, 60, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1: [9, 8, 7]}
    for r in (static, dynamic):
        for index, ids in prompts.items():
            r.forward([StepItem(r.sequence_blocks(index), ids, 0)], [])
    positions = {index: len(ids) for index, ids in prompts.items()}
    for step in range(3):  # index 0 passes its sliding window (16)
        items = {r: [StepItem(r.sequence_blocks(i), [30 + i + step], positions[i]) for i in (1, 0)] for r in (static, dynamic)}
        got, expected = static.forward([], items[static]), dynamic.forward([], items[dynamic])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        positions = {i: p + 1 for i, p in positions.items()}


def test_a_quantized_layout_has_no_static_path():
    with pytest.raises(ValueError, match="float weights"):
        plain_layers(tiny_weights(Layout("int8", torch.float32, TEXT.layers)))
