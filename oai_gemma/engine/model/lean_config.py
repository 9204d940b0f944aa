"""config.json of a Gemma-3 checkpoint read as engine/model/lean.py and lean_vision.py build it: no transformers.

Two formats reach us: what transformers 5's `save_pretrained` writes (every field, `rope_parameters` per layer
kind) and the released checkpoints' own (google/gemma-3-4b-it's: a few fields, transformers' defaults for the rest,
and the old `rope_scaling` / `rope_theta` / `rope_local_base_freq`). Both are read here into transformers 5's
names: the defaults filled in as Gemma3TextConfig, SiglipVisionConfig and Gemma3Config fill them (their values
pinned by tests/engine/test_lean_vision.py against transformers' own reading), the rope parameters per layer kind as
`Gemma3TextConfig.convert_rope_params_to_dict` makes them. What the modules do not implement is named, not built.

The result is the project's own frozen dataclasses (`TextConfig`, `VisionConfig`, `MultimodalConfig`) with
transformers' attribute names, so the lean modules, engine/shape.py's `Gemma3Shape.of` and the runner's checks read
either alike; what config.json holds beyond their fields is not kept.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..shape import FULL, SLIDING
from .gemma3 import GELU_TANH

LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "linear")
TEXT_DEFAULTS = {  # Gemma3TextConfig's defaults (the sizes are not defaulted: a config without them is not one)
    "vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
VISION_DEFAULTS = {  # SiglipVisionConfig's
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6, "vision_use_head": True,
}
MULTIMODAL_DEFAULTS = {  # Gemma3Config's
    "mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
    "image_token_index": 262_144, "tie_word_embeddings": True,
}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers")
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
OLD_THETA = {FULL: "rope_theta", SLIDING: "rope_local_base_freq"}


@dataclass(frozen=True)
class TextConfig:
    """A text-only Gemma-3's config (`Gemma3TextConfig`'s names): TEXT_DEFAULTS' fields and `layer_types`,
    `rope_parameters` as transformers 5 reads them."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    hidden_activation: str
    max_position_embeddings: int
    rms_norm_eps: float
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: list[str]
    rope_parameters: dict[str, dict]
    """Per layer kind: {"rope_type", "rope_theta"[, "factor"]}."""
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    attention_bias: bool
    use_bidirectional_attention: bool
    tie_word_embeddings: bool
    pad_token_id: int
    eos_token_id: int | list[int]
    bos_token_id: int
    _name_or_path: str = ""
    """The checkpoint's directory (transformers' name: engine/model/weights.py maps the embedding from it)."""


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP tower's config (`SiglipVisionConfig`'s names: VISION_DEFAULTS' fields)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    vision_use_head: bool


@dataclass(frozen=True)
class MultimodalConfig:
    """A Gemma3ForConditionalGeneration's config (`Gemma3Config`'s names)."""

    text_config: TextConfig
    vision_config: VisionConfig
    mm_tokens_per_image: int
    boi_token_index: int
    eoi_token_index: int
    image_token_index: int
    image_token_id: int
    tie_word_embeddings: bool
    _name_or_path: str = ""


