"""`load_engine(settings)`: the model loaded, the engine built from the settings and warmed up, ready to start.

It logs the start-up phases (load, relayout, KV cache, invariance check, warm-up) and the resident memory by
part, so that a regression in either shows in the first lines of a server's log.
"""

from __future__ import annotations

import logging
import time

from ..settings import Settings
from ..version import provenance, version_line
from .engine import Engine
from .model.loader import load, start_plan
from .cache.memory import release_free_memory, resident_bytes

log = logging.getLogger("oai_gemma.engine")

MB = 2**20


def load_engine(settings: Settings) -> Engine:
    """Everything start-up does before the server may say it is ready (seconds: run it off the event loop)."""
    log.info("%s", version_line())
    log.info("start-up: %s; /health answers 503 until ready", start_plan(settings.model))
    started = time.monotonic()
    loaded = load(settings.model, lean=True)  # transformers' modules only where lean.py cannot build the model
    loaded_at = time.monotonic()
    engine = Engine.from_settings(loaded, settings, own_weights=True)  # nothing else uses this model: one copy of its weights
    log.info("CPU kernels: torch %s, native %s", provenance()["cpu_capability"], engine.kernel_isa)
    built_at = time.monotonic()
    log.info("warm-up: running every step shape once, so no request pays for it")
    engine.warm_up()
    log.info("warm-up done in %.1f s", time.monotonic() - built_at)
    release_free_memory()  # warm-up's activations
    runner = engine.core.runner
    phases = {"load": loaded_at - started, **runner.timings, "warm-up": time.monotonic() - built_at}
    log.info("start-up phases: %s", ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
    total, weights, kv = resident_bytes(), engine.weight_bytes, runner.cache.resident_bytes()
    log.info(
        "resident memory: %.0f MB (weights %.0f, KV cache %.0f of %.0f allocated, other %.0f: runtime, tokenizer, "
        "grammar, activations); weights quantized: %s", total / MB, weights / MB, kv / MB, runner.cache.nbytes / MB,
        (total - weights - kv) / MB, runner.quantization,
    )
    return engine
