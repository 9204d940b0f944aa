"""`load_engine(settings)`: the model loaded, the machine probed, the configuration resolved, the engine built from
it and warmed up, ready to start.

Start-up in steps, as vLLM v1's engine factory and nano-vllm's `LLMEngine`: `load` (model/loader.py), `probe`
(the one step that builds or measures anything on this machine: the native kernel compiled or found, its ISA, the
model's KV bytes, the checkpoint's name for quantized weights), `resolve` (engine/config.py: pure, every `auto`
decided from the settings and what `probe` found), then `Engine` built from the resolved configuration. It logs
the start-up phases (load, relayout, KV cache, invariance check, warm-up) and the resident memory by part, so that
a regression in either shows in the first lines of a server's log.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..cpu import TURNS, compute_thread_count
from ..settings import EMBEDDED, QUANTIZATIONS, Settings
from ..version import provenance, version_line
from .cache.kv_cache import BLOCK_SIZE, KVCache
from .cache.memory import release_free_memory, resident_bytes
from .config import EngineConfig, Machine, resolve
from .engine import Engine
from .model.gguf_file import GGUFError
from .model.loader import LoadedModel, load, start_plan
from .model.layout import path_name
from .model.mapped import checkpoint_files
from .model.invariance_check import measure_invariance
from .model.runner import ModelRunner, load_weights
from .ops import native
from .ops.choice import linear_for
from .ops.int_dot import Q4Linear, Q5Linear
from .ops.quantized import FORMAT, NativeQ8Linear
from .shape import TextShape

log = logging.getLogger("oai_gemma.engine")

MB = 2**20


def load_engine(settings: Settings, grammars: bool = True) -> Engine:
    """Everything start-up does before the server may say it is ready (seconds: run it off the event loop).
    `grammars` off: the grammar compiler is left to the first structured request (a model loaded beside others,
    whose streams its build would stall holding the GIL; api/model_router.py)."""
    log.info("%s", version_line())
    log.info("start-up: %s; /health answers 503 until ready", start_plan(settings.model))
    started = time.monotonic()
    with TURNS.aside():  # beside streaming models: no unit of work in it to hand their steps the cores between
        loaded = load(settings.model, lean=True, stream=True)  # the text weights read later, one tensor at a time
        loaded_at = time.monotonic()
        machine = probe(settings, loaded)
    log.info("CPU kernels: torch %s, native %s", provenance()["cpu_capability"], machine.kernel_isa)
    engine = build_engine(loaded, resolve(settings, machine), own_weights=True)  # nothing else uses this model: one copy of its weights
    loaded_peak = resident_bytes("VmHWM")
    built_at = time.monotonic()
    log.info("warm-up: running every step shape once, so no request pays for it")
    engine.warm_up(grammars)
    warmed_at = time.monotonic()
    log.info("warm-up done in %.1f s", warmed_at - built_at)
    # ready means ready: the grammar compiler's build (its token trie: ~1 s holding the GIL) ends before /health says
    # 200, or the first request after it would wait that long; a tokenizer it cannot read was logged, and is no error
    if grammars:
        engine.build_grammars().exception()
    with TURNS.aside():  # memory given back and counted: no unit of work to hand streaming models' steps the cores between
        release_free_memory()  # warm-up's activations
        runner = engine.core.runner
        phases = {"load": loaded_at - started, **runner.timings, "warm-up": warmed_at - built_at,
                  "grammar compiler": time.monotonic() - warmed_at}
        log.info("start-up phases: %s", ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
        total, weights, kv = resident_bytes(), engine.weight_bytes, runner.cache.resident_bytes()
        log.info(
            "resident memory: %.0f MB (weights %.0f, KV cache %.0f of %.0f allocated, other %.0f: runtime, tokenizer, "
            "grammar, activations); weights quantized: %s; peak %.0f MB while loading, %.0f MB by the end of warm-up",
            total / MB, weights / MB, kv / MB, runner.cache.nbytes / MB, (total - weights - kv) / MB, runner.quantization,
            loaded_peak / MB, resident_bytes("VmHWM") / MB,
        )
    return engine


def probe(settings: Settings, loaded: LoadedModel) -> Machine:
    """What `resolve` needs to know of this machine and the loaded model, found once: on a CPU the native kernel is
    built (compiled once into the configured model cache's `native`, engine/ops/native) or the reason it cannot
    be; the KV cache's bytes per position; the checkpoint's name for its quantized weights."""
    device, dtype = loaded.device, loaded.dtype
    native_dir = settings.model.cache_path / "native"
    missing = native.build(native_dir) if device.type == "cpu" else None
    shape = TextShape.of(loaded.text_config)
    return Machine(
        shape=shape, device=str(device), dtype=str(dtype).removeprefix("torch."),
        kv_bytes_per_token=KVCache.bytes_per_token(shape, dtype), kv_block_size=BLOCK_SIZE,
        image_tokens=getattr(getattr(loaded.model, "config", None), "mm_tokens_per_image", 0) or 0,
        native_missing=missing, native_dir=native_dir,
        int_dot_missing=(missing or native.int_dot_unavailable()) if device.type == "cpu" else None,
        kernel_isa=native.kernel_isa() if device.type == "cpu" else "none", threads=compute_thread_count(),
        weights_name=weights_name(loaded.source_dir),
        quantized_layouts={q: _layout(q, dtype) for q in QUANTIZATIONS[1:]},
    )


def configure(settings: Settings, loaded: LoadedModel) -> EngineConfig:
    """The configuration `settings` resolve to on this machine and model: `resolve(settings, probe(...))`."""
    return resolve(settings, probe(settings, loaded))


def build_engine(loaded: LoadedModel, config: EngineConfig, own_weights: bool = False) -> Engine:
    """The engine built from a resolved configuration: the weights in their final layout first, batch-invariant
    mode measured on them (`auto` decided: the configuration logged once, as plain data, says `on` or `off`), then
    the runner fed both, then the engine around it."""
    started = time.monotonic()
    weights = load_weights(loaded, config.model, own_weights)
    measured = time.monotonic()
    with TURNS.aside():  # timed runs (cached after the first): none of their time handed over
        invariance, cost = measure_invariance(weights, config)
    config = replace(config, model=replace(config.model, batch_invariant="on" if invariance is not None else "off"))
    log.info("engine config: %s", json.dumps(config.as_dict()))
    runner = ModelRunner(weights, config, loaded.model, invariance)
    runner.invariance_cost = cost
    runner.timings = {"weights": measured - started, **runner.timings, "invariance check": time.monotonic() - measured}
    return Engine(loaded, config, own_weights, runner)


def weights_name(source_dir: str) -> str:
    """The checkpoint as its quantized weights' file is named: its path, and a short digest of its weight files'
    sizes and modification times ("unread" where they cannot be), so a checkpoint written again in place is
    quantized again."""
    name = path_name(source_dir)
    try:
        stats = [(path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in checkpoint_files(Path(source_dir))]
        stamp = hashlib.sha256(repr(stats).encode()).hexdigest()[:12]
    except (OSError, ValueError):
        stamp = "unread"
    return f"{name}-{stamp}"


def _layout(quantization: str, dtype: torch.dtype) -> str:
    """The stored layout of quantized weights: torch's version (its int4 layout is torch's own), the format's
    version, whether the lm_head is the native q8 kind (which depends on the kernel running here), the q4
    projections' own layout version and the q5 lm_head's (`q4-mix`'s: its files before the q5 lm_head are never read
    back as it)."""
    q8 = "q8" if linear_for(quantization, "lm_head", dtype) is NativeQ8Linear else ""
    q4 = f"q4v{Q4Linear.VERSION}" if linear_for(quantization, "projection.0", dtype) is Q4Linear else ""
    q5 = f"q5v{Q5Linear.VERSION}" if linear_for(quantization, "lm_head", dtype) is Q5Linear else ""
    return f"torch{torch.__version__}-f{FORMAT}{q8}{q4}{q5}"


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
