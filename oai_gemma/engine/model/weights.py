"""`Gemma3Weights`: the model's weights as the runner computes with them, owned by the project (issue 38.4).

The token embedding, each decoder layer's norms (as their float32 scales, 1 + weight) and projections (each in its
final layout: packed float or quantized, engine/model/layout.py), the final norm and the lm_head, described by
engine/shape.py's Gemma3Shape. The runner (engine/model/runner.py) reads nothing else of the model's text part, so
where the weights come from is this module's business:

- `from_modules`: a module tree with transformers' names (transformers' Gemma3ForCausalLM or
  Gemma3ForConditionalGeneration, or engine/model/lean.py's): tests that hold the engine against transformers, and
  every checkpoint lean.py does not build (a GPU, device_map, dummy weights);
- engine/model/streamed.py's `from_safetensors`: the server's path, one tensor at a time from the checkpoint's files
  into its final layout, so the model never exists whole in float32.

The vision tower and projector are engine/model/vision_weights.py's `VisionWeights` (`vision`): their tensors,
taken from whichever tree holds them (shared, not copied), and the forward as plain functions.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..shape import Gemma3Shape
from .gemma3 import LayerWeights, norm_scale
from .layout import Layout, LinearCache, quantized_names
from .mapped import copy_out_of_checkpoint, map_embedding
from .vision_weights import VisionWeights, from_modules as vision_from_modules

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
"""LayerWeights' projection fields, in the order the quantized-weights cache numbers them (`projection.{i}`)."""


@dataclass
class Gemma3Weights:
    shape: Gemma3Shape
    dtype: torch.dtype
    """The model's compute dtype (activations, KV cache)."""
    embedding: torch.Tensor
    """[vocab, hidden]: in memory in `dtype`, or mapped from the checkpoint file (`mapped`) in the file's dtype."""
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    """The final norm's float32 scale (1 + weight)."""
    lm_head: object
    """A linear ([vocab, hidden]: FrozenLinear, a quantized linear, PerStepLinear)."""
    quantization: str = "none"
    mapped: bool = False
    """The embedding is read from the checkpoint file on demand (engine/model/mapped.py), not held in memory."""
    vision: VisionWeights | None = None
    """The vision tower and projector, or None for a text-only model."""
    embed_scale: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.embed_scale = torch.tensor(self.shape.text.hidden**0.5, device=self.embedding.device)

    @property
    def device(self) -> torch.device:
        """Where the lm_head (and the final norm) run."""
        return self.final_norm.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden) in the embedding's dtype (transformers' Gemma3TextScaledWordEmbedding)."""
        return F.embedding(ids, self.embedding) * self.embed_scale.to(self.embedding.dtype)

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, with torch's ops as transformers' Gemma3RMSNorm computes it."""
        y = hidden.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.shape.text.rms_eps)
        return (y * self.final_norm).type_as(hidden)

    def linears(self) -> list[object]:
        return [*(getattr(w, name) for w in self.layers for name in PROJECTIONS), self.lm_head]

    def nbytes(self) -> int:
        """Bytes held in memory: norms, linears (their own layouts), the embedding unless mapped."""
        tensors = [t for w in self.layers for t in w if isinstance(t, torch.Tensor)] + [self.final_norm]
        held = sum(t.numel() * t.element_size() for t in tensors)
        held += sum(linear_bytes(linear) for linear in self.linears())
        return held + (0 if self.mapped else self.embedding.numel() * self.embedding.element_size())


def linear_bytes(linear) -> int:
    """Memory of one linear's own layout (a FrozenLinear that uses its weight as it is: that weight)."""
    if getattr(linear, "packed_bytes", 0):
        return linear.packed_bytes
    weight = getattr(linear, "weight", None)
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0


def text_parts(model):
    """(text decoder, lm_head) of a Gemma3ForCausalLM or Gemma3ForConditionalGeneration module tree."""
    inner = model.model
    return getattr(inner, "language_model", inner), model.lm_head


def from_modules(model, layout: Layout, cache_file=None, own_weights: bool = False) -> Gemma3Weights:
    """The weights of a module tree, quantized linears read from `cache_file` where it holds them (else kept there).
    `own_weights`: the tree's projections are freed once re-laid out and the embedding is mapped from the checkpoint
    where it can be (one copy of each weight; the tree can then no longer run its own forward)."""
    text, lm_head = text_parts(model)
    modules = [module for layer in text.layers for module in _projection_modules(layer)]
    if own_weights:  # all but what is re-laid out below: then the checkpoint's map can close
        copy_out_of_checkpoint(model, {id(m.weight) for m in modules} | {id(lm_head.weight)})
    names = [f"projection.{i}" for i in range(len(modules))] + ["lm_head"]
    weights = [m.weight.detach() for m in modules] + [lm_head.weight.detach()]
    cache = LinearCache(cache_file, quantized_names(layout, len(modules)))
    linears = []
    for name, weight in zip(names, weights):
        linear = layout.make(name, lambda lo, hi, w=weight: w[lo:hi], tuple(weight.shape), cache.stored(name))
        cache.keep(name, linear)
        linears.append(linear)
    cache.close()
    cache.save()
    per_layer = iter(linears)
    layers = [_layer_weights(layer, per_layer) for layer in text.layers]
    mapped = False
    if own_weights:
        _release(modules, linears)
        if linears[-1].packed is not None:
            source = getattr(model.config, "_name_or_path", "")
            mapped = map_embedding(text, lm_head, source, any_dtype=layout.quantization != "none")
        gc.collect()
    return Gemma3Weights(
        Gemma3Shape.of(model.config), weights[-1].dtype, text.embed_tokens.weight.detach(), layers,
        norm_scale(text.norm.weight), linears[-1], layout.quantization, mapped, vision_from_modules(getattr(model, "model", None)),
    )


def _layer_weights(layer, linears) -> LayerWeights:
    """One layer of the tree: its projections the next seven of `linears` (in PROJECTIONS' order), each norm's
    weight as its scale (`norm_scale`)."""
    a = layer.self_attn
    return LayerWeights(
        input_norm=norm_scale(layer.input_layernorm.weight), q_norm=norm_scale(a.q_norm.weight),
        k_norm=norm_scale(a.k_norm.weight), post_attention_norm=norm_scale(layer.post_attention_layernorm.weight),
        pre_feedforward_norm=norm_scale(layer.pre_feedforward_layernorm.weight),
        post_feedforward_norm=norm_scale(layer.post_feedforward_layernorm.weight),
        **{name: next(linears) for name in PROJECTIONS},
    )


def _projection_modules(layer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj


def _release(modules, linears) -> None:
    """Free the module weight of every projection that has its own layout."""
    for module, linear in zip(modules, linears):
        if linear.packed is not None:
            module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)