def _made(cls, values: dict):
    """An instance of dataclass `cls` from `values`' entries of its fields (the others: config.json's extras)."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def model_config(source: str, multimodal: bool = True) -> tuple[TextConfig | MultimodalConfig | None, str]:
    """(the config, "") when `source` is a checkpoint the lean modules build, else (None, why not). A multimodal
    config has `text_config` and `vision_config` as transformers' has."""
    directory = Path(source)
    if not (directory / "config.json").is_file():
        return None, "not a local directory with a config.json"
    if not any((directory / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return None, "no safetensors checkpoint"
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("model_type") == "gemma3" and multimodal:
        config, why = multimodal_config(raw)
    else:
        config, why = text_config(raw)
    return (None if config is None else dataclasses.replace(config, _name_or_path=str(directory))), why


def text_config(raw: dict) -> tuple[TextConfig | None, str]:
    """A text-only Gemma-3's config (`model_type` gemma3_text) with transformers' defaults and rope parameters."""
    if raw.get("model_type") != "gemma3_text":
        return None, f"model_type {raw.get('model_type')!r}"
    missing = [key for key in REQUIRED if raw.get(key) is None]
    if missing:
        return None, f"config.json lacks {', '.join(missing)}"
    config = {**TEXT_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if config.get("layer_types") is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        config["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(config["num_hidden_layers"])]
    config["rope_parameters"] = rope_parameters(raw)
    why = _not_understood(config)
    return (None, why) if why else (_made(TextConfig, config), "")


def rope_parameters(raw: dict) -> dict[str, dict]:
    """Per layer kind: {"rope_type", "rope_theta"[, "factor"]}, as transformers 5 reads either format."""
    parameters = copy.deepcopy(raw.get("rope_parameters") or {})
    if "rope_type" in parameters or "rope_theta" in parameters:  # one set for every kind
        parameters = {kind: dict(parameters) for kind in LAYER_TYPES}
    for kind in LAYER_TYPES:
        parameters[kind] = dict(parameters.get(kind) or {"rope_type": "default"})
    if raw.get("rope_scaling"):
        parameters[FULL].update(raw["rope_scaling"])
    for kind in LAYER_TYPES:
        rope = parameters[kind]
        if "type" in rope and "rope_type" not in rope:  # the oldest name
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", raw.get(OLD_THETA[kind]) or DEFAULT_THETA[kind])
    return parameters


def _not_understood(config: dict) -> str:
    """Why this text config is not what the lean modules implement ("" when it is)."""
    if config.get("quantization_config") or config["attention_bias"] or config["attn_logit_softcapping"] \
            or config["use_bidirectional_attention"]:
        return "quantization, attention bias, attention soft-capping or bidirectional attention"
    if config["hidden_activation"] not in GELU_TANH:
        return f"activation {config['hidden_activation']!r}"
    types = config["layer_types"]
    if len(types) != config["num_hidden_layers"] or not set(types) <= set(LAYER_TYPES):
        return "layer_types"
    for kind in set(types):
        rope = config["rope_parameters"][kind]
        if rope["rope_type"] not in ROPE_TYPES or (rope["rope_type"] == "linear" and not rope.get("factor")):
            return f"{kind}'s rope {rope['rope_type']!r}"
    return ""


def multimodal_config(raw: dict) -> tuple[MultimodalConfig | None, str]:
    """A Gemma3ForConditionalGeneration's config: its text config as `text_config` reads it, a SigLIP tower
    without the pooling head, transformers' defaults for the rest."""
    if raw.get("quantization_config"):
        return None, "quantization"
    text_raw = {"model_type": "gemma3_text", **(raw.get("text_config") or {})}
    text, why = text_config(text_raw)
    if text is None:
        return None, f"text_config: {why}"
    vision_raw = raw.get("vision_config") or {}
    if vision_raw.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        return None, f"vision model_type {vision_raw.get('model_type')!r}"
    vision = {**VISION_DEFAULTS, **{k: v for k, v in vision_raw.items() if v is not None}}
    if vision["vision_use_head"] or vision["hidden_act"] not in GELU_TANH or vision["num_channels"] != 3:
        return None, "a SigLIP tower with a pooling head, another activation or other than 3 channels"
    top = {**MULTIMODAL_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    patches, tokens = vision["image_size"] // vision["patch_size"], top["mm_tokens_per_image"]
    side = round(tokens**0.5)
    if side * side != tokens or patches % side:
        return None, f"{tokens} tokens per image do not pool evenly from {patches}x{patches} patches"
    top.update(text_config=dataclasses.replace(text, tie_word_embeddings=top["tie_word_embeddings"]),
               vision_config=_made(VisionConfig, vision), image_token_id=top["image_token_index"])
    return _made(MultimodalConfig, top), ""
