"""Promises a JSON grammar alone cannot keep: the document ends within the token budget, its numbers stay sane,
and no object repeats a key.

A grammar only says which tokens may come next; a small model can stay inside it forever (`"color":"black",`
again and again, or digits without end) until `max_tokens` cuts the document and it no longer parses. So:

* `bound_numbers(schema)` gives every integer without bounds the range +-9e18 (inside 64 bits; llguidance
  cannot build the exact int64 range) and every number without bounds the range +-1e15 in steps of 1e-9 (at
  most 16 integer and 9 decimal digits, no exponent): what JSON Schema leaves unbounded, bounded where a user
  would hardly notice. A value of any type (`{}`, `true`, the values of an object without `additionalProperties`,
  the items of an array without `items`) is any JSON whose numbers are so bounded (`ANY_VALUE`).
* `DocumentMatcher` wraps a sequence's llguidance matcher. It follows the text with a `JsonCursor` (open
  containers, string or not, the keys of each open object) and, each step, says which tokens it bans (those
  that would close a key the object already has) and which token it forces (once the budget left is within
  CLOSING_MARGIN of a short closing of the document found by `closing_tokens`, the sequence is held to it,
  and `cut_short` tells the engine to report `length`).
"""

from __future__ import annotations

import bisect
import copy
import functools

import llguidance
import numpy as np
import torch

INTEGER_BOUND = 9 * 10**18
NUMBER_BOUND = 1e15
NUMBER_STEP = 1e-9
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "example", "deprecated", "readOnly", "writeOnly"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")
"""Where a schema holds the schemas of the values it generates (never `enum`'s data, nor `not`, whose `{}` forbids)."""
_COMPOSED = frozenset({"allOf", "anyOf", "oneOf", "$ref"})
_ANY_REF = {"$ref": "#/$defs/oai_gemma_any"}
ANY_VALUE = {
    "type": ["null", "boolean", "string", "number", "array", "object"],
    "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND, "multipleOf": NUMBER_STEP,
    "items": _ANY_REF, "additionalProperties": _ANY_REF,
}
"""Any JSON value, its numbers bounded as an unbounded `number`'s (llguidance's own any-value has unbounded ones)."""

CLOSING_MARGIN = 8
"""Tokens of slack when a document starts closing: one sampled token can deepen the document by a few levels
(`[{"a":[{"`), so the closing starts while there is still room for what that token could add."""
CLOSING_HORIZON = 64
CALM_WINDOW = 24
"""The closing is only planned once this few tokens of budget are left (it costs a few mask computations)."""

# What brings a JSON document to its end soonest from each place in it, best first (tried as single tokens of
# the vocabulary; the grammar keeps only those the schema allows there)
_VALUE_STARTS = ("0", '""', '"', "null", "false", "true", "[]", "{}", "[", "{")
_CLOSING_TEXTS = {
    "string": ('"}]}', '"}}', '"}]', '"]}', '"]]', '"}', '"]', '"', '",', '":'),
    "colon": (":",),
    "value": _VALUE_STARTS,
    "key": ("}", '"'),
    "{after": ("}}}", "}]}", "}}", "}]", "}", ","),
    "[after": ("]}}", "]]}", "]}", "]]", "]", ","),
    "[": ("]",) + _VALUE_STARTS,
}


