"""The project's own CPU kernels (C files beside this one, one library per family: sources.py), compiled once with
the system's C compiler (or shipped compiled in the wheel: sources.PREBUILT) and kept
in a directory start-up passes in (`build`: the model cache's `native`, engine/config.py), as torch.compile's
inductor does for its CPU code. Used before any `build` (tests, benchmarks), they go to the default model cache. Plain C called through ctypes: no torch
headers (a 1 s compile instead of a minute), and its OpenMP calls bind to the libgomp torch already loaded
(same soname), so they use the engine thread's pool and thread count. Where there is no compiler or no AVX2,
`woq_int8_linear()` says why and the callers keep PyTorch's kernels."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from ....cpu import cpu_flags
from ....settings import ModelSettings
from .sources import PREBUILT, CompileFailed, compile_into, isa_flags, library_name

log = logging.getLogger(__name__)


class NativeKernelUnavailable(RuntimeError):
    """Why the native kernel cannot run here (no AVX2, no compiler, a failed compile)."""


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and cpu_flags() >= {"avx2", "fma"}


_directory: Path | None = None
"""Where the kernel is compiled and kept: the last `build`'s directory (None: the default model cache's)."""


def build(directory: Path) -> str | None:
    """Compile (once) or load the kernel kept in `directory`, which later calls then use; None where it runs
    here, else why not."""
    global _directory
    if directory != _directory:
        _directory = directory
        forget()
    return native_unavailable()


def forget() -> None:
    """Drop every loaded library and every cached verdict (which kernels run here), so the next caller looks again:
    after a change of directory, or of the environment a test built them under (CC, HOME)."""
    for cached in (_library, rms_norm_rows, lora_kernels, int_dot_unavailable, layer_kernels, decode_attention):
        cached.cache_clear()


def _library_path(family: str) -> Path:
    """The wheel's prebuilt library where it carries one for these sources, else the one built here."""
    prebuilt = PREBUILT / library_name(family)
    return prebuilt if prebuilt.exists() else (_directory or ModelSettings().cache_path / "native") / library_name(family)


_INT8_LINEAR = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
SIGNATURES = {
    "woq_int8": {
        "woq_int8_linear": _INT8_LINEAR, "woq_int8_linear_avx512": _INT8_LINEAR,
        "q8_linear": [*_INT8_LINEAR, ctypes.c_int],
        "rms_norm_rows": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                          ctypes.c_int],
    },
    "lora": {"lora_project": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]},
    "int_dot": {"q8_dot_linear": [*_INT8_LINEAR, ctypes.c_int, ctypes.c_int],
                "q4_dot_linear": [*_INT8_LINEAR, ctypes.c_int, ctypes.c_int],
                "q5_dot_linear": [*_INT8_LINEAR, ctypes.c_int, ctypes.c_int]},
    "layer": {
        "qk_norm_rope": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_float, *[ctypes.c_void_p] * 4],
        "residual_norm": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p],
        "gelu_tanh_mul": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p],
    },
    "attention": {"decode_attention": [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_float, ctypes.c_void_p]},
    "q4_quantize": {name: [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                    for name in ("q4_1_blocks", "q5_1_blocks")},
    "vision_dot": {"q7_dot_linear": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int]},
}
"""Each family's (sources.FAMILIES) functions and their argument types (all return nothing)."""


@functools.cache
def _library(family: str) -> ctypes.CDLL:
    if not cpu_has_avx2():
        raise NativeKernelUnavailable("this CPU (or ATEN_CPU_CAPABILITY) has no AVX2 with FMA")
    target = _library_path(family)
    if not target.exists():
        try:
            compile_into(target.parent, family)
        except CompileFailed as why:
            raise NativeKernelUnavailable(str(why)) from None
        log.info("compiled the native %s kernels into %s", family, target)
    else:
        log.info("native %s kernels: %s", family, target)
    library = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES[family].items():
        function = getattr(library, name)
        function.restype, function.argtypes = None, argtypes
    return library


