"""The resumable vision encode (engine/model/vision_encode.py) against the one-call encode, on the tiny vision model."""

import pytest
import torch

from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.vision_encode import VisionEncode, unit_rows
from oai_gemma.engine.model.vision_weights import from_modules
from oai_gemma.settings import ModelSettings


@pytest.fixture(scope="module")
def model(tiny_vision_dir):
    return load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"), lean=True).model


def pixels(crops: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(crops, 3, 896, 896, generator=torch.Generator().manual_seed(seed))


def encode(model, pixel_values, rows=0) -> VisionEncode:
    return VisionEncode(from_modules(model.model), pixel_values, rows)


@pytest.mark.parametrize("crops", [1, 2])
def test_unit_by_unit_encode_is_bitwise_the_one_call_encode(model, crops):
    pixel_values = pixels(crops)
    with torch.inference_mode():
        expected = model.get_image_features(pixel_values).reshape(-1, model.config.text_config.hidden_size)
    job = encode(model, pixel_values, rows=512)  # several units a stage, so the slicing is exercised
    steps = 0
    while not job.advance():
        steps += 1
        assert job.features is None
    assert steps + 1 == job.units_done == job.total_units > 4
    assert job.features.shape == (crops * 256, model.config.text_config.hidden_size)
    assert torch.equal(job.features, expected)


def test_the_time_budget_only_decides_how_many_units_run_not_the_result(model):
    pixel_values = pixels(1, seed=3)
    one_go = encode(model, pixel_values)
    assert one_go.run(3600.0) and one_go.units_done == one_go.total_units
    sliced = encode(model, pixel_values)
    runs = 0
    while not sliced.run(0.0):  # a zero budget still makes progress: one unit a call
        runs += 1
    assert runs + 1 == sliced.total_units
    assert torch.equal(sliced.features, one_go.features)
    assert sliced.seconds > 0


def test_unit_rows_follow_the_tower_shape():
    assert 256 == unit_rows(4096, 1152, 4304) < unit_rows(4096, 128, 256) < 4096
    assert unit_rows(4096, 1152, 4304) & (unit_rows(4096, 1152, 4304) - 1) == 0  # a power of two

def test_a_budget_starts_no_unit_that_would_end_past_it(model, monkeypatch):
    """Units of 1.0 (fake) second each and a 1.5 s budget: one unit a call, not two (the second would end at 2.0 s, half
    a unit past the budget: beside fast text streams that overrun took their ITL p99 over 2x)."""
    from oai_gemma.engine.model import vision_encode

    clock = [0.0]
    monkeypatch.setattr(vision_encode.time, "perf_counter", lambda: clock[0])
    job = encode(model, pixels(1, seed=5))

    def units():
        for _ in range(5):
            clock[0] += 1.0
            yield
        job.features = torch.zeros(1)

    job._units = units()
    calls = 0
    while not job.run(1.5):
        calls += 1
        assert job.units_done == calls
    assert job.longest == 1.0
    assert job.run(2.0) is True  # done stays done
