"""Weight-only quantized linear layers for the CPU (`model.quantization`: int8, int4).

A CPU decode step streams every weight once, so fewer bytes per weight is a faster single stream. These use
PyTorch's own CPU kernels: `torch._weight_int8pack_mm` (int8, one scale per output channel) and
`_weight_int4pack_mm_for_cpu` (int4 in groups of 32 along the input, a scale and a zero per group). Measured on
gemma-3-270m (docs/engine.md, "Weight-only quantized weights"): with bf16 activations the int4 lm_head is 3.4x
faster than packed bf16 at one row, but both kernels dequantize per call, so from 8 rows on they are slower
than oneDNN's packed bf16; with float32 activations they are slower at every size. Quality decides the int4
mix: every layer in int4 cost +41% perplexity (this model's GGUF keeps most tensors at 5-8 bits), the lm_head
alone in int4 with int8 projections +5.0%, so `int4` is that mix, as Q4_K_M keeps its sensitive tensors wider.
The layers keep the interface of engine/linear.py's FrozenLinear (`__call__`, `packed`, `packed_bytes`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

INT4_GROUP = 32
"""Input columns per int4 scale/zero: the GGUF Q4_K sub-block size; 128 measured no faster (docs/engine.md)."""
DEQUANTIZE_FROM_ROWS = 32
"""From this many rows an int8 projection is dequantized for the call instead (measured: 512 rows of the
2048 x 640 gate, 8.3 ms through the int8 kernel, 1.1 ms dequantized; equal at 32)."""


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
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.packed = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
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


def quantized_linear(quantization: str, name: str):
    """The linear class for weight `name` (`lm_head` or a projection) under a `model.quantization` value."""
    if quantization == "int4" and name == "lm_head":
        return Int4Linear
    return Int8Linear


def quantize_all(weights: dict[str, torch.Tensor], quantization: str, cache_file: Path | None) -> dict[str, object]:
    """{name: weight} -> {name: quantized linear}. Quantizing the 262k-row lm_head to int4 takes ~5 s, so the
    result is kept in `cache_file` (safetensors) and read back on later starts, as the GGUF conversion is."""
    from safetensors.torch import load_file, save_file

    if cache_file is not None and cache_file.exists():
        stored = load_file(str(cache_file))
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in stored.items():
            name, part = key.rsplit(".", 1)
            grouped.setdefault(name, {})[part] = tensor.clone()  # aligned: the kernels crash on the file's offsets
        if set(grouped) == set(weights):
            return {name: quantized_linear(quantization, name).from_tensors(grouped[name]) for name in weights}
    linears = {name: quantized_linear(quantization, name)(weight) for name, weight in weights.items()}
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        stored = {f"{name}.{part}": t.contiguous() for name, linear in linears.items() for part, t in linear.tensors().items()}
        save_file(stored, str(partial))
        partial.replace(cache_file)  # atomic: a concurrent start reads a whole file or none
    return linears
