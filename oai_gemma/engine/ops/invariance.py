"""Batch-invariant mode: a row's logits do not depend on what is computed beside it.

A matmul's kernel (oneDNN, MKL) is picked by its row count, and SDPA blocks its reductions by the query and key
lengths, so a token's last bits change with the step's shape: with the other requests decoding beside it, with
how its prompt was chunked, with a prefix-cache hit. Measured on this project's CPUs (docs/engine.md,
"Batch-invariant mode"): a linear's rows come out identical at 2 to 32 rows (one float32 row takes a GEMV path;
bf16 from 64 rows another kernel; float32 at any count from 2); SDPA's rows come out identical when the keys
start on a 512-position grid, their span is padded (prefill: to 512; decode: to 256 in float32, 16 in bf16) and
a prefill's queries are at least 32 rows. So in this mode every linear runs in tiles of 2 to 32 rows (or whole,
where the kernels allow) and attention reads grid-aligned, padded keys. Another CPU's kernels may differ:
`tile_rows` and `span_step` measure these facts on the real weights at start-up, and the mode is off where
they fail.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TILE_ROWS = 32
MIN_ROWS = 2
KEY_GRID = 512
MIN_QUERY_ROWS = 32
PROMPT_KERNEL_TOKENS = 64
"""A prompt of fewer tokens runs its rows through the row-exact kernel as decode rows do, a longer one through the
dequantized matmul (its fixed cost, dequantizing every weight, outweighs the kernel's rows below this: measured,
AVX2 EPYC, docs/engine.md). Decided per request by its prompt alone, never by the step, so its bits are its own;
the prefix cache keys the two paths apart (engine/cache/prefix_hash.py `CacheSpace.kernel`)."""
PREFILL_MIN_ROWS = 16
"""Fewest rows the prefill path's matmul is called with (measured, AVX2 EPYC, float32: 1-3, 5-7 and 9-11 rows
give a row other bits than at 12 to 600, where they agree; a shorter chunk is padded)."""


@dataclass(frozen=True)
class Invariance:
    """What start-up measured this CPU's kernels to need."""

    tile: int
    """Most rows per linear call."""
    span_step: int
    """Decode spans are padded to a multiple of this."""
    by_role: bool = False
    """Rows computed by role (`by_role`): prefill rows through the layouts' fast `prefill` path, decode rows through
    their row-exact kernel; False: every row through the kernel (`tiled`)."""
    small_spans: tuple[int, ...] = ()
    """Spans (keys) below `span_step` a decode row of few keys is computed at, each span its own attention call
    (`span_groups`): a row of 100 keys reads 128, not 512."""


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def tiled(linear, x: torch.Tensor, tile: int = TILE_ROWS) -> torch.Tensor:
    """`linear(x)` computed in tiles of MIN_ROWS..`tile` rows (a single row is doubled, the copy dropped); or in one
    call of its `rowwise` kernel where it has one (the native int8 and integer dot-product layouts: each output one
    fixed-order sum of that row alone, at any row count), which needs no tiles."""
    rowwise = getattr(linear, "rowwise", None)
    if rowwise is not None:
        return rowwise(x)
    if x.shape[0] == 1:
        return linear(x.expand(MIN_ROWS, -1).contiguous())[:1]
    if x.shape[0] <= tile:
        return linear(x)
    tiles = list(x.split(tile))
    return torch.cat([linear(t) for t in tiles[:-1]] + [tiled(linear, tiles[-1], tile)])


def prefill_call(linear, x: torch.Tensor) -> torch.Tensor:
    """`linear.prefill(x)` (a layout's prefill path: its weight dequantized, oneDNN's float32 matmul) at no fewer than
    PREFILL_MIN_ROWS rows (a short chunk's last row repeated, the copies dropped), where each row's bits are its own."""
    rows = x.shape[0]
    if rows < PREFILL_MIN_ROWS:
        x = torch.cat((x, x[-1:].expand(PREFILL_MIN_ROWS - rows, -1)))
    return linear.prefill(x)[:rows]


