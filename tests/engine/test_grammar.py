"""The grammar compiler and the batched masks, on a tiny byte-level tokenizer (one token per byte):
cheap to build, and every JSON text has exactly one tokenization, so tests can spell documents out."""

import asyncio
import json
import subprocess
import sys
import threading
from concurrent.futures import Future

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oai_gemma.api.errors import APIError
from oai_gemma.api.response_format import json_schema_grammar
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.sampling.grammar import GrammarCompiler, GrammarMasks, InvalidSchema, UnsupportedSchema, apply_bitmask_torch
from oai_gemma.engine.sampling.json_document import CLOSING_HORIZON

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "role": {"enum": ["admin", "user"]}},
    "required": ["name", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, [tokenizer.eos_token_id])


def allowed(logits_row: torch.Tensor, tokenizer) -> set[str]:
    return {tokenizer.decode([i]) for i in torch.isfinite(logits_row).nonzero().flatten().tolist()}


def test_the_same_schema_compiles_once_whatever_its_key_order(compiler):
    first = compiler.json_schema(PERSON)
    hits = compiler.hits
    reordered = dict(reversed(list(PERSON.items())))
    assert compiler.json_schema(reordered) is first
    assert compiler.hits == hits + 1


def test_a_different_schema_is_a_cache_miss(compiler):
    misses = compiler.misses
    compiler.json_schema({**PERSON, "required": ["name"]})
    assert compiler.misses == misses + 1


def test_unimplemented_keyword_is_unsupported_naming_it(compiler):
    with pytest.raises(UnsupportedSchema) as info:
        compiler.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert info.value.feature == "uniqueItems"


def test_unknown_format_is_unsupported_naming_it(compiler):
    with pytest.raises(UnsupportedSchema) as info:
        compiler.json_schema({"type": "string", "format": "madeup"})
    assert info.value.feature == "format: madeup"


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"properties": 3}, {"$ref": "#/nowhere"}, [1, 2], {"$ref": "#"}])
def test_invalid_schema_is_invalid(compiler, schema):
    # `{"$ref": "#"}` compiles, but its first mask fails (it allowed only the end: an empty "document")
    with pytest.raises(InvalidSchema):
        compiler.json_schema(schema)


SELF_LOOP = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"], "$defs": {"x": {"$ref": "#/$defs/x"}}}


def test_a_grammar_that_fails_part_way_says_why_when_the_end_comes(compiler, tokenizer):
    # `a`'s schema only refers to itself: after `{"a":` the mask allows only the end, which is no document
    matcher = compiler.json_schema(SELF_LOOP).matcher()
    for token in tokenizer.encode('{"a":'):
        assert matcher.failure() is None, "unfinished, not failed: a budget's cut stays a cut (`length`)"
        assert matcher.consume_token(token)
    assert "only refers to itself" in matcher.failure() and "<state>" not in matcher.failure()
    done = compiler.json_schema(PERSON).matcher()
    for token in tokenizer.encode('{"name":"a","role":"user"}'):
        done.consume_token(token)
    assert done.failure() is None


def test_document_complete_stops_the_matcher(compiler, tokenizer):
    matcher = compiler.json_schema(PERSON).matcher()
    for token in tokenizer.encode('{"name":"a","role":"user"}'):
        assert not matcher.is_stopped()
        assert matcher.consume_token(token)
    assert matcher.is_stopped()


def test_drafts_are_what_the_grammar_forces_or_takes_and_none_while_the_document_may_close(compiler, tokenizer):
    """Speculative decoding's view of a matcher: forced tokens, the leading tokens of a guess it takes (the matcher
    itself not advanced), and nothing once the budget is near its closing horizon."""
    grammar = compiler.json_schema(PERSON)
    matcher = grammar.matcher(budget=100)
    assert tokenizer.decode(matcher.forced_run(32)) == '{"name":"'
    assert matcher.grammatical(tokenizer.encode('{"name":"ab","rolx":')) == len('{"name":"ab","rol')
    assert matcher.grammatical(tokenizer.encode('{"name":"ab","role":"admin"}')) == len('{"name":"ab","role":"admin"}')
    assert tokenizer.decode(matcher.forced_run(4)) == '{"na'  # unchanged by the checks
    room = 100 - 2 - CLOSING_HORIZON  # every draft row stays before the first closing plan
    assert matcher.grammatical(tokenizer.encode('{"name":"' + "a" * 50)) == room
    assert grammar.matcher(budget=CLOSING_HORIZON + 2).forced_run(32) == []
    assert grammar.matcher().forced_run(32) and grammar.matcher().grammatical(tokenizer.encode("{")) == 1  # no budget


def test_matchers_of_one_grammar_advance_independently(compiler, tokenizer):
    grammar = compiler.json_object()
    first, second = grammar.matcher(), grammar.matcher()
    assert first.consume_token(tokenizer.encode("{")[0])
    assert not second.consume_token(tokenizer.encode("}")[0])  # second is still before the opening brace


