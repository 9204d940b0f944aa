"""Predicted Outputs (OpenAI's `prediction`): the predicted text's tokens, aligned to the output as it grows.

While the output follows the prediction, the next predicted tokens are the draft. Where it departs (an edit), the
alignment is lost until the output's last few tokens are found in the prediction again, the first such place
at or after where it was last aligned preferred (as a diff would resynchronise), else the latest before it.
The prediction is tokenized on its own, so a token boundary that differs from the output's costs a few tokens of
realignment, nothing more. Usage counts each prediction position once: accepted if the model drafted and kept it,
rejected if it was drafted and never kept (OpenAI's `accepted_prediction_tokens` / `rejected_prediction_tokens`).
"""

from __future__ import annotations


class PredictionDraft:
    def __init__(self, tokens: tuple[int, ...], n_max: int, n_min: int):
        self.tokens = list(tokens)
        self.sizes = range(n_max, n_min - 1, -1)
        self.starts: dict[tuple[int, ...], list[int]] = {}
        """n-gram of the prediction (sizes n_min..n_max) -> the positions after each occurrence, ascending."""
        for n in self.sizes:
            for end in range(n, len(self.tokens) + 1):
                self.starts.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
        self.cursor: int | None = 0
        """The prediction position the next output token is expected to match; None: not aligned."""
        self.last = 0
        """The last position the output was aligned at."""
        self.seen = 0
        """Output tokens followed so far."""
        self.draft_start = 0
        self.accepted: set[int] = set()
        self.drafted: set[int] = set()

    def propose(self, output: list[int], k: int) -> list[int]:
        """At most `k` predicted tokens to follow `output`, once it is aligned with the prediction."""
        self._follow(output)
        if self.cursor is None:
            return []
        self.draft_start = self.cursor
        return self.tokens[self.cursor : self.cursor + k]

    def verified(self, drafted: int, accepted: int) -> None:
        """The last draft's fate: `accepted` of its `drafted` tokens were kept."""
        self.drafted.update(range(self.draft_start, self.draft_start + drafted))
        self.accepted.update(range(self.draft_start, self.draft_start + accepted))

    @property
    def counts(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens."""
        return len(self.accepted), len(self.drafted - self.accepted)

    def _follow(self, output: list[int]) -> None:
        for token in output[self.seen :]:
            cursor = self.cursor
            if cursor is not None and cursor < len(self.tokens) and self.tokens[cursor] == token:
                self.cursor = self.last = cursor + 1
            else:
                self.cursor = None
        if self.cursor is None and len(output) > self.seen:
            self.cursor = self._realign(output)
        self.seen = len(output)

    def _realign(self, output: list[int]) -> int | None:
        for n in self.sizes:
            if len(output) >= n:
                starts = self.starts.get(tuple(output[-n:]))
                if starts:
                    ahead = [s for s in starts if s >= self.last]
                    self.last = ahead[0] if ahead else starts[-1]
                    return self.last
        return None
