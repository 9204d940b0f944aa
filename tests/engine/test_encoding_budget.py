"""The engine's time budget for an image encode's slice beside running sequences (engine/encoding.py)."""

import torch

import pytest

from oai_gemma.engine.encoding import IDLE_SECONDS, SHARE, STEPS, Encoding


def test_one_slow_step_does_not_set_the_next_slice_but_a_lasting_change_does():
    """The budget is at most the median of the last steps, not the last one alone: one slow step (the image's own preprocessing
    beside it, a prefill chunk) followed by a slice as long made two long gaps in a text stream, its ITL p99."""
    encoding = Encoding(None, "cpu", torch.float32)
    assert encoding.budget(busy=True) == IDLE_SECONDS  # no step yet
    for seconds in [0.1] * 5 + [1.0]:
        encoding.stepped(seconds)
    assert encoding.budget(busy=True) == pytest.approx(SHARE * 0.1)
    assert encoding.budget(busy=False) == IDLE_SECONDS
    for seconds in [0.3] * STEPS:
        encoding.stepped(seconds)
    assert encoding.budget(busy=True) == pytest.approx(SHARE * 0.3)
    encoding.stepped(0.1)  # shorter steps from now on (a stream ended): the median would keep 0.3 for a few steps
    assert encoding.budget(busy=True) == pytest.approx(SHARE * 0.1)


def test_a_slice_beside_a_stream_is_shorter_than_its_step():
    """A slice as long as the stream's step doubled its inter-token time exactly, so any longer unit or slower step
    beside the tower broke the 2x bound: the slice is a share of the step, below 1."""
    encoding = Encoding(None, "cpu", torch.float32)
    for _ in range(STEPS):
        encoding.stepped(0.08)
    assert 0.3 * 0.08 < encoding.budget(busy=True) <= 0.75 * 0.08


def test_a_set_step_budget_wins():
    encoding = Encoding(None, "cpu", torch.float32, step_seconds=0.05)
    encoding.stepped(1.0)
    assert encoding.budget(busy=True) == encoding.budget(busy=False) == 0.05
