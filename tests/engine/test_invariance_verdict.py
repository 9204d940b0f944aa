"""The batch-invariance check's verdict is remembered in the model cache (engine/model/invariance_check.py): a later
start with the same CPU, kernels, shapes and settings reads it instead of spending seconds on the check again, and
anything the verdict depends on changes its key. The check itself is tests/engine/test_batch_invariance.py's."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oai_gemma.engine.config import EngineConfig, ModelConfig
from oai_gemma.engine.model import invariance_check
from oai_gemma.engine.ops.invariance import Invariance


class Int8Like:
    """Stands for a linear layout: only its class name enters the key."""


def weights(dtype=torch.float32, layout=Int8Like):
    text = SimpleNamespace(hidden=64, intermediate=128, heads=4, kv_heads=1, head_dim=16, vocab=1000)
    layer = SimpleNamespace(**{name: layout() for name in ("q", "k", "v", "o", "gate", "up", "down")})
    return SimpleNamespace(shape=SimpleNamespace(text=text), layers=[layer], lm_head=layout(), dtype=dtype,
                           device=torch.device("cpu"))


@pytest.fixture
def checks(monkeypatch):
    """The check replaced by a counter that finds the mode on (tile 32, span step 256, cost 2%)."""
    calls = []

    def check(w, config):
        calls.append(config)
        return invariance_check._verdict(32, 256, 0.02, "info", "batch-invariant mode on (auto): measured cost +2.0%")

    monkeypatch.setattr(invariance_check, "_check", check)
    return calls


def test_the_second_start_reads_the_verdict_and_says_so(tmp_path, checks, caplog):
    config = EngineConfig(model=ModelConfig(cache_dir=tmp_path))
    with caplog.at_level(logging.INFO, "oai_gemma.engine"):
        first = invariance_check.measure_invariance(weights(), config)
        second = invariance_check.measure_invariance(weights(), config)
    assert len(checks) == 1
    assert first == second == (Invariance(32, 256), 0.02)
    assert len(list((tmp_path / "invariance").glob("*.json"))) == 1
    lines = [r.getMessage() for r in caplog.records if "batch-invariant" in r.getMessage()]
    assert "earlier start" not in lines[0] and "earlier start" in lines[1]


@pytest.mark.parametrize("change", [
    lambda c, w: (replace(c, model=replace(c.model, batch_invariant="on")), w),
    lambda c, w: (replace(c, model=replace(c.model, quantization="q8")), w),
    lambda c, w: (replace(c, scheduler=replace(c.scheduler, max_prefill_tokens=c.scheduler.max_prefill_tokens * 2)), w),
    lambda c, w: (c, weights(dtype=torch.bfloat16)),
    lambda c, w: (c, weights(layout=type("Q8Like", (), {}))),
], ids=["setting", "quantization", "rows", "dtype", "layout"])
def test_what_the_verdict_depends_on_changes_its_key(tmp_path, checks, change):
    config, w = EngineConfig(model=ModelConfig(cache_dir=tmp_path)), weights()
    invariance_check.measure_invariance(w, config)
    invariance_check.measure_invariance(*reversed(change(config, w)))
    assert len(checks) == 2


def test_the_environment_that_limits_the_isa_changes_the_key(tmp_path, monkeypatch):
    config, w = EngineConfig(model=ModelConfig(cache_dir=tmp_path)), weights()
    before = invariance_check.verdict_key(w, config)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert invariance_check.verdict_key(w, config) != before


def test_an_edit_to_a_linears_python_call_changes_the_key(tmp_path, monkeypatch):
    """Which kernel a row count takes is decided in ops/quantized.py and its siblings: an edit there is a new verdict."""
    config, w = EngineConfig(model=ModelConfig(cache_dir=tmp_path)), weights()
    before = invariance_check.verdict_key(w, config)
    edited = tmp_path / "quantized.py"
    edited.write_bytes(Path(invariance_check.ops_quantized.__file__).read_bytes() + b"\n# an edit\n")
    monkeypatch.setattr(invariance_check.ops_quantized, "__file__", str(edited))
    assert invariance_check.verdict_key(w, config) != before


def test_without_a_cache_or_with_a_broken_file_it_checks_again(tmp_path, checks):
    invariance_check.measure_invariance(weights(), EngineConfig(model=ModelConfig(cache_dir=None)))
    invariance_check.measure_invariance(weights(), EngineConfig(model=ModelConfig(cache_dir=None)))
    assert len(checks) == 2
    config = EngineConfig(model=ModelConfig(cache_dir=tmp_path))
    invariance_check.measure_invariance(weights(), config)
    (kept,) = (tmp_path / "invariance").glob("*.json")
    kept.write_text("{not json")
    assert invariance_check.measure_invariance(weights(), config) == (Invariance(32, 256), 0.02)
    assert len(checks) == 4


def test_off_is_not_checked_at_all(tmp_path, checks):
    assert invariance_check.measure_invariance(weights(), EngineConfig(
        model=ModelConfig(cache_dir=tmp_path, batch_invariant="off"),
    )) == (None, None)
    assert checks == []


def test_the_check_runs_on_and_is_keyed_by_the_engines_threads_not_the_loaders(tmp_path, monkeypatch):
    """A model loaded beside others is loaded on a one-thread thread (api/model_router.py) but computes on the
    engine's threads: the verdict must describe the kernels that will run (issue 41's note)."""
    seen = []

    def check(w, config):
        seen.append(torch.get_num_threads())
        return invariance_check._verdict(32, 256, 0.02, "info", "on")

    monkeypatch.setattr(invariance_check, "_check", check)
    config, w = EngineConfig(model=ModelConfig(cache_dir=tmp_path, threads=2)), weights()
    keys = []

    def load_on(threads: int) -> None:
        torch.set_num_threads(threads)
        keys.append(invariance_check.verdict_key(w, config))
        invariance_check.measure_invariance(w, replace(config, model=replace(config.model, cache_dir=None)))
        keys.append(torch.get_num_threads())

    for threads in (1, 2):
        thread = threading.Thread(target=load_on, args=(threads,))
        thread.start()
        thread.join()
    assert seen == [2, 2]
    assert keys[0] == keys[2] and keys[1] == 1 and keys[3] == 2  # one key; the loader's own count back after
