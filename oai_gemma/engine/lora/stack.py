"""Adapters side by side, per layer and per group of projections that share their input: one shrink of every
adapter's A for the whole group ([in] -> [projections x sum of ranks]) and per projection one B^T ([sum of ranks, out]).

A stack of one adapter is how it runs on its own rows (`AdapterLinears.stacks`, one per compute dtype); the stack of
the resident adapters (`LoraRegistry.stack`) runs decode rows of several adapters in one step: shrink every row by
every resident adapter, zero the columns that are not its own adapter's (a per-step mask), expand. Either way a group
is one shrink for its projections (q/k/v: one matmul instead of three, gate/up one instead of two) and each
projection one expand. The resident stack multiplies by every adapter's columns (eight times a row's own at eight
adapters of one rank), which AMX absorbs at decode's row counts better than a call per adapter would. A sum that runs
over other adapters' zeroed columns rounds in another order than its own rank alone, so batch-invariant mode keeps
its own path (engine/lora/apply.py). An adapter that does not target a projection has zero rows there; the resident
stack is rebuilt (on the engine thread, at the next step) when the resident set changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import native
from ..ops.linear import FrozenLinear

GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
"""The projections that take the same input in engine/model/gemma3.py's layer functions, in call order."""
OWN = 1
"""The slot an adapter's own stack files its columns under (it is built before the adapter has a slot)."""
FEW_ROWS = 8
"""Without the native kernel, a CPU step's rows below this compute the update in float32 whatever the model's dtype:
MKL's small float32 matmuls cost a few us a call, a bf16 one through oneDNN 15-40 us (measured on the 2-core Xeon);
from here bf16 (AMX) wins on the multiplications (the resident stack's are eight times its rows' own at eight
adapters)."""
NATIVE_ROWS = 64
"""A CPU step's part of at most this many rows runs the native kernel (engine/ops/native/lora.c), where it runs."""


def native_kernels(device: torch.device, dtype: torch.dtype):
    """The native kernel's (lora_project, avx512) for a model of `dtype` on `device`, or None (not a CPU, another
    dtype than float32 and bf16, or no kernel here)."""
    return native.lora_kernels() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None


class Matmul:
    """x -> x W^T in float32 through `torch.mm` on W^T kept contiguous: MKL's small matmuls cost a few us a call at
    a few rows, where F.linear's transpose and dispatch (or a packed oneDNN call, ~15 us) would add as much again."""

    def __init__(self, weight: torch.Tensor):
        self.weight_t = weight.T.contiguous()
        self.nbytes = self.weight_t.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight_t)


def linear(weight: torch.Tensor):
    """`weight` [out, in] as a call x -> x W^T: float32 as a `Matmul`, bf16 oneDNN-packed (FrozenLinear: AMX with no
    reorder of the weight per call, which read and wrote it again each time)."""
    if weight.dtype == torch.float32:
        return Matmul(weight)
    frozen = FrozenLinear(weight)
    frozen.nbytes = frozen.packed_bytes or weight.nbytes
    return frozen


@dataclass(eq=False)
class Group:
    """One layer's shrink for the projections of a group that any adapter of the stack targets."""

    shrink: Matmul | FrozenLinear
    """x [rows, in] -> [rows, len(expand) x width]: each projection's shrink (every adapter's A), side by side."""
    expand: dict[str, tuple[slice, torch.Tensor]]
    """Projection -> (its block of the shrunk columns, B^T [width, out]): added into the projection's output by
    `addmm_` (one oneDNN call with its sum post-op in bf16: a separate add of a prefill chunk's [rows, out] cost as
    much as the matmul) or, from float32 into a bf16 output, by `torch.mm` and `add_`."""
    a: torch.Tensor | None = None
    """The same weights as they are ([len(expand) x width, in], the stack's dtype): the native kernel's (None where it
    does not run)."""
    native: dict[str, tuple[int, torch.Tensor]] | None = None
    """Projection -> the native kernel's `weights` array for it (engine/ops/native/lora.c `lora_project`) and its
    address."""


