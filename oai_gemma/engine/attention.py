"""Attention over the KV cache for the dynamic path: each prefill chunk over its past and itself, and every
decode token of a step batched, each row masked to its own length. Sliding layers read and write their ring."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .invariance import KEY_GRID, grouped_attention, pad_keys, round_up
from .kv_cache import KVCache


@dataclass
class DecodeRows:
    """Where the step's decode tokens go: each row's slot and position (device tensors), and from the host the
    longest row's length and whether the slots are 0..B-1 in order (then the cache is sliced, not gathered)."""

    slots: torch.Tensor
    positions: torch.Tensor
    longest: int
    contiguous: bool

    def to(self, device: torch.device) -> DecodeRows:
        return DecodeRows(self.slots.to(device), self.positions.to(device), self.longest, self.contiguous)


def _block_ids(positions: torch.Tensor, spans) -> torch.Tensor:
    """Index of the image block each position is in, -1 for text."""
    ids = torch.full_like(positions, -1)
    for index, (start, end) in enumerate(spans):
        ids[(positions >= start) & (positions < end)] = index
    return ids


def prefill_attention(
    cache: KVCache, li: int, slot: int, start: int, image_spans, q, k, v, scaling: float, invariant: bool = False,
) -> torch.Tensor:
    """Attention of one chunk (positions start..start+n-1) of the sequence in `slot` over its cached past and
    itself, writing the chunk's K/V into the cache; image blocks attend to themselves both ways. `invariant`:
    keys from a position on the grid, padded (engine/invariance.py), so a row's result ignores the chunking."""
    kc, vc = cache.k[li], cache.v[li]
    n = q.shape[0]
    qpos = torch.arange(start, start + n, device=q.device)
    if cache.sliding[li]:
        window = cache.capacity[li]
        first = max(0, start - window + 1)
        if invariant:  # positions before the window read stale ring entries: masked below
            first -= first % KEY_GRID
        past = torch.arange(first, start, device=q.device)
        keys = torch.cat((kc[slot][:, past % window], k.transpose(0, 1)), dim=1)
        values = torch.cat((vc[slot][:, past % window], v.transpose(0, 1)), dim=1)
        kpos = torch.cat((past, qpos))
        keep = qpos[-window:]
        kc[slot][:, keep % window] = k[-window:].transpose(0, 1)
        vc[slot][:, keep % window] = v[-window:].transpose(0, 1)
    else:
        kc[slot, :, start : start + n] = k.transpose(0, 1)
        vc[slot, :, start : start + n] = v.transpose(0, 1)
        first = 0
        span = round_up(start + n, KEY_GRID) if invariant else start + n
        keys, values = kc[slot, :, :span], vc[slot, :, :span]
        kpos = torch.arange(start + n, device=q.device)
    if invariant:
        span = round_up(start + n - first, KEY_GRID)
        keys, values = pad_keys(keys, values, span)
        kpos = torch.cat((kpos, torch.full((span - kpos.shape[0],), start + n, device=q.device)))  # after every query
    mask = kpos[None, :] <= qpos[:, None]
    if cache.sliding[li]:
        mask &= kpos[None, :] > qpos[:, None] - window
    if image_spans:
        q_blocks = _block_ids(qpos, image_spans)[:, None]
        same_image = (q_blocks == _block_ids(kpos, image_spans)[None, :]) & (q_blocks >= 0)
        if cache.sliding[li]:
            mask |= same_image & (kpos[None, :] > qpos[:, None] - window)
        else:
            mask |= same_image
    if invariant:
        return grouped_attention(q, keys, values, mask, scaling)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def decode_attention(cache: KVCache, li: int, rows: DecodeRows, q, k, v, scaling: float, span_step: int = 0) -> torch.Tensor:
    """One new token for each of B sequences, batched: q [B, heads, D] over each row's own cache. `span_step`
    (batch-invariant mode, engine/invariance.py): the span padded to its multiple, so a row's result ignores how
    long the batch's other rows are."""
    slots, pos, longest = rows.slots, rows.positions, rows.longest
    if span_step:
        longest = round_up(longest, span_step)
    kc, vc = cache.k[li], cache.v[li]
    bsz, heads, head_dim = q.shape
    kv_heads = kc.shape[1]
    if cache.sliding[li]:
        window = cache.capacity[li]
        kc[slots, :, pos % window] = k
        vc[slots, :, pos % window] = v
        span = min(window, longest)  # before the window fills, entries >= longest are still empty
    else:
        kc[slots, :, pos] = k
        vc[slots, :, pos] = v
        span = longest
    if rows.contiguous:
        keys, values = kc[:bsz, :, :span], vc[:bsz, :, :span]
    else:
        keys, values = kc[slots, :, :span], vc[slots, :, :span]
    if span_step:
        keys, values = pad_keys(keys, values, span)
    mask = torch.arange(span, device=q.device)[None, :] <= pos[:, None]  # [B, span]
    # group the query heads by their kv head: [B, kv_heads, group, D] attends [B, kv_heads, span, D]
    qg = q.view(bsz, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :], scale=scaling)
    return out.reshape(bsz, heads, head_dim)

