"""Batch-invariant mode decided at start-up on the weights in their final layout (engine/factory.py), and remembered.

The check calls the linears and attention at the row counts and key spans the engine uses and compares rows bit for
bit (ops/invariance.py); on 2 cores it takes seconds of every start. Its verdict is about this CPU's kernels, not
the weights' values, so it is kept in the model cache (`<cache_dir>/invariance/<key>.json`), keyed by everything
the kernels' behaviour depends on: the CPU (model name and flags), torch and its CPU capability, the environment
that limits the kernel libraries' ISA, the native libraries' names (their sources' digests), this check's own
source and the linears' Python calls (ops/linear.py, quantized.py, int_dot.py: which kernel a row count takes), the dtype, the linears' layouts, the shapes and row counts, the threads and the setting. A later start
with the same key reads the verdict and says so; `cache_dir` None (tests) checks every time.

The check runs on the thread count the engine will compute with (`config.model.threads`), not the calling thread's:
a model loaded beside others is loaded on one thread (api/model_router.py) and computes on the compute threads'
count, and oneDNN's or the native kernels' summation order may differ between the two (issue 41's note).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ...cpu import computing_with
from .buckets import bucket, buckets
from .weights import Gemma3Weights
from ..config import ConfigError, EngineConfig
from ..ops import int_dot as ops_int_dot, invariance as ops_invariance, linear as ops_linear, quantized as ops_quantized
from ..ops.invariance import (COST_DECODE_ROWS, COST_ROWS, PROMPT_KERNEL_TOKENS, TILE_ROWS, Invariance, prefill_cost,
                              prefill_rows_exact, small_spans, span_step, tile_rows, window_blocks)
from ..cache.kv_cache import BLOCK_SIZE
from ..ops.native.sources import FAMILIES, library_name

log = logging.getLogger("oai_gemma.engine")

ISA_ENVIRONMENT = ("ATEN_CPU_CAPABILITY", "FBGEMM_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA")


def measure_invariance(weights: Gemma3Weights, config: EngineConfig) -> tuple[Invariance | None, float | None]:
    """Batch-invariant mode, decided on the weights before the runner is built, and what it costs (or would cost) a
    prefill chunk's linears (`prefill_cost`, None where not measured). `on`: on, or a start-up error where this
    CPU's kernels cannot be made invariant; `auto`: on where the linears need no tiling (their own kernel's rows
    are exact at any count, as the native int8 ones are, or the whole call's are, as float32 oneDNN's are here);
    off where they need tiles (bf16 oneDNN: prefill 1.5x slower). Off the CPU path it is off (engine/config.py
    makes `on` there a start-up error)."""
    if config.model.batch_invariant == "off" or config.model.static_decode or weights.device.type != "cpu":
        return None, None
    cache_dir = config.model.cache_dir
    path = None if cache_dir is None else Path(cache_dir) / "invariance" / f"{verdict_key(weights, config)}.json"
    verdict = _read(path)
    if verdict is None:
        with computing_with(engine_threads(config)):
            verdict = _check(weights, config)
        _write(path, verdict)
    else:
        verdict["message"] += f" (this CPU's kernels and shapes checked at an earlier start: {path.name})"
    getattr(log, verdict["level"])("%s", verdict["message"])
    on = verdict["tile"] is not None and verdict["step"] is not None
    spans = tuple(verdict.get("small_spans", ()))
    return (Invariance(verdict["tile"], verdict["step"], verdict.get("by_role", False), spans) if on else None), verdict["cost"]


def _check(weights: Gemma3Weights, config: EngineConfig) -> dict:
    """The verdict measured now: {tile, step, by_role, cost, level, message} (tile or step None: off)."""
    setting, text = config.model.batch_invariant, weights.shape.text
    w, most_tokens = weights.layers[0], bucket(config.max_tokens_per_step, buckets(config.max_tokens_per_step))
    projections = {
        "q_proj": (w.q, text.hidden, most_tokens), "o_proj": (w.o, text.heads * text.head_dim, most_tokens),
        "gate_proj": (w.gate, text.hidden, most_tokens), "down_proj": (w.down, text.intermediate, most_tokens),
    }
    tile = tile_rows({**projections, "lm_head": (weights.lm_head, text.hidden, bucket(config.max_logits_rows, buckets(config.max_logits_rows)))},
                     weights.dtype, whole_only=setting == "auto")
    # prompt rows through the layouts' prefill path, decode rows through their row-exact kernel (ops/invariance.py)
    by_role = tile is not None and hasattr(w.q, "rowwise") and prefill_rows_exact(projections, weights.dtype)
    slow = not by_role and not getattr(w.q, "prefill_rowwise", True)  # exact rows, far slower than the plain call on prefill
    if setting == "auto" and (tile is None or slow):
        cost = layer_cost(weights, tile or TILE_ROWS)
        why = "their exact kernel lags the dequantized matmul on a prefill chunk" if slow else "they need row tiles"
        return _verdict(None, None, cost, "info", f"batch-invariant mode off (auto): this CPU's linears would make a "
                        f"{COST_ROWS}-token prefill chunk's linears {100 * cost:+.1f}% slower ({why}); on with --batch-invariant on")
    step = span_step(text.heads, text.kv_heads, text.head_dim, weights.dtype, window_blocks(text.sliding_window, BLOCK_SIZE) * BLOCK_SIZE)
    if tile is None or step is None:
        if setting == "on":
            raise ConfigError("engine.batch_invariant = \"on\", but this CPU's kernels are not batch-invariant")
        return _verdict(None, None, None, "warning", "batch-invariant mode off: this CPU's kernels are not batch-invariant "
                        f"(linears: {'ok' if tile else 'differ'}, attention: {'ok' if step else 'differ'})")
    cost = layer_cost(weights, tile, by_role)
    spans = small_spans(text.heads, text.kv_heads, text.head_dim, weights.dtype, step)
    if by_role:
        how = f"prompts of {PROMPT_KERNEL_TOKENS}+ tokens dequantized, shorter ones and decode rows in the row-exact kernel"
        what = f"a step of {COST_ROWS - COST_DECODE_ROWS} prompt rows beside {COST_DECODE_ROWS} decode rows"
    else:
        how = "their own kernels at any row count" if hasattr(w.q, "rowwise") else f"calls of at most {tile} rows"
        what = f"a {COST_ROWS}-token prefill chunk"
    small = "/".join(map(str, spans)) + " or " if spans else ""
    verdict = _verdict(tile, step, cost, "info", f"batch-invariant mode on ({setting}): measured cost {100 * cost:+.1f}% on the "
                       f"linears of {what} (linears: {how}; decode spans {small}padded to {step}; off with --batch-invariant off)")
    return {**verdict, "by_role": by_role, "small_spans": list(spans)}


def engine_threads(config: EngineConfig) -> int:
    """The torch threads the engine will compute with: its configuration's, else (0: torch's default) this thread's."""
    return config.model.threads or torch.get_num_threads()


