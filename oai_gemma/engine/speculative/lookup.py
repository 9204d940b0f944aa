"""Prompt lookup (vLLM's n-gram proposer, llama.cpp's ngram-simple): the sequence's last n tokens are looked up in
its prompt and output (a system prompt's shared prefix included: it is part of the prompt), and the tokens that
followed their latest earlier occurrence are the draft (a repeat that reaches the end continues with its period). A dict per n-gram size, extended as tokens come: no model.
"""

from __future__ import annotations


class PromptLookup:
    """The n-grams of one sequence's tokens, longest first (`n_max` down to `n_min`, the minimum match)."""

    def __init__(self, n_max: int, n_min: int):
        self.sizes = range(n_max, n_min - 1, -1)
        self.tokens: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        """Per size, n-gram -> the position after its latest occurrence that has a token after it."""

    def sync(self, tokens: list[int]) -> None:
        """Index the tokens of `tokens` (the sequence so far, which only grows) not indexed yet."""
        known = self.tokens
        for token in tokens[len(known):]:
            end = len(known)
            for n, table in self.after.items():
                if end >= n:
                    table[tuple(known[end - n : end])] = end
            known.append(token)

    def propose(self, k: int, tail: list[int] | None = None) -> list[int]:
        """At most `k` tokens that followed the longest n-gram the sequence now ends with, else none. `tail`: tokens
        already drafted before these (a grammar's forced tokens): the lookup goes on from after them."""
        tokens = self.tokens + tail if tail else self.tokens
        for n in self.sizes:
            if len(tokens) > n:
                start = self.after[n].get(tuple(tokens[-n:]))
                if start is not None:  # past the end, a repeat goes on as it went (a loop's period)
                    period = len(tokens) - start
                    return [tokens[start + i % period] for i in range(k)]
        return []
