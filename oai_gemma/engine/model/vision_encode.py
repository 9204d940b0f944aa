"""The vision tower as resumable work: an image's encode cut into units the engine runs between its steps.

The one-call encode (`ModelRunner.image_features`, transformers' `get_image_features`) runs SigLIP's 27 layers
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
import torch.nn.functional as F

from .lean_vision import VisionTower

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
    """One request's crops [crops, 3, H, W] through `tower` (lean_vision.VisionTower) and `projector`.

    `advance()` runs the next unit; `run(seconds)` runs units until that much time has passed (at least one);
    `features` is the result ([crops * tokens per crop, text hidden], as `ModelRunner.image_features`) once
    `done`."""

    def __init__(self, tower, projector, pixel_values: torch.Tensor, rows: int = 0):
        """`rows`: rows a unit (default `unit_rows` of the tower's shape)."""
        v = tower.config
        self.tower, self.projector, self.pixels = tower, projector, pixel_values
        self.rows = rows or unit_rows((v.image_size // v.patch_size) ** 2, v.hidden_size, v.intermediate_size)
        self.units_done = 0
        self.seconds = 0.0
        """Wall time spent in its units so far (the vision tower's time, however it was spread over steps)."""
        self.features: torch.Tensor | None = None
        self._units = self._plan()
        self.total_units = self._count()

    @property
    def done(self) -> bool:
        return self.features is not None

    def _count(self) -> int:
        crops = self.pixels.shape[0]
        v = self.tower.config
        patches = (v.image_size // v.patch_size) ** 2
        per_layer = -(-crops * patches // self.rows) + crops * -(-patches // self.rows)
        return 2 + v.num_hidden_layers * per_layer

    def advance(self) -> bool:
        """Run the next unit; True once the encode is done."""
        if self.done:
            return True
        started = time.perf_counter()
        with torch.inference_mode():
            next(self._units, None)
        self.units_done += 1
        self.seconds += time.perf_counter() - started
        return self.done

    def run(self, seconds: float) -> bool:
        """Units until `seconds` have passed (at least one); True once the encode is done."""
        deadline = time.perf_counter() + seconds
        while not self.advance() and time.perf_counter() < deadline:
            pass
        return self.done

    def _plan(self) -> Iterator[None]:
        hidden = self.tower.embeddings(self.pixels).contiguous()
        yield
        for layer in self.tower.encoder.layers:
            yield from self._layer(layer, hidden)
        features = self.projector(self.tower.post_layernorm(hidden))
        self.features = features.reshape(-1, features.shape[-1])
        self.pixels = None

    def _layer(self, layer, hidden: torch.Tensor) -> Iterator[None]:
        """One encoder layer, in place on `hidden` [crops, patches, width]."""
        attn = layer.self_attn
        crops, patches, width = hidden.shape
        flat = hidden.view(-1, width)
        q, k, v = (torch.empty_like(hidden) for _ in range(3))
        for lo in range(0, flat.shape[0], self.rows):
            normed = layer.layer_norm1(flat[lo : lo + self.rows])
            for proj, out in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
                out.view(-1, width)[lo : lo + self.rows] = proj(normed)
            yield
        shape = (crops, patches, attn.heads, attn.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        for crop in range(crops):
            for lo in range(0, patches, self.rows):
                _mix(layer, hidden[crop, lo : lo + self.rows], q[crop : crop + 1, :, lo : lo + self.rows], k[crop : crop + 1], v[crop : crop + 1])
                yield


class OneCall:
    """A tower that is not lean_vision's (transformers' modules, a test's): its encode is a single unit."""

    def __init__(self, model, pixel_values: torch.Tensor):
        self.model, self.pixels = model, pixel_values
        self.units_done, self.total_units, self.seconds = 0, 1, 0.0
        self.features: torch.Tensor | None = None

    done = VisionEncode.done
    run = VisionEncode.run

    def advance(self) -> bool:
        started = time.perf_counter()
        with torch.inference_mode():
            features = self.model.get_image_features(self.pixels)
        features = getattr(features, "pooler_output", features)
        self.features, self.pixels = features.reshape(-1, features.shape[-1]), None
        self.units_done, self.seconds = 1, time.perf_counter() - started
        return True


def encode_job(model, pixel_values: torch.Tensor) -> VisionEncode | OneCall:
    """The resumable encode of `pixel_values` for a multimodal model's inner `model` (its `vision_tower`,
    `multi_modal_projector`): unit by unit where the tower is lean_vision's, else one unit."""
    tower = model.vision_tower
    if isinstance(tower, VisionTower):  # transformers' SiglipVisionModel has an encoder and embeddings too
        return VisionEncode(tower, model.multi_modal_projector, pixel_values)
    return OneCall(model, pixel_values)


def _mix(layer, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Attention of `rows`' queries over every key of their crop, then their MLP: `rows` updated in place, as the
    one-call layer computes x = x + attn(ln1(x)); x = x + mlp(ln2(x)) for them."""
    attn = layer.self_attn
    out = F.scaled_dot_product_attention(q, k, v, scale=attn.head_dim**-0.5)
    out = attn.out_proj(out.transpose(1, 2).reshape(1, rows.shape[0], -1).contiguous())[0]
    mixed = rows + out
    mlp = layer.mlp
    rows.copy_(mixed + mlp.fc2(F.gelu(mlp.fc1(layer.layer_norm2(mixed)), approximate="tanh")))