def map_subschemas(schema: dict, f) -> dict:
    """A copy of `schema` with `f` applied to each schema of a value it generates (`_SCHEMA_VALUES` and co.)."""
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: f(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [f(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = [f(sub) for sub in out[key]] if isinstance(out[key], list) else f(out[key])
    return out


def schema_types(schema: dict) -> set[str]:
    kinds = schema.get("type")
    return {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()


def bound_numbers(schema: dict) -> dict:
    """A copy of `schema` where integers and numbers without bounds, also inside values of any type, get the
    module's bounds (see above)."""
    out = _bounded(schema)
    defs = out.get("$defs") if isinstance(out.get("$defs"), dict) else {}
    return {**out, "$defs": {**defs, "oai_gemma_any": ANY_VALUE}}


def _bounded(schema, free: bool = True):
    """`free`: a value of any type may become ANY_VALUE; not in what llguidance intersects (an `allOf`'s members,
    a schema whose `anyOf`, `oneOf`, `allOf` or `$ref` has other keywords beside it), where two ANY_VALUEs met
    would recurse without end ("Schema intersection stack level exceeded")."""
    if free and (schema is True or (isinstance(schema, dict) and not set(schema) - _ANNOTATIONS)):
        return dict(_ANY_REF)
    if not isinstance(schema, dict):
        return schema
    free = free and not (set(schema) & _COMPOSED and set(schema) - _COMPOSED - _ANNOTATIONS)
    out = map_subschemas(schema, lambda sub: _bounded(sub, free))
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [_bounded(sub, free=False) for sub in schema["allOf"]]
    kinds = schema_types(out)
    if "number" in kinds:
        _bound(out, NUMBER_BOUND)
        if "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    elif "integer" in kinds:
        _bound(out, INTEGER_BOUND)
    if free and ("object" in kinds or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = dict(_ANY_REF)  # JSON Schema's default, `true`, with bounded numbers
    if free and "array" in kinds and "items" not in out:
        out["items"] = dict(_ANY_REF)
    return out


def _bound(schema: dict, bound) -> None:
    low = next((schema[k] for k in ("minimum", "exclusiveMinimum") if isinstance(schema.get(k), (int, float))), None)
    high = next((schema[k] for k in ("maximum", "exclusiveMaximum") if isinstance(schema.get(k), (int, float))), None)
    if low is None and (high is None or high > -bound):
        schema["minimum"] = -bound
    if high is None and (low is None or low < bound):
        schema["maximum"] = bound


class JsonVocabulary:
    """The model's vocabulary as JSON sees it: token -> bytes, the tokens of `_CLOSING_TEXTS`, and the tokens
    sorted by their bytes (to find every token that starts with given bytes)."""

    def __init__(self, tokenizer, pieces: list[bytes]):
        """`pieces`: every token's bytes (engine/sampling/token_table.py). The sorted order and the calm mask are
        made at their first use (a fifth of a second of Python: not on the start-up path)."""
        self.pieces = pieces
        self.decode = pieces.__getitem__
        self.closers: dict[str, tuple[int, ...]] = {}
        for place, texts in _CLOSING_TEXTS.items():
            singles = (tokenizer.encode(text, add_special_tokens=False) for text in texts)
            self.closers[place] = tuple(dict.fromkeys(ids[0] for ids in singles if len(ids) == 1))

    @functools.cached_property
    def _sorted_ids(self) -> list[int]:
        return sorted(range(len(self.pieces)), key=self.pieces.__getitem__)

    @functools.cached_property
    def _sorted_bytes(self) -> list[bytes]:
        return [self.pieces[token] for token in self._sorted_ids]

    @functools.cached_property
    def calm_mask(self) -> torch.Tensor:
        """A bitmask of the tokens without `,` `{` `[` (what a calm sequence may take)."""
        mask = torch.full(((len(self.pieces) + 31) // 32,), -1, dtype=torch.int32)
        for token, piece in enumerate(self.pieces):
            if b"," in piece or b"{" in piece or b"[" in piece:
                bit = token % 32
                mask[token // 32] &= 0x7FFFFFFF if bit == 31 else ~(1 << bit)
        return mask

    def starting_with(self, prefix: bytes) -> list[int]:
        start = bisect.bisect_left(self._sorted_bytes, prefix)
        end = start
        while end < len(self._sorted_bytes) and self._sorted_bytes[end].startswith(prefix):
            end += 1
        return self._sorted_ids[start:end]


class JsonCursor:
    """Where a JSON text is, lexically: the open containers (with the keys each open object has), inside a
    string or not, what comes next. Escapes are followed but not decoded (`"\\u0061"` and `"a"` differ here)."""

    def __init__(self):
        self.stack: list[set[bytes] | None] = []  # per open container: an object's keys, None for an array
        self.expect = "value"  # value | key | colon | after | [
        self.in_string = False
        self.escape = False
        self.key = bytearray()

    def copy(self) -> "JsonCursor":
        other = JsonCursor()
        other.stack = [None if keys is None else set(keys) for keys in self.stack]
        other.expect, other.in_string, other.escape, other.key = self.expect, self.in_string, self.escape, bytearray(self.key)
        return other

    def feed(self, data: bytes) -> None:
        for byte in data:
            char = chr(byte)
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
                    if self.expect == "key":
                        if self.stack and self.stack[-1] is not None:
                            self.stack[-1].add(bytes(self.key))
                        self.expect = "colon"
                        continue
                    self.expect = "after"
                    continue
                if self.expect == "key":
                    self.key.append(byte)
            elif char == '"':
                self.in_string = True
                self.key.clear()
                if self.expect != "key":
                    self.expect = "value"
            elif char in "{[":
                self.stack.append(set() if char == "{" else None)
                self.expect = "key" if char == "{" else "["
            elif char in "}]":
                if self.stack:
                    self.stack.pop()
                self.expect = "after"
            elif char == ":":
                self.expect = "value"
            elif char == ",":
                self.expect = "key" if self.stack and self.stack[-1] is not None else "value"
            elif not char.isspace():
                self.expect = "after"  # inside a number or a literal: it can end here

    def place(self) -> str:
        if self.in_string:
            return "string"
        if self.expect == "after":
            return ("[" if self.stack and self.stack[-1] is None else "{") + "after"
        return self.expect

    def repeated_key_endings(self) -> list[bytes]:
        """Inside a key: for each key its object already has that starts like this one, the rest of it and the
        closing quote (a token starting with one of these would repeat that key)."""
        if not (self.in_string and self.expect == "key" and self.stack and self.stack[-1]) or self.escape:
            return []
        typed = bytes(self.key)
        return [key[len(typed):] + b'"' for key in self.stack[-1] if key.startswith(typed)]


class DocumentMatcher:
    """One sequence's place in its JSON grammar, with the module's promises (see the module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: JsonVocabulary | None, budget: int | None):
        self.matcher = matcher
        self.vocabulary = vocabulary
        self.budget = budget if vocabulary is not None else None
        self.cursor = JsonCursor()
        self.plan: list[int] | None = None
        self.cut_short = False
        self._next_check = CLOSING_HORIZON  # plan again once the budget is down to this
        self.calm = False
        """Near the end: no token that opens more structure (`,` `{` `[`) unless the document still closes in
        time after it: one such token can add more to the closing than the margin (`}},` then a whole object of
        required keys)."""

    def consume_token(self, token: int) -> bool:
        if self.vocabulary is not None:
            self.cursor.feed(self.vocabulary.decode(token))
        if self.budget is not None:
            self.budget -= 1
        if self.plan:
            self.plan.pop(0) if self.plan[0] == token else self.plan.clear()
        return self.matcher.consume_token(token)

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def draft_room(self) -> int:
        """How many draft tokens (speculative decoding) this document may take in one step: none while it is being
        closed (or soon may be), so that every draft row is masked as a step of its own would be; those steps are
        planned one token at a time."""
        if self.plan is not None or self.calm or self.matcher.is_stopped():
            return 0
        return max(0, self.budget - 2 - self._next_check) if self.budget is not None else 1 << 30

    def forced_run(self, most: int) -> list[int]:
        """Up to `most` tokens the grammar forces from here (drafts that are sure), within the draft room."""
        most = min(most, self.draft_room())
        return self.matcher.compute_ff_tokens()[:most] if most > 0 else []

    def grammatical(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar takes from here, within the draft room (the matcher is not
        advanced: llguidance validates on a copy of its state)."""
        room = self.draft_room()
        return self.matcher.validate_tokens(tokens[:room]) if room > 0 else 0

    def probe(self, token: int) -> "DocumentMatcher":
        """A copy that has taken `token`: a draft row's grammar state (engine/speculative/verify.py)."""
        probe = copy.copy(self)
        probe.matcher, probe.cursor = self.matcher.deep_copy(), self.cursor.copy()
        probe.plan = None if self.plan is None else list(self.plan)
        probe.consume_token(token)
        return probe

    def get_error(self) -> str:
        return self.matcher.get_error()

    def failure(self) -> str | None:
        """Why the grammar itself failed where the sequence ends, or None: a complete document, or one the budget cut
        (`closing_tokens` found no closing in time: `length`, as documented). A failed grammar's mask allows only the
        end, maybe computed in a draft row's copy: computed here again, it says why."""
        if self.matcher.is_accepting():
            return None
        if not self.matcher.is_error():
            self.matcher.compute_bitmask()
        return grammar_failure(self.matcher.get_error()) if self.matcher.is_error() else None

    def banned_tokens(self) -> list[int]:
        """Tokens the grammar allows but that would close a key this object already has."""
        if self.vocabulary is None:
            return []
        return [t for ending in self.cursor.repeated_key_endings() for t in self.vocabulary.starting_with(ending)]

    def forced_token(self, eos_token: int) -> int | None:
        """The token this sequence must take next to close its document in time, else None (free choice)."""
        if self.plan is None and self.budget is not None and self.budget <= self._next_check:
            plan = closing_tokens(self.matcher, self.cursor, self.vocabulary, limit=self.budget)
            if plan is not None and len(plan) + CLOSING_MARGIN >= self.budget:
                self.plan, self.cut_short = plan, True
            elif plan is not None:  # plan again when half the gap is used up
                gap = self.budget - len(plan) - CLOSING_MARGIN
                self.calm = gap <= CALM_WINDOW  # `GrammarMasks` sets `cut_short` where calm overrules the model
                self._next_check = self.budget - max(1, gap // 2)
            else:  # no closing fits the budget (the schema's shortest document is longer): retry now and then
                self._next_check = self.budget - CLOSING_MARGIN
        if self.plan is None:
            return None
        return self.plan[0] if self.plan else eos_token

    def closes_in_time_after(self, token: int) -> bool:
        """Whether, once `token` is taken, a closing of the document still fits the budget with its margin."""
        probe, cursor = self.matcher.deep_copy(), self.cursor.copy()
        if not probe.consume_token(token):
            return False
        cursor.feed(self.vocabulary.decode(token))
        limit = (self.budget or 0) - 1 - CLOSING_MARGIN
        return limit >= 0 and closing_tokens(probe, cursor, self.vocabulary, limit=limit) is not None

    def next_closing_token(self, eos_token: int) -> int:
        """The first token of a closing planned now (when calm leaves the model no token), EOS if complete."""
        plan = closing_tokens(self.matcher, self.cursor, self.vocabulary, limit=max(self.budget or 0, 1) * 4)
        return plan[0] if plan else eos_token


def grammar_failure(error: str) -> str:
    """llguidance's error, its first line (a parser state dump follows), with what usually causes it."""
    return (f"{error.strip().splitlines()[0]} (a `$ref` that only refers to itself, or a schema past the grammar "
            "engine's limits, cannot be followed to a complete document)")


def closing_tokens(matcher: llguidance.LLMatcher, cursor: JsonCursor, vocabulary: JsonVocabulary, limit: int) -> list[int] | None:
    """A short sequence of tokens that completes the document from `matcher`'s state (no model involved): at
    each point the forced tokens, else the allowed token that closes soonest from the JSON place (`cursor`),
    else the allowed token with the lowest id. None when it would take more than `limit` tokens."""
    probe, cursor = matcher.deep_copy(), cursor.copy()
    out: list[int] = []
    while not probe.is_accepting():
        if len(out) >= limit or probe.is_error():
            return None
        banned = {t for ending in cursor.repeated_key_endings() for t in vocabulary.starting_with(ending)}
        step = probe.compute_ff_tokens() or [_best_allowed(probe, vocabulary.closers.get(cursor.place(), ()), banned)]
        if step[0] < 0 or not probe.consume_tokens(step):
            return None
        for token in step:
            cursor.feed(vocabulary.decode(token))
        out.extend(step)
    return out


def _best_allowed(matcher: llguidance.LLMatcher, preferred: tuple[int, ...], banned: set[int]) -> int:
    for token in preferred:
        if token not in banned and matcher.validate_tokens([token]) == 1:
            return token
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little").nonzero()[0]
    return next((int(token) for token in allowed if int(token) not in banned), -1)
