"""Batched sampling: one call per step for all rows, each with its own temperature, top-p, top-k and seed.

Randomness is one uniform number per row from that request's own generator (inverse-CDF sampling),
so a seeded request draws the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..types import SamplingParams


class RowRandom:
    """The per-request source of uniforms: seeded when the request has a seed. The n-th sampled output token
    takes the n-th uniform, whether it came from a step of its own or from a verified draft: a draft row looks
    ahead (`peek`) and the step then consumes only the uniforms of the tokens it kept (`advance`)."""

    def __init__(self, seed: int | None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed % (2**63))
        self.ahead: list[float] = []

    def uniform(self) -> float:
        value = self.peek(0)
        self.advance(1)
        return value

    def peek(self, offset: int) -> float:
        """The uniform `offset` places after the next one, without consuming it."""
        while len(self.ahead) <= offset:
            self.ahead.append(float(torch.rand((), generator=self.generator)))
        return self.ahead[offset]

    def advance(self, count: int) -> None:
        """Consume the next `count` uniforms that were looked at (a greedy row looks at none)."""
        del self.ahead[:count]


class Row(Protocol):
    """What the sampler reads of a sequence (the scheduler's Sequence is one)."""

    sampling: SamplingParams
    random: RowRandom
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class PlainRow:
    """A Row outside the engine: warm-up and tests."""

    sampling: SamplingParams
    random: RowRandom
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


Logprobs = tuple[float, list[tuple[int, float]]]


def sample(logits: torch.Tensor, rows: list[Row], stop_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """Pick one token per row of `logits` [rows, vocab] (the model's dtype)."""
    return sample_with_logprobs(logits, rows, stop_token_ids)[0]


def sample_with_logprobs(
    logits: torch.Tensor, rows: list[Row], stop_token_ids: frozenset[int] = frozenset()
) -> tuple[list[int], list[Logprobs | None]]:
    """`sample`, plus for the rows that ask: (chosen token's logprob, [(id, logprob)] of the top n), under
    the distribution the token was drawn from (after penalties and bias, at the row's temperature; greedy
    rows at temperature 1)."""
    logits = _adjust(logits, rows, stop_token_ids)
    tokens = _pick(logits, rows)
    return tokens, _logprobs(logits, rows, tokens)


def _logprobs(logits: torch.Tensor, rows: list[Row], tokens: list[int]) -> list[Logprobs | None]:
    out: list[Logprobs | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.sampling.logprobs is not None]
    if not wanted:
        return out
    temperature = torch.tensor([rows[i].sampling.temperature or 1.0 for i in wanted])
    found = token_logprobs(
        logits[wanted].float() / temperature[:, None], [tokens[i] for i in wanted], [rows[i].sampling.logprobs for i in wanted]
    )
    for i, entry in zip(wanted, found):
        out[i] = entry
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int]) -> list[Logprobs]:
    """Per row of `logits` [rows, vocab]: (logprob of `tokens[row]`, [(id, logprob)] of its `counts[row]` most
    likely tokens)."""
    # a banned token (grammar, min_tokens) has -inf, which JSON cannot carry: report it as vLLM does
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(min=-9999.0)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    most = max(counts)
    top_values, top_ids = logp.topk(most, dim=-1) if most else (logp[:, :0], logp[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [(chosen[r], list(zip(top_ids[r][:n], top_values[r][:n]))) for r, n in enumerate(counts)]


def _pick(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Greedy rows take the max in the model's dtype (the float32 copy would be the same values, and
    `max` with indices is the fast reduction on CPU); sampled rows are softmaxed in float32."""
    params = [r.sampling for r in rows]
    greedy = torch.tensor([p.greedy for p in params])
    tokens = logits.max(dim=-1).indices
    if greedy.all():
        return tokens.tolist()
    picks = (~greedy).nonzero().flatten()
    sub = logits[picks].float()
    chosen = [params[i] for i in picks.tolist()]
    temperature = torch.tensor([p.temperature for p in chosen], dtype=sub.dtype)
    probs = torch.softmax(sub / temperature[:, None], dim=-1)
    min_p = torch.tensor([p.min_p for p in chosen], dtype=sub.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    u = torch.tensor([rows[i].random.uniform() for i in picks.tolist()], dtype=torch.float64)
    top_p = torch.tensor([p.top_p for p in chosen], dtype=sub.dtype)
    top_k = torch.tensor([p.top_k for p in chosen])
    if bool((top_p < 1.0).any()) or bool((top_k > 0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the strictly more likely tokens
        ranks = torch.arange(sub.shape[-1])[None, :]
        drop = (before >= top_p[:, None] * sorted_probs.sum(-1, keepdim=True)) | (
            (top_k[:, None] > 0) & (ranks >= top_k[:, None])
        )
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        picked = _inverse_cdf(sorted_probs, u)
        picked = order.gather(1, picked[:, None])[:, 0]
    else:
        picked = _inverse_cdf(probs, u)
    tokens[picks] = picked
    return tokens.tolist()


def _adjust(logits: torch.Tensor, rows: list[Row], stop_token_ids: frozenset[int]) -> torch.Tensor:
    """Penalties, logit_bias and min_tokens, in float32, on the rows that ask for them. Each row's work is
    a handful of tensor ops over the tokens it has seen, never a Python loop over the vocabulary."""
    wanted = [i for i, r in enumerate(rows) if _adjusts(r)]
    if not wanted:
        return logits
    logits = logits.float()
    stops = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
    for i in wanted:
        p, row, output = rows[i].sampling, logits[i], rows[i].output_ids
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(rows[i].prompt_ids + output).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output:
            counts = torch.bincount(torch.tensor(output), minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            row[torch.tensor(ids)] += torch.tensor(bias, dtype=row.dtype)
        if len(output) < p.min_tokens and len(stops):
            row[stops] = float("-inf")
    return logits


def _adjusts(row: Row) -> bool:
    p = row.sampling
    return bool(
        p.repetition_penalty != 1.0
        or ((p.presence_penalty or p.frequency_penalty) and row.output_ids)
        or p.logit_bias
        or len(row.output_ids) < p.min_tokens
    )


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target)[:, 0]
    # never land on a zero-probability tail token through rounding
    last_nonzero = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(index, last_nonzero)
