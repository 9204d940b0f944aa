"""Predicted Outputs (OpenAI's `prediction`): the predicted text's tokens, aligned to the output as it grows.

While the output follows the prediction, the next predicted tokens are the draft. Where it departs (an edit), the
alignment is lost until the output's last few tokens are found in the prediction again, the first such place
at or after where it was last aligned preferred (as a diff would resynchronise), else the latest before it.
The prediction is tokenized on its own, so a token boundary that differs from the output's costs a few tokens of
realignment, nothing more.

Usage counts (`prediction_counts`) do not depend on what was drafted: as OpenAI documents them, accepted are the
prediction's tokens that appear in the completion and rejected the rest, computed once at the finish from the two
token sequences, so they are the same alone or under load, with speculation on or off.
"""

from __future__ import annotations

from difflib import SequenceMatcher


def prediction_counts(prediction: list[int] | tuple[int, ...], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens: those matched in the output by a token alignment (a diff's matching
    blocks, in order, each prediction token at most once), and the rest of the prediction."""
    matcher = SequenceMatcher(None, prediction, output, autojunk=False)  # autojunk would drop frequent tokens
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted


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

    def propose(self, output: list[int], k: int) -> list[int]:
        """At most `k` predicted tokens to follow `output`, once it is aligned with the prediction."""
        self._follow(output)
        if self.cursor is None:
            return []
        return self.tokens[self.cursor : self.cursor + k]

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
