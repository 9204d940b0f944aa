"""The physical floor of one stream: a CPU decode step of one row reads every weight it uses once, so it cannot be
faster than (bytes read per token) / (memory read bandwidth). The bandwidth is measured here with a streaming
read (a sum over a buffer far larger than the caches, with the engine's thread count); the bytes per token come
from each server: ours reports them in `/health` (`decode_bytes`: the layout a one-row step uses), llama-server
reads its GGUF's tensors once a token (the file's size stands in for them)."""

from __future__ import annotations

import statistics
import time

import httpx

READ_BYTES = 1 << 30
"""The buffer read: 1 GiB, a hundred times any cache here."""


def read_bandwidth(repeats: int = 5, size: int = READ_BYTES) -> float:
    """Bytes per second of a streaming read of `size` bytes (median of `repeats` passes after one untimed pass)."""
    import torch

    buffer = torch.ones(size // 4, dtype=torch.float32)
    buffer.sum()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        samples.append(size / (time.perf_counter() - started))
    return statistics.median(samples)


def decode_bytes(health_url: str) -> int | None:
    """Bytes ours reads for one token at one stream (`/health`'s `decode_bytes`); None where not reported."""
    try:
        return httpx.get(health_url, timeout=5.0, trust_env=False).json().get("decode_bytes")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def floor_table(servers: dict, bandwidth: float | None, markdown: bool = False) -> str | None:
    """c=1 ITL p50 beside the floor its bytes per token imply, per server that reported its bytes."""
    rows = []
    for name, server in servers.items():
        level = next((lv for lv in server.get("levels", ()) if lv["concurrency"] == 1), None)
        if not bandwidth or not server.get("decode_bytes") or level is None or not level["itl_ms"]["p50"]:
            continue
        floor_ms = server["decode_bytes"] / bandwidth * 1e3
        itl = level["itl_ms"]["p50"]
        rows.append((name, server["decode_bytes"] / 2**20, floor_ms, itl, itl / floor_ms))
    if not rows:
        return None
    if markdown:
        lines = ["| server | MB read per token | floor (ms) | c=1 ITL p50 (ms) | ITL / floor |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {mb:.0f} | {f:.1f} | {i:.1f} | {r:.2f}x |" for n, mb, f, i, r in rows]
    else:
        lines = [f"{'server':<28} {'MB/token':>9} {'floor ms':>9} {'ITL p50':>8} {'ITL/floor':>9}"]
        lines += [f"{n:<28} {mb:9.0f} {f:9.1f} {i:8.1f} {r:8.2f}x" for n, mb, f, i, r in rows]
    return "\n".join(lines)


def bandwidth_line(bandwidth: float | None) -> str:
    return "memory read bandwidth: not measured" if not bandwidth else (
        f"memory read bandwidth (a streaming sum over 1 GiB, median of 5): {bandwidth / 1e9:.1f} GB/s")
