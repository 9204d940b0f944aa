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
(`linear_for`); without the native kernel (no compiler, no AVX2) `int4` keeps packed float32 projections.
The layers keep the interface of engine/linear.py's FrozenLinear (`__call__`, `packed`, `packed_bytes`).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native
from ...progress import Phase
from .native import native_unavailable, woq_int8_linear

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


class Int8Linear(QuantizedLinear):
    """Symmetric int8 per output channel."""

    FIELDS = ("packed", "scale")

    def __init__(self, weight: torch.Tensor):
        self.packed, scale = int8_per_channel(weight)
        self.scale = scale.to(weight.dtype)

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


class NativeInt8Linear(QuantizedLinear):
    """Symmetric int8 per output channel, float32 activations, through engine/ops/native/woq_int8.c (AVX2): the
    weight stored as [N/8, K, 8], eight output channels side by side per input column."""

    FIELDS = ("packed", "scale")

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        if n % 8:
            raise ValueError(f"the native int8 kernel needs output sizes divisible by 8; this layer has {n}")
        q, self.scale = int8_per_channel(weight)
        self.packed = q.view(n // 8, 8, k).transpose(1, 2).contiguous()

    def dequantized(self) -> torch.Tensor:
        groups, k, _ = self.packed.shape
        return self.packed.transpose(1, 2).reshape(groups * 8, k).float() * self.scale[:, None]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] float32 or bf16 (widened in the kernel) -> [M, N] in `out_dtype` (float32 or bf16)."""
        if x.shape[0] >= KERNEL_ROWS:  # a prefill chunk: the weight dequantized once beats the kernel
            return F.linear(x.float(), self.dequantized()).to(out_dtype)
        x = x.contiguous()
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

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        if n % 16 or k % 32:
            raise ValueError(f"the int8 x int8 kernel needs N % 16 == 0 and K % 32 == 0; this layer is {n} x {k}")
        q, self.scale = int8_per_channel(weight)
        self.packed = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()

    def dequantized(self) -> torch.Tensor:
        groups, quads, _, _ = self.packed.shape
        return self.packed.permute(0, 2, 1, 3).reshape(groups * 16, quads * 4).float() * self.scale[:, None]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if x.shape[0] >= KERNEL_ROWS:
            return F.linear(x.float(), self.dequantized()).to(out_dtype)
        x = x.contiguous()
        rows, k = x.shape
        n = self.scale.numel()
        y = torch.empty(rows, n, dtype=out_dtype)
        native.q8_linear()(x.data_ptr(), rows, k, self.packed.data_ptr(), self.scale.data_ptr(), n, y.data_ptr(),
                           x.dtype == torch.bfloat16, out_dtype == torch.bfloat16, native.cpu_has_vnni())
        return y


DOT_BLOCK = 32
"""Input columns per activation scale (both integer dot-product layouts) and per 4-bit weight scale (`Q4Linear`)."""
DOT_TILES = {"q8": ((1, 4), (2, 4)), "q4": ((1, 4), (4, 3))}
"""Register tiles of int_dot.c (rows of x, groups of 8 outputs) for one row and for several (measured on the AVX2
EPYC, one thread, the 6912 x 1152 gate, nine tiles each: the fastest at 8 and 32 rows or within 3% of it)."""


def _check_dot_input(x: torch.Tensor, k: int) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16):  # the kernel would read other bytes as float32
        raise ValueError(f"the integer dot-product kernels take float32 or bfloat16 rows, not {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected rows of {k} inputs, got {tuple(x.shape)}")


class _DotLinear(QuantizedLinear):
    """What `Q8Linear` and `Q4Linear` share: rows of float32 or bf16 in, their activations quantized per row and
    block of 32 inputs inside the kernel (one float scale a block, GGUF's Q8_0), integer dot products (AVX2
    vpmaddubsw + vpmaddwd; int_dot.c). A row's result depends only on that row, bit for bit (its own scales, exact
    integer sums, one order of float steps). From KERNEL_ROWS rows (a prefill chunk) the weight is dequantized for
    the call and oneDNN multiplies the float activations instead."""

    FIELDS = ("packed", "scale")
    KIND = ""

    @staticmethod
    def _check_shape(n: int, k: int) -> None:
        if n % 8 or k % DOT_BLOCK:
            raise ValueError(f"the integer dot-product kernels need N % 8 == 0 and K % {DOT_BLOCK} == 0; this layer is {n} x {k}")

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] float32 or bf16 -> [M, N] in `out_dtype` (default: x's dtype; float32 or bf16)."""
        out_dtype = out_dtype or x.dtype
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the integer dot-product kernels write float32 or bfloat16, not {out_dtype}")
        if x.shape[0] >= KERNEL_ROWS:
            return F.linear(x.float(), self.dequantized()).to(out_dtype)
        k = self.in_features
        _check_dot_input(x, k)
        x = x.contiguous()
        rows = x.shape[0]
        n = self.out_features
        y = torch.empty(rows, n, dtype=out_dtype)
        tile_rows, tile_groups = DOT_TILES[self.KIND][rows > 1]
        kernel = native.q4_dot_linear() if self.KIND == "q4" else native.q8_dot_linear()
        kernel(x.data_ptr(), rows, k, self.packed.data_ptr(), self.scale.data_ptr(), n, y.data_ptr(),
               x.dtype == torch.bfloat16, out_dtype == torch.bfloat16, tile_rows, tile_groups)
        return y


