"""What models of one process share (engine/model/shared.py, issue 41's load stall): the Rust tokenizer and the
grammar compiler of one tokenizer.json content, while a model holds them."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest

from oai_gemma.engine.model.loader import embedded_model_dir
from oai_gemma.engine.model.tokenizer import RustTokenizer
from oai_gemma.engine.warmup import shared_compiler
from oai_gemma.settings import ModelSettings

# fast subset (issue 36.4): 22 s of tokenizer and token-trie builds; test_multi_model (slow too) shares them through a server
pytestmark = pytest.mark.slow


@pytest.fixture
def copies(tmp_path) -> tuple[Path, Path, Path]:
    """A tokenizer.json of this test's own (the embedded model's plus a token, so no model the session loaded shares
    it) twice (the second with its own special tokens' config, as the 1B's differs from the 270M's), and once
    changed (one token more)."""
    source = embedded_model_dir()
    same, other, changed = tmp_path / "same", tmp_path / "other", tmp_path / "changed"
    data = json.loads((source / "tokenizer.json").read_text())
    for folder, extra in ((same, ["<only-this-test>"]), (other, ["<only-this-test>"]), (changed, ["<only-this-test>", "<extra>"])):
        folder.mkdir()
        tokens = [{"id": 262144 + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                   "normalized": False, "special": True} for i, text in enumerate(extra)]
        (folder / "tokenizer.json").write_text(json.dumps({**data, "added_tokens": data["added_tokens"] + tokens}))
    shutil.copy(source / "tokenizer_config.json", same)
    (other / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<end_of_turn>"}))
    return same, other, changed


def test_one_tokenizer_content_is_built_once_and_freed_with_its_last_user(copies):
    same, other, changed = copies
    first, second, third = RustTokenizer(same), RustTokenizer(other), RustTokenizer(changed)
    assert first.backend_tokenizer is second.backend_tokenizer  # same content, other folder
    assert third.backend_tokenizer is not first.backend_tokenizer and len(third) == len(first) + 1
    assert (first.eos_token, second.eos_token) == ("<eos>", "<end_of_turn>")  # each folder's own config
    assert first.encode("Hello there") == second.encode("Hello there")
    holder = weakref.ref(first._shared)
    del first, second
    gc.collect()
    assert holder() is None


def test_the_grammar_compiler_is_shared_by_tokenizer_content(copies):
    same, other, _ = copies
    cache = ModelSettings().cache_path
    first, second = RustTokenizer(same), RustTokenizer(other)  # this test's own content: no other holder
    compiler = shared_compiler(first, [1, 106], cache)
    assert shared_compiler(second, [1, 106], cache) is compiler
    assert compiler.json_object().matcher() is not None
    kept = weakref.ref(compiler)
    del compiler
    gc.collect()
    assert kept() is None
