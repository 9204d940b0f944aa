"""Incremental, UTF-8-safe detokenizing and stop-string matching, per sequence.

Each new token costs a decode of a few tokens (never the whole text): the text of
ids[prefix:read] is compared with ids[prefix:], as vLLM does. A character split over several
byte-fallback tokens decodes to U+FFFD until its last byte arrives, so it is emitted whole, once.
"""

from __future__ import annotations

import re


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], context: int = 6):
        self._decode = tokenizer.backend_tokenizer.decode  # the Rust tokenizer: no Python post-processing
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add a token; return the text it completes (often '' while a multi-byte character is pending)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self._decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


class TokenBytes:
    """Each token's own text and UTF-8 bytes, as OpenAI's logprobs report them: a byte-fallback token
    (`<0xE4>`) is its one byte, so the bytes of consecutive tokens concatenate to the output's bytes."""

    _BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer):
        self._piece = tokenizer.convert_ids_to_tokens
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            piece = self._piece(token_id)
            byte = self._BYTE.fullmatch(piece)
            raw = bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()
            self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token_id]


class StopMatcher:
    """Holds back text that could be the start of a stop string, so no partial stop string ever leaks."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). After a stop, nothing more comes."""
        if not self.stops:
            return text, False
        buffer = self.pending + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buffer[: min(hits)], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self.pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of generation the held-back text was no stop string after all."""
        text, self.pending = self.pending, ""
        return text