def _verdict(tile: int | None, step: int | None, cost: float | None, level: str, message: str) -> dict:
    return {"tile": tile, "step": step, "cost": cost, "level": level, "message": message}


def layer_cost(weights: Gemma3Weights, tile: int, by_role: bool = False) -> float:
    """`prefill_cost` of the first layer's seven linears (`by_role`: on a step with decode rows, the mode's dearest)."""
    w, text = weights.layers[0], weights.shape.text
    features = [text.hidden] * 3 + [text.heads * text.head_dim] + [text.hidden] * 2 + [text.intermediate]
    return prefill_cost([w.q, w.k, w.v, w.o, w.gate, w.up, w.down], features, weights.dtype, tile,
                        decode_rows=COST_DECODE_ROWS if by_role else 0)


def verdict_key(weights: Gemma3Weights, config: EngineConfig) -> str:
    """The digest of everything the check's verdict depends on (the module docstring's list)."""
    text, w = weights.shape.text, weights.layers[0]
    facts = {
        "cpu": _cpu(), "torch": str(torch.__version__), "capability": torch.backends.cpu.get_cpu_capability(),
        "environment": {name: os.environ.get(name) for name in ISA_ENVIRONMENT}, "threads": engine_threads(config),
        "native": sorted(library_name(family) for family in FAMILIES),
        "check": [hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()
                  for module in (ops_invariance, ops_linear, ops_quantized, ops_int_dot)]
        + [hashlib.sha256(Path(__file__).read_bytes()).hexdigest()],
        "dtype": str(weights.dtype), "quantization": config.model.quantization,
        "layouts": [type(linear).__name__ for linear in (w.q, w.k, w.v, w.o, w.gate, w.up, w.down, weights.lm_head)],
        "shape": [text.hidden, text.intermediate, text.heads, text.kv_heads, text.head_dim, text.vocab],
        "rows": [config.max_tokens_per_step, config.max_logits_rows], "setting": config.model.batch_invariant,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cpu() -> str:
    """The CPU's model name and flags (Linux), else what the platform says."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _read(path: Path | None) -> dict | None:
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def _write(path: Path | None, verdict: dict) -> None:
    """Written whole (a temporary file renamed); a cache that cannot be written only costs the check next time."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(verdict))
        os.replace(temporary, path)
    except OSError as exc:
        log.debug("the batch-invariance verdict was not kept (%s)", exc)
