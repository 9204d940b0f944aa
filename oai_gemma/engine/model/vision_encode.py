"""The vision tower as resumable work: an image's encode cut into units the engine runs between its steps.

The one-call encode (vision_weights.py's `image_features`, as transformers' `get_image_features`) runs SigLIP's 27 layers
over an 896x896 image's 4096 patches at once: tens of seconds on a CPU, during which no other stream would get a
token. `VisionEncode` runs the same math a unit at a time:

    embed           the patch convolution and position rows (all crops)
    qkv   rows a:b  layer_norm1 and the q, k, v projections of those rows (every row of every crop)
    mix   rows a:b  attention of those query rows over the crop's keys, out_proj, the residual, then the MLP of
                    the same rows (row-wise after attention, so it needs no other row) and its residual
    finish          post_layernorm and the projector (pool to the soft tokens, norm, project)

The engine runs units while the next one is expected to end within the step's budget (`UnitCosts`: each kind's
recent longest time, kept across images; a kind never run yet, its multiply-adds at the slowest rate seen).

Each unit is the same torch op on a slice of the rows the one-call encode runs on all of them; on this CPU's
kernels (GEMM, scaled_dot_product_attention) a row's result does not depend on the rows around it, so the output
is bitwise the one-call encode's (tests/engine/test_vision_encode.py holds it to that). The slice size is fixed by the
tower's shape (about `UNIT_FLOPS` a unit), never by timing, so however the engine spreads the units over steps
the result is the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .vision_weights import VisionLayer, VisionWeights, embed, finish, heads, mix, qkv

UNIT_FLOPS = 4e9
"""About how much work one unit is at most, above `MIN_ROWS`: the grain of the engine's per-step budget."""
MIN_ROWS = 256
"""Fewer rows a unit cost more than they save: measured on the 4B's tower (2-core AVX2 EPYC, float32), one layer
in 32-row units took 6.5x the one-call layer (attention over 4096 keys and the GEMMs starve at so few rows)."""
WIDE_ROWS = 1024
"""A `mix` unit's rows where the step's budget holds one (no text stream waits: `IDLE_SECONDS`): torch's CPU flash
attention blocks its queries by 256 from 768 query rows on and by 64 below, and the 4B's attention over 4,096 keys
took 0.36 s a layer in 256-row units against 0.26 s in 1,024-row ones (2-core AVX512-bf16 EPYC, bf16 precision; the
same bits either way, as the GEMMs': docs/benchmarks.md)."""


class UnitCosts:
    """What a unit of each kind is expected to take: the longest of its recent units (a max that decays by `DECAY` a
    unit of the kind, so one slow unit does not hold the budget down for good). The engine keeps one across images
    (engine/encoding.py), so an image's first units are known from the last image's. A kind with no time yet
    (the server's first image) is estimated from its multiply-adds at the slowest rate of the kinds run so far:
    with the longest unit of any kind as the estimate, the first layer's first `mix` unit (5x a `qkv` unit's work)
    started within a budget sized for a `qkv` unit and overran it."""

    DECAY = 0.9

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.rates: dict[str, float] = {}
        """Kind -> its seconds (decaying max) and seconds per multiply-add of its last unit."""

    def add(self, kind: str, macs: float, took: float) -> None:
        self.seconds[kind] = max(took, self.DECAY * self.seconds.get(kind, 0.0))
        self.rates[kind] = took / max(macs, 1.0)

    def estimate(self, kind: str, macs: float) -> float:
        """Seconds the next unit of `kind` (of `macs` multiply-adds) is expected to take; 0.0 when nothing ran yet."""
        if kind in self.seconds:
            return self.seconds[kind]
        return max(self.rates.values(), default=0.0) * macs


def unit_rows(patches: int, width: int, intermediate: int) -> int:
    """Rows per unit: the largest power of two whose attention + out_proj + MLP stays within `UNIT_FLOPS`, but at
    least `MIN_ROWS` (and at most every patch)."""
    per_row = 4 * patches * width + 2 * width * width + 4 * width * intermediate
    rows = MIN_ROWS
    while rows * 2 * per_row <= UNIT_FLOPS and rows < patches:
        rows *= 2
    return min(rows, patches)


class Units:
    """Work cut into units that run a few at a time between the engine's steps: the vision encode here, an image's
    prefill chunk in prefill_units.py. A subclass's `_plan()` yields each unit's (kind, multiply-adds) and then runs
    it; `costs` is what a unit of each kind is expected to take (kept across jobs by the engine).

    `advance()` runs the next unit; `run(seconds)` runs units while the next is expected to end within `seconds` (at
    least one)."""

    def __init__(self, costs: UnitCosts | None = None):
        """Call last in a subclass's `__init__`: it starts `_plan()` up to its first unit's (kind, multiply-adds)."""
        self.costs = costs or UnitCosts()
        self.units_done = 0
        self.budget = 0.0
        """The seconds of the step `run` works in (0 outside one): a unit planned now may be larger where it holds one."""
        self.seconds = 0.0
        """Wall time spent in its units so far (however it was spread over steps)."""
        self._units = self._plan()
        self.next: tuple[str, float] | None = next(self._units, None)
        """The next unit's (kind, multiply-adds); None once done."""

    @property
    def done(self) -> bool:
        return self.next is None

    def _plan(self) -> Iterator[tuple[str, float]]:
        raise NotImplementedError

    def advance(self) -> bool:
        """Run the next unit; True once all are done."""
        if self.done:
            return True
        kind, macs = self.next
        started = time.perf_counter()
        with torch.inference_mode():
            self.next = next(self._units, None)
        self.units_done += 1
        took = time.perf_counter() - started
        self.seconds += took
        self.costs.add(kind, macs, took)
        return self.done

    def run(self, seconds: float) -> bool:
        """Units while the next one, as long as `costs` expects, still ends within `seconds` (at least one unit);
        True once all are done. Starting a unit just before the deadline would overrun it by up to a unit: beside
        text streams of a fast model that overrun (of the vision encode's units) took their ITL p99 from 2x to 2.8x
        at 4B."""
        deadline = time.perf_counter() + seconds
        self.budget = seconds
        try:
            while not self.advance() and time.perf_counter() + self.costs.estimate(*self.next) <= deadline:
                pass
        finally:
            self.budget = 0.0
        return self.done


