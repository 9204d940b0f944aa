"""Weight-only quantized linear layers for the CPU (`model.quantization`: int8, int4).

A CPU decode step streams every weight once, so fewer bytes per weight is a faster single stream. These use
PyTorch's own CPU kernels: `torch._weight_int8pack_mm` (int8, one scale per output channel) and
`_weight_int4pack_mm_for_cpu` (int4 in groups of 32 along the input, a scale and a zero per group). Measured on
gemma-3-270m (docs/engine.md, "Weight-only quantized weights"): with bf16 activations the int4 lm_head is 3.4x
faster than packed bf16 at one row, but both kernels dequantize per call, so from 8 rows on they are slower
than oneDNN's packed bf16; with float32 activations they are slower at every size. Quality decides the int4
mix: every layer in int4 cost +41% perplexity (this model's GGUF keeps most tensors at 5-8 bits), the lm_head
alone in int4 with int8 projections +5.0%, so `int4` is that mix, as Q4_K_M keeps its sensitive tensors wider.

A CPU without bf16 computes in float32, and there both weight-only kernels are slower than packed float32 at
every size. There the project's own AVX2 kernel (engine/ops/native, `NativeInt8Linear`: int8 weights widened to
float32 in registers, float32 activations, so int8's quality) streams a quarter of the bytes: the projections
of a decode step at one row take 3.1 ms instead of 17.8 (docs/engine.md). fbgemm's int8 kernel
(`torch.ops.quantized.linear_dynamic`: activations quantized per call to 8 bits, one scale for the call) is
faster still on the 262k-row lm_head from a few rows on, but its results depend on the rows beside them and
it costs +0.8% perplexity (+23% on the projections: Gemma's activations have outliers). So in float32 `int8`
is the native kernel everywhere, and `int4` the native kernel on the projections with fbgemm's lm_head
(`ops/choice.py`); without the native kernel (no compiler, no AVX2) `int4` keeps packed float32 projections.
The layers keep the interface of engine/ops/linear.py's FrozenLinear (`__call__`, `packed`, `packed_bytes`).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.nn.functional as F

from ...cpu import TURNS
from . import native
from .native import woq_int8_linear

log = logging.getLogger("oai_gemma.engine")

INT4_GROUP = 32
"""Input columns per int4 scale/zero: the GGUF Q4_K sub-block size; 128 measured no faster (docs/engine.md)."""
DEQUANTIZE_FROM_ROWS = 32
"""From this many rows an int8 projection is dequantized for the call instead (measured: 512 rows of the
2048 x 640 gate, 8.3 ms through the int8 kernel, 1.1 ms dequantized; equal at 32)."""


KERNEL_ROWS = 128
"""Below this many rows `NativeInt8Linear` runs its kernel; from it on (a prefill chunk) the weight is dequantized
for the call and oneDNN multiplies (measured, 2048 x 640 gate: 64 rows 0.85 vs 1.37 ms, 128 rows 2.19 vs 1.66 ms
with AVX512's oneDNN; with AVX2's 2.05 vs 3.46 ms)."""
DEQUANTIZE_BYTES = 16 << 20
"""A prefill chunk dequantizes a weight in tiles of about this many bytes of float32 (the 1B's 262k-row lm_head whole
would be 1.2 GB; a 6912 x 1152 projection is 32 MB)."""
UNIT_MACS = 1 << 27
"""A load's call of a native quantized linear goes in spans of outputs of about this many multiply-adds (`in_units`:
2-9 ms of one core on the AVX2 EPYC; the longest of the 4B's warm-up calls, its 128-token gate and up, 0.12 s whole)."""
FORMAT = 2
"""The stored layout's version, part of the model cache's file name (2: float32 int8 as [N/8, K, 8])."""


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scale [N]): symmetric, one scale per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale


