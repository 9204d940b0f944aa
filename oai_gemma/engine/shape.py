"""`Gemma3Shape`: the model's dimensions as the project sees them, read once from a config (transformers' config
object or config.json's attributes) and handed to the rooms that size things by it (the KV cache, the memory
budget, the runner), so none of them reads transformers' config or imports the model to learn a layer's kind.

A leaf: it imports nothing of the engine. The 1B and 4B shapes the benchmarks build are these fields too."""

from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class TextShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    sliding_window: int
    sliding: tuple[bool, ...]
    """Per layer: True for a sliding-window (local) layer, False for a global one."""
    rms_eps: float
    query_pre_attn_scalar: float
    rope: dict[str, tuple[float, float]]
    """Per layer kind (SLIDING, FULL): (rope theta, linear scaling factor; 1.0 for none)."""
    final_softcap: float | None = None
    """The final logits' soft-capping (None: none, as in Gemma-3)."""

    @property
    def layers(self) -> int:
        return len(self.sliding)

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """K and V of one token over every layer."""
        return self.layers * self.kv_heads * self.head_dim * 2 * element_bytes

    @classmethod
    def of(cls, config) -> TextShape:
        """From a Gemma-3 text config (transformers 5's names: `layer_types`, `rope_parameters`)."""
        kinds = tuple(config.layer_types)
        return cls(
            hidden=config.hidden_size, intermediate=config.intermediate_size, heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads, head_dim=config.head_dim, vocab=config.vocab_size,
            sliding_window=config.sliding_window, sliding=tuple(kind == SLIDING for kind in kinds),
            rms_eps=config.rms_norm_eps, query_pre_attn_scalar=config.query_pre_attn_scalar,
            rope={kind: _rope(config, kind) for kind in set(kinds)},
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )


@dataclass(frozen=True)
class VisionShape:
    """The SigLIP tower and the projector's output: what an image costs."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    patch: int
    image_size: int
    tokens_per_image: int
    eps: float = 1e-6
    """The LayerNorms' and the projector's RMSNorm epsilon (the vision config's layer_norm_eps)."""

    @classmethod
    def of(cls, config) -> VisionShape:
        """From a Gemma3ForConditionalGeneration config (its `vision_config` and `mm_tokens_per_image`)."""
        vision = config.vision_config
        return cls(
            hidden=vision.hidden_size, intermediate=vision.intermediate_size, layers=vision.num_hidden_layers,
            heads=vision.num_attention_heads, patch=vision.patch_size, image_size=vision.image_size,
            tokens_per_image=config.mm_tokens_per_image, eps=vision.layer_norm_eps,
        )


@dataclass(frozen=True)
class Gemma3Shape:
    text: TextShape
    vision: VisionShape | None = None

    @classmethod
    def of(cls, config) -> Gemma3Shape:
        """From a Gemma-3 config, text-only or multimodal."""
        if getattr(config, "vision_config", None) is not None:
            return cls(TextShape.of(config.text_config), VisionShape.of(config))
        return cls(TextShape.of(getattr(config, "text_config", None) or config))


def _rope(config, kind: str) -> tuple[float, float]:
    parameters = _get(getattr(config, "rope_parameters", None) or {}, kind) or {}
    theta = _get(parameters, "rope_theta")
    if theta is None:  # older configs: one global theta and a local base frequency
        theta = getattr(config, "rope_local_base_freq", 10_000.0) if kind == SLIDING else getattr(config, "rope_theta", 10_000.0)
    linear = _get(parameters, "rope_type") == "linear"
    return float(theta), float(_get(parameters, "factor") or 1.0) if linear else 1.0


def _get(mapping, key):
    return mapping.get(key) if isinstance(mapping, dict) else getattr(mapping, key, None)
