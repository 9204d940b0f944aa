"""Verification: a drafted sequence's k + 1 logits rows become sampler rows, and its drafts are kept while the
model drew them itself.

Row j is sampled as the sequence would be had its first j drafts been accepted: its penalties, `min_tokens` and
logit bias see those drafts in the output, and it takes the uniform the (j+1)-th next output token would take
(`RowRandom.peek`). Draft j + 1 is kept when row j drew it. For a draft proposed with certainty that is exactly
speculative rejection sampling: the draft is accepted with the target's probability of it, and when rejected the
token row j drew is a draw from the target with the draft removed. So every emitted token is the one the same
uniform would have drawn without speculation: greedy and seeded outputs are the same with speculation on or off
wherever the logits are (batch-invariant mode), and the output distribution is the target's everywhere.
"""

from __future__ import annotations

from ..sequence import Sequence, Step

Run = list[tuple[int, object, bool]]
"""A sequence's tokens of one step: (token, its logprob entry or None, whether it was an accepted draft)."""


class _Ahead:
    def __init__(self, random, offset: int):
        self.random, self.offset = random, offset

    def uniform(self) -> float:
        return self.random.peek(self.offset)


class DraftRow:
    """The sampler's view of a drafted sequence's j-th logits row (`matcher`: its grammar's state there)."""

    def __init__(self, seq: Sequence, j: int, matcher):
        self.sampling = seq.sampling
        self.prompt_ids = seq.prompt_ids
        self.output_ids = seq.output_ids + seq.draft[:j]
        self.random = _Ahead(seq.random, j)
        self.matcher = matcher


def sampler_rows(sampled: list[Sequence]) -> list:
    """One sampler row per logits row: a sequence without drafts is its own row."""
    rows: list = []
    for seq in sampled:
        if not seq.draft:
            rows.append(seq)
            continue
        matcher = seq.matcher
        for j in range(len(seq.draft) + 1):
            if j and matcher is not None:  # the grammar as it stands after the drafts before this row
                matcher = matcher.probe(seq.draft[j - 1])
            rows.append(DraftRow(seq, j, matcher))
    return rows


def accept(sampled: list[Sequence], step: Step, tokens: list[int], logprobs: list, speculator) -> list[Run]:
    """Each sequence's tokens of this step; a drafted one's step item is cut back to the positions kept, so the
    scheduler counts (and may index) accepted tokens only."""
    items = {id(seq): item for seq, item in zip(step.decode_owners, step.decodes)}
    runs: list[Run] = []
    row = 0
    for seq in sampled:
        draft = seq.draft
        if not draft:
            runs.append([(tokens[row], logprobs[row], False)])
            row += 1
            continue
        drawn, entries = tokens[row : row + len(draft) + 1], logprobs[row : row + len(draft) + 1]
        row += len(draft) + 1
        kept = 0
        while kept < len(draft) and drawn[kept] == draft[kept]:
            kept += 1
        runs.append([(drawn[j], entries[j], j < kept) for j in range(kept + 1)])
        del items[id(seq)].token_ids[1 + kept :]
        seq.random.advance(kept + 1)
        speculator.verified(seq.speculation, len(draft), kept)
        seq.draft = []
    return runs