@functools.cache
def cpu_has_avx512() -> bool:
    """AVX512F here and not switched off for torch's own kernels (`ATEN_CPU_CAPABILITY=avx2`: the AVX2 stand-in)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512f" in cpu_flags()


@functools.cache
def cpu_has_vnni() -> bool:
    """AVX512 VNNI (and BW) here and AVX512 not switched off: the int8 x int8 kernel's VNNI tiles, else AVX2's."""
    return cpu_has_avx512() and cpu_flags() >= {"avx512_vnni", "avx512bw"}


def q8_linear():
    """The compiled `q8_linear(x, M, K, w, scale, N, y, x_bf16, y_bf16, vnni)` (woq_int8.c: activations quantized per block
    of 32, int8 x int8 products), compiled on first use."""
    return _library("woq_int8").q8_linear


def q8_dot_linear():
    """The compiled `q8_dot_linear(x, M, K, w, scale, N, y, x_bf16, y_bf16, tile_rows, tile_groups)` (int_dot.c:
    int8 weights per output channel, activations quantized per row and block of 32, AVX2 integer dot products);
    raises NativeKernelUnavailable where it cannot run here."""
    return _library("int_dot").q8_dot_linear


def q4_dot_linear():
    """The compiled `q4_dot_linear(x, M, K, w, scale, N, y, x_bf16, y_bf16, tile_rows, tile_groups)` (int_dot.c:
    4-bit weights in blocks of 32 with a float16 scale each, GGUF's Q4_0, times the same int8 activations)."""
    return _library("int_dot").q4_dot_linear


def q7_dot_linear():
    """The compiled `q7_dot_linear(x, M, K, w, wsum, scale, bias, N, y, tile_rows, tile_groups)` (vision_dot.c: int8
    weights per output channel in int_dot.c's q8 layout times activations quantized per row and block of 32 to 7
    bits, float32 in and out, the bias added)."""
    return _library("vision_dot").q7_dot_linear


def dot_linear(kind: str):
    """The compiled integer dot-product kernel of layout `kind` (`q8`, `q4`, `q5`: `q5_dot_linear` is q4's with 5-bit
    levels, GGUF's Q5_1), all with the arguments of `q8_dot_linear`."""
    return getattr(_library("int_dot"), f"{kind}_dot_linear")


def q5_1_blocks():
    """The compiled `q5_1_blocks(w, blocks, levels, scale, min)`: `q4_1_blocks`' search with levels 0..31."""
    return _library("q4_quantize").q5_1_blocks


def q4_1_blocks():
    """The compiled `q4_1_blocks(w, blocks, levels, scale, min)` (q4_quantize.c: GGUF's Q4_1 least-squares search,
    float32 blocks of 32 -> levels uint8, float16 scale and min a block)."""
    return _library("q4_quantize").q4_1_blocks


@functools.cache
def int_dot_unavailable() -> str | None:
    """None where the integer dot-product kernels (`model.quantization` q8, q4) run here, else why not (they need
    F16C beside AVX2 and FMA: every AVX2 CPU has it)."""
    if "f16c" not in cpu_flags():
        return "this CPU has no F16C"
    try:
        q8_dot_linear()
    except NativeKernelUnavailable as why:
        return str(why)
    return None


def woq_int8_linear(even_k: bool = False):
    """The compiled `woq_int8_linear(x, M, K, w, scale, N, y, x_bf16, y_bf16)` (woq_int8.c), compiled on first use: its AVX512
    variant where the CPU has it and K (`even_k`) is even, else the AVX2 one; raises NativeKernelUnavailable with
    the reason where it cannot run here."""
    library = _library("woq_int8")
    return library.woq_int8_linear_avx512 if even_k and cpu_has_avx512() else library.woq_int8_linear


def _optional(family: str, name: str | None = None):
    """Family `family`'s compiled library (or its function `name`), or None where it cannot run here: for kernels
    whose callers keep torch's ops without them."""
    try:
        library = _library(family)
    except NativeKernelUnavailable:
        return None
    return library if name is None else getattr(library, name)


def runs_on(x: torch.Tensor) -> bool:
    """Whether the float32 native steps (layer.c, attention.c) apply to `x`: a CPU float32 tensor outside a compiled
    graph (which fuses the ops itself)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()


@functools.cache
def rms_norm_rows():
    """The compiled `rms_norm_rows(x, rows, D, scale, eps, y, bf16)` (Gemma-3's RMSNorm in one call), or None where
    the kernel cannot run here (the caller keeps torch's ops)."""
    return _optional("woq_int8", "rms_norm_rows")


@functools.cache
def layer_kernels() -> ctypes.CDLL | None:
    """The compiled layer steps (layer.c: `qk_norm_rope`, `residual_norm`, float32), or None where they cannot run
    here (the caller keeps torch's ops)."""
    return _optional("layer")


@functools.cache
def decode_attention():
    """The compiled `decode_attention(q, rows, heads, kv_heads, D, k, v, block_size, tables, table_rows, count, mask,
    scaling, out)` (attention.c: decode rows over their KV blocks in place, float32), or None where it cannot run
    here (the caller keeps torch's gather and scaled_dot_product_attention)."""
    return _optional("attention", "decode_attention")


@functools.cache
def lora_kernels():
    """The compiled `lora_project(rows, weights, x, y, first)` (lora.c: a step's few rows, each on its own adapter)
    and whether to run its AVX512 variant, or None where the kernel cannot run here (the caller keeps torch's
    matmuls)."""
    try:
        library = _library("lora")
    except NativeKernelUnavailable as why:
        log.warning("the native LoRA kernel cannot run here (%s): adapters' few-row steps use torch's matmuls", why)
        return None
    return library.lora_project, cpu_has_avx512() and "avx512bw" in cpu_flags()


def native_unavailable() -> str | None:
    """None where the kernel runs here, else why not."""
    try:
        woq_int8_linear()
    except NativeKernelUnavailable as why:
        return str(why)
    return None


def kernel_isa() -> str:
    """The instruction set the native kernels run with here (`/v1/server_info`): `avx512-vnni`, `avx512`,
    `avx2-vnni` (AVX2 with AVX-VNNI: int_dot.c's vpdpbusd on 256-bit registers) or `avx2`; `none` where they cannot
    run (the reason is logged at start-up)."""
    if native_unavailable():
        return "none"
    if cpu_has_vnni():
        return "avx512-vnni"
    return "avx512" if cpu_has_avx512() else "avx2-vnni" if "-mavxvnni" in isa_flags("int_dot") else "avx2"
