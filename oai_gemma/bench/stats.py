"""Percentiles and one concurrency level's summary, from the client's raw timings (no I/O)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .client import LevelRun


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1000 for v in values]


def _pcts(values_ms: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values_ms, q) for q in qs}
    out["mean"] = sum(values_ms) / len(values_ms) if values_ms else None
    return out


def summarize_level(run: LevelRun) -> dict:
    """Per-level numbers: latency percentiles over successful requests, aggregate throughput over wall time."""
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    ttft = _ms([r.ttft for r in ok])
    itl = _ms([gap for r in ok for gap in r.itls])
    tpot = _ms([t for r in ok if (t := r.tpot) is not None])
    e2e = _ms([r.e2e for r in ok])
    tokens = sum(r.output_tokens for r in ok)
    wall = run.wall_s
    return {
        "concurrency": run.concurrency,
        "num_requests": len(run.results),
        "completed": len(ok),
        "errors": len(failed),
        "error_samples": sorted({r.error or "no content" for r in failed})[:3],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "requests_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": _pcts(ttft, (50, 90, 99)),
        "itl_ms": _pcts(itl, (50, 99)),
        "tpot_ms": _pcts(tpot, (50, 99)),
        "e2e_ms": _pcts(e2e, (50, 99)),
        "raw": {"ttft_ms": ttft, "itl_ms": itl, "e2e_ms": e2e},
    }
