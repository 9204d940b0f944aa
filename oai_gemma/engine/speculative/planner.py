"""When to speculate and how much: drafts spend compute to save weight reads, which pays at small batches only.
Which drafts: a grammar's forced tokens, the request's Predicted Output while the output follows it, prompt lookup.

Each step the decode part of a batch may hold at most `budget` tokens (`engine.speculative_budget`): every running
sequence's own token first, drafts in what is left, so a batch of `budget` sequences or more carries none. Each sequence's draft length follows its own history: doubled (up to `k`) after a draft was kept whole, cut to
what was kept plus one after a rejection; while less than a fifth of its drafted tokens are kept it only probes, one
token every few steps. A draft is also cut to the tokens the request may still generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import EngineConfig
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
    most: int
    rate: float = 1.0
    """Moving average of the share of drafted tokens kept."""
    quiet: int = 0
    """Steps without a draft while the rate is low."""
    source: PredictionDraft | PromptLookup | str | None = None
    """Where the current draft came from (`grammar`: the tokens a grammar forces)."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    def propose(self, seq, cap: int) -> list[int]:
        """The draft for `seq`'s next step (at most `cap` tokens): under a grammar the tokens it forces, else the
        prediction while it aligns, else prompt lookup."""
        if self.rate < LOW_RATE:
            self.quiet += 1
            if self.quiet % PROBE_EVERY:
                return []
            cap = 1
        cap = min(cap, self.k)
        self.source = None
        if seq.matcher is not None:
            forced = seq.matcher.forced_run(cap)
            self.source = "grammar" if forced else None
            return forced
        output = seq.output_ids
        if self.prediction is not None:
            draft = self.prediction.propose(output, cap)
            if draft:
                self.source = self.prediction
                return draft
        if self.lookup is not None:
            self.lookup.sync(seq.prompt_ids + output)
            draft = self.lookup.propose(cap)
            if draft:
                self.source = self.lookup
                return draft
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        self.rate = 0.7 * self.rate + 0.3 * accepted / drafted
        self.k = min(self.most, 2 * self.k) if accepted == drafted else max(1, accepted + 1)
        if self.source is self.prediction and self.prediction is not None:
            self.prediction.verified(drafted, accepted)


@dataclass
class Speculator:
    """The engine's drafting policy (`EngineConfig.speculative*`) and its counts (vLLM's spec_decode metrics)."""

    config: EngineConfig
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return self.config.speculative != "off"

    def start(self, request: GenerationRequest, grammar: bool) -> Speculation | None:
        """A new sequence's speculation, or None (speculation off, or the request opted out). Under a grammar the
        drafts are the tokens it forces (keys, punctuation), each row masked as the grammar would mask it."""
        config = self.config
        if not self.on or not request.speculative:
            return None
        n_max, n_min = config.speculative_ngram_max, config.speculative_ngram_min
        if grammar:
            return Speculation(None, None, config.speculative_k, config.speculative_k)
        prediction = PredictionDraft(request.prediction, n_max, n_min) if request.prediction else None
        first = config.speculative_k if prediction is not None else min(FIRST_LOOKUP_DRAFT, config.speculative_k)
        return Speculation(PromptLookup(n_max, n_min), prediction, first, config.speculative_k)

    def plan(self, decoding: list, max_len: int) -> None:
        """Set each decoding sequence's `draft` for this step, within the step's budget."""
        left = self.config.speculative_budget - len(decoding)
        for seq in decoding:
            seq.draft = []
            spec = seq.speculation
            if spec is None or left <= 0:
                continue
            output = seq.output_ids
            # drafts never pass max_tokens (so never the blocks kept for the request) nor the context
            cap = min(left, seq.sampling.max_tokens - len(output) - 1, max_len - seq.num_computed - 2)
            if cap > 0:
                seq.draft = spec.propose(seq, cap)
                left -= len(seq.draft)

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