class Q8Linear(_DotLinear):
    """`model.quantization = q8`: symmetric int8 weights per output channel (int8's), laid out [N/8, K/4, 8, 4]
    (one 32-byte load is four input columns of eight outputs), times int8 activations (`_DotLinear`)."""

    KIND = "q8"

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        self._check_shape(n, k)
        q, self.scale = int8_per_channel(weight)
        self.packed = q.view(n // 8, 8, k // 4, 4).permute(0, 2, 1, 3).contiguous()

    @property
    def out_features(self) -> int:
        return self.scale.numel()

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 4

    def dequantized(self) -> torch.Tensor:
        groups, quads, _, _ = self.packed.shape
        return self.packed.permute(0, 2, 1, 3).reshape(groups * 8, quads * 4).float() * self.scale[:, None]


def q4_blocks(weight: torch.Tensor, steps: range = range(-9, 10)) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (levels uint8 [N, K/32, 32] in 0..15, standing for (level - 8) * scale; scale float16
    [N, K/32]): GGUF's Q4_0, its scale chosen per block by least squares among a few roundings (llama.cpp's
    make_qx_quants): for each candidate inverse scale -(8 + step / 10) / m (m the block's value of largest
    magnitude) the levels are clamp(round(w * iscale), -8, 7) and their best scale <w, l> / <l, l>; the one of least
    squared error is kept (a third less error than m / -8 alone on gemma-3-270m's projections)."""
    w = weight.detach().float()
    n, k = w.shape
    levels = torch.empty(n, k // DOT_BLOCK, DOT_BLOCK, dtype=torch.uint8)
    scales = torch.empty(n, k // DOT_BLOCK, dtype=torch.float16)
    for start in range(0, n, 4096):  # bounded temporaries on the 262k-row lm_head
        blocks = w[start : start + 4096].reshape(-1, k // DOT_BLOCK, DOT_BLOCK)
        m = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True)).squeeze(2)
        m = torch.where(m != 0, m, torch.ones_like(m))
        best_err = best_l = best_d = None
        for step in steps:
            lv = torch.clamp(torch.round(blocks * (-(8 + 0.1 * step) / m)[..., None]), -8, 7)
            d = ((blocks * lv).sum(2) / (lv * lv).sum(2).clamp(min=1)).half()
            err = ((blocks - d.float()[..., None] * lv) ** 2).sum(2)
            if best_err is None:
                best_err, best_l, best_d = err, lv, d
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_l = torch.where(better[..., None], lv, best_l)
                best_d = torch.where(better, d, best_d)
        levels[start : start + 4096] = (best_l + 8).to(torch.uint8)
        scales[start : start + 4096] = best_d
    return levels, scales


class Q4Linear(_DotLinear):
    """`model.quantization = q4`'s projections: 4-bit weights in blocks of 32 inputs, a float16 scale a block
    (GGUF's Q4_0: 4.5 bits a weight, `q4_blocks`), times int8 activations (`_DotLinear`). Stored as `packed` uint8
    [N/8, K/32, 128] (a block of eight outputs: four 32-byte rows, byte j of row r holding the [8 outputs][4
    inputs] quads 2r in its low nibble and 2r + 1 in its high one) and `scale` float16 [N/8, K/32, 8]."""

    KIND = "q4"

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        self._check_shape(n, k)
        levels, scales = q4_blocks(weight)
        quads = levels.view(n // 8, 8, k // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 8, k // 32, 4, 2, 32)
        self.packed = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).reshape(n // 8, k // 32, 128).contiguous()
        self.scale = scales.view(n // 8, 8, k // 32).permute(0, 2, 1).contiguous()

    @property
    def out_features(self) -> int:
        return self.packed.shape[0] * 8

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * DOT_BLOCK

    def dequantized(self) -> torch.Tensor:
        groups, blocks, _ = self.packed.shape
        rows = self.packed.view(groups, blocks, 4, 1, 32)
        levels = torch.cat([rows & 15, rows >> 4], dim=3).view(groups, blocks, 8, 8, 4).permute(0, 3, 1, 2, 4)
        levels = levels.reshape(groups * 8, blocks, DOT_BLOCK).float() - 8
        scale = self.scale.permute(0, 2, 1).reshape(groups * 8, blocks, 1).float()
        return (levels * scale).view(groups * 8, blocks * DOT_BLOCK)


PER_STEP_ROWS = {"AVX512": 8, "AVX2": 4}
"""`per-step`: calls of fewer rows than this (by the native kernel's instruction set) go through the int8 kernel,
the others through packed bf16 (busy-machine medians, 2026-12-05, benchmarks/weight_only_kernels.py --step
--lm-head: the 262k-row lm_head at 1 / 4 / 8 rows 19.4 / 23.9 / 32.1 ms with the AVX512 variant, 22.4 / 27.8 /
43.9 with AVX2's, 39.5 / 36.1 / 33.5 packed bf16 with AMX; docs/engine.md)."""


class PerStepLinear:
    """One weight in two layouts, the one used chosen per call by its row count (`model.quantization =
    per-step`): a step of few rows reads every weight once, so the int8 copy (a quarter of float32's bytes,
    native kernel) is faster; a step of many rows computes, and oneDNN's packed bf16 (AMX) is. Each call's
    rows go through one layout, so a row's result depends on how many rows share its step (batch-invariant
    mode pins the packed layout: `pin`). The int8 result is float32 for the lm_head (the sampler widens
    logits anyway), the model's dtype for the projections."""

    def __init__(self, few: NativeInt8Linear, many, cast: bool):
        self.few, self.many, self.cast = few, many, cast
        self.rows = PER_STEP_ROWS["AVX512" if native.cpu_has_avx512() else "AVX2"]

    def pin(self) -> None:
        """Every call through the packed layout (batch-invariant mode)."""
        self.rows = 0

    @property
    def packed(self):
        return self.many.packed

    @property
    def packed_bytes(self) -> int:
        return self.few.packed_bytes + self.many.packed_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.rows:
            return self.many(x)
        return self.few(x, x.dtype if self.cast else torch.float32)  # bf16 in and out in the kernel itself


class DynamicInt8Linear(QuantizedLinear):
    """Symmetric int8 per output channel through fbgemm, activations quantized per call (float32 only)."""

    FIELDS = ("weight", "scale")

    def __init__(self, weight: torch.Tensor):
        self.weight, self.scale = int8_per_channel(weight)

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


def resolve(quantization: str, dtype: torch.dtype, device: torch.device) -> str:
    """`model.quantization` = `auto` where the native kernel runs on a CPU: `int8` where the CPU computes in float32
    (faster at 1, 8 and 32 streams, +0.5% perplexity; docs/engine.md), `per-step` where it computes in bf16 (the
    int8 copy for steps of few rows, packed bf16 for the others); else none (a GPU has no quantized path)."""
    if quantization != "auto":
        return quantization
    if device.type != "cpu" or native_unavailable() is not None:
        return "none"
    return "int8" if dtype == torch.float32 else "per-step" if dtype == torch.bfloat16 else "none"


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


def quantize_all(weights: dict[str, torch.Tensor], quantization: str, cache_file: Path | None) -> dict[str, object]:
    """{name: weight} -> {name: quantized linear}, for every weight that `linear_for` quantizes. Quantizing the
    262k-row lm_head to int4 takes ~5 s, so the result is kept in `cache_file` (safetensors) and read back on later
    starts, as the GGUF conversion is."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    classes = {name: linear_for(quantization, name, weight.dtype) for name, weight in weights.items()}
    weights = {name: weight for name, weight in weights.items() if classes[name] is not None}
    if cache_file is not None and cache_file.exists():
        stored = load_file(str(cache_file))
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in stored.items():
            name, part = key.rsplit(".", 1)
            grouped.setdefault(name, {})[part] = tensor.clone()  # aligned: the kernels crash on the file's offsets
        if set(grouped) == set(weights):
            return {name: classes[name].from_tensors(grouped[name]) for name in weights}
    with Phase(log, f"quantizing the weights to {quantization} (once: kept in the model cache)") as phase:
        linears = {name: classes[name](weight) for name, weight in phase.track(weights.items(), len(weights))}
    if cache_file is not None:
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        stored = {f"{name}.{part}": t.contiguous() for name, linear in linears.items() for part, t in linear.tensors().items()}
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            save_file(stored, str(partial))
            partial.replace(cache_file)  # atomic: a concurrent start reads a whole file or none
        except (OSError, SafetensorError) as exc:  # a read-only cache (a container's read-only root): every start quantizes
            log.warning("could not keep the quantized weights in %s (%s): each start quantizes them again", cache_file, exc)
    return linears
