"""xgrammar vs llguidance with the embedded model's tokenizer: the numbers behind docs/engine.md's
"Structured output" choice.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/grammar_backends.py

Measures, for each backend: tokenizer-info build time, compile time for `json_object` and a nested
schema (cold, no cache), per-token mask fill and apply time at batch 1 and 8 along a real JSON document,
and which schema features each rejects.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from oai_gemma.engine.model.loader import embedded_model_dir

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"},
     "role": "admin"},
    separators=(",", ":"),
)
FEATURES = {
    "pattern": {"type": "string", "pattern": "^a+$"},
    "format: email": {"type": "string", "format": "email"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": 1, "maximum": 9},
    "multipleOf": {"type": "integer", "multipleOf": 3},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
    "recursive $ref": {"$defs": {"t": {"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
    "const": {"const": "x"},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "string"}, "then": {"minLength": 1}, "else": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "unknown keyword": {"type": "string", "x-made-up": 1},
    "unknown format": {"type": "string", "format": "madeup"},
}


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.vocab = vocab
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compiler(self):
        return self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)

    def compile_object(self, compiler):
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))

    def compile_schema(self, compiler, schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers, bitmask):
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token):
        assert matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.vocab = vocab

    def compiler(self):
        return None

    def _compile(self, grammar: str):
        matcher = self.ll.LLMatcher(self.info, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def compile_object(self, compiler):
        return self._compile(self.ll.LLMatcher.grammar_from_json_schema({"type": "object"}, {"whitespace_flexible": False}))

    def compile_schema(self, compiler, schema):
        return self._compile(self.ll.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False}))

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.info, compiled, log_level=0)

    def bitmask(self, rows: int):
        return self.llt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers, bitmask):
        if len(matchers) == 1:
            self.llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask):
        self.llt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


def measure(backend_cls, tokenizer, vocab: int, eos: list[int]) -> dict:
    out: dict = {}
    out["tokenizer info"], backend = timed(lambda: backend_cls(tokenizer, vocab, eos))
    compiler = backend.compiler()
    out["compile json_object"], _ = timed(lambda: backend.compile_object(backend.compiler()), repeat=3)
    out["compile nested schema"], compiled = timed(lambda: backend.compile_schema(backend.compiler(), NESTED), repeat=3)
    # a document's tokens as the model would emit them (grammar-valid); the first token is "{"
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    logits_dtype = torch.bfloat16
    for rows in (1, 8):
        matchers = [backend.matcher(compiled) for _ in range(rows)]
        bitmask = backend.bitmask(rows)
        logits = torch.randn(rows, vocab, dtype=logits_dtype)
        fills, applies = [], []
        backend.apply(logits.clone(), bitmask)  # first call compiles kernels where the backend has any
        for token in ids:
            start = time.perf_counter()
            backend.fill(matchers, bitmask)
            fills.append(time.perf_counter() - start)
            work = logits.clone()
            start = time.perf_counter()
            backend.apply(work, bitmask)
            applies.append(time.perf_counter() - start)
            assert torch.isfinite(work[:, token]).all(), f"{backend.name} masked token {token} ({tokenizer.convert_ids_to_tokens(token)!r}) at batch {rows}"
            for matcher in matchers:
                backend.accept(matcher, token)
        out[f"fill batch {rows}"] = statistics.median(fills)
        out[f"apply batch {rows}"] = statistics.median(applies)
    rejected = []
    for feature, schema in FEATURES.items():
        try:
            backend.compile_schema(compiler if compiler is not None else backend.compiler(), schema)
        except Exception as exc:  # noqa: BLE001 - we report what each rejects
            rejected.append(f"{feature} ({str(exc).splitlines()[0][:80]})")
    out["rejects"] = rejected
    return out


def main() -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    print(f"vocab {vocab}, document of {len(tokenizer.encode(DOCUMENT, add_special_tokens=False))} tokens")
    for backend_cls in (XGrammar, LLGuidance):
        results = measure(backend_cls, tokenizer, vocab, eos)
        print(f"\n## {backend_cls.name}")
        for key, value in results.items():
            if key == "rejects":
                print(f"rejects: {value or 'nothing'}")
            else:
                print(f"{key}: {ms(value)}")


if __name__ == "__main__":
    main()
