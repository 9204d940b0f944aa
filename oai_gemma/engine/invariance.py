"""Batch-invariant mode: a row's logits do not depend on what is computed beside it.

A matmul's kernel (oneDNN, MKL) is picked by its row count, and SDPA blocks its reductions by the query and key
lengths, so a token's last bits change with the step's shape: with the other requests decoding beside it, with
how its prompt was chunked, with a prefix-cache hit. Measured on this project's CPUs (docs/engine.md,
"Batch-invariant mode"): a linear's rows come out identical at 2 to 32 rows (one float32 row takes a GEMV path;
bf16 from 64 rows another kernel); SDPA's rows come out identical when the keys start on a 512-position grid,
their span is padded (decode: to 256, prefill: to 512) and a prefill's queries are at least 32 rows. So in this
mode every linear runs in tiles of 2 to 32 rows and attention reads grid-aligned, padded keys. Another CPU's
kernels may differ: `verify` checks these facts on the real weights at start-up, and the mode says off when
they fail there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 32
MIN_ROWS = 2
KEY_GRID = 512
DECODE_SPAN_STEP = 256
MIN_QUERY_ROWS = 32


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def tiled(linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` computed in tiles of MIN_ROWS..TILE_ROWS rows (a single row is doubled, the copy dropped)."""
    if x.shape[0] == 1:
        return linear(x.expand(MIN_ROWS, -1).contiguous())[:1]
    if x.shape[0] <= TILE_ROWS:
        return linear(x)
    tiles = list(x.split(TILE_ROWS))
    if tiles[-1].shape[0] == 1:
        return torch.cat([linear(t) for t in tiles[:-1]] + [tiled(linear, tiles[-1])])
    return torch.cat([linear(t) for t in tiles])


def tiled_call_linear(x: torch.Tensor, linear) -> torch.Tensor:
    """`linear` for engine/gemma3.py's layer functions in this mode."""
    return tiled(linear, x)


def pad_keys(keys: torch.Tensor, values: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [..., positions, D] padded with zeros to `span` positions (the mask hides them)."""
    missing = span - keys.shape[-2]
    if missing <= 0:
        return keys, values
    return F.pad(keys, (0, 0, 0, missing)), F.pad(values, (0, 0, 0, missing))


def grouped_attention(q, keys, values, mask, scaling: float) -> torch.Tensor:
    """Prefill attention with each kv head's query heads as rows of one query [kv_heads, tokens * group, D],
    padded to at least MIN_QUERY_ROWS rows (the row count at which SDPA's blocking stops changing here).
    q [tokens, heads, D], keys/values [kv_heads, span, D], mask [tokens, span] -> [tokens, heads, D]."""
    n, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    tokens = max(n, -(-MIN_QUERY_ROWS // group))
    if tokens > n:  # repeat the last query (its output is dropped)
        q = torch.cat((q, q[-1:].expand(tokens - n, -1, -1)))
        mask = torch.cat((mask, mask[-1:].expand(tokens - n, -1)))
    rows = q.view(tokens, kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, tokens * group, head_dim)
    row_mask = mask.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(rows[None], keys[None], values[None], attn_mask=row_mask, scale=scaling)
    return out[0].view(kv_heads, tokens, group, head_dim).permute(1, 0, 2, 3).reshape(tokens, heads, head_dim)[:n]


# ---- start-up check ---------------------------------------------------------------------------------

CHECK_ROWS = (2, 4, 8, 16, 32)
"""Row counts a tile can have: steps are padded to token buckets (1, 2, 4, ... 64, then multiples of 64)."""


def linear_problems(linears: dict[str, object], in_features: dict[str, int], dtype: torch.dtype) -> list[str]:
    """Each linear whose rows differ between tiles of CHECK_ROWS rows and the rows computed alone (random input)."""
    problems = []
    generator = torch.Generator().manual_seed(0)
    for name, linear in linears.items():
        x = torch.randn(TILE_ROWS, in_features[name], generator=generator).to(dtype)
        alone = torch.cat([tiled(linear, x[i : i + 1]) for i in range(TILE_ROWS)])
        for rows in CHECK_ROWS:
            if not torch.equal(tiled(linear, x[:rows]), alone[:rows]):
                problems.append(f"{name} at {rows} rows")
    return problems


def attention_problems(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[str]:
    """Prefill rows computed whole and in chunks, and decode rows alone and in a longer batch, must agree."""
    generator = torch.Generator().manual_seed(1)
    n, problems = 600, []
    q = torch.randn(n, heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(kv_heads, 2 * KEY_GRID, head_dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, 2 * KEY_GRID, head_dim, generator=generator).to(dtype)

    def prefill(start: int, end: int) -> torch.Tensor:
        span = round_up(end, KEY_GRID)
        mask = torch.arange(span)[None, :] <= torch.arange(start, end)[:, None]
        return grouped_attention(q[start:end], keys[:, :span], values[:, :span], mask, 0.0625)

    whole = prefill(0, n)
    for cuts in ((1, 100), (37, 300, 599)):
        parts = [prefill(a, b) for a, b in zip((0, *cuts), (*cuts, n))]
        if not torch.equal(torch.cat(parts), whole):
            problems.append(f"prefill chunked at {cuts}")

    def decode(lengths: list[int]) -> torch.Tensor:
        span = round_up(max(lengths), DECODE_SPAN_STEP)
        rows = len(lengths)
        qg = q[:rows].view(rows, kv_heads, heads // kv_heads, head_dim)
        k = keys[None, :, :span].expand(rows, -1, -1, -1)
        v = values[None, :, :span].expand(rows, -1, -1, -1)
        mask = torch.arange(span)[None, :] < torch.tensor(lengths)[:, None]
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=0.0625)[0]

    alone = decode([300])
    if not all(torch.equal(decode([300, *others]), alone) for others in ([900], [5, 700, 1000])):
        problems.append("decode batched with longer rows")
    return problems
