"""Projections that read the same rows in one kernel call: q/k/v and gate/up (issue 37: a 1B decode step made 182
kernel calls, each a parallel region and an activation quantization; fused it makes 104; `q4-mix`'s 13 layers with
v in q8 fuse q and k alone: 117, not 130).

Only the native quantized layouts fuse (`FUSES`): each of their outputs is its own sum over the row's inputs in one
fixed order, so the whole call gives every output the bits its own projection's call gives (tested). The parts stay
what they were (the cache, LoRA's per-projection updates, the byte counts and the invariance check see them), their
tensors now views of the whole's, so no weight is held twice. A prefill chunk (from KERNEL_ROWS rows, where the
layouts dequantize for oneDNN, whose order may depend on the call's width) still calls each part on its own.
"""

from __future__ import annotations

import torch

from ...cpu import TURNS
from .int_dot import Q4Linear, Q8Linear
from .quantized import KERNEL_ROWS, NativeInt8Linear, output_count

FUSES = (Q4Linear, Q8Linear, NativeInt8Linear)
"""The layouts whose outputs do not depend on the other outputs of their call (exactly these classes: not the
lm_head's NativeQ8Linear, nor PerStepLinear or packed float)."""


class Fused:
    """One linear over several parts' outputs side by side: `parts` the projections, `whole` their weights
    concatenated (same class), `bounds` each part's output columns."""

    def __init__(self, parts: list):
        cls = type(parts[0])
        self.parts = parts
        self.whole = cls.from_tensors({f: torch.cat([p.tensors()[f] for p in parts]) for f in cls.FIELDS})
        sizes = [output_count(p) for p in parts]
        total, self.bounds = sum(sizes), []
        for part, size in zip(parts, sizes):  # the parts' tensors become views of the whole's (dim 0: by outputs)
            lo = self.bounds[-1][1] if self.bounds else 0
            self.bounds.append((lo, lo + size))
            for f, t in self.whole.tensors().items():
                setattr(part, f, t[lo * t.shape[0] // total : (lo + size) * t.shape[0] // total])
            part.fused = self
        self.prefill_rowwise = getattr(self.whole, "prefill_rowwise", True)
        if hasattr(parts[0], "prefill"):  # batch-invariant mode's prompt rows (ops/invariance.py `by_role`)
            self.prefill = self._prefill

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Each part's own prefill path (its dequantized matmul, whose order may depend on the call's width)."""
        return torch.cat([part.prefill(x) for part in self.parts], dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= KERNEL_ROWS:  # a prefill chunk: each part's own dequantized matmul, its own bits
            return torch.cat([part(x) for part in self.parts], dim=1)
        return self.whole(x)

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole.rowwise(x)


def fuse_layers(layers) -> int:
    """Fuse each layer's q/k/v and gate/up where their layout allows (q and k alone where v's layout is another:
    `q4-mix`'s v in q8 beside 4-bit q and k); returns how many groups were fused."""
    fused = 0
    for w in layers:
        for names in (("q", "k", "v"), ("q", "k"), ("gate", "up")):
            TURNS.offer()  # a group is a unit of a load's work (cpu.Turns)
            parts = [getattr(w, name) for name in names]
            if (type(parts[0]) in FUSES and all(type(p) is type(parts[0]) for p in parts)
                    and not any(hasattr(p, "fused") for p in parts)):
                Fused(parts)  # the parts read the same rows: the same inputs
                fused += 1
    return fused


def projections(linear, x: torch.Tensor, parts) -> list[torch.Tensor]:
    """Each part's `linear(x, part)`: one call of a `Fused` for each run of parts that is one (all of them, or q and k
    before v) where the step's `linear` is a plain call (`fuses`: not LoRA's per-projection wrapper), its outputs
    split (q and k contiguous for the native norm)."""
    if isinstance(parts[0], torch.Tensor) or not getattr(linear, "fuses", False):  # plain weights: F.linear
        return [linear(x, part) for part in parts]
    outs, i = [], 0
    while i < len(parts):
        fused = getattr(parts[i], "fused", None)
        run = tuple(parts[i : i + len(fused.parts)]) if fused is not None else ()
        if fused is None or len(run) != len(fused.parts) or any(a is not b for a, b in zip(run, fused.parts)):
            outs.append(linear(x, parts[i]))
            i += 1
            continue
        out = linear(x, fused)
        outs += [out[:, lo:hi] for lo, hi in fused.bounds]
        i += len(run)
    return outs