def test_masks_touch_only_rows_with_a_grammar(compiler, tokenizer):
    logits = torch.randn(3, len(tokenizer))
    before = logits.clone()
    out = GrammarMasks(compiler.vocab_size).apply(logits, [None, compiler.json_object().matcher(), None])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert allowed(out[1], tokenizer) == {"{"}


def test_masks_follow_each_rows_place_in_its_grammar(compiler, tokenizer):
    grammar = compiler.json_schema(PERSON)
    started, fresh = grammar.matcher(), grammar.matcher()
    for token in tokenizer.encode('{"name":"a","role":"'):
        started.consume_token(token)
    out = GrammarMasks(compiler.vocab_size).apply(torch.randn(2, len(tokenizer)), [started, fresh])
    assert allowed(out[0], tokenizer) == {"a", "u"}
    assert allowed(out[1], tokenizer) == {"{"}


def test_complete_document_allows_only_end_of_sequence(compiler, tokenizer):
    matcher = compiler.json_schema({"type": "integer"}).matcher()
    matcher.consume_token(tokenizer.encode("7")[0])
    out = GrammarMasks(compiler.vocab_size).apply(torch.randn(1, len(tokenizer)), [matcher])
    assert "<eos>" in allowed(out[0], tokenizer)
    assert not allowed(out[0], tokenizer) & {" ", "\n"}  # no free whitespace, ever


def test_lark_grammar_constrains_to_its_alternatives(compiler, tokenizer):
    matcher = compiler.lark('start: "yes" | "no"').matcher()
    out = GrammarMasks(compiler.vocab_size).apply(torch.randn(1, len(tokenizer)), [matcher])
    assert allowed(out[0], tokenizer) == {"y", "n"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [64, 1000, 262_144])
