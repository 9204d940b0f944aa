"""The low-rank updates of one step: each row's adapter, gathered (Punica's shrink/expand, in torch).

Every projection runs as before over all the step's tokens; then each adapter of the step adds
`expand(shrink(x[rows]))` to its rows (A [r, in], then B [out, r] carrying the scale), in place. A row of the base
model gets nothing added, and a step where no row has an adapter does not come here at all (`LoraStep.of` is None):
the path without adapters is unchanged.

Two ways to compute it. In batch-invariant mode the update goes through the step's own linear call on the adapter's
linears in the model's dtype (oneDNN-packed and tiled as the base's are), so a row's result does not depend on the
rows beside it either. Otherwise each part of the step (a prefill chunk, the decode rows) goes through a stack
(engine/lora/stack.py): its adapter's own, or the resident adapters' with a per-step column mask when the decode rows
are on several; a group of projections that share their input (q/k/v, gate/up) is shrunk once, then each projection
expanded. A part of fewer than `FEW_ROWS` rows computes in float32 (MKL's small matmuls: a few us a call, against
15-40 us for oneDNN's), rounded once into a bf16 output; a larger one in the model's dtype (bf16: AMX, the shrink
oneDNN-packed, the expand added in place by `addmm_`); measured in docs/engine.md (LoRA row of the file table).

The projections are told apart by identity: engine/model/gemma3.py's layer functions call `linear(x, w.q)` etc.,
and `module_names` maps each of the runner's projection objects to its name once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .adapter import MODULES, AdapterLinears
from .stack import GROUPS, OWN, Group, Stack, native_kernels, runs_native, step_dtype

if TYPE_CHECKING:
    from .registry import ResidentAdapters

Rows = slice | torch.Tensor
"""A step's rows: a slice when contiguous, else an index tensor."""


def module_names(weights) -> list[dict[int, str]]:
    """Per layer, the identity of each projection (engine/model/gemma3.py's LayerWeights) -> its module name."""
    return [{id(getattr(w, module)): module for module in MODULES} for w in weights]


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


class NativeRows:
    """A part's rows for the native kernel (engine/ops/native/lora.c `lora_project`'s `rows` array): their count,
    each row's columns [start, end) of its stack's blocks (none for a base row), the rows grouped by adapter
    (`order`), the shrink's buffer, the model's dtype (of the activations and the stack alike), the ISA."""

    def __init__(self, slots: list[int], stack: Stack, dtype: torch.dtype, device, avx512: bool):
        if stack.dtype != dtype or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native LoRA kernel reads a stack in the model's dtype, float32 or bfloat16: got a "
                             f"{stack.dtype} stack for a {dtype} model")
        columns = [stack.columns[slot] if slot else (0, 0) for slot in slots]
        order = sorted(range(len(slots)), key=lambda row: columns[row])
        self.rows = torch.tensor([[c[0] for c in columns], [c[1] for c in columns], order], dtype=torch.int32, device=device)
        self.shrunk = torch.empty(len(slots), len(GROUPS[0]) * stack.width, dtype=torch.float32, device=device)
        self.dtype = dtype
        self.args = torch.tensor([len(slots), *(row.data_ptr() for row in self.rows), self.shrunk.data_ptr(), dtype == torch.bfloat16,
                                  avx512], dtype=torch.int64)
        self.pointer = self.args.data_ptr()


Part = tuple[Stack, Rows, "torch.Tensor | None", "NativeRows | None"]
"""A stack, its rows, their column mask (torch's path: None when every row is on the stack's one adapter) or the
native kernel's rows (None: torch's path)."""


