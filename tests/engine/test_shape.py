"""`Gemma3Shape`, the project's view of a model's dimensions (engine/shape.py), read from configs in both formats
transformers writes and from the lean loader's config.json attributes."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from oai_gemma.engine.model.lean import text_config
from oai_gemma.engine.model.loader import embedded_model_dir
from oai_gemma.engine.shape import FULL, SLIDING, Gemma3Shape, TextShape, VisionShape

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "hf"


def test_the_4b_shape_has_its_published_dimensions_and_linear_rope_scaling_on_global_layers():
    shape = Gemma3Shape.of(AutoConfig.from_pretrained(CONFIGS / "gemma-3-4b-it"))
    text = shape.text
    assert (text.hidden, text.intermediate, text.layers, text.heads, text.kv_heads, text.head_dim) == (2560, 10240, 34, 8, 4, 256)
    assert text.sliding_window == 1024 and text.vocab == 262_208
    assert text.sliding[:6] == (True,) * 5 + (False,) and sum(not s for s in text.sliding) == 5
    assert text.rope == {SLIDING: (10_000.0, 1.0), FULL: (1_000_000.0, 8.0)}
    assert shape.vision == VisionShape(hidden=1152, intermediate=4304, layers=27, heads=16, patch=14, image_size=896,
                                       tokens_per_image=256, eps=1e-6)


def test_the_embedded_shape_is_the_same_from_config_json_and_from_transformers():
    directory = embedded_model_dir()
    lean, why = text_config(str(directory))
    assert lean is not None, why
    ours, theirs = Gemma3Shape.of(lean), Gemma3Shape.of(AutoConfig.from_pretrained(directory))
    assert ours == theirs and ours.vision is None
    assert ours.text.kv_bytes_per_token(4) == 18 * 1 * 256 * 2 * 4  # 18 layers, 1 KV head of 256, K and V, float32
    assert isinstance(ours.text, TextShape) and ours.text.rope[SLIDING][1] == ours.text.rope[FULL][1] == 1.0
