"""What a weight setting (dtype, `model.quantization`) costs in quality, measured on the real model: perplexity
of a fixed text, how many greedy tokens agree with a reference, and the next-token logits' error against a
reference's (`logit_error`: what random-weight checkpoints can measure, their distributions being flat). Used by
tests/engine/test_quantization.py, benchmarks/quantization_quality.py and benchmarks/logit_error.py (docs/engine.md,
"Weight-only quantized weights")."""

from __future__ import annotations

import math

import torch

from ..sequence import StepItem
from .runner import ModelRunner


@torch.inference_mode()
def chunk_logits(runner: ModelRunner, ids: list[int], chunk: int = 256):
    """The float32 next-token logits after each of ids[:-1] (one sequence in slot 0, prefilled in `chunk`-token
    steps), yielded a row bucket at a time: the 262k-column logits of a whole text would not fit."""
    for start in range(0, len(ids) - 1, chunk):
        item = StepItem(runner.sequence_blocks(0), ids[start : start + chunk], start, want_logits=False, keep_hidden=True)
        runner.forward([item], [])
        count, rows = min(chunk, len(ids) - 1 - start), runner.row_buckets[-1]
        for first in range(0, count, rows):
            yield runner.logits_of(item.hidden[first : min(first + rows, count)]).float()


def perplexity(runner: ModelRunner, ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given what precedes each, prefilled in `chunk`-token steps."""
    total, count = 0.0, 0
    for logits in chunk_logits(runner, ids, chunk):
        picked = torch.tensor(ids[count + 1 : count + 1 + len(logits)])
        total -= float(torch.log_softmax(logits, dim=-1).gather(1, picked[:, None]).sum())
        count += len(picked)
    return math.exp(total / count)


class LogitError:
    """Next-token logits against a reference's, position by position (`add`): the mean KL divergence of the
    distributions (reference || other, nats), the root mean square and largest logit difference, and the share of
    positions whose top token agrees."""

    def __init__(self):
        self.kl = self.squares = self.largest = 0.0
        self.values = self.positions = self.agree = 0

    def add(self, reference: torch.Tensor, other: torch.Tensor) -> None:
        ref, out = torch.log_softmax(reference, dim=-1), torch.log_softmax(other, dim=-1)
        self.kl += float((ref.exp() * (ref - out)).sum())
        diff = other - reference
        self.squares += float(diff.square().sum())
        self.largest = max(self.largest, float(diff.abs().max()))
        self.values, self.positions = self.values + diff.numel(), self.positions + len(diff)
        self.agree += int((reference.argmax(-1) == other.argmax(-1)).sum())

    def summary(self) -> dict[str, float]:
        return {"mean_kl": self.kl / self.positions, "rms": math.sqrt(self.squares / self.values),
                "max": self.largest, "top1_agree": self.agree / self.positions}


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
