"""Batched sampling: one call per step for all rows, each with its own temperature, top-p, top-k and seed.

Randomness is one uniform number per row from that request's own generator (inverse-CDF sampling),
so a seeded request draws the same tokens alone or in any batch.
"""

from __future__ import annotations

import torch

from .types import SamplingParams


class RowRandom:
    """The per-request source of uniforms: seeded when the request has a seed."""

    def __init__(self, seed: int | None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed % (2**63))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], randoms: list[RowRandom], outputs: list[list[int]]
) -> list[int]:
    """Pick one token per row of `logits` [rows, vocab] (the model's dtype); `outputs` are each row's tokens so far.

    Greedy rows take the max in the model's dtype (the float32 copy would be the same values, and
    `max` with indices is the fast reduction on CPU); sampled rows are softmaxed in float32.
    """
    logits = _apply_penalties(logits, params, outputs)
    greedy = torch.tensor([p.greedy for p in params])
    tokens = logits.max(dim=-1).indices
    if greedy.all():
        return tokens.tolist()
    rows = (~greedy).nonzero().flatten()
    sub = logits[rows].float()
    chosen = [params[i] for i in rows.tolist()]
    temperature = torch.tensor([p.temperature for p in chosen], dtype=sub.dtype)
    probs = torch.softmax(sub / temperature[:, None], dim=-1)
    u = torch.tensor([randoms[i].uniform() for i in rows.tolist()], dtype=torch.float64)
    top_p = torch.tensor([p.top_p for p in chosen], dtype=sub.dtype)
    top_k = torch.tensor([p.top_k for p in chosen])
    if bool((top_p < 1.0).any()) or bool((top_k > 0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the strictly more likely tokens
        ranks = torch.arange(sub.shape[-1])[None, :]
        drop = (before >= top_p[:, None]) | ((top_k[:, None] > 0) & (ranks >= top_k[:, None]))
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        picked = _inverse_cdf(sorted_probs, u)
        picked = order.gather(1, picked[:, None])[:, 0]
    else:
        picked = _inverse_cdf(probs, u)
    tokens[rows] = picked
    return tokens.tolist()


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties on the rows that ask for them (in float32 then)."""
    rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and outputs[i]]
    if not rows:
        return logits
    logits = logits.float()
    counts = torch.zeros(len(rows), logits.shape[-1], dtype=logits.dtype)
    for r, i in enumerate(rows):
        ids = torch.tensor(outputs[i])
        counts[r].index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype)[:, None]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype)[:, None]
    logits[rows] -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target)[:, 0]
    # never land on a zero-probability tail token through rounding
    last_nonzero = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(index, last_nonzero)