@dataclass
class Stack:
    layers: list[dict[str, Group]]
    """Per layer, each projection an adapter of the stack targets -> its group."""
    columns: dict[int, tuple[int, int]]
    """Slot -> its adapter's [start, end) columns of a projection's shrunk block."""
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        groups = {id(group): group for layer in self.layers for group in layer.values()}.values()
        return sum(group.shrink.nbytes + (0 if group.a is None else group.a.nbytes) + sum(b_t.nbytes for _, b_t in group.expand.values())
                   for group in groups)

    def mask(self, slots: list[int], device) -> torch.Tensor:
        """[rows, 1, width]: 1 on each row's own adapter's columns (none for a base row), for every block of a group."""
        mask = torch.zeros(len(slots), 1, self.width, device=device, dtype=self.dtype)
        for row, slot in enumerate(slots):
            if slot:
                start, end = self.columns[slot]
                mask[row, :, start:end] = 1
        return mask


def compute_dtypes(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes a model of `dtype` computes adapters in: its own, and float32 for a CPU step's few rows."""
    return tuple(dict.fromkeys((dtype, torch.float32))) if native_kernels(device, dtype) is None and device.type == "cpu" else (dtype,)


def step_dtype(dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
    """The dtype a model of `dtype` computes `rows` rows' update in (FEW_ROWS; the native kernel reads the model's)."""
    return torch.float32 if device.type == "cpu" and rows < FEW_ROWS and native_kernels(device, dtype) is None else dtype


def runs_native(dtype: torch.dtype, device: torch.device, rows: int) -> bool:
    """Whether a step's part of `rows` rows of a model of `dtype` runs the native kernel (NATIVE_ROWS)."""
    return rows <= NATIVE_ROWS and native_kernels(device, dtype) is not None


def build_stack(adapters: dict[int, tuple[int, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]], num_layers: int,
                dtype: torch.dtype) -> Stack | None:
    """The stack of `adapters` (slot -> (rank, per layer its projections' (A [r, in], B [out, r]))) in `dtype`; None
    if empty."""
    if not adapters:
        return None
    columns, width = {}, 0
    for slot, (rank, _) in adapters.items():
        columns[slot] = (width, width + rank)
        width += rank
    layers = []
    for layer in range(num_layers):
        groups = {}
        for modules in GROUPS:
            parts = {module: _parts(adapters, layer, module) for module in modules
                     if any(module in tensors[layer] for _, tensors in adapters.values())}
            if parts:
                a_cat = torch.cat([a for pairs in parts.values() for a, _ in pairs]).to(dtype)
                shrink = linear(a_cat)
                expand = {module: (slice(i * width, (i + 1) * width), torch.cat([b for _, b in pairs], dim=1).to(dtype).T.contiguous())
                          for i, (module, pairs) in enumerate(parts.items())}
                group = Group(shrink, expand)
                if native_kernels(a_cat.device, dtype) is not None:
                    group.a, group.native = a_cat, {module: _native_weights(a_cat, width, column.start, b_t) for module, (column, b_t) in expand.items()}
                groups.update(dict.fromkeys(parts, group))
        layers.append(groups)
    return Stack(layers, columns, width, dtype)


def _native_weights(a: torch.Tensor, width: int, column: int, b_t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """lora.c's `weights` array: {A, K, width, blocks, B^T, N, its first column} and its address."""
    weights = torch.tensor([a.data_ptr(), a.shape[1], width, a.shape[0] // width, b_t.data_ptr(), b_t.shape[1], column],
                           dtype=torch.int64)
    return weights.data_ptr(), weights


def _parts(adapters, layer: int, module: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each adapter's (A, B) of a projection padded to the adapter's rank (ranks may differ per module:
    rank_pattern), empty where it does not target the projection."""
    like_a, like_b = next(tensors[layer][module] for _, tensors in adapters.values() if module in tensors[layer])
    parts = []
    for rank, tensors in adapters.values():
        a, b = tensors[layer].get(module, (like_a[:0], like_b[:, :0]))
        pad = rank - a.shape[0]
        parts.append((F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))) if pad else (a, b))
    return parts
