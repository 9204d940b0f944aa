"""What one stream's token costs (issue 27). The physical floor: a CPU decode step of one row reads every weight
it uses once, so it cannot be faster than (bytes read per token) / (memory read bandwidth). The bandwidth is
measured here with a streaming read (a sum over a buffer far larger than the caches, with the engine's thread
count); the bytes per token come from each server: ours reports them in `/health` (`decode_bytes`: the layout a
one-row step uses), llama-server reads its GGUF's tensors once a token (the file's size stands in for them).
And the server's own work per token: the client's inter-token time less the engine's mean step (`/health`'s
`steps` and `step_seconds`, read before and after the level)."""

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


def health(url: str) -> dict:
    """A server's `/health` JSON ({} where it has none: llama-server's says only its status)."""
    try:
        answer = httpx.get(url, timeout=5.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}


def engine_step_ms(before: dict, after: dict) -> float | None:
    """Mean wall time of ours' engine steps between two `/health` answers (`steps`, `step_seconds`): what the
    engine thread spent per token at one stream, against which the client's inter-token time shows the server's
    own per-token work (HTTP, SSE framing, the event-loop hop). A level's one prefill step per request is in
    the mean too (1 in 64 steps at 64 tokens)."""
    try:
        steps = after["steps"] - before["steps"]
        return (after["step_seconds"] - before["step_seconds"]) / steps * 1e3 if steps > 0 else None
    except (KeyError, TypeError):
        return None


def speculation(before: dict, after: dict, output_tokens: int) -> dict | None:
    """Speculative decoding between two of ours' `/health` answers: the share of draft tokens accepted, the mean
    draft length, and the output tokens per engine step (at concurrency 1: per forward of the model); None for a
    server that does not report them."""
    try:
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        steps = after["steps"] - before["steps"]
    except (KeyError, TypeError):
        return None
    return {
        "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None, "draft_len": drafted / drafts if drafts else None,
        "tokens_per_step": output_tokens / steps if steps else None,
    }


def floor_table(servers: dict, bandwidth: float | None, markdown: bool = False) -> str | None:
    """Per server, at one stream: its bytes per token, the floor they imply, ITL p50 against it, and for ours the
    engine's mean step and what the server adds to it per token (ITL p50 - step)."""
    rows = []
    for name, server in servers.items():
        level = next((lv for lv in server.get("levels", ()) if lv["concurrency"] == 1), None)
        if level is None or not level["itl_ms"]["p50"]:
            continue
        itl, step = level["itl_ms"]["p50"], level.get("engine_step_ms")
        floor_ms = server["decode_bytes"] / bandwidth * 1e3 if bandwidth and server.get("decode_bytes") else None
        if floor_ms is None and step is None:
            continue
        rows.append((name, server.get("decode_bytes"), floor_ms, itl, step))
    if not rows:
        return None

    def cells(mb, floor_ms, itl, step) -> list[str]:
        return [f"{mb / 2**20:.0f}" if mb else "-", f"{floor_ms:.1f}" if floor_ms else "-", f"{itl:.1f}",
                f"{itl / floor_ms:.2f}x" if floor_ms else "-", f"{step:.1f}" if step else "-",
                f"{itl - step:.1f}" if step else "-"]

    header = ["MB read per token", "floor (ms)", "c=1 ITL p50 (ms)", "ITL / floor", "engine step (ms)", "ITL - step (ms)"]
    if markdown:
        lines = ["| server | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
        lines += [f"| {name} | " + " | ".join(cells(*rest)) + " |" for name, *rest in rows]
    else:
        lines = [f"{'server':<28} " + " ".join(f"{h:>17}" for h in header)]
        lines += [f"{name:<28} " + " ".join(f"{c:>17}" for c in cells(*rest)) for name, *rest in rows]
    return "\n".join(lines)


def bandwidth_line(bandwidth: float | None) -> str:
    return "memory read bandwidth: not measured" if not bandwidth else (
        f"memory read bandwidth (a streaming sum over 1 GiB, median of 5): {bandwidth / 1e9:.1f} GB/s")
