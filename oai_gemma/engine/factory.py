"""`load_engine(settings)`: the model loaded, the engine built from the settings and warmed up, ready to start.

It logs the start-up phases (load, relayout, KV cache, invariance check, warm-up) and the resident memory by
part, so that a regression in either shows in the first lines of a server's log.
"""

from __future__ import annotations

import errno
import logging
import time

from safetensors import SafetensorError

from ..settings import EMBEDDED, Settings
from ..version import provenance, version_line
from .engine import Engine
from .model.gguf_file import GGUFError
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
    warmed_at = time.monotonic()
    log.info("warm-up done in %.1f s", warmed_at - built_at)
    # ready means ready: the grammar compiler's build (its token trie: ~1 s holding the GIL) ends before /health says
    # 200, or the first request after it would wait that long; a tokenizer it cannot read was logged, and is no error
    engine.build_grammars().exception()
    release_free_memory()  # warm-up's activations
    runner = engine.core.runner
    phases = {"load": loaded_at - started, **runner.timings, "warm-up": warmed_at - built_at,
              "grammar compiler": time.monotonic() - warmed_at}
    log.info("start-up phases: %s", ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
    total, weights, kv = resident_bytes(), engine.weight_bytes, runner.cache.resident_bytes()
    log.info(
        "resident memory: %.0f MB (weights %.0f, KV cache %.0f of %.0f allocated, other %.0f: runtime, tokenizer, "
        "grammar, activations); weights quantized: %s", total / MB, weights / MB, kv / MB, runner.cache.nbytes / MB,
        (total - weights - kv) / MB, runner.quantization,
    )
    return engine


def explain_load_failure(error: BaseException, source: str) -> str:
    """What went wrong loading the model and what to do about it, in one line (the traceback is logged at debug)."""
    text = " ".join(str(error).split())[:400] or type(error).__name__
    out_of_memory = isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == errno.ENOMEM)
    if out_of_memory or "can't allocate memory" in text or "out of memory" in text.lower():
        return (f"out of memory while loading the model ({text}): free memory, lower --kv-cache-gib or --max-num-seqs, "
                "or serve a smaller or quantized model (--quantization int8)")
    where = "the embedded model" if source == EMBEDDED else source
    if isinstance(error, GGUFError):
        return f"cannot convert {where}: {text}"
    if isinstance(error, (OSError, ValueError, KeyError, SafetensorError)):
        return (f"cannot load the model from {where}: {type(error).__name__}: {text}; --model takes a Gemma-3 "
                "checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    return f"loading the model from {where} failed: {type(error).__name__}: {text}; --log-level debug shows the traceback"
