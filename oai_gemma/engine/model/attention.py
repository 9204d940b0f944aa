"""Attention over the paged KV cache for the dynamic path: each prefill chunk over its past and itself, and
every decode token of a step batched, each row over its own blocks, masked to its own positions. Sliding layers
read only the blocks that hold their window."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.invariance import KEY_GRID, decode_call, grouped_attention, pad_keys, round_up, span_groups, window_blocks
from ..cache.kv_cache import KVCache
from ..ops import native


@dataclass
class DecodeKeys:
    """Which blocks some of a step's decode rows read in one kind of layer, and which of their positions each may
    attend."""

    tables: torch.Tensor
    """[rows, blocks] block ids (padding: the scratch block); [1, blocks] where every row reads the same blocks (a
    drafted sequence's positions: gathered once)."""
    mask: torch.Tensor
    """[rows, blocks * block_size]."""
    rows: torch.Tensor | None = None
    """Which of the step's decode rows these are (batch-invariant mode's span groups); None: all, in order."""

    def to(self, device: torch.device) -> DecodeKeys:
        return DecodeKeys(self.tables.to(device), self.mask.to(device), None if self.rows is None else self.rows.to(device))


def decode_keys(tables: list[list[int]], positions: list[int], window: int | None, cache: KVCache, span_step: int = 0,
                small: tuple[int, ...] = ()) -> list[DecodeKeys]:
    """The blocks rows at `positions` read: all of theirs up to the position, or (sliding layers, `window`) those
    from the window's first position on. `span_step` (batch-invariant mode): the rows in groups, each group's span
    one the mode allows (`span_groups`: a row's span its own where it is one of the `small` spans, else padded to
    the step's multiple)."""
    size = cache.block_size
    firsts = [max(0, p - window + 1) // size if window else 0 for p in positions]
    counts = [p // size - first + 1 for p, first in zip(positions, firsts)]
    if not span_step:
        return [_keys(tables, positions, firsts, max(counts), window, cache)]
    groups = span_groups(counts, size, span_step, window_blocks(window, size) if window else None, small)
    return [keys for count, rows in groups for keys in _shared(tables, positions, firsts, count, window, cache, rows,
                                                              len(groups) == 1)]


def _shared(tables, positions, firsts, count: int, window: int | None, cache: KVCache, rows: list[int],
            only: bool) -> list[DecodeKeys]:
    """A span group's rows, those that read the very same blocks (a drafted sequence's positions: engine/speculative/)
    in a call of their own whose keys are gathered once and read by each of its rows (`DecodeKeys.tables` of one row,
    expanded: the same values at the same span, so the same bits as gathered per row), the others in one call.
    `only`: the step's one span group (no row sharing its blocks: all rows, in order)."""
    by_blocks: dict[tuple[int, ...], list[int]] = {}
    for i in rows:
        by_blocks.setdefault(tuple(tables[i][firsts[i] : firsts[i] + count]), []).append(i)
    shared = [group for group in by_blocks.values() if len(group) > 1]
    rest = [i for group in by_blocks.values() if len(group) == 1 for i in group]
    if only and not shared:
        return [_keys(tables, positions, firsts, count, window, cache)]

    def call(ix: list[int]) -> DecodeKeys:
        return _keys([tables[i] for i in ix], [positions[i] for i in ix], [firsts[i] for i in ix], count, window, cache,
                     torch.tensor(ix))

    out = [call(rest)] if rest else []
    for group in shared:
        keys = call(group)
        out.append(DecodeKeys(keys.tables[:1], keys.mask, keys.rows))
    return out


def _keys(tables, positions, firsts, count: int, window: int | None, cache: KVCache, rows=None) -> DecodeKeys:
    """Rows' `count` blocks from their first (`firsts`), padded with the scratch block, and their masks."""
    size = cache.block_size
    blocks = torch.tensor([t[f : f + count] + [cache.scratch] * (count - len(t[f : f + count])) for t, f in zip(tables, firsts)],
                          dtype=torch.long)
    pos = torch.tensor(positions)[:, None]
    kpos = torch.tensor(firsts)[:, None] * size + torch.arange(count * size)[None, :]
    mask = kpos <= pos
    if window:
        mask &= kpos > pos - window
    return DecodeKeys(blocks, mask, rows)


def _block_ids(positions: torch.Tensor, spans) -> torch.Tensor:
    """Index of the image block each position is in, -1 for text."""
    ids = torch.full_like(positions, -1)
    for index, (start, end) in enumerate(spans):
        ids[(positions >= start) & (positions < end)] = index
    return ids


def prefill_attention(
    cache: KVCache, li: int, table: torch.Tensor, start: int, image_spans, q, scaling: float, invariant: bool = False,
    end: int | None = None,
) -> torch.Tensor:
    """Attention of one chunk (positions start..start+n-1, its K/V already written) of the sequence whose blocks
    are `table` over its past and itself; image blocks attend to themselves both ways. `invariant`: keys from a
    position on the grid, padded (engine/ops/invariance.py), so a row's result ignores the chunking. `end`: keys
    through this position (a row slice of a chunk already written, engine/model/prefill_units.py); default the
    chunk's own end."""
    n = q.shape[0]
    end = start + n if end is None else end
    qpos = torch.arange(start, start + n, device=q.device)
    sliding = cache.sliding[li]
    first = max(0, start - cache.window + 1) if sliding else 0
    if invariant:  # positions before the window are masked below
        first -= first % KEY_GRID
    keys, values = cache.positions(li, table, first, end)
    kpos = torch.arange(first, end, device=q.device)
    if invariant:
        span = round_up(end - first, KEY_GRID)
        keys, values = pad_keys(keys, values, span)
        kpos = torch.cat((kpos, torch.full((span - kpos.shape[0],), end, device=q.device)))  # after every query
    mask = kpos[None, :] <= qpos[:, None]
    if sliding:
        in_window = kpos[None, :] > qpos[:, None] - cache.window
        mask &= in_window
    if image_spans:
        q_blocks = _block_ids(qpos, image_spans)[:, None]
        same_image = (q_blocks == _block_ids(kpos, image_spans)[None, :]) & (q_blocks >= 0)
        mask |= same_image & in_window if sliding else same_image
    if invariant:
        return grouped_attention(q, keys, values, mask, scaling)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def decode_attention(cache: KVCache, li: int, groups: list[DecodeKeys], q, scaling: float,
                     invariant: bool = False) -> torch.Tensor:
    """One new token for each of B sequences (K/V already written), batched: q [B, heads, D] over each row's
    blocks; in groups (`decode_keys`), each one call. `invariant` (batch-invariant mode): each call of at least
    `attention_rows` rows (engine/ops/invariance.py `decode_call`)."""
    if len(groups) == 1 and groups[0].rows is None:
        return _decode(cache, li, groups[0], q, scaling, invariant)
    out = torch.empty_like(q)
    for keys in groups:
        out[keys.rows] = _decode(cache, li, keys, q[keys.rows], scaling, invariant)
    return out


def _decode(cache: KVCache, li: int, rows: DecodeKeys, q, scaling: float, invariant: bool = False) -> torch.Tensor:
    native_out = _native_decode(cache, li, rows, q, scaling)
    if native_out is not None:
        return native_out
    bsz, heads, head_dim = q.shape
    keys, values = (t.expand(bsz, -1, -1, -1) for t in cache.blocks(li, rows.tables))  # [B, kv_heads, span, D]
    kv_heads = keys.shape[1]
    # group the query heads by their kv head: [B, kv_heads, group, D] attends [B, kv_heads, span, D]
    out = decode_call(q.view(bsz, kv_heads, heads // kv_heads, head_dim), keys, values, rows.mask, scaling, invariant)
    return out.reshape(bsz, heads, head_dim)


def _native_decode(cache: KVCache, li: int, rows: DecodeKeys, q, scaling: float) -> torch.Tensor | None:
    """The rows' attention in one native call reading the cache's blocks in place (engine/ops/native/attention.c:
    no gather, no flash kernel's dispatch: a 1B decode step ran 26 of each), or None where it does not apply (not a
    CPU float32 cache, no compiler, a compiled graph): torch's gather and scaled_dot_product_attention then."""
    k, v = cache.k[li], cache.v[li]
    if (not native.runs_on(q) or k.dtype != torch.float32 or q.shape[-1] % 8
            or not (k.is_contiguous() and v.is_contiguous()) or rows.mask.dtype != torch.bool):
        return None
    kernel = native.decode_attention()
    if kernel is None:
        return None
    q = q.contiguous()
    tables, mask = rows.tables.to(torch.int64).contiguous(), rows.mask.contiguous()
    out = torch.empty_like(q)
    kernel(q.data_ptr(), q.shape[0], q.shape[1], k.shape[2], q.shape[2], k.data_ptr(), v.data_ptr(), k.shape[1],
           tables.data_ptr(), tables.shape[0], tables.shape[1], mask.data_ptr(), scaling, out.data_ptr())
    return out
