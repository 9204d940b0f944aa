"""The low-rank updates of one step: each row's adapter, gathered (Punica's shrink/expand, in torch).

A step's tokens are grouped by their item's adapter slot; every projection then runs as before over all tokens,
and for each adapter in the step its rows get `expand(shrink(x[rows]))` added (A [r, in] then B [out, r], B
carrying the scale), in place, through the same linear call as the base (oneDNN-packed on a CPU; tiled in
batch-invariant mode, so a row's update does not depend on the rows beside it either). A row of the base model gets
nothing added, and a step where no row has an adapter does not come here at all (`LoraStep.of` is None): the
path without adapters is unchanged.

The projections are told apart by identity: engine/model/gemma3.py's layer functions call `linear(x, w.q)` etc.,
and `module_names` maps each of the runner's projection objects to its name once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .adapter import MODULES, AdapterLinears
from .stack import Stack

if TYPE_CHECKING:
    from .registry import LoraRegistry


def module_names(weights) -> list[dict[int, str]]:
    """Per layer, the identity of each projection (engine/model/gemma3.py's LayerWeights) -> its module name."""
    return [{id(getattr(w, module)): module for module in MODULES} for w in weights]


class LoraStep:
    """The adapters of one step's rows: `groups` [(adapter, its rows: a slice when contiguous, else an index tensor)],
    and, when decode rows of several adapters run outside batch-invariant mode, `stacked` (the resident adapters'
    stack, the decode rows' slice, their column mask: engine/lora/stack.py)."""

    def __init__(self, groups: list[tuple[AdapterLinears, slice | torch.Tensor]], names: list[dict[int, str]],
                 stacked: tuple[Stack, slice, torch.Tensor] | None = None):
        self.groups, self.names, self.stacked = groups, names, stacked

    @classmethod
    def of(cls, prefills: Sequence, decodes: Sequence, registry: LoraRegistry, names: list[dict[int, str]], device,
           dtype: torch.dtype, stackable: bool) -> LoraStep | None:
        """The step's adapters from its items (`StepItem.adapter`: a slot, 0 for the base), in packing order; None
        when no row has one. `stackable`: decode rows of two adapters or more may use the stack."""
        rows: dict[int, list[int]] = {}
        offset = 0
        for item in prefills:
            count = len(item.token_ids)
            if item.adapter:
                rows.setdefault(item.adapter, []).extend(range(offset, offset + count))
            offset += count
        decode_slots = [item.adapter or 0 for item in decodes for _ in item.token_ids]
        stacked = None
        if stackable and len(set(decode_slots) - {0}) > 1:
            stack = registry.stack()
            stacked = (stack, slice(offset, offset + len(decode_slots)), stack.mask(decode_slots, dtype, device))
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
        return cls(groups, names, stacked)

    def around(self, linear: Callable, layer: int) -> Callable:
        """`linear` (the step's projection call) with each row's adapter update added, for layer `layer`."""
        names = self.names[layer]

        def call(x: torch.Tensor, weight) -> torch.Tensor:
            return self.add(linear(x, weight), x, layer, names[id(weight)], linear)

        return call

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str, linear: Callable) -> torch.Tensor:
        """out[rows] += (x[rows] A^T) B^T for each adapter of the step that targets this projection."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(module)
            if pair is None:
                continue
            a, b = pair
            if isinstance(rows, slice):
                out[rows] += linear(linear(x[rows], a), b)
            else:
                out.index_add_(0, rows, linear(linear(x.index_select(0, rows), a), b))
        if self.stacked is not None:
            stack, rows, mask = self.stacked
            pair = stack.layers[layer].get(module)
            if pair is not None:
                out[rows] += linear(linear(x[rows], pair[0]) * mask, pair[1])
        return out
