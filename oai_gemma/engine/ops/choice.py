"""Which linear class each weight becomes under a `model.quantization` value (the one choice, for the loader, the
quantized-weights cache's file name and the tests)."""

from __future__ import annotations

import torch

from ...settings import INT_DOT_QUANTIZATIONS
from . import native
from .int_dot import Q4Linear, Q5Linear, Q8Linear
from .native import native_unavailable
from .quantized import DynamicInt8Linear, Int4Linear, Int8Linear, NativeInt8Linear, NativeQ8Linear


PROJECTIONS_PER_LAYER = 7
"""q, k, v, o, gate, up, down: a projection's number `projection.{i}` is layer i // 7, kind i % 7
(engine/model/weights.py's PROJECTIONS)."""
MORE_BITS_KINDS = (2, 6)
"""v and down: the projections llama.cpp's Q4_K_M keeps at 6 bits in the `more_bits` layers."""


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and the last eighth of the layers and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def linear_for(quantization: str, name: str, dtype: torch.dtype, layers: int = 0):
    """The quantized linear class for weight `name` (`lm_head` or `projection.{i}`) under a `model.quantization`
    value and the model's dtype (`layers`: the model's layer count, which `q4-mix` needs); None: that weight stays
    as it is (packed float32). `per-step`: the int8 copy, which the runner pairs with the packed weight
    (`PerStepLinear`). `q8`: every linear `Q8Linear` (int8 weights, int8 activations); `q4`: the projections
    `Q4Linear` (4-bit blocks), the lm_head `Q8Linear`; `q4-mix`: `q4` with v and down `Q8Linear` in the
    `more_bits` layers (llama.cpp's Q4_K_M recipe) and the lm_head `Q5Linear` (GGUF's Q5_1: 226 MB a token at the 1B
    where q8 reads 303; docs/engine.md, "Quality at the 1B shape")."""
    if quantization in INT_DOT_QUANTIZATIONS and native.int_dot_unavailable() is None:
        if quantization == "q4-mix" and name == "lm_head":
            return Q5Linear
        if quantization == "q8" or name == "lm_head":
            return Q8Linear
        layer, kind = divmod(int(name.rpartition(".")[2]), PROJECTIONS_PER_LAYER)
        mixed = quantization == "q4-mix" and kind in MORE_BITS_KINDS and more_bits(layer, layers)
        return Q8Linear if mixed else Q4Linear
    if quantization in INT_DOT_QUANTIZATIONS:  # engine/config.py refuses this at start-up; direct callers get int8's choice
        quantization = "int8"
    native_lm_head = NativeQ8Linear if name == "lm_head" else NativeInt8Linear
    if quantization == "per-step":
        return native_lm_head
    if dtype == torch.float32 and native_unavailable() is None:
        return DynamicInt8Linear if quantization == "int4" and name == "lm_head" else native_lm_head
    if dtype == torch.float32 and quantization == "int4":
        return DynamicInt8Linear if name == "lm_head" else None
    if quantization == "int4" and name == "lm_head":
        return Int4Linear
    return Int8Linear
