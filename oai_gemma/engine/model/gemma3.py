"""One Gemma-3 decoder layer's math, shared by the dynamic runner and the static decode step.

A layer is attention between two plain functions of tensors: `pre_attention` (norm, q/k/v projections,
q/k norms, rope) and `post_attention` (output projection, residuals, gated-GELU MLP). The weights are
arguments, not module state, so `torch.compile` compiles each function once for every layer (static decode),
and the projections go through `linear`: `F.linear` over plain tensors by default, or a call of the
CPU's pre-packed oneDNN weights (`engine/ops/linear.py`, `call_linear`) in the dynamic runner.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...cpu import TURNS
from ..ops import native
from ..ops.fused import projections

NATIVE_NORM_DTYPES = (torch.float32, torch.bfloat16)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (projections: tensors, or whatever `linear` takes; norms: their float32
    scale, 1 + weight, computed once rather than in every call)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    post_feedforward_norm: torch.Tensor


def check_supported(config) -> None:
    """Refuse what this layer does not implement, rather than compute something else."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention projections with bias are not supported by this runner (Gemma-3 has none)")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping (Gemma-2 style) is not supported by this runner")
    if config.hidden_activation not in GELU_TANH:
        raise ValueError(f"this runner implements Gemma-3's tanh GELU, not {config.hidden_activation}")


def norm_scale(weight: torch.Tensor) -> torch.Tensor:
    """What Gemma-3's RMSNorm multiplies by: 1 + weight, in float32."""
    return 1.0 + weight.detach().float()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-3's RMSNorm (transformers' Gemma3RMSNorm): in float32, times `norm_scale(weight)`, cast back. On a CPU
    one call of the native kernel (engine/ops/native: eight torch ops' dispatch cost more than their arithmetic
    at one row: 108 norms a decode step), else torch's ops."""
    if (x.device.type == "cpu" and x.dtype in NATIVE_NORM_DTYPES and x.is_contiguous() and x.shape[-1] % 8 == 0
            and scale.dtype == torch.float32 and scale.is_contiguous() and not torch.compiler.is_compiling()):  # a compiled layer fuses the ops itself, in one graph
        kernel = native.rms_norm_rows()
        if kernel is not None:
            y = torch.empty_like(x)
            kernel(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], scale.data_ptr(), eps, y.data_ptr(), x.dtype == torch.bfloat16)
            return y
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * scale).type_as(x)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with its first half negated: `rope` then rotates with one `roll` instead of a slice, negate and cat
    (the same values: only signs move)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding; `sin` from `signed_sin`: rotate_half(x) * sin == roll(x, half) * signed_sin(sin)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _layer_kernels(x: torch.Tensor):
    """The native layer steps (engine/ops/native/layer.c) where they apply to `x`: a CPU float32 tensor outside a
    compiled graph (which fuses the ops itself); else None (torch's ops)."""
    return native.layer_kernels() if native.runs_on(x) else None


def _rows_fit(t: torch.Tensor, width: int) -> bool:
    """Whether `t` [rows, >= width] float32 has each row's first `width` values contiguous (a fused output's columns)."""
    return t.dim() == 2 and t.shape[1] >= width and t.stride(1) == 1 and t.dtype == torch.float32


def qk_norm_rope(q, k, w: LayerWeights, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    """q [B, heads * D] and k [B, kv_heads * D] -> each head RMSNorm'd (q_norm, k_norm) and rotated: [B, heads, D],
    [B, kv_heads, D]. On a CPU in float32 one native call (the same bits as the torch ops), else torch's ops."""
    kernels = _layer_kernels(q)
    rows = q.shape[0]
    if (kernels is not None and head_dim % 8 == 0 and head_dim <= 1024 and _rows_fit(q, heads * head_dim)
            and _rows_fit(k, kv_heads * head_dim) and cos.is_contiguous() and sin.is_contiguous()
            and cos.numel() == sin.numel() == rows * head_dim and cos.dtype == sin.dtype == torch.float32):
        q_out, k_out = q.new_empty(rows, heads, head_dim), k.new_empty(rows, kv_heads, head_dim)
        kernels.qk_norm_rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), rows, heads, kv_heads, head_dim,
                             w.q_norm.data_ptr(), w.k_norm.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
                             q_out.data_ptr(), k_out.data_ptr())
        return q_out, k_out
    q = rms_norm(q.contiguous().view(-1, heads, head_dim), w.q_norm, eps)
    k = rms_norm(k.contiguous().view(-1, kv_heads, head_dim), w.k_norm, eps)
    return rope(q, cos, sin), rope(k, cos, sin)


