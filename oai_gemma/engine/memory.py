"""Memory budgeting: how many KV slots fit, and giving freed heap back to the OS when idle."""

from __future__ import annotations

import ctypes

from .kv_cache import KVCache


def slots_within_budget(text_config, dtype, max_num_seqs: int, max_model_len: int, kv_cache_gib: float) -> int:
    """All of the KV cache is allocated once at start, so memory never grows with traffic."""
    if not kv_cache_gib:
        return max_num_seqs
    per_slot = KVCache.bytes_per_slot(text_config, max_model_len, dtype)
    slots = int(kv_cache_gib * 2**30 // per_slot)
    if slots < 1:
        raise ValueError(
            f"kv_cache_gib={kv_cache_gib} cannot hold one sequence of max_model_len={max_model_len} "
            f"({per_slot / 2**30:.3f} GiB); raise it or lower max_model_len"
        )
    return min(slots, max_num_seqs)


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


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
