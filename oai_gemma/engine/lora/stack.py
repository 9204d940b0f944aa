"""The resident adapters side by side: per projection one A of every adapter's rows stacked [sum of ranks, in] and
one B [out, sum of ranks], for decode rows of many adapters in one step.

Per adapter and projection a step of N adapters makes 2N small matmuls and N gathers and scatters (`LoraStep`'s
groups); with the stack it is two matmuls whatever N: shrink every decode row by every resident adapter, zero the
columns that are not its own adapter's (a per-step mask), expand. The extra multiplications are small at decode's
row counts (a few rows times the ranks). A sum that runs over other adapters' zeroed columns rounds in another
order than its own rank alone, so batch-invariant mode keeps the groups. An adapter that does not target a
projection has zero rows there; the stack is rebuilt (on the engine thread, at the next step) when the resident set
changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter import MODULES, AdapterLinears


@dataclass
class Stack:
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    """Per layer, per projection any resident adapter targets: (A stacked, B stacked), float32."""
    columns: dict[int, tuple[int, int]]
    """Slot -> its adapter's [start, end) columns of the shrunk rows."""
    width: int

    def mask(self, slots: list[int], device) -> torch.Tensor:
        """[rows, width]: 1 on each row's own adapter's columns (none for a base row), float32."""
        mask = torch.zeros(len(slots), self.width, device=device)
        for row, slot in enumerate(slots):
            if slot:
                start, end = self.columns[slot]
                mask[row, start:end] = 1
        return mask


def build_stack(slots: list[AdapterLinears | None], num_layers: int) -> Stack | None:
    """The stack of the resident adapters (`slots[s]`, None where free); None when none is resident."""
    resident = [(slot, adapter) for slot, adapter in enumerate(slots) if adapter is not None]
    if not resident:
        return None
    columns, width = {}, 0
    for slot, adapter in resident:
        columns[slot] = (width, width + adapter.rank)
        width += adapter.rank
    layers = []
    for layer in range(num_layers):
        stacked = {}
        for module in MODULES:
            present = [adapter.tensors[layer].get(module) for _, adapter in resident]
            sample = next((pair for pair in present if pair is not None), None)
            if sample is None:
                continue
            a_parts, b_parts = [], []
            for (_, adapter), pair in zip(resident, present):
                a, b = pair if pair is not None else (sample[0].new_zeros(0, sample[0].shape[1]), sample[1].new_zeros(sample[1].shape[0], 0))
                pad = adapter.rank - a.shape[0]  # ranks may differ per module (rank_pattern): pad to the adapter's width
                a_parts.append(torch.cat((a, a.new_zeros(pad, a.shape[1]))) if pad else a)
                b_parts.append(torch.cat((b, b.new_zeros(b.shape[0], pad)), dim=1) if pad else b)
            stacked[module] = (torch.cat(a_parts), torch.cat(b_parts, dim=1))
        layers.append(stacked)
    return Stack(layers, columns, width)
