"""Which linear class each weight becomes under a `model.quantization` value (the one choice, for the loader, the
quantized-weights cache's file name and the tests)."""

from __future__ import annotations

import torch

from . import native
from .int_dot import Q4Linear, Q8Linear
from .native import native_unavailable
from .quantized import DynamicInt8Linear, Int4Linear, Int8Linear, NativeInt8Linear, NativeQ8Linear


def linear_for(quantization: str, name: str, dtype: torch.dtype):
    """The quantized linear class for weight `name` (`lm_head` or a projection) under a `model.quantization`
    value and the model's dtype; None: that weight stays as it is (packed float32). `per-step`: the int8 copy,
    which the runner pairs with the packed weight (`PerStepLinear`). `q8`: every linear `Q8Linear` (int8 weights,
    int8 activations); `q4`: the projections `Q4Linear` (4-bit blocks), the lm_head `Q8Linear`."""
    if quantization in ("q8", "q4") and native.int_dot_unavailable() is None:
        return Q4Linear if quantization == "q4" and name != "lm_head" else Q8Linear
    if quantization in ("q8", "q4"):  # engine/config.py refuses this at start-up; direct callers get int8's choice
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
