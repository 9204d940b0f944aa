"""Frozen linear layers for the runner's fast path.

On CPU the weight is re-laid out once for oneDNN (`mkldnn._reorder_linear_weight`): its bf16 AMX and
fp32 kernels then skip a per-call reorder. Measured on the 2-core CI machine with gemma-3-270m in bf16:
the decode step at batch 8 went from 58.7 ms to 39.1 ms, the 262k-row lm_head alone from 24.6 to 14.1 ms,
with bit-identical logits (docs/engine.md). Fusing q/k/v or gate/up into one matmul did not pay on this
CPU (measured: equal at batch 1, 5-15% slower from batch 8 up), so each projection stays its own.
Elsewhere (GPU) it is a plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 8


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class FrozenLinear:
    """`keep_weight`: `weight` stays beside a packed copy (the static decode's layer functions take plain tensors:
    engine/model/static_decode.py); else only where it is not packed."""

    def __init__(self, weight: torch.Tensor, keep_weight: bool = False):
        weight = weight.detach()
        self.packed = None
        if _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            except RuntimeError:  # a torch build without this oneDNN path: fall back to F.linear
                self.packed = None
        self.weight = weight if self.packed is None or keep_weight else None
        self.packed_bytes = weight.numel() * weight.element_size() if self.packed is not None else 0
        """Memory of the re-laid-out copy (0 when the module's own weight is used as it is)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def call_linear(x: torch.Tensor, linear: FrozenLinear) -> torch.Tensor:
    """`linear` for engine/model/gemma3.py's layer functions when the projections are FrozenLinears."""
    return linear(x)


call_linear.fuses = True
"""A plain call: fused projections (engine/ops/fused.py) may be called as one."""
