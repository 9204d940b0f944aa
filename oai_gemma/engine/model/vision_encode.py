"""The vision tower as resumable work: an image's encode cut into units the engine runs between its steps.

The one-call encode (vision_weights.py's `image_features`, as transformers' `get_image_features`) runs SigLIP's 27 layers
over an 896x896 image's 4096 patches at once: tens of seconds on a CPU, during which no other stream would get a
token. `VisionEncode` runs the same math a unit at a time:

    embed           the patch convolution and position rows (all crops)
    qkv   rows a:b  layer_norm1 and the q, k, v projections of those rows (every row of every crop)
    mix   rows a:b  attention of those query rows over the crop's keys, out_proj, the residual, then the MLP of
                    the same rows (row-wise after attention, so it needs no other row) and its residual
    finish          post_layernorm and the projector (pool to the soft tokens, norm, project)

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


def unit_rows(patches: int, width: int, intermediate: int) -> int:
    """Rows per unit: the largest power of two whose attention + out_proj + MLP stays within `UNIT_FLOPS`, but at
    least `MIN_ROWS` (and at most every patch)."""
    per_row = 4 * patches * width + 2 * width * width + 4 * width * intermediate
    rows = MIN_ROWS
    while rows * 2 * per_row <= UNIT_FLOPS and rows < patches:
        rows *= 2
    return min(rows, patches)


class VisionEncode:
    """One request's crops [crops, 3, H, W] through the tower and projector of `weights` (vision_weights.py).

    `advance()` runs the next unit; `run(seconds)` runs units until that much time has passed (at least one);
    `features` is the result ([crops * tokens per crop, text hidden], as `image_features`) once `done`."""

    def __init__(self, weights: VisionWeights, pixel_values: torch.Tensor, rows: int = 0):
        """`rows`: rows a unit (default `unit_rows` of the tower's shape)."""
        shape = weights.shape
        self.weights, self.pixels = weights, pixel_values
        self.patches = (shape.image_size // shape.patch) ** 2
        self.rows = rows or unit_rows(self.patches, shape.hidden, shape.intermediate)
        self.units_done = 0
        self.seconds = 0.0
        """Wall time spent in its units so far (the vision tower's time, however it was spread over steps)."""
        self.longest = 0.0
        """The longest unit's wall time so far (`run` starts no unit that would end past its budget by it)."""
        self.features: torch.Tensor | None = None
        self._units = self._plan()
        self.total_units = self._count()

    @property
    def done(self) -> bool:
        return self.features is not None

    def _count(self) -> int:
        crops = self.pixels.shape[0]
        per_layer = -(-crops * self.patches // self.rows) + crops * -(-self.patches // self.rows)
        return 2 + self.weights.shape.layers * per_layer

    def advance(self) -> bool:
        """Run the next unit; True once the encode is done."""
        if self.done:
            return True
        started = time.perf_counter()
        with torch.inference_mode():
            next(self._units, None)
        self.units_done += 1
        took = time.perf_counter() - started
        self.seconds += took
        self.longest = max(self.longest, took)
        return self.done

    def run(self, seconds: float) -> bool:
        """Units while the next one, as long as the longest so far, still ends within `seconds` (at least one unit);
        True once the encode is done. Starting a unit just before the deadline would overrun it by up to a unit:
        beside text streams of a fast model that overrun took their ITL p99 from 2x to 2.8x at 4B."""
        deadline = time.perf_counter() + seconds
        while not self.advance() and time.perf_counter() + self.longest <= deadline:
            pass
        return self.done

    def _plan(self) -> Iterator[None]:
        hidden = embed(self.weights, self.pixels).contiguous()
        yield
        for layer in self.weights.layers:
            yield from self._layer(layer, hidden)
        features = finish(self.weights, hidden)
        self.features = features.reshape(-1, features.shape[-1])
        self.pixels = None

    def _layer(self, layer: VisionLayer, hidden: torch.Tensor) -> Iterator[None]:
        """One encoder layer, in place on `hidden` [crops, patches, width]: `qkv` of a slice of rows (every row
        of every crop), then `mix` of a slice of one crop's query rows over that crop's keys (row-wise after the
        attention, so it needs no other row)."""
        w = self.weights
        crops, patches, width = hidden.shape
        flat = hidden.view(-1, width)
        q, k, v = (torch.empty_like(hidden) for _ in range(3))
        for lo in range(0, flat.shape[0], self.rows):
            for out, rows in zip((q, k, v), qkv(w, layer, flat[lo : lo + self.rows])):
                out.view(-1, width)[lo : lo + self.rows] = rows
            yield
        q, k, v = (heads(w, t) for t in (q, k, v))
        for crop in range(crops):
            keys, values = k[crop : crop + 1], v[crop : crop + 1]
            for lo in range(0, patches, self.rows):
                rows = hidden[crop : crop + 1, lo : lo + self.rows]
                rows.copy_(mix(w, layer, rows, q[crop : crop + 1, :, lo : lo + self.rows], keys, values))
                yield
