"""What a weight setting (dtype, `model.quantization`) costs in quality, measured on the real model: perplexity
of a fixed text, and how many greedy tokens agree with a reference. Used by tests/engine/test_quantization.py and
benchmarks/quantization_quality.py (docs/engine.md, "Weight-only quantized weights")."""

from __future__ import annotations

import math

import torch

from ..sequence import StepItem
from .runner import ModelRunner


@torch.inference_mode()
def perplexity(runner: ModelRunner, ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given what precedes each, prefilled in `chunk`-token steps."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        item = StepItem(runner.sequence_blocks(0), ids[start : start + chunk], start, want_logits=False, keep_hidden=True)
        runner.forward([item], [])
        targets = ids[start + 1 : start + chunk + 1]
        rows = runner.row_buckets[-1]
        for first in range(0, len(targets), rows):
            logits = runner.logits_of(item.hidden[first : min(first + rows, len(targets))]).float()
            picked = torch.tensor(targets[first : first + rows])
            total -= float(torch.log_softmax(logits, dim=-1).gather(1, picked[:, None]).sum())
            count += len(picked)
    return math.exp(total / count)


@torch.inference_mode()
def greedy_tokens(runner: ModelRunner, prompt: list[int], count: int) -> list[int]:
    """`count` greedy tokens after `prompt`, one sequence alone in slot 0."""
    logits = runner.forward([StepItem(runner.sequence_blocks(0), prompt, 0)], [])
    tokens = [int(logits[0].argmax())]
    for position in range(len(prompt), len(prompt) + count - 1):
        tokens.append(int(runner.forward([], [StepItem(runner.sequence_blocks(0), tokens[-1:], position)])[0].argmax()))
    return tokens


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of positions where the greedy tokens agree, each sequence compared up to its first difference
    (after one, the texts differ and so do the contexts)."""
    agreed = total = 0
    for ref, out in zip(reference, other):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
        agreed, total = agreed + same, total + len(ref)
    return agreed / total