class QuantizedLinear:
    """What both layers share: their tensors (`FIELDS`, kept in the model cache) and the bytes they hold."""

    FIELDS: tuple[str, ...] = ()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]):
        linear = cls.__new__(cls)
        for name in cls.FIELDS:
            setattr(linear, name, tensors[name])
        return linear

    @property
    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def outputs(self, lo: int, hi: int):
        """This linear over its output channels lo..hi (multiples of its layout's group), its tensors views of these:
        every field's first dimension runs over the outputs (packed groups of them, or one scale each)."""
        n = output_count(self)
        return type(self).from_tensors({f: t[lo * t.shape[0] // n : hi * t.shape[0] // n] for f, t in self.tensors().items()})


def output_count(linear) -> int:
    """A native quantized linear's (or a fused group's whole's) output channels."""
    return linear.out_features if hasattr(linear, "out_features") else linear.scale.numel()


def in_units(linear: QuantizedLinear, x: torch.Tensor, call) -> torch.Tensor:
    """`call(linear, x)`; on a load's thread in its turn (cpu.Turns) while a step waits, over spans of the outputs of
    about UNIT_MACS multiply-adds, an offer before each: the 4B's 128-row gate and up call of its warm-up is 6.7G
    multiply-adds, a tenth of a second of one core that streaming models' steps would otherwise wait through whole
    (issue 41). Each output is its own sum over the row's inputs in the native layouts: the same bits either way. With
    no step waiting, one call (spans cost up to 1.5x a call in activation quantizing: a load alone pays nothing)."""
    if not (TURNS.loading and TURNS.waiting):
        return call(linear, x)
    n = output_count(linear)
    group = n // linear.packed.shape[0]
    span = max(group, UNIT_MACS // (x.shape[0] * x.shape[1]) // group * group)
    parts = []
    for lo in range(0, n, span):
        TURNS.offer()
        parts.append(call(linear.outputs(lo, min(n, lo + span)), x))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class RowsQuantized(QuantizedLinear):
    """An int8-per-output-channel linear, made from the weight's rows a chunk at a time (`from_rows`): each channel is
    quantized on its own, so the chunks give the whole weight's bits. `GROUP`: output channels its layout interleaves
    (the chunks are multiples of it); `pack`: int8 rows -> their part of `packed`; `finish`: the stored scale."""

    GROUP = 1

    @staticmethod
    def check(n: int, k: int) -> None:
        pass

    @staticmethod
    def pack(q: torch.Tensor) -> torch.Tensor:
        return q

    @staticmethod
    def finish(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scale

    def __init__(self, weight: torch.Tensor):
        linear = type(self).from_rows(tuple(weight.shape), lambda lo, hi: weight[lo:hi], weight.shape[0])
        self.__dict__.update(linear.__dict__)

    @classmethod
    def from_rows(cls, shape: tuple[int, int], rows, chunk: int):
        """From `rows(lo, hi)` (the weight's rows, in the model's dtype), `chunk` rows (a multiple of 16) at a time."""
        n, k = shape
        cls.check(n, k)
        packed, scale, dtype = None, torch.empty(n), None
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            part = rows(lo, hi)
            q, scale[lo:hi] = int8_per_channel(part)
            q = cls.pack(q)
            if packed is None:
                packed, dtype = torch.empty((n // cls.GROUP, *q.shape[1:]), dtype=torch.int8), part.dtype
            packed[lo // cls.GROUP : hi // cls.GROUP] = q
        return cls.from_tensors(dict(zip(cls.FIELDS, (packed, cls.finish(scale, dtype)))))


class Int8Linear(RowsQuantized):
    """Symmetric int8 per output channel."""

    FIELDS = ("packed", "scale")

    @staticmethod
    def finish(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scale.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= DEQUANTIZE_FROM_ROWS:  # a prefill chunk: the weight dequantized once beats the kernel
            return F.linear(x, self.packed.to(x.dtype) * self.scale[:, None])
        return torch._weight_int8pack_mm(x, self.packed, self.scale)


class Int4Linear(QuantizedLinear):
    """Asymmetric int4 in groups of INT4_GROUP input columns (min/max per group, 16 levels)."""

    FIELDS = ("packed", "scales_and_zeros")

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs input sizes divisible by {INT4_GROUP}; this layer has {k}")
        grouped = w.view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = grouped.amin(dim=2), grouped.amax(dim=2)
        scale = ((high - low) / 15).clamp(min=1e-8)
        levels = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        # the kernel computes (q - 8) * scale + zero per group: zero = low + 8 * scale
        self.scales_and_zeros = torch.stack((scale, low + 8 * scale), dim=2).transpose(0, 1).contiguous().to(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)


class NativeInt8Linear(RowsQuantized):
    """Symmetric int8 per output channel, float32 activations, through engine/ops/native/woq_int8.c (AVX2): the
    weight stored as [N/8, K, 8], eight output channels side by side per input column."""

    FIELDS = ("packed", "scale")
    GROUP = 8

    @staticmethod
    def check(n: int, k: int) -> None:
        if n % 8:
            raise ValueError(f"the native int8 kernel needs output sizes divisible by 8; this layer has {n}")

    @staticmethod
    def pack(q: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        return q.view(n // 8, 8, k).transpose(1, 2)

    def dequantized(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Output channels lo..hi (multiples of GROUP; all by default) in float32."""
        hi = self.scale.numel() if hi is None else hi
        return self.unpack(self.packed[lo // self.GROUP : hi // self.GROUP]).float() * self.scale[lo:hi, None]

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        groups, k, _ = packed.shape
        return packed.transpose(1, 2).reshape(groups * 8, k)

    def dequantized_call(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """A prefill chunk: dequantizing beats the kernel there, a tile of about DEQUANTIZE_BYTES of output channels
        at a time (one copy of each weight: the float32 tile is the only other, issue 37)."""
        x, n = x.float(), self.scale.numel()
        step = max(self.GROUP, DEQUANTIZE_BYTES // (4 * x.shape[1]) // self.GROUP * self.GROUP)
        parts = []
        for lo in range(0, n, step):
            TURNS.offer()  # a tile is a unit of a load's warm-up (cpu.Turns; a no-op on an engine's thread)
            parts.append(F.linear(x, self.dequantized(lo, min(n, lo + step))).to(out_dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] float32 or bf16 (widened in the kernel) -> [M, N] in `out_dtype` (float32 or bf16)."""
        if x.shape[0] >= KERNEL_ROWS:  # a prefill chunk: the weight dequantized beats the kernel
            return self.dequantized_call(x, out_dtype)
        return self.rowwise(x, out_dtype)

    def prefill(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Batch-invariant mode's call for a prompt chunk's rows (ops/invariance.py `by_role`): the dequantized
        matmul at any row count, whose rows are exact from 12 rows on (measured; the mode pads shorter chunks)."""
        return self.dequantized_call(x, out_dtype)

    @property
    def prefill_rowwise(self) -> bool:
        """Whether `rowwise` keeps up with the dequantized matmul on a prefill chunk: the AVX2 loop's panels do
        (woq_int8.c `run_panels`); the AVX512 loop has none yet, and bf16 CPUs' oneDNN (AMX) is far ahead of it."""
        return not (native.cpu_has_avx512() and self.packed.shape[1] % 2 == 0)

    def rowwise(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The kernel at any row count: each row's result is its own, bit for bit, whatever M (batch-invariant
        mode calls this instead of tiling; a prefill chunk then skips the dequantized matmul)."""
        return in_units(self, x.contiguous(), lambda part, rows: part.kernel(rows, out_dtype))

    def kernel(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows, k = x.shape
        n = self.scale.numel()
        y = torch.empty(rows, n, dtype=out_dtype)
        woq_int8_linear(k % 2 == 0)(x.data_ptr(), rows, k, self.packed.data_ptr(), self.scale.data_ptr(), n, y.data_ptr(),
                                    x.dtype == torch.bfloat16, out_dtype == torch.bfloat16)
        return y


class NativeQ8Linear(NativeInt8Linear):
    """The lm_head's int8 copy wherever the native kernel runs: the same int8 weights and scales laid out as [N/16,
    K/4, 16, 4], the activations quantized per block of 32 inputs in the kernel (llama.cpp's Q8_0), int8 x int8
    products (woq_int8.c `q8_linear`: VNNI's vpdpbusd, else AVX2's vpmaddubsw): a step of few rows no longer waits on widening 168M weights to float32
    (issue 27; measured in docs/engine.md, quality in its table). The projections keep float32 activations: their
    inputs have outliers that 8 bits do not hold (fbgemm's per-call scale: +23% perplexity there)."""

    GROUP = 16

    @staticmethod
    def check(n: int, k: int) -> None:
        if n % 16 or k % 32:
            raise ValueError(f"the int8 x int8 kernel needs N % 16 == 0 and K % 32 == 0; this layer is {n} x {k}")

    @staticmethod
    def pack(q: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        return q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3)

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        groups, quads, _, _ = packed.shape
        return packed.permute(0, 2, 1, 3).reshape(groups * 16, quads * 4)

    def kernel(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows, k = x.shape
        n = self.scale.numel()
        y = torch.empty(rows, n, dtype=out_dtype)
        native.q8_linear()(x.data_ptr(), rows, k, self.packed.data_ptr(), self.scale.data_ptr(), n, y.data_ptr(),
                           x.dtype == torch.bfloat16, out_dtype == torch.bfloat16, native.cpu_has_vnni())
        return y


class PerStepLinear:
    """`model.quantization = per-step` (bf16 CPUs): the int8 weight (native kernel) in the model's dtype, its one
    layout (issue 37: one copy of each weight). It used to sit beside a packed bf16 copy for steps of many rows
    (oneDNN AMX); now a step below `KERNEL_ROWS` rows runs the kernel (bf16 in and out in the kernel itself) and a
    prefill chunk dequantizes the weight for the call, as `int8` does. The int8 result is float32 for the lm_head
    (the sampler widens logits anyway), the model's dtype for the projections. Every row's result is its own
    (no second layout chosen by the step's row count), so batch-invariant mode has nothing to pin."""

    def __init__(self, few: NativeInt8Linear, cast: bool):
        self.few, self.cast = few, cast

    def pin(self) -> None:
        """Nothing to pin: one layout (kept for batch-invariant mode's callers)."""

    @property
    def packed(self):
        return self.few.packed

    @property
    def packed_bytes(self) -> int:
        return self.few.packed_bytes

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.few.tensors()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.few(x, x.dtype if self.cast else torch.float32)

    @property
    def prefill_rowwise(self) -> bool:
        return self.few.prefill_rowwise

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        return self.few.rowwise(x, x.dtype if self.cast else torch.float32)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        return self.few.prefill(x, x.dtype if self.cast else torch.float32)


class DynamicInt8Linear(RowsQuantized):
    """Symmetric int8 per output channel through fbgemm, activations quantized per call (float32 only)."""

    FIELDS = ("weight", "scale")

    @property
    def packed(self):
        """fbgemm's packed weight, built on first use (1.6 s for the 262k-row lm_head; it has no stored form),
        after which the plain int8 copy (what the model cache keeps) is let go."""
        if "_packed" not in self.__dict__:
            zeros = torch.zeros(self.weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensors are deprecated as a user type; fbgemm's op takes one
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(self.weight, self.scale.double(), zeros, 0)
            self._packed = torch.ops.quantized.linear_prepack(quantized, None)
            self._bytes = self.weight.numel() + 4 * self.scale.numel()
            self.weight = self.scale = None
        return self._packed

    @property
    def packed_bytes(self) -> int:
        _ = self.packed
        return self._bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, REDUCE_RANGE)


REDUCE_RANGE = not torch.cpu._is_vnni_supported() or os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper() in (
    "AVX2", "AVX512", "AVX512_256",
)
"""fbgemm's kernels without VNNI (AVX2; or forced with FBGEMM_ENABLE_INSTRUCTIONS) sum pairs of u8 x s8 products
in saturating int16: activations then take 7 bits, as PyTorch's dynamic quantization does there (measured: +2.0%
perplexity on the lm_head instead of +0.8%)."""
