"""Memory budgeting: how many KV blocks fit, and giving freed heap back to the OS when idle."""

from __future__ import annotations

import ctypes

from ..shape import TextShape
from .kv_cache import BLOCK_SIZE, KVCache


def blocks_within_budget(shape: TextShape, dtype, max_num_seqs: int, max_model_len: int, kv_cache_gib: float) -> int:
    """KV blocks in `kv_cache_gib` (0: what a ring-buffer cache of max_num_seqs sequences of max_model_len would
    take, where sliding layers keep only their window: the budget this engine had before it was paged). They
    must hold at least one sequence of max_model_len (the default budget is raised to that)."""
    per_token = KVCache.bytes_per_token(shape, dtype)
    least = -(-max_model_len // BLOCK_SIZE)
    budget = kv_cache_gib * 2**30 or max(
        max_num_seqs * _ring_bytes(shape, max_model_len, per_token), least * BLOCK_SIZE * per_token
    )
    blocks = int(budget // (per_token * BLOCK_SIZE))
    if blocks < least:
        raise ValueError(
            f"kv_cache_gib={kv_cache_gib} cannot hold one sequence of max_model_len={max_model_len} "
            f"({least * BLOCK_SIZE * per_token / 2**30:.3f} GiB); raise it or lower max_model_len"
        )
    return blocks


def _ring_bytes(shape: TextShape, max_len: int, per_token: int) -> int:
    per_layer = per_token // shape.layers
    return sum(per_layer * (min(shape.sliding_window, max_len) if sliding else max_len) for sliding in shape.sliding)


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS when the engine goes idle: each step's logits and
    activations come in many sizes, and glibc would otherwise keep the high-water mark for good."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (VmRSS; `VmHWM`: its peak since it started), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