def test_torch_mask_apply_bans_exactly_the_zero_bits(dtype, vocab):
    # the reference: token t is allowed iff bit t % 32 of word t // 32 is set (llguidance's layout)
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # all banned
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    before = logits.clone()
    apply_bitmask_torch(logits, bitmask)
    token = torch.arange(vocab)
    allowed = ((bitmask[:, token // 32] >> (token % 32).to(torch.int32)) & 1).bool()
    assert torch.equal(torch.isneginf(logits), ~allowed)
    assert torch.equal(logits[allowed], before[allowed])


def test_masks_need_no_xgrammar_on_a_cpu(tmp_path):
    # a CPU install has no xgrammar (it pulls triton, ~1 GB): the grammar module must work without it
    script = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "import torch, llguidance\n"
        "from oai_gemma.engine.sampling import grammar\n"
        "assert grammar._xgrammar() is None\n"
        "logits = torch.zeros(2, 64)\n"
        "grammar.apply_bitmask_torch(logits, torch.tensor([[1, 0], [-1, -1]], dtype=torch.int32))\n"
        "assert torch.isneginf(logits[0]).sum() == 63 and logits[0, 0] == 0 and not torch.isinf(logits[1]).any()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


class EngineWithoutGrammars:
    """The engine's own `grammars` property over a grammar compiler whose build failed (a tokenizer
    llguidance cannot read)."""

    grammars = Engine.grammars

    def __init__(self):
        self._grammars = Future()
        self._grammars.set_exception(ValueError("cannot read this tokenizer"))


def test_structured_output_without_a_grammar_engine_is_a_400_naming_the_parameter():
    with pytest.raises(APIError) as info:
        asyncio.run(json_schema_grammar(EngineWithoutGrammars(), {"type": "object"}, "response_format"))
    error = info.value.body.error
    assert (info.value.status, error.param, error.code) == (400, "response_format", "structured_output_unavailable")
    assert "cannot read this tokenizer" in error.message


def test_schemas_compile_off_the_event_loop(compiler):
    """`json_schema_grammar` hands the compile to a worker thread: the event loop never runs it."""
    seen = []

    class RecordingCompiler:
        def json_schema(self, schema):
            seen.append(threading.current_thread())
            return compiler.json_schema(schema)

    class EngineWithCompiler:
        grammars = RecordingCompiler()

    async def compile_on_the_loop():
        loop_thread = threading.current_thread()
        grammar = await json_schema_grammar(EngineWithCompiler(), {"type": "object"}, "response_format")
        return loop_thread, grammar

    loop_thread, grammar = asyncio.run(compile_on_the_loop())
    assert grammar.matcher() is not None
    assert seen and seen[0] is not loop_thread


def run_greedy(compiler, tokenizer, grammar, budget: int, favourite: str) -> tuple[str, bool]:
    """Generate under the grammar with a 'model' whose logits favour the characters of `favourite` (in order,
    cyclically, as a looping small model would), within `budget` tokens. Returns (text, cut_short)."""
    eos = tokenizer.eos_token_id
    masks = GrammarMasks(compiler.vocab_size, eos)
    matcher = grammar.matcher(budget=budget)
    text = ""
    for step in range(budget):
        logits = torch.zeros(1, len(tokenizer))
        for rank, char in enumerate(favourite):
            logits[0, tokenizer.convert_tokens_to_ids(char)] = 10.0 - rank * 0.01 if char == favourite[step % len(favourite)] else 5.0 - rank * 0.01
        logits[0, eos] = -5.0
        token = int(masks.apply(logits, [matcher]).argmax())
        if token == eos:
            break
        assert matcher.consume_token(token)
        text += tokenizer.decode([token])
        if matcher.is_stopped():
            break
    return text, matcher.cut_short


@pytest.mark.parametrize("budget", [12, 20, 40, 100])
def test_a_looping_object_is_closed_within_its_budget(compiler, tokenizer, budget):
    # the model would repeat `"color":"black",` forever; the document must still end, parse, within budget
    text, cut = run_greedy(compiler, tokenizer, compiler.json_object(), budget, '{"color":"black",')
    assert len(text) <= budget
    assert isinstance(json.loads(text), dict), text
    assert cut


def test_endless_digits_and_nested_arrays_are_closed(compiler, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "xs": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}},
              "required": ["n", "xs"], "additionalProperties": False}
    text, cut = run_greedy(compiler, tokenizer, compiler.json_schema(schema), 30, '{"n":1234567891234567891234')
    doc = json.loads(text)
    assert set(doc) == {"n", "xs"} and cut and len(text) <= 30


@pytest.mark.parametrize("budget", [100, 40])
def test_a_document_that_ends_by_itself_is_not_cut(compiler, tokenizer, budget):
    # at 40 the budget is close enough for the sequence to be held calm: still not cut, as the model
    # never wanted a token calm took from it
    text, cut = run_greedy(compiler, tokenizer, compiler.json_schema(PERSON), budget, '{"name":"a","role":"user"}')
    assert json.loads(text) == {"name": "a", "role": "user"} and not cut


def no_repeated_keys(pairs):
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {pairs}"
    return dict(pairs)


@pytest.mark.parametrize("favourite", ['{"a":1,', '{"color":"black",', '{"k":{"k":{"k":1,'])
def test_an_object_never_repeats_a_key(compiler, tokenizer, favourite):
    # the model wants the same key again and again: the grammar must make it write another one
    text, _ = run_greedy(compiler, tokenizer, compiler.json_object(), 60, favourite)
    json.loads(text, object_pairs_hook=no_repeated_keys)


def test_unbounded_numbers_get_sane_bounds(compiler, tokenizer):
    def accepts(schema, text):
        matcher = compiler.json_schema(schema).matcher()
        return matcher.matcher.validate_tokens(tokenizer.encode(text)) == len(tokenizer.encode(text))

    integer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert accepts(integer, '{"n":-9000000000000000000}')
    assert not accepts(integer, '{"n":12345678901234567890')  # 20 digits: beyond 64 bits
    number = {"type": "array", "items": {"type": "number"}}
    assert accepts(number, "[0.5,-3,123456789012345.123456789]")
    assert not accepts(number, "[0.1234567891")  # a 10th decimal
    assert not accepts(number, "[1e5")  # no exponent
    assert not accepts(number, "[9999999999999999")  # beyond 1e15
    # a schema's own bounds are kept
    at_least_5 = {"type": "array", "items": {"type": "integer", "minimum": 5}}
    assert accepts(at_least_5, "[123456789012345]")
    assert not accepts(at_least_5, "[4]")
    assert accepts({"type": "array", "items": {"type": "number", "multipleOf": 0.5, "maximum": 10}}, "[9.5]")


@pytest.mark.parametrize("schema", [
    {"type": "object"},  # json_object: values of any type
    {"type": "object", "properties": {"s": {"type": "string"}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}},
    {"type": "object", "properties": {"a": {"type": "array"}}},
    {"type": "object", "properties": {"a": {"description": "anything"}}},
])
def test_numbers_in_values_of_any_type_are_bounded_too(compiler, tokenizer, schema):
    # issue 42: `{"city":"Paris",":":5005571221656402272548}` came from a value of any type
    def accepts(text):
        return compiler.json_schema(schema).matcher().matcher.validate_tokens(tokenizer.encode(text)) == len(tokenizer.encode(text))

    assert accepts('{"a":[-9000000000,{"b":[0.5,null,true,"x",{}]}]}')
    assert accepts('{"a":[123456789012345')
    assert not accepts('{"a":[5005571221656402272548')
    assert not accepts('{"a":[{"b":1e5')


POINT = {"type": "object", "properties": {"x": {"type": "number"}}}


@pytest.mark.parametrize("schema", [
    {"allOf": [POINT, {"type": "object", "properties": {"y": {}}}]},
    {"type": "object", "anyOf": [POINT, {"type": "object", "properties": {"z": {}}}]},
    {"allOf": [{"$ref": "#/$defs/p"}, {"$ref": "#/$defs/p"}], "$defs": {"p": POINT}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/p", "type": "object"}}, "$defs": {"p": POINT}},
])
def test_schemas_llguidance_intersects_still_compile(compiler, schema):
    # two values of any type (ANY_VALUE) met in an intersection recurse without end: none is put there
    assert compiler.json_schema(schema).matcher() is not None
