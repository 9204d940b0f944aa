"""The integer dot-product layouts (`model.quantization` q8, q4; engine/ops/native/int_dot.c): activations
quantized per row and block of 32 inside the kernel, so a row's result depends on that row alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .quantized import KERNEL_ROWS, QuantizedLinear, in_units, int8_per_channel


DOT_BLOCK = 32
"""Input columns per activation scale (both integer dot-product layouts) and per 4-bit weight scale and min (`Q4Linear`)."""
DOT_TILES = {"q8": ((1, 4), (2, 4)), "q4": ((1, 4), (4, 3)), "q5": ((1, 4), (4, 2))}
"""Register tiles of int_dot.c (rows of x, groups of 8 outputs) for one row and for several (measured on the AVX2
EPYC, one thread, the 6912 x 1152 gate, nine tiles each: the fastest at 8 and 32 rows or within 3% of it; q5 at
8 rows of a 2048 x 1152 weight, seven tiles: (4, 2) the fastest, (4, 3) within 3%). An AVX512-VNNI build takes
its own 512-bit tile for several rows (int_dot.c's `WIDE`: 4 rows x 3 pairs of groups, measured on an AVX512 EPYC,
4B shapes, 64 and 512 rows, seven shapes: the fastest or within 2%)."""


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
    prefill_rowwise = True
    """`rowwise` keeps up with the dequantized matmul on a prefill chunk (integer products: the AVX2 EPYC)."""

    @staticmethod
    def _check_shape(n: int, k: int) -> None:
        if n % 8 or k % DOT_BLOCK:
            raise ValueError(f"the integer dot-product kernels need N % 8 == 0 and K % {DOT_BLOCK} == 0; this layer is {n} x {k}")

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def from_rows(cls, shape: tuple[int, int], rows, chunk: int):
        """From `rows(lo, hi)`, `chunk` rows (a multiple of 8) at a time: each group of eight outputs is quantized and
        laid out on its own, so the chunks give the whole weight's bits with one chunk of float at a time (the 4B's
        262k-row lm_head whole in float32 would be 2.7 GB)."""
        n, k = shape
        cls._check_shape(n, k)
        whole = {}
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            for name, t in cls(rows(lo, hi)).tensors().items():
                per = (hi - lo) // t.shape[0]  # rows one entry of the field stands for: 1 (a scale) or 8 (packed)
                if name not in whole:
                    whole[name] = torch.empty((n // per, *t.shape[1:]), dtype=t.dtype)
                whole[name][lo // per : hi // per] = t
        return cls.from_tensors(whole)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] float32 or bf16 -> [M, N] in `out_dtype` (default: x's dtype; float32 or bf16)."""
        out_dtype = out_dtype or x.dtype
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the integer dot-product kernels write float32 or bfloat16, not {out_dtype}")
        if x.shape[0] >= KERNEL_ROWS:
            return in_units(self, x, lambda part, rows: F.linear(rows.float(), part.dequantized()).to(out_dtype))
        return self.rowwise(x, out_dtype)

    def rowwise(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The kernel at any row count: a row's result is its own whatever M (batch-invariant mode's call)."""
        _check_dot_input(x, self.in_features)
        return in_units(self, x.contiguous(), lambda part, rows: part.kernel(rows, out_dtype or x.dtype))

    def kernel(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        k, rows = self.in_features, x.shape[0]
        n = self.out_features
        y = torch.empty(rows, n, dtype=out_dtype)
        tile_rows, tile_groups = DOT_TILES[self.KIND][rows > 1]
        run = native.dot_linear(self.KIND)
        scale = self.scale if self.KIND == "q8" else self.packed  # q4's and q5's scales are inside `packed`
        run(x.data_ptr(), rows, k, self.packed.data_ptr(), scale.data_ptr(), n, y.data_ptr(),
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


def q4_blocks(weight: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (levels uint8 [N, K/32, 32] in 0..15, scale and min float16 [N, K/32]): GGUF's Q4_1, a level
    q standing for scale * q + min, each block's pair chosen by least squares among a few roundings (as llama.cpp's
    make_qkx searches; engine/ops/native/q4_quantize.c, seconds for a 1B where the torch version took half an hour).
    On gemma-3-270m's projections: 0.57x the squared error of the least-squares Q4_0 (symmetric) scales, perplexity
    with float activations 10.32 against 13.38 (float32 8.58; docs/engine.md). `bits` 5: GGUF's Q5_1, levels 0..31."""
    n, k = weight.shape
    levels = torch.empty(n, k // DOT_BLOCK, DOT_BLOCK, dtype=torch.uint8)
    scales = torch.empty(n, k // DOT_BLOCK, dtype=torch.float16)
    mins = torch.empty(n, k // DOT_BLOCK, dtype=torch.float16)
    search = native.q4_1_blocks() if bits == 4 else native.q5_1_blocks()
    chunk = max(1, (1 << 22) // k)  # rows converted to float32 at a time (16 MiB)
    for start in range(0, n, chunk):
        rows = weight[start : start + chunk].detach().float().contiguous()
        blocks = rows.numel() // DOT_BLOCK
        search(rows.data_ptr(), blocks, levels[start:].data_ptr(), scales[start:].data_ptr(), mins[start:].data_ptr())
    return levels, scales, mins


class Q4Linear(_DotLinear):
    """`model.quantization = q4`'s projections: 4-bit weights in blocks of 32 inputs, a float16 scale and min a block
    (GGUF's Q4_1: 5 bits a weight, `q4_blocks`), times int8 activations (`_DotLinear`). Stored as `packed` uint8
    [N/8, K/32, 160]: a block of eight outputs is four 32-byte rows of levels (byte j of row r holding the [8
    outputs][4 inputs] quads 2r in its low nibble and 2r + 1 in its high one), then the eight outputs' float16
    scales, then their float16 mins, so each group of eight outputs is one sequential stream (`VERSION` 4: the native
    search's bits; 3 was the torch search's, 2 Q4_0 with the scales inside, 1 kept them apart)."""

    KIND = "q4"
    FIELDS = ("packed",)
    VERSION = 4
    """The stored layout's version (part of the model cache's file name: a stale layout is never read back)."""
    BITS = 4
    LEVEL_BYTES = 128
    """Bytes of a block's levels (eight outputs x 32 inputs) before its scales and mins."""

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        self._check_shape(n, k)
        levels, scales, mins = q4_blocks(weight, self.BITS)
        quads = levels.view(n // 8, 8, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [groups, blocks, quad, output, input]
        self.packed = torch.cat([self.pack_levels(quads.reshape(n // 8, k // 32, 8, 32)),
                                 *(t.view(n // 8, 8, k // 32).permute(0, 2, 1).contiguous().view(torch.uint8)
                                   for t in (scales, mins))], dim=2).contiguous()

    @staticmethod
    def pack_levels(quads: torch.Tensor) -> torch.Tensor:
        """[groups, blocks, 8 quads, 32] levels -> [groups, blocks, 128]: row r's byte j holds quad 2r's value j in its
        low nibble and quad 2r + 1's in its high one."""
        rows = quads.view(*quads.shape[:2], 4, 2, 32)
        return (rows[:, :, :, 0] | (rows[:, :, :, 1] << 4)).reshape(*quads.shape[:2], 128)

    @property
    def scale(self) -> torch.Tensor:
        """The blocks' float16 scales [N/8, K/32, 8] (a view of `packed`)."""
        return self.packed[:, :, self.LEVEL_BYTES : self.LEVEL_BYTES + 16].view(torch.float16)

    @property
    def min(self) -> torch.Tensor:
        """The blocks' float16 mins [N/8, K/32, 8] (a view of `packed`)."""
        return self.packed[:, :, self.LEVEL_BYTES + 16 : self.LEVEL_BYTES + 32].view(torch.float16)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0] * 8

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * DOT_BLOCK

    def quads(self) -> torch.Tensor:
        """The levels as [groups, blocks, 8 quads, 32] uint8 (`pack_levels`' input)."""
        groups, blocks, _ = self.packed.shape
        rows = self.packed[:, :, :128].reshape(groups, blocks, 4, 1, 32)
        return torch.cat([rows & 15, rows >> 4], dim=3).view(groups, blocks, 8, 32)

    def levels(self) -> torch.Tensor:
        """The levels [N, K/32, 32] (0..15; q5: 0..31) as float32."""
        groups, blocks, _ = self.packed.shape
        levels = self.quads().view(groups, blocks, 8, 8, 4).permute(0, 3, 1, 2, 4)
        return levels.reshape(groups * 8, blocks, DOT_BLOCK).float()

    def per_output(self, t: torch.Tensor) -> torch.Tensor:
        """`scale` or `min` [N/8, K/32, 8] as [N, K/32] float32."""
        groups, blocks, _ = t.shape
        return t.permute(0, 2, 1).reshape(groups * 8, blocks).float()

    def dequantized(self) -> torch.Tensor:
        scale, low = self.per_output(self.scale)[..., None], self.per_output(self.min)[..., None]
        return (self.levels() * scale + low).view(self.out_features, self.in_features)


class Q5Linear(Q4Linear):
    """The `q5` lm_head (`q4-mix`'s): GGUF's Q5_1, 5-bit levels in blocks of 32 with a float16 scale and min (6 bits a
    weight: the 1B's 262k-row lm_head reads 226 MB a token where `Q8Linear`'s reads 303), times the same int8
    activations. `packed` uint8 [N/8, K/32, 192]: `Q4Linear`'s low nibbles, then 32 bytes of the levels' fifth bits
    (byte j's bit i: quad i's value j, so each quad's bit is one shift and mask away), then the scales and mins."""

    KIND = "q5"
    VERSION = 1
    BITS = 5
    LEVEL_BYTES = 160

    @staticmethod
    def pack_levels(quads: torch.Tensor) -> torch.Tensor:
        fifth = quads >> 4
        bits = sum((fifth[:, :, i].to(torch.int32) << i) for i in range(8)).to(torch.uint8)
        return torch.cat([Q4Linear.pack_levels(quads & 15), bits], dim=2)

    def quads(self) -> torch.Tensor:
        groups, blocks, _ = self.packed.shape
        bits = self.packed[:, :, 128:160]
        fifth = torch.stack([(bits >> i) & 1 for i in range(8)], dim=2)
        return super().quads() | (fifth << 4)
