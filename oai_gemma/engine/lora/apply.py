"""The low-rank updates of one step: each row's adapter, gathered (Punica's shrink/expand, in torch).

Every projection runs as before over all the step's tokens; then each adapter of the step adds
`expand(shrink(x[rows]))` to its rows (A [r, in], then B [out, r] carrying the scale), in place. A row of the base
model gets nothing added, and a step where no row has an adapter does not come here at all (`LoraStep.of` is None):
the path without adapters is unchanged.

Two ways to compute it. In batch-invariant mode the update goes through the step's own linear call on the adapter's
linears in the model's dtype (oneDNN-packed and tiled as the base's are), so a row's result does not depend on the
rows beside it either. Otherwise it is plain float32 matmuls (`F.linear`, MKL): at decode's few rows a call costs a
fraction of a packed oneDNN call's fixed overhead (measured here: 2 to 5 us against 16 to 18 us), and a projection's
input is widened once for q/k/v (and gate/up), which share it; decode rows of several adapters then go through the
resident adapters' stack in two matmuls (engine/lora/stack.py).

The projections are told apart by identity: engine/model/gemma3.py's layer functions call `linear(x, w.q)` etc.,
and `module_names` maps each of the runner's projection objects to its name once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .adapter import MODULES, AdapterLinears
from .stack import Stack

if TYPE_CHECKING:
    from .registry import LoraRegistry

Rows = slice | torch.Tensor
"""A step's rows: a slice when contiguous, else an index tensor."""


def module_names(weights) -> list[dict[int, str]]:
    """Per layer, the identity of each projection (engine/model/gemma3.py's LayerWeights) -> its module name."""
    return [{id(getattr(w, module)): module for module in MODULES} for w in weights]


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: torch.Tensor, rows: Rows, delta: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] += delta
    else:
        out.index_add_(0, rows, delta.to(out.dtype))


class LoraStep:
    """The adapters of one step's rows: `groups` [(adapter, its rows)], and `stacked` (the resident adapters' stack,
    the decode rows, their column mask) when decode rows of several adapters run outside batch-invariant mode."""

    def __init__(self, groups: list[tuple[AdapterLinears, Rows]], names: list[dict[int, str]], exact: bool,
                 stacked: tuple[Stack, slice, torch.Tensor] | None = None):
        self.groups, self.names, self.exact, self.stacked = groups, names, exact, stacked

    @classmethod
    def of(cls, prefills: Sequence, decodes: Sequence, registry: LoraRegistry, names: list[dict[int, str]], device,
           exact: bool) -> LoraStep | None:
        """The step's adapters from its items (`StepItem.adapter`: a slot, 0 for the base), in packing order; None
        when no row has one. `exact`: batch-invariant mode."""
        rows: dict[int, list[int]] = {}
        offset = 0
        for item in prefills:
            count = len(item.token_ids)
            if item.adapter:
                rows.setdefault(item.adapter, []).extend(range(offset, offset + count))
            offset += count
        decode_slots = [item.adapter or 0 for item in decodes for _ in item.token_ids]
        stacked = None
        if not exact and len(set(decode_slots) - {0}) > 1:
            stack = registry.stack()
            stacked = (stack, slice(offset, offset + len(decode_slots)), stack.mask(decode_slots, device))
        else:
            for row, slot in enumerate(decode_slots, start=offset):
                if slot:
                    rows.setdefault(slot, []).append(row)
        if not rows and stacked is None:
            return None
        groups = []
        for slot, where in rows.items():
            contiguous = where[-1] - where[0] + 1 == len(where)
            index = slice(where[0], where[-1] + 1) if contiguous else torch.tensor(where, dtype=torch.long, device=device)
            groups.append((registry.slots[slot], index))
        return cls(groups, names, exact, stacked)

    def around(self, linear: Callable, layer: int) -> Callable:
        """`linear` (the step's projection call) with each row's adapter update added, for layer `layer`."""
        names = self.names[layer]
        if self.exact:
            return lambda x, weight: self.add_exact(linear(x, weight), x, layer, names[id(weight)], linear)
        widened: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # q/k/v (gate/up) share their input: widen it once

        def call(x: torch.Tensor, weight) -> torch.Tensor:
            seen = widened.get(id(x))
            if seen is None or seen[0] is not x:
                seen = widened[id(x)] = (x, x.float())
            return self.add(linear(x, weight), seen[1], layer, names[id(weight)])

        return call

    def add(self, out: torch.Tensor, x32: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """out[rows] += (x[rows] A^T) B^T for each adapter of the step that targets this projection, in float32."""
        for adapter, rows in self.groups:
            pair = adapter.tensors[layer].get(module)
            if pair is not None:
                _put(out, rows, F.linear(F.linear(_take(x32, rows), pair[0]), pair[1]))
        if self.stacked is not None:
            stack, rows, mask = self.stacked
            pair = stack.layers[layer].get(module)
            if pair is not None:
                out[rows] += F.linear(F.linear(x32[rows], pair[0]) * mask, pair[1])
        return out

    def add_exact(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str, linear: Callable) -> torch.Tensor:
        """The same through the step's linear call on the adapters' linears (batch-invariant mode)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(module)
            if pair is not None:
                _put(out, rows, linear(linear(_take(x, rows), pair[0]), pair[1]))
        return out
