"""A prefill chunk holding an image block, run as resumable units between the engine's steps.

An image block is never split into token chunks (its tokens attend to each other both ways, so each needs the
whole block's keys), so at 4B its ~270 tokens were one engine step of ~10 s, and every running stream waited that
long for its next token. Here the chunk's forward runs a unit at a time, its hidden state kept between units:
per layer `qkv` (norm, q/k/v, rope, the whole chunk's K/V written into the cache) and then `mix` units over row
slices (the slice's queries over the whole chunk's keys, output projection and MLP of those rows); the logits last.
Every op is row-wise except attention, whose query rows read the same keys as in the one-call step, so in
batch-invariant mode the bits are the one-call step's (tests/engine/test_prefill_units.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .attention import prefill_attention
from .gemma3 import post_attention, pre_attention, signed_sin
from .vision_encode import UnitCosts, Units
from ..ops.invariance import RoleLinear, TiledLinear
from ..ops.linear import call_linear
from ..sequence import StepItem

MIX_ROWS = 64
"""Rows a `mix` unit runs (a 4B layer's 64 rows: ~60 ms quiet on 2 cores, less than a decode step)."""


class PrefillUnits(Units):
    """One prefill `item` (a StepItem with image embeddings, its blocks already held) on `runner`, unit by unit, as
    `Units` (vision_encode.py); once `done`, `logits` holds the item's logits rows (empty when it wants none)."""

    def __init__(self, runner, item: StepItem, costs: UnitCosts | None = None, mix_rows: int = MIX_ROWS):
        """`costs`: the unit times of earlier chunks (vision_encode.py's `UnitCosts`: each kind's recent longest,
        `qkv`, `mix`, `logits`), default none."""
        self.runner, self.item, self.mix_rows = runner, item, mix_rows
        self.logits: torch.Tensor | None = None
        with torch.inference_mode():
            self._start()
        super().__init__(costs)

    def _start(self) -> None:
        r, it = self.runner, self.item
        n = self.rows = len(it.token_ids)
        positions = torch.arange(it.start, it.start + n, device=r.input_device)
        ids = torch.tensor(it.token_ids, dtype=torch.long, device=r.input_device)
        hidden = r.gemma.embed(ids).to(r.dtype)
        if it.image_embeds is not None:
            rows, values = it.image_embeds
            hidden[rows] = values.to(hidden.device, hidden.dtype)
        self.hidden = hidden
        rope = {t: r.rotary(hidden, positions[None], t) for t in set(r.layer_types)}
        self.rope = {t: (cos[0, :, None, :], signed_sin(sin[0, :, None, :])) for t, (cos, sin) in rope.items()}
        size = r.cache.block_size
        blocks = [it.blocks[p // size] for p in range(it.start, it.start + n)]
        self.writes = (torch.tensor(blocks, dtype=torch.long, device=r.input_device), positions % size)
        self.table = torch.tensor(it.blocks, dtype=torch.long, device=r.input_device)
        self.plan = [unit for li in range(len(r.weights)) for unit in
                     [(li, None)] + [(li, lo) for lo in range(0, n, self.mix_rows)]] + [(None, None)]
        self.q = self.out = None

    def _linear(self, rows: int):
        """The projections' call for `rows` prompt rows: as the runner's step runs a prompt's rows (by role in
        batch-invariant mode: each row's bits its own at any row count)."""
        inv = self.runner.invariance
        if inv is None:
            return call_linear
        if not inv.by_role:
            return TiledLinear(inv.tile)
        prompt = 0 if self.item.kernel else rows
        return RoleLinear(inv.tile, prompt, rows, rows)

    def _kind(self, unit) -> tuple[str, float]:
        """The unit's kind and multiply-adds (what `UnitCosts` estimates a kind not run yet from)."""
        (li, lo), text = unit, self.runner.text_shape
        width = text.heads * text.head_dim
        if li is None:
            return "logits", self.item.num_logits * text.hidden * text.vocab
        if lo is None:
            return "qkv", self.rows * text.hidden * (width + 2 * text.kv_heads * text.head_dim)
        rows = min(self.mix_rows, self.rows - lo)
        return "mix", rows * (width * text.hidden + 3 * text.hidden * text.intermediate)

    def _plan(self) -> Iterator[tuple[str, float]]:
        """The units in order; each yields its (kind, multiply-adds) before it runs."""
        for unit in self.plan:
            yield self._kind(unit)
            self._unit(*unit)

    def _unit(self, li: int | None, lo: int | None) -> None:
        r, it, n = self.runner, self.item, self.rows
        if li is None:
            self.logits = r.logits_of(self.hidden[n - it.num_logits:]) if it.want_logits else torch.empty(0, r.text_shape.vocab)
            return
        w = r.weights[li]
        if lo is None:  # the whole chunk's q/k/v; its K/V into the cache, as the one-call step writes them
            cos, sin = self.rope[r.layer_types[li]]
            self.q, k, v = pre_attention(self.hidden, w, cos, sin, r.eps, *r.shape, linear=self._linear(n))
            r.cache.write(li, *self.writes, k, v)
            self.out = torch.empty_like(self.hidden)
            return
        hi = min(lo + self.mix_rows, n)
        attn = prefill_attention(r.cache, li, self.table, it.start + lo, it.image_spans, self.q[lo:hi], r.scaling,
                                 r.batch_invariant, end=it.start + n)
        self.out[lo:hi] = post_attention(self.hidden[lo:hi], attn, w, r.eps, linear=self._linear(hi - lo))
        if hi == n:
            self.hidden, self.q, self.out = self.out, None, None
