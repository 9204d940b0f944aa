"""The vision tower's projections with int8 weights and integer dot products (issue 37.4): `q8a7`, int8 weights per
output channel times activations quantized per row and block of 32 inputs to 7 bits (engine/ops/native/
vision_dot.c); `q8`, the same weights times 8-bit activations (engine/ops/int_dot.py's `Q8Linear`, GGUF's Q8_0).

SigLIP at 896x896 runs its linears on 4,096 patch rows a layer: compute-bound, where float32 FMAs run at the
cores' peak. AVX2's vpmaddubsw takes unsigned x signed bytes: 8-bit activations need a vpsignb a product to move
their signs onto the weights, 7-bit ones stored offset by 64 do not, so `q8a7` runs the linears in ~0.5x float32's
time and `q8` in ~0.72x (AVX2 EPYC, one thread, 256 rows of the 4B's shapes; docs/benchmarks.md "Issue 37.4: the
tower's linears in integers"), with a quarter of the float32 weights' memory (the 4B's tower: ~400 MB instead of
1.6 GB); on a VNNI CPU vision_dot.c's vpdpbusd and, with AVX512, its 512-bit tiles take the linears to ~0.45x the
AVX2 build's time (same bits; docs/benchmarks.md). The attention over 4,096 keys, the norms and the GELU stay float32. Every row's result is its own (exact
integer sums, each row quantized alone), so the resumable encode's units (vision_encode.py) give bitwise the
one-call encode's features in these layouts too.

`bf16`: the projections' weights in bfloat16, their rows cast to bfloat16 for oneDNN's GEMM and the results back to
the tower's dtype (bias added there): on a CPU with AVX512-BF16 or AMX that GEMM runs ~4x float32's and ~3x `q8a7`'s
at 4,096 rows (2-core AVX512-bf16 EPYC: 0.15 s a layer's linears against ~0.45 s), at half float32's memory.

The server's tower, wherever the text takes an integer dot-product layout (`model.quantization` q8, q4, q4-mix:
`tower_layout`), is `bf16` on such a CPU and `q8a7` elsewhere; float otherwise. For the int8 layouts an intermediate
size that is not a multiple of 32 (SigLIP's 4304) is padded: fc1 gets zero rows and zero biases (their GELU is
exactly 0), fc2 the matching zero input columns.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ...cpu import cpu_has_fast_bf16
from ...settings import INT_DOT_QUANTIZATIONS
from ..ops import native
from ..ops.int_dot import DOT_BLOCK, Q8Linear
from .vision_weights import VisionWeights

log = logging.getLogger("oai_gemma.engine")

LAYOUTS = INT_DOT_QUANTIZATIONS
"""`model.quantization` values whose tower is `q8a7` (the text's own integer dot-product kernels run here)."""
LINEARS = (("q_weight", "q_bias"), ("k_weight", "k_bias"), ("v_weight", "v_bias"), ("o_weight", "o_bias"),
           ("fc1_weight", "fc1_bias"), ("fc2_weight", "fc2_bias"))
"""A VisionLayer's projections: (weight field, bias field)."""
TILE = (2, 4)
"""vision_dot.c's register tile (rows, groups of 8 outputs): the fastest of six at 256 rows of the 4B's shapes or
within 3% of it (AVX2 EPYC, one thread)."""


class _ConvertedLinear:
    """A projection made from its float weight and bias, at once or at its first call (`lazy`: the server's, so the
    conversion stays off the warm start and is spread over the first image's encode, a layer at a time; ~3.7 s of
    CPU for the 4B's tower in int8). Until then `source` holds the float weight and bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, lazy: bool):
        self.source = (weight, bias)
        if not lazy:
            self._ready()

    def _ready(self) -> None:
        if self.source is not None:
            weight, bias = self.source
            self.source = None
            self._convert(weight.detach(), bias.detach())

    def _convert(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def packed_bytes(self) -> int:
        if self.source is not None:  # not converted yet: the float weight and bias
            return sum(t.numel() * t.element_size() for t in self.source)
        return self._converted_bytes()

    def _converted_bytes(self) -> int:
        raise NotImplementedError


class VisionLinear(_ConvertedLinear):
    """A SigLIP projection with int8 weights per output channel and its float32 bias: rows [..., K] -> [..., N] (N
    and K as padded). `activations`: 7 (the server's: vision_dot.c, each block's activations in -63..63, no sign
    moves) or 8 (int_dot.c's `Q8Linear`, Q8_0 blocks: 0.7x its error, measured ~1.45x its time)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, pad_outputs: int = 0, pad_inputs: int = 0,
                 activations: int = 7, lazy: bool = False):
        self.activations, self.pads = activations, (pad_outputs, pad_inputs)
        super().__init__(weight, bias, lazy)

    def _convert(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        pad_outputs, pad_inputs = self.pads
        weight = F.pad(weight.float(), (0, pad_inputs, 0, pad_outputs))
        self.linear = Q8Linear(weight)
        self.bias = F.pad(bias.float(), (0, pad_outputs))
        if self.activations == 7:
            n, k = weight.shape
            levels = self.linear.packed.permute(0, 2, 1, 3).reshape(n // 8, 8, k // DOT_BLOCK, DOT_BLOCK)
            self.block_sums = levels.sum(-1, dtype=torch.int32).transpose(1, 2).to(torch.int16).contiguous()
            """[N/8, K/32, 8] int16 (at most 32 * 127): each output's weights summed per block (the kernel takes 64 of
            each off)."""

    def _converted_bytes(self) -> int:
        sums = self.block_sums.numel() * 2 if self.activations == 7 else 0
        return self.linear.packed_bytes + self.bias.numel() * 4 + sums

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._ready()
        rows = x.reshape(-1, x.shape[-1])
        if self.activations == 8:
            y = self.linear.rowwise(rows if rows.dtype == torch.bfloat16 else rows.float(), torch.float32)
            y += self.bias
        else:
            rows = rows.float().contiguous()
            n, k = self.linear.out_features, self.linear.in_features
            if rows.shape[1] != k:
                raise ValueError(f"expected rows of {k} inputs, got {tuple(rows.shape)}")
            y = torch.empty(rows.shape[0], n)
            native.q7_dot_linear()(rows.data_ptr(), rows.shape[0], k, self.linear.packed.data_ptr(),
                                   self.block_sums.data_ptr(), self.linear.scale.data_ptr(), self.bias.data_ptr(), n,
                                   y.data_ptr(), *TILE)
        return y.view(*x.shape[:-1], -1).to(x.dtype)


class Bf16VisionLinear(_ConvertedLinear):
    """A SigLIP projection with a bfloat16 weight and its bias in the tower's dtype: rows [..., K] -> [..., N]. Each
    output is rounded to bfloat16 once (oneDNN's bf16 GEMM writes bf16) and the bias added after, in the rows' dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, lazy: bool = False):
        super().__init__(weight, bias, lazy)

    def _convert(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.weight, self.bias = weight.to(torch.bfloat16).contiguous(), bias

    def _converted_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._ready()
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype).add_(self.bias.to(x.dtype))


def _swap_linears(weights: VisionWeights, make) -> VisionWeights:
    """Every encoder layer's projections replaced by `make(weight name, weight, bias)`, their biases inside it (the
    layer's bias fields None), in place, one layer at a time; the patch embedding and the projector stay."""
    for layer in weights.layers:
        for weight_name, bias_name in LINEARS:
            setattr(layer, weight_name, make(weight_name, getattr(layer, weight_name), getattr(layer, bias_name)))
            setattr(layer, bias_name, None)
    return weights


def to_bf16(weights: VisionWeights, lazy: bool = False) -> VisionWeights:
    """Every encoder layer's projections as `Bf16VisionLinear`s, in place (`lazy`: each converted at its first call),
    and the attention's float32 matmuls under oneDNN's `bf16` precision (vision_weights.py's `mkldnn_fp32_precision`)."""
    weights.attention_fp32_precision = "bf16"
    return _swap_linears(weights, lambda name, weight, bias: Bf16VisionLinear(weight, bias, lazy=lazy))


def why_not_q8(weights: VisionWeights) -> str | None:
    """Why this tower cannot take `q8a7` or `q8`, or None."""
    why = native.int_dot_unavailable()
    if why is None:
        try:
            native.q7_dot_linear()
        except native.NativeKernelUnavailable as error:
            why = str(error)
    if why is None and weights.shape.hidden % DOT_BLOCK:
        why = f"its width {weights.shape.hidden} is not a multiple of {DOT_BLOCK}"
    return why


def to_q8(weights: VisionWeights, activations: int = 7, lazy: bool = False) -> VisionWeights:
    """Every encoder layer's projections as `VisionLinear`s (`activations`: 7 for `q8a7`, 8 for `q8`), in place, one
    layer at a time (each layer's float weights let go as it is done; `lazy`: at each linear's first call); the
    patch embedding and the projector stay."""
    pad = -weights.shape.intermediate % DOT_BLOCK
    pads = {"fc1_weight": (pad, 0), "fc2_weight": (0, pad)}
    return _swap_linears(weights, lambda name, weight, bias: VisionLinear(
        weight, bias, *pads.get(name, (0, 0)), activations=activations, lazy=lazy))


def tower_layout(weights: VisionWeights | None, quantization: str, fast_bf16: bool | None = None) -> VisionWeights | None:
    """The server's tower for the text's `quantization`: where the text runs the integer dot-product kernels, `bf16`
    on a CPU with fast bf16 GEMMs (`fast_bf16`, default: this CPU's), else `q8a7` where the tower's shape allows it;
    each linear converted at its first call (`lazy`). Otherwise as it is (float in the model's dtype)."""
    if weights is None or quantization not in LAYOUTS:
        return weights
    if cpu_has_fast_bf16() if fast_bf16 is None else fast_bf16:
        log.info("vision tower: its linears in bf16 (this CPU's bf16 GEMM), converted at the first image's encode")
        return to_bf16(weights, lazy=True)
    why = why_not_q8(weights)
    if why is not None:
        log.info("vision tower in %s (the int8 layout cannot run: %s)", weights.dtype, why)
        return weights
    log.info("vision tower: its linears in int8 x 7-bit activations (q8a7), quantized at the first image's encode")
    return to_q8(weights, lazy=True)
