"""Structured output: grammars that constrain a request's tokens, and the token masks that enforce them.

llguidance compiles JSON schemas and tracks each sequence's place in its grammar; the step's masks are applied
to the logits in one batched op: plain torch on a CPU (no triton for a CPU install), xgrammar's kernel on a GPU
when the `gpu` extra installed it (as vLLM does). Why: docs/engine.md, "Structured output".

The interface, generic on purpose (response_format uses it; so can tool calls):

    compiler = engine.grammars                      # GrammarCompiler, one per model (built once at start)
    grammar = compiler.json_schema(schema_dict)     # -> Grammar; raises UnsupportedSchema / InvalidSchema
    grammar = compiler.json_object()                # any JSON object
    grammar = compiler.lark(text)                   # anything llguidance's Lark dialect says, e.g. free text
                                                    # OR a tool call: `start: TEXT | json_call` ...
    GenerationRequest(..., grammar=grammar)         # the engine makes a matcher per sequence

Compiling takes well under a millisecond for typical schemas but must stay off the event loop and out of
the engine thread: call it through `asyncio.to_thread`. Results are cached (LRU) by the grammar's
canonical text, so a repeated schema costs a dictionary lookup.

Whitespace between JSON tokens is not allowed (compact `,` and `:`): a small base model would otherwise
emit whitespace forever inside a JSON document.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from .json_document import DocumentMatcher, JsonVocabulary, bound_numbers, grammar_failure
from .token_table import ll_tokenizer


@functools.cache
def _xgrammar():
    """The `gpu` extra's xgrammar, or None: its CUDA kernel applies masks on the device (it needs triton, ~1 GB:
    not for CPU installs). Imported on a GPU's first mask only: 0.2 s of every CPU start-up otherwise."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
CACHE_SIZE = 256


class InvalidSchema(ValueError):
    """The schema is not a valid JSON schema (or the grammar does not compile)."""


class StructuredOutputUnavailable(RuntimeError):
    """The grammar engine could not be built for this model's tokenizer: no request can be constrained."""


class UnsupportedSchema(ValueError):
    """The schema is valid but uses a feature the grammar engine cannot enforce; `feature` names it."""

    def __init__(self, feature: str, message: str):
        super().__init__(message)
        self.feature = feature


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: immutable, shared by every request that asks for it."""

    key: str
    template: llguidance.LLMatcher
    """A matcher at the start of the grammar; never advanced, only copied."""
    json: JsonVocabulary | None = None
    """Set for JSON grammars: their documents get json_document's promises (closed in budget, no repeated key)."""

    def matcher(self, budget: int | None = None) -> DocumentMatcher:
        """A fresh matcher for one sequence (a copy: microseconds, no compilation). `budget`: the tokens the
        sequence may generate; a JSON document is closed within it."""
        return DocumentMatcher(self.template.deep_copy(), self.json, budget)


class GrammarCompiler:
    """Schema -> Grammar for one tokenizer, with an LRU cache. Thread-safe."""

    def __init__(self, tokenizer, eos_token_ids: list[int], cache_dir: Path | None = None):
        # the token trie of a 262k vocabulary, holding the GIL: 0.8 s from the cached token table, 2.7 s without
        self.tokenizer, table = ll_tokenizer(tokenizer, list(eos_token_ids), cache_dir)
        self.vocab_size = self.tokenizer.vocab_size
        self.json = JsonVocabulary(tokenizer, table.pieces)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def json_schema(self, schema: dict) -> Grammar:
        if not isinstance(schema, dict):
            raise InvalidSchema("a JSON schema must be an object")
        key = "json_schema:" + json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return self._cached(key, lambda: llguidance.LLMatcher.grammar_from_json_schema(bound_numbers(schema), JSON_OPTIONS))

    def json_object(self) -> Grammar:
        return self.json_schema({"type": "object"})

    def lark(self, text: str) -> Grammar:
        return self._cached("lark:" + text, lambda: llguidance.LLMatcher.grammar_from_lark(text))

    def _cached(self, key: str, build) -> Grammar:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return grammar
            self.misses += 1
        # only JSON documents get json_document's promises: a Lark grammar may have no JSON in it
        json_vocabulary = self.json if key.startswith("json_schema:") else None
        grammar = Grammar(key, self._compile(build), json_vocabulary)  # outside the lock: compiles may run side by side
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, build) -> llguidance.LLMatcher:
        try:
            text = build()
        except ValueError as exc:
            raise InvalidSchema(str(exc)) from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise schema_error(matcher.get_error())
        first = matcher.deep_copy()
        first.compute_bitmask()  # a schema that can never start (`{"$ref": "#"}`) fails only here: refused as sent
        if first.is_error():
            raise InvalidSchema(grammar_failure(first.get_error()))
        return matcher


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def schema_error(message: str) -> ValueError:
    """llguidance's error text -> UnsupportedSchema naming the feature, or InvalidSchema."""
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented:
        keys = ", ".join(k.strip().strip('"') for k in unimplemented.group(1).split(","))
        return UnsupportedSchema(keys, f"the JSON schema keyword(s) {keys} are not supported for structured output")
    unknown_format = _UNKNOWN_FORMAT.search(message)
    if unknown_format:
        feature = f"format: {unknown_format.group(1)}"
        return UnsupportedSchema(feature, f"the JSON schema `{feature}` is not supported for structured output")
    return InvalidSchema(message.strip())


