"""Giving freed heap back to the OS when idle, and resident memory (the KV budget's arithmetic is configuration:
engine/config.py's `cache.kv_blocks`)."""

from __future__ import annotations

import ctypes


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
