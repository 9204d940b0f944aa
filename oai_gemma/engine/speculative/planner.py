"""When to speculate and how much: drafts spend compute to save weight reads, which pays at small batches only.
Which drafts: the request's Predicted Output while the output follows it, else prompt lookup; under a grammar the
tokens it forces, then prompt lookup's as far as the grammar takes them (the values between the keys).

Each step may hold at most `budget` tokens (`engine.speculative_budget`) before drafts are left out: every running
sequence's own token and the step's prefill chunk first, drafts in what is left, so a batch of `budget` sequences
or more, or a step with a long prefill chunk, carries none. Each
sequence's guessed tokens (all but a grammar's forced ones) follow its own history: doubled (up to `k`) after a
guess was kept whole, cut to what was kept plus one after a rejection; while less than a fifth of them are kept it
only probes, one token every few steps. A draft is also cut to the tokens the request may still generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import SpeculativeConfig
from ..types import GenerationRequest
from .lookup import PromptLookup
from .prediction import PredictionDraft

FIRST_LOOKUP_DRAFT = 4
"""A prompt-lookup draft's first length: a guess from free text costs little when wrong."""
LOW_RATE, PROBE_EVERY = 0.2, 8


@dataclass(eq=False)
class Speculation:
    """One sequence's draft sources, next draft length and acceptance history."""

    lookup: PromptLookup | None
    prediction: PredictionDraft | None
    k: int
    """The most guessed tokens in the next draft (a grammar's forced tokens come on top)."""
    most: int
    rate: float = 1.0
    """Moving average of the share of guessed tokens kept."""
    quiet: int = 0
    """Steps without a guess while the rate is low."""
    sure: int = 0
    """How many of the current draft's first tokens a grammar forces (not guesses: they leave `k` and `rate` be)."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    def propose(self, seq, cap: int) -> list[int]:
        """The draft for `seq`'s next step (at most `cap` tokens): under a grammar the tokens it forces, then
        prompt-lookup tokens while the grammar takes them; else the prediction while it aligns, else prompt lookup."""
        matcher = seq.matcher
        sure = matcher.forced_run(cap) if matcher is not None else []
        self.sure = len(sure)
        most = self._guess_length(cap - len(sure))
        if most <= 0:
            return sure
        output = seq.output_ids
        guess = self.prediction.propose(output, most) if self.prediction is not None else []
        if not guess and self.lookup is not None:
            self.lookup.sync(seq.prompt_ids + output)
            guess = self.lookup.propose(most, sure)
            if matcher is not None and guess:  # stop at the first token the grammar would reject
                guess = guess[: matcher.grammatical(sure + guess) - len(sure)]
        return sure + guess

    def _guess_length(self, cap: int) -> int:
        """`k` guessed tokens at most; while few are kept, one every few steps (a probe)."""
        if self.rate < LOW_RATE:
            self.quiet += 1
            return min(cap, 1) if self.quiet % PROBE_EVERY == 0 else 0
        return min(cap, self.k)

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        guessed, kept = drafted - self.sure, max(0, accepted - self.sure)
        if guessed:
            self.rate = 0.7 * self.rate + 0.3 * kept / guessed
            self.k = min(self.most, 2 * self.k) if kept == guessed else max(1, kept + 1)


@dataclass
class Speculator:
    """The engine's drafting policy (its SpeculativeConfig, `EngineConfig.speculative`) and its counts (vLLM's
    spec_decode metrics)."""

    config: SpeculativeConfig
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return self.config.on

    def start(self, request: GenerationRequest, grammar: bool) -> Speculation | None:
        """A new sequence's speculation, or None (speculation off, or the request opted out). Under a grammar the
        drafts are the tokens it forces (keys, punctuation) and prompt lookup's that it allows, each row masked as
        the grammar would mask it (no prediction there: it would have to follow the forced tokens too)."""
        config = self.config
        if not self.on or not request.speculative:
            return None
        n_max, n_min = config.ngram_max, config.ngram_min
        prediction = PredictionDraft(request.prediction, n_max, n_min) if request.prediction and not grammar else None
        first = config.k if prediction is not None else min(FIRST_LOOKUP_DRAFT, config.k)
        return Speculation(PromptLookup(n_max, n_min), prediction, first, config.k)

    def plan(self, decoding: list, max_len: int, prefill_tokens: int = 0) -> None:
        """Set each decoding sequence's `draft` for this step, within the step's budget: what its decode rows and
        its prefill chunk (`prefill_tokens`) leave. A step that carries a prefill chunk is already compute-bound, so
        drafts would slow it (and the prefilling request's first token) more than they save. The budget is shared
        max-min fairly (`fair_shares`): a sequence that wants few drafts takes them all, the rest split what is left,
        so one copy-heavy stream cannot take a step's whole budget from the others."""
        left = self.config.budget - len(decoding) - prefill_tokens
        wants = []
        for seq in decoding:
            seq.draft = []
            if seq.speculation is None or left <= 0:
                continue
            # drafts never pass max_tokens (so never the blocks kept for the request) nor the context
            cap = min(left, seq.sampling.max_tokens - len(seq.output_ids) - 1, max_len - seq.num_computed - 2)
            if cap > 0:
                seq.draft = seq.speculation.propose(seq, cap)
                wants.append(seq)
        for seq, share in zip(wants, fair_shares([len(seq.draft) for seq in wants], left)):
            if share < len(seq.draft):
                seq.draft = seq.draft[:share]
                seq.speculation.sure = min(seq.speculation.sure, share)

    def verified(self, spec: Speculation, drafted: int, accepted: int) -> None:
        spec.verified(drafted, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def stats(self) -> dict[str, object]:
        return {
            "spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens, "spec_accepted_per_pos": list(self.accepted_per_pos),
        }


def fair_shares(wants: list[int], total: int) -> list[int]:
    """Max-min fair shares of `total` (water-filling): the smallest wants are met whole, the others get equal parts
    of what is left (rounded up while it lasts); never more than `total` in all."""
    shares, left = [0] * len(wants), total
    for rank, index in enumerate(sorted(range(len(wants)), key=wants.__getitem__)):
        shares[index] = min(wants[index], -(-left // (len(wants) - rank)))
        left -= shares[index]
    return shares