def by_role(linear, x: torch.Tensor, prefill_rows: int, real_rows: int, tile: int = TILE_ROWS) -> torch.Tensor:
    """`linear(x)` for a step whose rows are `prefill_rows` prompt rows, then decode rows up to `real_rows`, then
    padding: each row by its role, never by its neighbours. Prompt rows through the layout's prefill path (as fast
    as mode off's), decode rows (drafts included) through its row-exact kernel (`rowwise`), padding beside the
    prompt rows or zero. Layouts without a prefill path: `tiled`."""
    if prefill_rows == 0 and real_rows == x.shape[0] or not hasattr(linear, "prefill"):
        return tiled(linear, x, tile)
    if prefill_rows == real_rows:  # no decode rows: the padding rides with the prompt rows
        return prefill_call(linear, x)
    parts = [linear.rowwise(x[prefill_rows:real_rows])]
    if prefill_rows:
        parts.insert(0, prefill_call(linear, x[:prefill_rows]))
    if real_rows < x.shape[0]:
        parts.append(parts[-1].new_zeros(x.shape[0] - real_rows, parts[-1].shape[1]))
    return torch.cat(parts)


class RoleLinear:
    """`linear` for engine/model/gemma3.py's layer functions in this mode when the step's rows go `by_role`; a call
    on other rows than the step's (a LoRA adapter's linears) is `tiled`."""

    fuses = True
    """Fused projections (engine/ops/fused.py) by role as one: decode rows in the whole's kernel call (each output
    its own sum), prompt rows through each part's own prefill path."""

    def __init__(self, tile: int, prefill_rows: int, real_rows: int, rows: int):
        self.tile, self.prefill_rows, self.real_rows, self.rows = tile, prefill_rows, real_rows, rows

    def __call__(self, x: torch.Tensor, linear) -> torch.Tensor:
        if x.shape[0] != self.rows:
            return tiled(linear, x, self.tile)
        return by_role(linear, x, self.prefill_rows, self.real_rows, self.tile)


class TiledLinear:
    """`linear` for engine/model/gemma3.py's layer functions in this mode: calls of at most `tile` rows."""

    fuses = True
    """Fused projections (engine/ops/fused.py) are tiled as one: each output's bits are its own either way."""

    def __init__(self, tile: int):
        self.tile = tile

    def __call__(self, x: torch.Tensor, linear) -> torch.Tensor:
        return tiled(linear, x, self.tile)


