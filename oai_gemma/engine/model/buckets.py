"""The few shapes a step runs at: token counts, logits rows and (static decode) attention spans.

Every distinct shape costs oneDNN kernels and buffers on a CPU and a CUDA graph on a GPU, so steps are padded
to a bucket and every bucket is built once at warm-up (docs/engine.md, "bucketed step shapes").
"""

from __future__ import annotations

MIN_SPAN = 256


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... 64, then multiples of 64, up to the first one >= limit."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 64 else sizes[-1] + 64)
    return sizes


def span_buckets(max_len: int) -> list[int]:
    """KV spans attended by the static decode's SDPA path: 256, 512, ... doubling, then max_len."""
    sizes = []
    size = MIN_SPAN
    while size < max_len:
        sizes.append(size)
        size *= 2
    return sizes + [max_len]


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds n (n itself past the largest: correct, just not pre-compiled)."""
    for size in sizes:
        if size >= n:
            return size
    return n
