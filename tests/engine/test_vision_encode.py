"""The resumable vision encode (engine/model/vision_encode.py) against the one-call encode, on the tiny vision model."""

import pytest
import torch

from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.vision_encode import WIDE_ROWS, VisionEncode, unit_rows
from oai_gemma.engine.model.vision_weights import from_modules
from oai_gemma.settings import ModelSettings


@pytest.fixture(scope="module")
def model(tiny_vision_dir):
    return load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"), lean=True).model


def pixels(crops: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(crops, 3, 896, 896, generator=torch.Generator().manual_seed(seed))


def encode(model, pixel_values, rows=0, wide=0) -> VisionEncode:
    """The encode with `rows`-row units (no wider `mix` units unless `wide`: the budget tests' units keep one size)."""
    return VisionEncode(from_modules(model.model), pixel_values, rows, wide=wide)


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


def test_the_time_budget_only_decides_how_many_units_run_and_how_wide_not_the_result(model):
    # 256-row units: a budget that holds them makes the `mix` units WIDE_ROWS wide (fewer units), a zero budget
    # keeps them at 256 rows, one a call; the features are the same bits, and the one-call encode's
    pixel_values = pixels(1, seed=3)
    with torch.inference_mode():
        expected = model.get_image_features(pixel_values).reshape(-1, model.config.text_config.hidden_size)
    one_go = encode(model, pixel_values, rows=256, wide=WIDE_ROWS)
    assert one_go.run(3600.0) and one_go.units_done < one_go.total_units
    assert {"first wide mix", "wide mix"} <= set(one_go.costs.seconds) and "mix" not in one_go.costs.seconds
    sliced = encode(model, pixel_values, rows=256, wide=WIDE_ROWS)
    runs = 0
    while not sliced.run(0.0):  # a zero budget still makes progress: one unit a call
        runs += 1
    assert runs + 1 == sliced.total_units and "wide mix" not in sliced.costs.seconds
    assert torch.equal(sliced.features, one_go.features) and torch.equal(one_go.features, expected)
    assert sliced.seconds > 0


def test_unit_rows_follow_the_tower_shape():
    assert 256 == unit_rows(4096, 1152, 4304) < unit_rows(4096, 128, 256) < 4096
    assert unit_rows(4096, 1152, 4304) & (unit_rows(4096, 1152, 4304) - 1) == 0  # a power of two

def fake_clock(monkeypatch) -> list[float]:
    from oai_gemma.engine.model import vision_encode

    clock = [0.0]
    monkeypatch.setattr(vision_encode.time, "perf_counter", lambda: clock[0])
    return clock


def test_a_budget_starts_no_unit_that_would_end_past_it(model, monkeypatch):
    """Units of 1.0 (fake) second each and a 1.5 s budget: one unit a call, not two (the second would end at 2.0 s, half
    a unit past the budget: beside fast text streams that overrun took their ITL p99 over 2x)."""
    clock = fake_clock(monkeypatch)
    job = encode(model, pixels(1, seed=5))

    def units():
        for _ in range(5):
            clock[0] += 1.0
            yield "qkv", 1.0
        clock[0] += 1.0
        job.features = torch.zeros(1)

    job._units, job.next = units(), ("qkv", 1.0)
    calls = 0
    while not job.run(1.5):
        calls += 1
        assert job.units_done == calls
    assert job.costs.seconds == {"qkv": 1.0}
    assert job.run(2.0) is True  # done stays done


def timed(job: VisionEncode, clock: list[float], per_mac: dict[str, float]) -> None:
    """Make `job`'s units take (fake) time: the unit's multiply-adds at its kind's rate (`job.ran`: the last one's kind)."""
    real = job._units

    def units():
        while True:
            kind, macs = job.next  # the unit about to run
            clock[0] += macs * per_mac.get(kind, 1e-9)
            job.ran = kind
            try:
                item = next(real)
            except StopIteration:
                return
            yield item

    job._units = units()


def overruns(job: VisionEncode, clock: list[float], budget: float) -> list[tuple[str, float]]:
    """Run `job` to the end in calls of `budget`: [(kind, seconds past the budget)] of each call that ran more than one
    unit and ended past its budget (a call's first unit runs whatever it takes)."""
    late = []
    while True:
        started, before = clock[0], job.units_done
        done = job.run(budget)
        if job.units_done - before > 1 and clock[0] - started > budget + 1e-12:
            late.append((job.ran, clock[0] - started - budget))
        if done:
            return late


def mix_seconds(model, rows: int = 512) -> float:
    """A `mix` unit's (fake) time at `timed`'s default rate: its attention over 4,096 keys, out_proj and MLP."""
    vision = model.config.vision_config
    width = vision.hidden_size
    return rows * (2 * 4096 * width + width * width + 2 * width * vision.intermediate_size) * 1e-9


def test_a_kind_not_run_yet_is_expected_at_its_multiply_adds_not_at_the_longest_unit_so_far(model, monkeypatch):
    """The first `mix` unit (attention and MLP of its rows: many `qkv` units' work) comes after the patch embedding and
    `qkv` units only: the longest unit so far (the embedding) as its estimate started it after the `qkv` units in a
    budget it did not fit, and the step overran (the 4B's text streams' long gaps beside an encode). At one rate for
    every kind the multiply-adds are the time: no call overruns."""
    clock = fake_clock(monkeypatch)
    job = encode(model, pixels(1, seed=6), rows=512)
    timed(job, clock, {})
    assert overruns(job, clock, 0.9 * mix_seconds(model)) == []
    assert job.costs.seconds["mix"] == pytest.approx(mix_seconds(model))


def test_unit_costs_carry_over_to_the_next_image(model, monkeypatch):
    """A kind slower per multiply-add than the kinds before it (float attention after integer linears) is under-
    estimated on the server's first image, once; the next image, with the same costs, starts no unit past a budget."""
    from oai_gemma.engine.model.vision_encode import UnitCosts

    clock, costs, budget = fake_clock(monkeypatch), UnitCosts(), 2.0 * mix_seconds(model)
    per_mac = {"mix": 3e-9, "first mix": 3e-9}
    first = encode(model, pixels(1, seed=7), rows=512)
    first.costs = costs
    timed(first, clock, per_mac)
    assert [kind for kind, _ in overruns(first, clock, budget)] == ["first mix"]
    second = encode(model, pixels(1, seed=8), rows=512)
    second.costs = costs
    timed(second, clock, per_mac)
    assert overruns(second, clock, budget) == []


def test_a_crops_first_mix_of_a_layer_is_costed_apart_from_the_others(model, monkeypatch):
    """The first `mix` unit of a layer (after the `qkv` units) took 2-2.5x the layer's other `mix` units beside a 4B's
    text stream: as one kind with them, every layer's first overran a budget; as its own kind, the first layer's only."""
    clock = fake_clock(monkeypatch)
    job = encode(model, pixels(1, seed=9), rows=512)
    timed(job, clock, {"first mix": 3e-9})
    assert [kind for kind, _ in overruns(job, clock, 3.5 * mix_seconds(model))] == ["first mix"]
    assert model.config.vision_config.num_hidden_layers > 1
