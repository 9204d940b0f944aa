"""Prompt logprobs (a request's `prompt_logprobs`): each flagged prefill chunk's, added to its sequence."""

from __future__ import annotations

from .sampler import token_logprobs
from ..sequence import Step


def prompt_logprobs(step: Step, logits_of, vocab_limit: int, size: int) -> None:
    """Add each flagged prefill chunk's prompt logprobs to its sequence: the hidden state at position p
    predicts prompt token p + 1 (the chunk's last position predicts the next chunk's first token, or,
    on the last chunk, the first output token: that one is sampled, not reported here). `logits_of`: the runner's
    (hidden states -> logits, at most `size` rows a call)."""
    for seq, item in zip(step.prefill_owners, step.prefills):
        if item.hidden is None:
            continue
        if item.start == 0:
            seq.prompt_logprobs = [None]  # the first token has nothing before it
        targets = seq.prompt_ids[item.start + 1 : item.start + len(item.token_ids) + 1]
        top = seq.sampling.prompt_logprobs
        for lo in range(0, len(targets), size):  # a slice at a time: a chunk's full logits would be large
            logits = logits_of(item.hidden[lo : lo + size])[:, :vocab_limit]
            part = targets[lo : lo + size]
            seq.prompt_logprobs += token_logprobs(logits, part, [top] * len(part))
        item.hidden = None
