"""`from_safetensors`: Gemma3Weights read from a safetensors checkpoint one tensor at a time (the server's path).

Each tensor is read from its file (`pread`, engine/model/layout.py's TensorFile: not mapped, so the file's pages never
count in the process's resident memory) and turned straight into its final layout: a projection quantized in row
chunks, or cast and packed; the norms into their float32 scales. The model never exists in float32 at once: loading
holds the final weights plus one chunk (or, unquantized, one tensor) of float. The token embedding stays mapped from
the file where its rows can be used as stored (engine/model/mapped.py). Quantized linears come from the model cache
(`LinearCache`) where a previous start kept them: a warm start reads the stored layout and quantizes nothing.

The checkpoint's tensor names are transformers' (a released multimodal checkpoint's older names are renamed as
engine/model/lean_vision.py renames them); names and shapes are checked against the shape first, every difference
named, as lean.py's `fill` does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...progress import Phase
from ..shape import Gemma3Shape, TextShape
from .gemma3 import LayerWeights, norm_scale
from .layout import Layout, LinearCache, TensorFile, quantized_names
from .lean_vision import VISION_PREFIXES, checkpoint_name
from .mapped import checkpoint_files, map_tensor
from .vision_weights import VisionWeights
from .weights import Gemma3Weights

log = logging.getLogger("oai_gemma.engine")

NORMS = ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
         "pre_feedforward_layernorm", "post_feedforward_layernorm")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
"""In the order of LayerWeights' projections and of the quantized-weights cache's `projection.{i}`."""


class Checkpoint:
    """A checkpoint directory's tensors by module name, read on demand."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = [TensorFile(path) for path in checkpoint_files(directory)]
        self.where = {checkpoint_name(key): (file, key) for file in self.files for key in file.entries}

    def close(self) -> None:
        for file in self.files:
            file.close()

    def shape(self, name: str) -> list[int]:
        file, key = self.where[name]
        return file.shape(key)

    def dtype(self, name: str) -> torch.dtype:
        file, key = self.where[name]
        return file.dtype(key)

    def rows(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        file, key = self.where[name]
        return file.rows(key, lo, hi)

    def mapped(self, name: str) -> torch.Tensor:
        file, key = self.where[name]
        return map_tensor(file.path, file.offset(key), file.dtype(key), file.shape(key))


def expected_shapes(text: TextShape, prefix: str, tied: bool) -> dict[str, list[int]]:
    """Every text tensor's module name -> its shape, as the shape says."""
    q, kv = text.heads * text.head_dim, text.kv_heads * text.head_dim
    per_layer = {
        "input_layernorm": [text.hidden], "self_attn.q_norm": [text.head_dim], "self_attn.k_norm": [text.head_dim],
        "post_attention_layernorm": [text.hidden], "pre_feedforward_layernorm": [text.hidden],
        "post_feedforward_layernorm": [text.hidden], "self_attn.q_proj": [q, text.hidden],
        "self_attn.k_proj": [kv, text.hidden], "self_attn.v_proj": [kv, text.hidden], "self_attn.o_proj": [text.hidden, q],
        "mlp.gate_proj": [text.intermediate, text.hidden], "mlp.up_proj": [text.intermediate, text.hidden],
        "mlp.down_proj": [text.hidden, text.intermediate],
    }
    shapes = {f"{prefix}layers.{i}.{name}.weight": shape for i in range(text.layers) for name, shape in per_layer.items()}
    shapes[f"{prefix}embed_tokens.weight"] = [text.vocab, text.hidden]
    shapes[f"{prefix}norm.weight"] = [text.hidden]
    if not tied:
        shapes["lm_head.weight"] = [text.vocab, text.hidden]
    return shapes


def check(checkpoint: Checkpoint, expected: dict[str, list[int]], tied: bool) -> None:
    """A ValueError naming what differs between the checkpoint's text tensors and `expected`."""
    found = {name for name in checkpoint.where if not name.startswith(VISION_PREFIXES)}
    if tied:
        found.discard("lm_head.weight")
    if found != set(expected):
        raise ValueError(f"{checkpoint.directory}: the checkpoint's tensors are not Gemma-3's: missing "
                         f"{sorted(set(expected) - found)[:3]}, unexpected {sorted(found - set(expected))[:3]}")
    for name, shape in expected.items():
        if checkpoint.shape(name) != shape:
            raise ValueError(f"{checkpoint.directory}: {name} has shape {checkpoint.shape(name)}, config.json says {shape}")


def from_safetensors(directory: Path, shape: Gemma3Shape, layout: Layout, cache_file: Path | None = None,
                     tied: bool = True) -> Gemma3Weights:
    """The weights of the checkpoint in `directory`: the text decoder in `layout`, a multimodal one's vision tower
    and projector in the layout's dtype (engine/model/vision_weights.py)."""
    text = shape.text
    prefix = "model.language_model." if shape.vision is not None else "model."
    checkpoint = Checkpoint(Path(directory))
    try:
        check(checkpoint, expected_shapes(text, prefix, tied), tied)
        kind = f"{layout.quantization}-{str(layout.dtype).removeprefix('torch.')}"
        cache = LinearCache(cache_file, quantized_names(layout, text.layers * len(PROJECTIONS)), directory, kind)
        how = "from the model cache" if cache.complete else f"quantizing to {layout.quantization}" if cache.names else "packing"
        with Phase(log, f"loading the weights ({how}, one tensor at a time)") as phase:
            layers = [_layer(checkpoint, f"{prefix}layers.{i}.", i, layout, cache) for i in phase.track(range(text.layers))]
            lm_head = _linear(checkpoint, f"{prefix}embed_tokens.weight" if tied else "lm_head.weight", "lm_head", layout, cache)
        cache.close()
        cache.save()
        embedding, mapped = _embedding(checkpoint, f"{prefix}embed_tokens.weight", layout)
        final_norm = norm_scale(checkpoint.rows(f"{prefix}norm.weight").to(layout.dtype))
        vision = _vision(checkpoint, shape, layout.dtype)
    finally:
        checkpoint.close()
    return Gemma3Weights(shape, layout.dtype, embedding, layers, final_norm, lm_head, layout.quantization, mapped, vision)


def _linear(checkpoint: Checkpoint, key: str, name: str, layout: Layout, cache: LinearCache):
    linear = layout.make(name, lambda lo, hi: checkpoint.rows(key, lo, hi), tuple(checkpoint.shape(key)), cache.stored(name))
    cache.keep(name, linear)
    return linear


def _layer(checkpoint: Checkpoint, prefix: str, index: int, layout: Layout, cache: LinearCache) -> LayerWeights:
    norms = {name: norm_scale(checkpoint.rows(f"{prefix}{name}.weight").to(layout.dtype)) for name in NORMS}
    linears = [_linear(checkpoint, f"{prefix}{name}.weight", f"projection.{index * len(PROJECTIONS) + j}", layout, cache)
               for j, name in enumerate(PROJECTIONS)]
    q, k, v, o, gate, up, down = linears
    return LayerWeights(
        norms["input_layernorm"], q, k, v, norms["self_attn.q_norm"], norms["self_attn.k_norm"], o,
        norms["post_attention_layernorm"], norms["pre_feedforward_layernorm"], gate, up, down,
        norms["post_feedforward_layernorm"],
    )


def _vision(checkpoint: Checkpoint, shape: Gemma3Shape, dtype: torch.dtype) -> VisionWeights | None:
    """The vision tower and projector, each tensor read and cast (a ValueError naming a missing one)."""
    if shape.vision is None:
        return None

    def tensor(name: str) -> torch.Tensor:
        if name not in checkpoint.where:
            raise ValueError(f"{checkpoint.directory}: the checkpoint has no {name} (config.json describes a vision tower)")
        return checkpoint.rows(name).to(dtype)

    with Phase(log, "loading the vision tower and projector"):
        return VisionWeights.from_tensors(shape.vision, shape.vision.eps, tensor)


def _embedding(checkpoint: Checkpoint, key: str, layout: Layout) -> tuple[torch.Tensor, bool]:
    """The token embedding mapped from its file where it is stored in the model's dtype, or where the model is quantized
    (its rows are cast as they are looked up: the lm_head has its own layout); else read and cast."""
    if checkpoint.dtype(key) == layout.dtype or layout.quantization != "none":
        log.info("token embedding mapped from %s (read on demand, not copied)", checkpoint.where[key][0].path.name)
        return checkpoint.mapped(key), True
    return checkpoint.rows(key).to(layout.dtype), False