class VisionEncode(Units):
    """One request's crops [crops, 3, H, W] through the tower and projector of `weights` (vision_weights.py), as
    `Units`; `features` is the result ([crops * tokens per crop, text hidden], as `image_features`) once `done`."""

    def __init__(self, weights: VisionWeights, pixel_values: torch.Tensor, rows: int = 0, costs: UnitCosts | None = None,
                 wide: int = WIDE_ROWS):
        """`rows`: rows a unit (default `unit_rows` of the tower's shape); `wide`: a `mix` unit's rows where the step's
        budget holds one (0: never more than `rows`); `costs`: the unit times of earlier encodes (default none)."""
        shape = weights.shape
        self.weights, self.pixels = weights, pixel_values
        self.patches = (shape.image_size // shape.patch) ** 2
        self.rows = rows or unit_rows(self.patches, shape.hidden, shape.intermediate)
        self.wide = wide
        self.features: torch.Tensor | None = None
        self.total_units = self._count()
        super().__init__(costs)

    def _count(self) -> int:
        """The units with no wide `mix` among them: the most there can be."""
        crops = self.pixels.shape[0]
        per_layer = -(-crops * self.patches // self.rows) + crops * -(-self.patches // self.rows)
        return 2 + self.weights.shape.layers * per_layer

    def _plan(self) -> Iterator[tuple[str, float]]:
        """The units in order; each yields its (kind, multiply-adds) before it runs."""
        crops, shape = self.pixels.shape[0], self.weights.shape
        yield "embed", crops * self.patches * 3 * shape.patch**2 * shape.hidden
        hidden = embed(self.weights, self.pixels).contiguous()
        for layer in self.weights.layers:
            yield from self._layer(layer, hidden)
        yield "finish", crops * shape.tokens_per_image * shape.hidden * self.weights.projection.shape[-1]
        features = finish(self.weights, hidden)
        self.features = features.reshape(-1, features.shape[-1])
        self.pixels = None

    def _layer(self, layer: VisionLayer, hidden: torch.Tensor) -> Iterator[tuple[str, float]]:
        """One encoder layer, in place on `hidden` [crops, patches, width]: `qkv` of a slice of rows (every row
        of every crop), then `mix` of a slice of one crop's query rows over that crop's keys (row-wise after the
        attention, so it needs no other row). A crop's first `mix` after the `qkv` units is its own kind for the
        costs: traced beside a 4B's text stream it took 2-2.5x the layer's other `mix` units (1.06 s against 0.42 s,
        loaded machine), an overrun of most of a budget each layer under the plain `mix` estimate."""
        w = self.weights
        crops, patches, width = hidden.shape
        flat = hidden.view(-1, width)
        q, k, v = (torch.empty_like(hidden) for _ in range(3))
        for lo in range(0, flat.shape[0], self.rows):
            yield "qkv", min(self.rows, flat.shape[0] - lo) * 3 * width * width
            for out, rows in zip((q, k, v), qkv(w, layer, flat[lo : lo + self.rows])):
                out.view(-1, width)[lo : lo + self.rows] = rows
        q, k, v = (heads(w, t) for t in (q, k, v))
        per_row = 2 * patches * width + width * width + 2 * width * w.shape.intermediate
        for crop in range(crops):
            keys, values = k[crop : crop + 1], v[crop : crop + 1]
            lo = 0
            while lo < patches:
                kind, n = self._mix_unit(lo, patches - lo, per_row)
                yield kind, n * per_row
                rows = hidden[crop : crop + 1, lo : lo + n]
                rows.copy_(mix(w, layer, rows, q[crop : crop + 1, :, lo : lo + n], keys, values))
                lo += n

    def _mix_unit(self, lo: int, left: int, per_row: int) -> tuple[str, int]:
        """The next `mix` unit's kind and rows: `wide` where the step's budget holds one as `costs` expects it, else
        `rows`. A crop's first after the qkv units is a kind of its own: 2-2.5x the others' time."""
        first = "" if lo else "first "
        wide = min(max(self.rows, self.wide), left)
        if wide > self.rows and self.costs.estimate(f"{first}wide mix", wide * per_row) <= self.budget:
            return f"{first}wide mix", wide
        return f"{first}mix", min(self.rows, left)