def window_blocks(window: int, size: int) -> int:
    """The most blocks of `size` positions a decode row of a sliding layer of `window` reads."""
    return -(-(window - 1) // size) + 1


def padded_blocks(count: int, size: int, step: int, most: int | None = None) -> int:
    """Blocks a decode step's keys are padded to: `count` rounded up to `step` positions; in a sliding layer at most
    `most` (`window_blocks`: what any row there reads) where those are at least `step` positions, so a row past
    its window reads 528 keys there as without the mode, not 1024 (start-up checks that span too: `span_step`)."""
    padded = round_up(count * size, step) // size
    return min(padded, most) if most is not None and most * size >= step else padded


def span_groups(counts: list[int], size: int, step: int, most: int | None = None,
                small: tuple[int, ...] = ()) -> list[tuple[int, list[int]]]:
    """Decode rows grouped by the blocks each is computed over, [(blocks, row indices)]: a row that needs `counts[i]`
    blocks goes to the smallest of the `small` spans that holds it (each its own attention call, so a row's span
    is its own: SDPA's CPU kernel reads a span below 512 keys as one block, and a row's bits follow that
    blocking); the others share one call padded as `padded_blocks` pads them (their blocks of 512 are alike)."""
    groups: dict[int, list[int]] = {}
    for row, count in enumerate(counts):
        span = next((s for s in sorted(small) if count * size <= s), None)
        groups.setdefault(span // size if span else 0, []).append(row)
    rest = groups.pop(0, None)
    out = sorted(groups.items())
    if rest:
        out.append((padded_blocks(max(counts[row] for row in rest), size, step, most), rest))
    return out


def attention_rows(kv_heads: int) -> int:
    """Fewest rows a decode attention call is computed with in this mode (its rows repeated, the copies dropped).
    SDPA's CPU flash kernel computes a call of fewer (row, kv head) pairs than the threads it runs on another way:
    measured, torch 2.13, bf16, 2 threads, one KV head: a decode row alone differed from the same row beside any
    other rows in about one output element of 50,000, by one ulp (enough to change a greedy text within 12 tokens);
    from as many pairs as threads on, every row agreed at every batch size. The threads are the calling thread's
    (the engine's compute threads when it runs a step, the start-up check's when it checks)."""
    return -(-torch.get_num_threads() // kv_heads)


def decode_call(qg, keys, values, mask, scaling: float, invariant: bool) -> torch.Tensor:
    """SDPA of decode rows qg [B, kv_heads, group, D] over keys/values [B, kv_heads, span, D] where mask [B, span];
    `invariant`: with the last row repeated up to `attention_rows` rows, the copies dropped."""
    rows = qg.shape[0]
    if invariant and rows < (least := attention_rows(keys.shape[1])):
        index = torch.arange(least).clamp(max=rows - 1)
        qg, keys, values, mask = qg[index], keys[index], values[index], mask[index]
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :], scale=scaling)[:rows]


def pad_keys(keys: torch.Tensor, values: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [..., positions, D] padded with zeros to `span` positions (the mask hides them)."""
    missing = span - keys.shape[-2]
    if missing <= 0:
        return keys, values
    return F.pad(keys, (0, 0, 0, missing)), F.pad(values, (0, 0, 0, missing))


def grouped_attention(q, keys, values, mask, scaling: float) -> torch.Tensor:
    """Prefill attention with each kv head's query heads as rows of one query [kv_heads, tokens * group, D],
    padded to a multiple of MIN_QUERY_ROWS rows (SDPA's query block here: a shorter last block, of 4 or 8 rows
    in float32, is computed differently).
    q [tokens, heads, D], keys/values [kv_heads, span, D], mask [tokens, span] -> [tokens, heads, D]."""
    n, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    tokens = round_up(n, -(-MIN_QUERY_ROWS // group))
    if tokens > n:  # repeat the last query (its output is dropped)
        q = torch.cat((q, q[-1:].expand(tokens - n, -1, -1)))
        mask = torch.cat((mask, mask[-1:].expand(tokens - n, -1)))
    rows = q.view(tokens, kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, tokens * group, head_dim)
    row_mask = mask.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(rows[None], keys[None], values[None], attn_mask=row_mask, scale=scaling)
    return out[0].view(kv_heads, tokens, group, head_dim).permute(1, 0, 2, 3).reshape(tokens, heads, head_dim)[:n]


# ---- start-up check: which tile and span step this CPU's kernels allow --------------------------------

SMALL_TILES = (2, 4, 8, 16, 32)
"""Row counts a tile can have: steps are padded to token buckets (1, 2, 4, ... 64, then multiples of 64)."""
SAMPLE_ROWS = (0, 1, 2, 3, 7, 8, 15, 16, 31)
"""Rows held against themselves computed alone: each place in a kernel's row blocks of 1 to 16."""
SPAN_STEPS = (16, 64, 256, 512)
DECODE_LENGTHS = (5, 130, 250, 300, 520, 700, 1000)
"""A decode row's keys held alone against beside longer rows: every part of a 512-key block (measured, AVX2 EPYC, torch
2.13: padded to 256, a row of 129-256 or 641-768 keys differs alone from beside a longer row; to 512 none does)."""


def tile_rows(linears: dict[str, tuple[object, int, int]], dtype: torch.dtype, whole_only: bool = False) -> int | None:
    """Rows per linear call at which every row equals the row computed alone, for linears {name: (linear,
    in_features, most rows it is called with)}: the most rows (no tiling) where the kernels allow it (measured:
    float32), else TILE_ROWS (bf16), else None (also with `whole_only` when tiles would be needed). Random
    inputs, at the token buckets' row counts."""
    generator = torch.Generator().manual_seed(0)
    whole = True
    for linear, features, most in linears.values():
        x = torch.randn(max(most, TILE_ROWS), features, generator=generator).to(dtype)
        alone = torch.cat([tiled(linear, x[i : i + 1]) for i in SAMPLE_ROWS])

        def agree(rows: int, out: torch.Tensor) -> bool:
            sampled = [i for i, row in enumerate(SAMPLE_ROWS) if row < rows]
            return torch.equal(out[[SAMPLE_ROWS[i] for i in sampled]], alone[sampled])

        def call(rows: int) -> torch.Tensor:  # what the mode runs for a step of `rows` rows, untiled
            return tiled(linear, x[:rows], rows)

        if whole and most > TILE_ROWS:
            reference = tiled(linear, x)
            # oneDNN picks its kernel by the row count: every bucket; a row-exact kernel changes only its tiles
            counts = sorted({r for r in (64, 128, most) if r <= most}) if hasattr(linear, "rowwise") else range(64, most + 1, 64)
            whole = agree(TILE_ROWS, reference) and all(torch.equal(call(rows), reference[:rows]) for rows in counts)
            if not whole and whole_only:
                return None
        if not all(agree(rows, call(rows)) for rows in SMALL_TILES):
            return None
    return max(most for _, _, most in linears.values()) if whole else TILE_ROWS


PREFILL_COUNTS = (1, 2, 3, 5, 9, 11, 16, 17, 31, 100, 129)
"""Row counts of a prompt chunk held against the whole chunk: below, at and above PREFILL_MIN_ROWS and the kernels'
row blocks."""


def prefill_rows_exact(linears: dict[str, tuple[object, int, int]], dtype: torch.dtype) -> bool:
    """Whether the layouts' prefill path (`prefill_call`) gives a row the same bits at every prompt-chunk row count and
    at any place among the other rows, for linears {name: (linear, in_features, most rows)}: random rows picked in
    random order, held against the same rows in one call of the most rows. False where a linear has no such path."""
    generator = torch.Generator().manual_seed(3)
    for linear, features, most in linears.values():
        if not hasattr(linear, "prefill"):
            return False
        x = torch.randn(most, features, generator=generator).to(dtype)
        whole = prefill_call(linear, x)
        for rows in sorted({count for count in (*PREFILL_COUNTS, most - 1) if 0 < count < most}):
            picked = torch.randperm(most, generator=generator)[:rows]
            if not torch.equal(prefill_call(linear, x[picked]), whole[picked]):
                return False
    return True


def span_step(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, most_span: int | None = None) -> int | None:
    """The finest padding of decode spans at which a decode row's result ignores the batch's longer rows, or
    None; and None too when chunked prefill rows differ from whole ones (random inputs). `most_span`: a sliding
    layer's cap on the padded span (`padded_blocks`), held against the padded span too."""
    generator = torch.Generator().manual_seed(1)
    n = 600
    q = torch.randn(n, heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(kv_heads, 4 * KEY_GRID, head_dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, 4 * KEY_GRID, head_dim, generator=generator).to(dtype)

    def prefill(start: int, end: int) -> torch.Tensor:
        span = round_up(end, KEY_GRID)
        mask = torch.arange(span)[None, :] <= torch.arange(start, end)[:, None]
        return grouped_attention(q[start:end], keys[:, :span], values[:, :span], mask, 0.0625)

    for end, cuts in [(80, (cut,)) for cut in range(1, 80)] + [(n, (37, 300, 599))]:  # every chunk size to 79
        if not torch.equal(torch.cat([prefill(a, b) for a, b in zip((0, *cuts), (*cuts, end))]), prefill(0, end)):
            return None

    def decode(lengths: list[int], step: int, span: int = 0) -> torch.Tensor:
        return decode_rows(q, keys, values, lengths, span or round_up(max(lengths), step))

    def agrees(length: int, step: int) -> bool:
        alone = decode([length], step)
        capped = most_span is not None and round_up(length, step) < most_span
        return all(torch.equal(decode([length, *others], step), alone) for others in ([length + 30], [1500], [5, 700, 1900])) and (
            not capped or torch.equal(decode([length], step, most_span), alone))

    if not rows_alone_agree(heads, kv_heads, head_dim, dtype):
        return None
    for step in SPAN_STEPS:
        if all(agrees(length, step) for length in DECODE_LENGTHS):
            return step
    return None


def decode_rows(q, keys, values, lengths: list[int], span: int) -> torch.Tensor:
    """Row 0's output of decode rows q[i] over keys[:, :span] masked to their `lengths`, as decode attention calls SDPA
    (q [rows, heads, D], keys/values [kv_heads, positions, D])."""
    rows, (kv_heads, _, head_dim), heads = len(lengths), keys.shape, q.shape[1]
    qg = q[:rows].view(rows, kv_heads, heads // kv_heads, head_dim)
    k = keys[None, :, :span].expand(rows, -1, -1, -1)
    v = values[None, :, :span].expand(rows, -1, -1, -1)
    mask = torch.arange(span)[None, :] < torch.tensor(lengths)[:, None]
    return decode_call(qg, k, v, mask, 0.0625, invariant=True)[0]


ALONE_ROWS, ALONE_SPAN = 600, 16
"""Decode rows of their own random keys start-up holds alone against together (`rows_alone_agree`): the kernel
quirk `attention_rows` avoids showed in about one output of 50,000, at spans of 16 keys."""


def rows_alone_agree(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ALONE_ROWS decode rows, each over ALONE_SPAN keys of its own (random lengths), give the same bits
    computed one by one as in one call, as the mode calls SDPA (`decode_call`)."""
    generator = torch.Generator().manual_seed(5)
    q = (torch.randn(ALONE_ROWS, kv_heads, heads // kv_heads, head_dim, generator=generator) * 3).to(dtype)
    keys = (torch.randn(ALONE_ROWS, kv_heads, ALONE_SPAN, head_dim, generator=generator) * 3).to(dtype)
    values = torch.randn(ALONE_ROWS, kv_heads, ALONE_SPAN, head_dim, generator=generator).to(dtype)
    mask = torch.arange(ALONE_SPAN)[None, :] < torch.randint(1, ALONE_SPAN + 1, (ALONE_ROWS, 1), generator=generator)
    together = decode_call(q, keys, values, mask, 0.0625, invariant=True)
    return all(torch.equal(decode_call(q[r : r + 1], keys[r : r + 1], values[r : r + 1], mask[r : r + 1], 0.0625, True)[0],
                           together[r]) for r in range(ALONE_ROWS))


SMALL_SPANS = (64, 128, 256)
"""Spans a decode row of few keys may be computed at, each its own call (`span_groups`)."""


def small_spans(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, step: int) -> tuple[int, ...]:
    """The SMALL_SPANS below `step` at which a decode row's result is the same alone and beside other rows of that
    span (the call's batch is all that changes: measured, random inputs, rows at both ends of the span)."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(8, heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(kv_heads, max(SMALL_SPANS), head_dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, max(SMALL_SPANS), head_dim, generator=generator).to(dtype)
    spans = []
    for span in (s for s in SMALL_SPANS if s < step):
        lengths = (1, span // 2 + 1, span - 1, span)
        if all(torch.equal(decode_rows(q, keys, values, [length, *others], span), decode_rows(q, keys, values, [length], span))
               for length in lengths for others in ([span], [3, span // 2, span - 5, span, 7, 1, span])):
            spans.append(span)
    return tuple(spans)


COST_ROWS = 512
"""Rows of the prefill chunk whose linears start-up times with the mode and without (the default chunk)."""
COST_DECODE_ROWS = 8
"""Of them, decode rows (by role: the mode's dearest step, a prompt chunk beside decodes, each part in its own call)."""


def prefill_cost(linears: list, features: list[int], dtype: torch.dtype, tile: int, rows: int = COST_ROWS,
                 repeats: int = 3, decode_rows: int = 0) -> float:
    """What the mode adds to a prefill chunk's linears, as a fraction of their time without it (0.021: 2.1%
    slower): one layer's `linears` (each taking `features` inputs) called on `rows` random rows as the mode calls
    them (`tiled`; with `decode_rows`, the last of them decode rows, `by_role`) and as they are called without it,
    interleaved, the median of `repeats` rounds. Only the linears: attention's padding and a decode step's doubled
    row are not in it (docs/engine.md measures those)."""
    generator = torch.Generator().manual_seed(2)
    xs = [torch.randn(rows, k, generator=generator).to(dtype) for k in features]

    def mode(lin, x):
        return by_role(lin, x, rows - decode_rows, rows, tile) if decode_rows else tiled(lin, x, tile)

    on, off = [], []
    for _ in range(repeats):
        for times, call in ((off, lambda lin, x: lin(x)), (on, mode)):
            started = time.perf_counter()
            for linear, x in zip(linears, xs):
                call(linear, x)
            times.append(time.perf_counter() - started)
    return statistics.median(on) / statistics.median(off) - 1
