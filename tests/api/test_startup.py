"""Start-up says where its time and memory went (issue 18 items 6 and 9); not timed: the numbers are only logged."""

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import MAX_MODEL_LEN
from oai_gemma.engine.cache.kv_cache import KVCache
from oai_gemma.engine.shape import FULL, TextShape

PHASES = re.compile(r"start-up phases: load ([\d.]+) s, weights ([\d.]+) s, KV cache ([\d.]+) s, invariance check ([\d.]+) s, warm-up ([\d.]+) s, grammar compiler ([\d.]+) s")
MEMORY = re.compile(r"resident memory: (\d+) MB \(weights (\d+), KV cache (\d+) of (\d+) allocated, other (-?\d+)")


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_server_logs_its_start_up_phases_and_resident_memory_by_part(server):
    log = server.log_path.read_text()
    assert PHASES.search(log), log[-3000:]
    total, weights, kv, allocated, other = map(int, MEMORY.search(log).groups())
    assert weights > 200 and total >= weights + kv  # gemma-3-270m in float32 is ~1 GB of weights
    assert allocated > kv  # the KV cache's untouched pages are not resident


def test_the_console_says_listening_not_running_before_the_model_is_ready(server):
    log = server.log_path.read_text()
    assert "Uvicorn running on" not in log  # it read as ready while the model was still loading
    listening, ready = log.index(f"listening on 127.0.0.1:{server.port}; /health answers 503"), log.index("ready: ")
    assert listening < log.index("start-up: ") < ready


def test_a_phase_reports_its_progress_every_few_seconds_with_percent_and_time_left(caplog):
    import logging
    import time

    from oai_gemma.progress import Phase

    def slowly(parts):
        for part in parts:
            time.sleep(0.05)
            yield part

    with caplog.at_level(logging.WARNING, logger="test.progress"):
        with Phase(logging.getLogger("test.progress"), "converting", usually=9, every=0.2) as phase:
            assert list(phase.track(slowly(range(20)), total=20)) == list(range(20))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "converting (usually about 9 s)" and lines[-1].startswith("converting: done in")
    progress = [line for line in lines[1:-1] if "%" in line]
    assert len(progress) >= 2 and all(re.fullmatch(r"converting: \d+% \(\d+/20\), about \d+ s left", line) for line in progress)


def test_the_engine_configuration_is_logged_once_and_served_with_every_auto_decided(server):
    info = httpx.get(server.url + "/v1/server_info").json()
    config = info["engine_config"]
    assert config["dtype"] == "float32" and config["quantization"] == "none" and config["max_model_len"] == MAX_MODEL_LEN
    assert config["kv_blocks"] > 0 and config["threads"] > 0 and config["native_dir"].endswith("native")
    assert isinstance(info["batch_invariant"], bool)  # `auto`, as the start-up check on the weights found it
    assert config["batch_invariant"] == ("on" if info["batch_invariant"] else "off")  # decided before the engine was built
    assert httpx.get(server.url + "/health").json()["engine_config"] == config
    logged = re.findall(r"engine config: (.*)", server.log_path.read_text())
    assert len(logged) == 1 and json.loads(logged[0]) == config