class LoraStep:
    """The adapters of one step's rows. Outside batch-invariant mode: `parts` [Part]: each prefill chunk on its
    adapter's own stack, the decode rows on their one adapter's (masked where base rows sit beside them) or on the
    resident adapters' stack; a part of few rows through the native kernel (NATIVE_ROWS) where it runs. In
    batch-invariant mode: `groups` [(adapter, its rows)]."""

    def __init__(self, names: list[dict[int, str]], parts: list[Part] = (), groups: list[tuple[AdapterLinears, Rows]] = (),
                 kernel=None):
        self.names, self.parts, self.groups, self.kernel = names, parts, groups, kernel

    @classmethod
    def of(cls, prefills: Sequence, decodes: Sequence, registry: ResidentAdapters, names: list[dict[int, str]], device,
           exact: bool) -> LoraStep | None:
        """The step's adapters from its items (`StepItem.adapter`: a slot, 0 for the base), in packing order; None
        when no row has one. `exact`: batch-invariant mode."""
        slots = [item.adapter or 0 for item in (*prefills, *decodes) for _ in item.token_ids]
        if not any(slots):
            return None
        if exact:
            return cls(names, groups=[(registry.slots[slot], _rows(where, device)) for slot, where in _by_slot(slots).items()])
        parts, offset, kernels = [], 0, native_kernels(device, registry.dtype)

        def native_rows(slots: list[int], stack: Stack) -> NativeRows:
            return NativeRows(slots, stack, registry.dtype, device, kernels[1])

        for item in prefills:
            count = len(item.token_ids)
            if item.adapter:
                stack = registry.slots[item.adapter].stacks[step_dtype(registry.dtype, device, count)]
                native = native_rows([OWN] * count, stack) if runs_native(registry.dtype, device, count) else None
                parts.append((stack, slice(offset, offset + count), None, native))
            offset += count
        decode, rows = slots[offset:], slice(offset, len(slots))
        adapters, dtype = set(decode) - {0}, step_dtype(registry.dtype, device, len(decode))
        if adapters:
            if len(adapters) == 1:  # one adapter's rows, maybe beside base rows: its own stack (its columns are OWN's)
                stack, decode = registry.slots[adapters.pop()].stacks[dtype], [OWN if slot else 0 for slot in decode]
            else:
                stack = registry.stack(dtype)
            if runs_native(registry.dtype, device, len(decode)):
                parts.append((stack, rows, None, native_rows(decode, stack)))
            else:  # a mask unless every row is on the stack's one adapter
                parts.append((stack, rows, None if set(decode) == {OWN} else stack.mask(decode, device), None))
        return cls(names, parts, kernel=kernels and kernels[0])

    def around(self, linear: Callable, layer: int) -> Callable:
        """`linear` (the step's projection call) with each row's adapter update added, for layer `layer`."""
        names = self.names[layer]
        if self.groups:
            return lambda x, weight: self.add_exact(linear(x, weight), x, layer, names[id(weight)], linear)
        shrunk: dict[tuple[int, Group], tuple[torch.Tensor, torch.Tensor]] = {}  # a group's shrink, by part

        def call(x: torch.Tensor, weight) -> torch.Tensor:
            out, module = linear(x, weight), names[id(weight)]
            whole = len(self.parts) == 1 and self.parts[0][1].stop - self.parts[0][1].start == x.shape[0]  # no slicing
            for index, (stack, rows, mask, native) in enumerate(self.parts):
                group = stack.layers[layer].get(module)
                if group is None:
                    continue
                seen = shrunk.get((index, group))
                first = seen is None or seen[0] is not x  # the group's first projection: shrink once for all of them
                if native is not None:
                    if first:
                        shrunk[(index, group)] = (x, None)
                    self.project_native(x, out, rows, whole, native, group.native[module][0], first)
                    continue
                if first:
                    seen = shrunk[(index, group)] = (x, self.shrink(x if whole else x[rows], group, stack, mask))
                columns, b_t = group.expand[module]
                into = out if whole else out[rows]
                if into.dtype == b_t.dtype:
                    into.addmm_(seen[1][:, columns], b_t)
                else:  # few rows of a bf16 model, in float32: rounded once, here
                    into.add_(torch.mm(seen[1][:, columns], b_t))
            return out

        return call

    @staticmethod
    def shrink(x: torch.Tensor, group: Group, stack: Stack, mask: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] -> [rows, blocks x width]: every projection of the group's shrink, each row's other adapters'
        columns zeroed by `mask`."""
        s = group.shrink(x.to(stack.dtype))
        if mask is not None:
            s.view(s.shape[0], -1, stack.width).mul_(mask)
        return s

    def project_native(self, x: torch.Tensor, out: torch.Tensor, rows: slice, whole: bool, native: NativeRows, weights: int,
                       first: bool) -> None:
        """out[rows] += each row's update by the native kernel, in place (shrinking x[rows] first if `first`)."""
        if not (x.is_contiguous() and out.is_contiguous() and x.dtype == out.dtype == native.dtype):
            raise ValueError(f"the native LoRA kernel reads and writes contiguous {native.dtype} rows, not {x.dtype} {x.stride()} -> "
                             f"{out.dtype} {out.stride()}")
        offset = 0 if whole else rows.start
        self.kernel(native.pointer, weights, x.data_ptr() + offset * x.shape[1] * x.element_size(),
                    out.data_ptr() + offset * out.shape[1] * out.element_size(), first)

    def add_exact(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str, linear: Callable) -> torch.Tensor:
        """out[rows] += (x[rows] A^T) B^T for each adapter of the step that targets this projection, through the step's
        linear call on the adapters' linears (batch-invariant mode)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(module)
            if pair is not None:
                delta = linear(linear(_take(x, rows), pair[0]), pair[1])
                if isinstance(rows, slice):
                    out[rows] += delta
                else:
                    out.index_add_(0, rows, delta.to(out.dtype))
        return out


def _by_slot(slots: list[int]) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot:
            rows.setdefault(slot, []).append(row)
    return rows


def _rows(where: list[int], device) -> Rows:
    contiguous = where[-1] - where[0] + 1 == len(where)
    return slice(where[0], where[-1] + 1) if contiguous else torch.tensor(where, dtype=torch.long, device=device)