def residual_norm(hidden, delta, scale, eps: float, next_scale=None):
    """hidden + rms_norm(delta, scale), and with `next_scale` also (that sum, rms_norm(sum, next_scale)): a residual
    branch and the next sublayer's input. On a CPU in float32 one native call (the same bits), else torch's ops."""
    kernels = _layer_kernels(hidden)
    if (kernels is not None and delta.dtype == torch.float32 and hidden.is_contiguous() and delta.is_contiguous()
            and hidden.shape == delta.shape and hidden.dim() == 2 and hidden.shape[1] % 8 == 0):
        out = torch.empty_like(hidden)
        normed = torch.empty_like(hidden) if next_scale is not None else None
        kernels.residual_norm(hidden.data_ptr(), delta.data_ptr(), hidden.shape[0], hidden.shape[1], scale.data_ptr(),
                              None if normed is None else next_scale.data_ptr(), eps, out.data_ptr(),
                              None if normed is None else normed.data_ptr())
        return out if normed is None else (out, normed)
    out = hidden + rms_norm(delta, scale, eps)
    return out if next_scale is None else (out, rms_norm(out, next_scale, eps))


def pre_attention(hidden, w: LayerWeights, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int, linear=F.linear):
    """hidden [B, H] -> q [B, heads, D], k and v [B, kv_heads, D], normed and rotated."""
    x = rms_norm(hidden, w.input_norm, eps)
    q, k, v = projections(linear, x, (w.q, w.k, w.v))  # one kernel call where they are fused (engine/ops/fused.py)
    q, k = qk_norm_rope(q, k, w, cos, sin, eps, heads, kv_heads, head_dim)
    return q, k, v.reshape(-1, kv_heads, head_dim)


def _offer_turn() -> None:
    """`TURNS.offer()`, left out of a compiled layer function (the GPU's static decode: one graph, no load beside)."""
    if not torch.compiler.is_compiling():
        TURNS.offer()


def post_attention(hidden, attn, w: LayerWeights, eps: float, linear=F.linear):
    """Output projection, residuals and the gated-GELU MLP of one layer."""
    hidden, x = residual_norm(hidden, linear(attn.reshape(attn.shape[0], -1), w.o), w.post_attention_norm, eps,
                              w.pre_feedforward_norm)
    _offer_turn()  # the MLP's calls are units of a load's warm-up too (cpu.Turns; a no-op on an engine's thread)
    gate, up = projections(linear, x, (w.gate, w.up))
    _offer_turn()
    mlp = linear(_gelu_times(gate, up), w.down)
    return residual_norm(hidden, mlp, w.post_feedforward_norm, eps)


def _gelu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up: on a CPU in float32 one native call at any row count (layer.c's `gelu_tanh_mul`: its own exp,
    closer to the exact function than torch's float32 tanh form; a 1B decode row's 26 calls at 2.6x less time), else
    torch's gelu with the product written into its output."""
    kernels = _layer_kernels(gate)
    width = gate.shape[-1]
    if kernels is not None and width % 8 == 0 and gate.shape == up.shape and _rows_fit(gate, width) and _rows_fit(up, width):
        out = gate.new_empty(gate.shape)  # a fused gate/up output's columns, rows apart by their stride: whatever the row count
        kernels.gelu_tanh_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), gate.shape[0], width, out.data_ptr())
        return out
    return F.gelu(gate, approximate="tanh").mul_(up)