def test_the_kv_cache_takes_memory_only_where_it_is_written():
    shape = TextShape(hidden=640, intermediate=2048, heads=4, kv_heads=1, head_dim=256, vocab=262_144, sliding_window=512,
                      sliding=(False,) * 4, rms_eps=1e-6, query_pre_attn_scalar=256, rope={FULL: (1e6, 1.0)})
    before = rss()
    cache = KVCache(shape, num_blocks=32 * 8192 // 16, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.nbytes == (32 * 8192 + 16) * 256 * 4 * 2 * 4  # 2 GiB allocated (and the scratch block)...
    assert rss() - before < 64 * 2**20  # ...none of it resident
    assert cache.resident_bytes() < 2**20
    assert not cache.k[0][7].any() and not cache.v[3][-10:].any()  # reads as zeros
    cache.k[2][5:12] = 1.0  # one sequence's first 112 positions of one layer
    assert 100 * 256 * 4 <= cache.resident_bytes() < 2**20
    before = rss()
    assert float(cache.k[1][:8192].sum()) == 0.0  # reading 128 MiB never written (padding blocks of a batch)...
    assert rss() - before < 64 * 2**20 and cache.resident_bytes() < 2**20  # ...takes no memory, and is not counted


def test_importing_the_app_pulls_in_neither_dynamo_nor_xgrammar():
    """1.8 s of every start-up went to `llguidance.torch` (a torch.compile kernel: dynamo and inductor) and
    xgrammar, neither of which a CPU server uses."""
    script = (
        "import sys, oai_gemma.api.app\n"
        "loaded = [m for m in ('torch._dynamo', 'torch._inductor', 'xgrammar', 'llguidance.torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


def test_the_tokenizer_read_by_tokenizers_answers_as_transformers_does():
    """Start-up reads tokenizer.json with the `tokenizers` library (engine/model/tokenizer.py) instead of
    transformers' AutoTokenizer, whose Python pass over Gemma-3's added tokens was most of the tokenizer's load."""
    from transformers import AutoTokenizer

    from oai_gemma.engine.model.loader import embedded_model_dir
    from oai_gemma.engine.model.tokenizer import RustTokenizer, load_tokenizer

    source = embedded_model_dir()
    ours, theirs = load_tokenizer(str(source)), AutoTokenizer.from_pretrained(source)
    assert isinstance(ours, RustTokenizer)
    texts = ["Hello, world!", "  two  spaces\tand a tab\n\nnewlines", "<start_of_turn>user\nHi<end_of_turn>\n",
             "ünïcödé 😀 中文 \u00a0nbsp", "<bos><eos><pad><unk>", "", "def f(x):\n    return x ** 2  # code"]
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    ids = ours.encode(texts[3])
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[1]) == theirs.convert_ids_to_tokens(ids[1])
    for token in ("<end_of_turn>", "<start_of_image>", "no-such-token-here"):
        assert ours.convert_tokens_to_ids(token) == theirs.convert_tokens_to_ids(token)
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_the_grammar_compiler_is_built_after_warm_up_or_at_first_use(monkeypatch):
    """Its token trie holds the GIL for seconds: built beside warm-up it stalled warm-up's steps on 2 cores."""
    import threading

    from oai_gemma.engine import engine as engine_module

    built, during_warm_up = [], []
    monkeypatch.setattr(engine_module, "build_grammars", lambda *inputs: built.append(inputs) or "compiler")
    monkeypatch.setattr(engine_module, "warm_up", lambda core, grammars: during_warm_up.append(list(built)))

    class Bare:
        warm_up, build_grammars, grammars = (engine_module.Engine.warm_up, engine_module.Engine.build_grammars,
                                             engine_module.Engine.grammars)

        def __init__(self):
            self.core, self._grammar_inputs = None, ("tokenizer", [1])
            self._grammars, self._grammars_lock = None, threading.Lock()

    engine = Bare()
    engine.warm_up()
    assert during_warm_up == [[]], "nothing built while warm-up ran"
    assert engine.grammars == "compiler" and engine.grammars == "compiler"
    assert built == [("tokenizer", [1])], "built once"
    lazy = Bare()
    assert lazy.grammars == "compiler" and len(built) == 2, "without warm-up: at the first structured request"


@pytest.mark.slow  # fast subset (issue 36.4): the same subsystem is covered by its lighter tests
def test_the_grammar_tokenizer_from_the_cached_token_table_is_the_one_from_tokenizer_json(tmp_path, caplog):
    """Start-up builds llguidance's tokenizer from a token table cached on the first start (2.7 s -> 0.9 s,
    engine/sampling/token_table.py): it must tokenize, mask and force exactly as the one read from tokenizer.json,
    and an unreadable table is rebuilt, not trusted."""
    from oai_gemma.engine.model.loader import embedded_model_dir
    from oai_gemma.engine.model.tokenizer import load_tokenizer
    from oai_gemma.engine.sampling.grammar import GrammarCompiler

    tokenizer = load_tokenizer(str(embedded_model_dir()))
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    from_json = GrammarCompiler(tokenizer, eos)  # no cache: llguidance reads tokenizer.json
    (table,) = list(tmp_path.rglob("*.bin")) or [None]
    assert table is None
    GrammarCompiler(tokenizer, eos, tmp_path)  # writes the table
    (table,) = tmp_path.rglob("*.bin")
    from_table = GrammarCompiler(tokenizer, eos, tmp_path)
    assert from_table.json.pieces == from_json.json.pieces and table.stat().st_size > 1_000_000
    for text in ('{"name":"Ada","n":[1,2.5e3]}', "hello <end_of_turn> world", " \n\t x", "日本語 🎉", "<start_of_image>"):
        assert from_table.tokenizer.tokenize_str(text) == from_json.tokenizer.tokenize_str(text), text
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"enum": ["x", "yy"]}},
              "required": ["a", "b", "c"]}
    ours, theirs = from_table.json_schema(schema).matcher(), from_json.json_schema(schema).matcher()
    ours, theirs = ours.matcher, theirs.matcher  # llguidance's own matchers under json_document's wrapper
    for token in tokenizer.encode('{"a":"hello there","b":42,"c":"yy"}', add_special_tokens=False):
        assert ours.compute_bitmask() == theirs.compute_bitmask()
        assert ours.compute_ff_tokens() == theirs.compute_ff_tokens()
        assert ours.consume_token(token) and theirs.consume_token(token)
    assert ours.is_accepting() and theirs.is_accepting()
    table.write_bytes(table.read_bytes()[:-7])  # truncated: rebuilt with a warning
    assert GrammarCompiler(tokenizer, eos, tmp_path).json.pieces == from_json.json.pieces
    assert "unreadable" in caplog.text and len(table.read_bytes()) > 1_000_000


def test_the_kv_cache_count_is_taken_again_only_past_its_max_age(monkeypatch):
    """/health's count (`max_age` 1 s) serves a client that polls it often from one pagemap read a second: that read
    is ~9 MB for a 4B's cache, and /health polled every 20 ms slowed the engine's steps beside it."""
    from oai_gemma.engine.cache import kv_cache

    shape = TextShape(hidden=640, intermediate=2048, heads=4, kv_heads=1, head_dim=256, vocab=262_144, sliding_window=512,
                      sliding=(False,) * 2, rms_eps=1e-6, query_pre_attn_scalar=256, rope={FULL: (1e6, 1.0)})
    cache = KVCache(shape, num_blocks=64, dtype=torch.float32, device=torch.device("cpu"))
    clock = [100.0]
    monkeypatch.setattr(kv_cache.time, "monotonic", lambda: clock[0])
    assert cache.resident_bytes(max_age=1.0) < 4096
    cache.k[0][3] = 1.0  # a block written
    assert cache.resident_bytes(max_age=1.0) < 4096  # the count of 0.0 s ago serves
    assert cache.resident_bytes() >= 16 * 256 * 4  # no max_age: counted now
    clock[0] += 0.5
    cache.k[1][3] = 1.0
    assert cache.resident_bytes(max_age=1.0) < 2 * 16 * 256 * 4  # the count of 0.5 s ago
    clock[0] += 0.6
    assert cache.resident_bytes(max_age=1.0) >= 2 * 16 * 256 * 4  # older than 1 s: counted again