# byte value -> its 8 bits as 8 bools (True = token banned), packed into one int64: one gather unpacks a byte
_BANNED_BY_BYTE = (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0).to(torch.uint8).view(torch.int64).view(256)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf on every token whose bit is 0 in `bitmask` [rows, words] (token t: bit t % 32 of word t // 32, as
    llguidance fills it), in place on `logits` [rows, vocab]. Plain torch: one gather unpacks the bits, one
    `masked_fill_` applies them."""
    table = _BANNED_BY_BYTE.to(bitmask.device)
    bytes_ = bitmask.view(torch.uint8)  # little-endian: byte k holds tokens 8k .. 8k+7, lowest bit first
    banned = table[bytes_.long()].view(torch.bool).view(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    logits.masked_fill_(banned, float("-inf"))


def _bit(token: int) -> int:
    """`token`'s bit in its int32 bitmask word (two's complement: bit 31 is the sign)."""
    bit = 1 << (token % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


class GrammarMasks:
    """Each step: the rows that have a grammar get -inf on every token their grammar forbids.

    The masks are filled in parallel (llguidance's executor, off the GIL) into one bitmask and applied in
    one batched op; rows without a grammar are not touched.
    """

    def __init__(self, vocab_size: int, eos_token: int = -1):
        self.words = (vocab_size + 31) // 32
        self.eos_token = eos_token
        self.executor = llguidance.LLExecutor()

    def apply(self, logits: torch.Tensor, matchers: list[DocumentMatcher | None]) -> torch.Tensor:
        """`logits` [rows, vocab] with the masks applied; the same tensor unless it had to be made contiguous."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        if not logits.is_contiguous():
            logits = logits.contiguous()
        bitmask = torch.empty((len(matchers), self.words), dtype=torch.int32)  # rows without a grammar: unused
        # llguidance.torch.fill_next_token_bitmask_par's one line: importing that module costs 1.6 s of start-up
        # (its mask kernel is a torch.compile, which pulls in dynamo and inductor), and we apply masks ourselves
        self.executor.unsafe_compute_mask_ptr(
            [(matchers[i].matcher, i) for i in rows], bitmask.data_ptr(), self.words * 4, len(matchers)
        )
        for i in rows:  # json_document's promises: no repeated key; a document closing within its budget
            for token in matchers[i].banned_tokens():
                bitmask[i, token // 32] &= ~_bit(token)
            forced = matchers[i].forced_token(self.eos_token)
            if forced is None and matchers[i].calm:
                self._calm(matchers[i], bitmask[i], logits[i])
                if not bool(bitmask[i].any()):  # nothing calm is allowed here: close now
                    forced = matchers[i].next_closing_token(self.eos_token)
            if forced is not None and 0 <= forced < self.words * 32:
                bitmask[i] = 0
                bitmask[i, forced // 32] = _bit(forced)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        if logits.device.type == "cuda" and _xgrammar() is not None:
            _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
        elif len(rows) == len(matchers):
            apply_bitmask_torch(logits, bitmask)
        else:  # only the rows with a grammar: the others keep their logits bit for bit
            index = torch.tensor(rows, device=logits.device)
            picked = logits.index_select(0, index)
            apply_bitmask_torch(picked, bitmask.index_select(0, index))
            logits.index_copy_(0, index, picked)
        return logits

    def _calm(self, matcher: DocumentMatcher, bitmask: torch.Tensor, logits: torch.Tensor) -> None:
        """Takes the structure-opening tokens out of one row's `bitmask`, but for the model's favourite when the
        document still closes in time after it; where calm overrules the model, the budget shaped the document
        (`cut_short`)."""
        calm_mask = matcher.vocabulary.calm_mask[: self.words]
        if not bool((bitmask & ~calm_mask).any()):
            return
        row = logits[None].clone()
        apply_bitmask_torch(row, bitmask[None].to(logits.device))
        favourite = int(row.argmax())
        bitmask &= calm_mask
        if bitmask[favourite // 32] & _bit(favourite):
            return  # the favourite was never a structure opener
        if matcher.closes_in_time_after(favourite):
            bitmask[favourite // 32] |= _bit(favourite)
        else:
            matcher.cut_short = True
