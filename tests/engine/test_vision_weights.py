"""`VisionWeights` (engine/model/vision_weights.py, issue 38.4): the project's SigLIP tower and projector, filled from
the lean safetensors tree and from transformers' model, compute transformers' `get_image_features` on the tiny
multimodal model (the mmproj GGUF source: tests/engine/test_gguf.py)."""

from __future__ import annotations

import pytest
import torch

from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.vision_weights import VisionWeights, from_modules, image_features
from oai_gemma.settings import ModelSettings


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def both(tiny_vision_dir):
    """(lean, transformers') inner models of the tiny multimodal model in float32."""
    settings = ModelSettings(source=str(tiny_vision_dir), dtype="float32")
    return load(settings, lean=True).model.model, load(settings).model.model


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 896, 896, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def expected(both, pixels):
    with torch.inference_mode():
        return both[1].get_image_features(pixels).pooler_output.reshape(-1, 640)


def test_the_weights_are_the_trees_tensors_shared_not_copied(both):
    for inner in both:
        weights = from_modules(inner)
        assert isinstance(weights, VisionWeights) and len(weights.layers) == weights.shape.layers == 2
        held = {t.data_ptr() for t in inner.parameters()}
        assert all(t.data_ptr() in held for t in weights.tensors())
        assert weights.nbytes() == sum(t.numel() * 4 for t in (*inner.vision_tower.parameters(), *inner.multi_modal_projector.parameters()))


def test_a_text_only_model_has_no_vision_weights():
    assert from_modules(None) is None and from_modules(torch.nn.Module()) is None


@pytest.mark.parametrize("source", ["lean", "transformers"])
def test_features_are_transformers_get_image_features_bitwise(both, pixels, expected, source):
    """Each source's tensors through the project's functions: the very values of transformers' forward (the same
    torch ops in the same order)."""
    weights = from_modules(both[source == "transformers"])
    got = image_features(weights, pixels)
    assert got.shape == expected.shape == (2 * 256, 640)
    assert torch.equal(got, expected)


def test_features_are_the_lean_module_trees_bitwise(both, pixels):
    lean = both[0]
    with torch.inference_mode():
        reference = lean.get_image_features(pixels[:1]).reshape(-1, 640)
    assert torch.equal(image_features(from_modules(lean), pixels[:1]), reference)

