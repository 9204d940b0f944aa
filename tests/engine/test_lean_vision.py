"""The 4B without transformers (issue 37 item 3): linear rope, the SigLIP tower, the projector and the image
preprocessing built by the project (engine/model/lean_config.py, lean_vision.py, processor.py), held to
transformers' on the tiny multimodal model: the same config, tensors, image features, pixels and tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lean_checks import assert_runs_without_transformers
from oai_gemma.chat import render_chat
from oai_gemma.chat.images import _to_rgb
from oai_gemma.chat.vision import expand_images
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.model import lean, lean_config
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.processor import Processor
from oai_gemma.engine.shape import Gemma3Shape
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

FOUR_B = Path(__file__).resolve().parents[2] / "configs" / "hf" / "gemma-3-4b-it"
TEXT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "rms_norm_eps", "query_pre_attn_scalar", "vocab_size", "sliding_window", "layer_types",
             "rope_parameters", "hidden_activation", "final_logit_softcapping", "max_position_embeddings")
VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
               "image_size", "patch_size", "hidden_act", "layer_norm_eps", "vision_use_head")


@pytest.fixture(scope="module")
def both(tiny_vision_dir):
    """(lean, transformers') loads of the tiny multimodal model in float32."""
    settings = ModelSettings(source=str(tiny_vision_dir), dtype="float32")
    return load(settings, lean=True), load(settings)


def _theirs(directory: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


@pytest.mark.parametrize("directory", ["4b", "12b", "27b", "tiny"])
def test_config_json_is_read_as_transformers_reads_it(directory, tiny_vision_dir):
    """The real 4B's sparse old-format config.json (transformers' defaults, `rope_scaling`) and transformers 5's
    own (`rope_parameters` per layer kind) give transformers' values."""
    path = tiny_vision_dir if directory == "tiny" else FOUR_B.parent / f"gemma-3-{directory}-it"
    ours, why = lean_config.multimodal_config(json.loads((path / "config.json").read_text()))
    theirs = _theirs(path)
    assert ours is not None, why
    for key in TEXT_KEYS:
        assert getattr(ours.text_config, key) == getattr(theirs.text_config, key), key
    for key in VISION_KEYS:
        assert getattr(ours.vision_config, key) == getattr(theirs.vision_config, key), key
    for key in ("mm_tokens_per_image", "image_token_id", "boi_token_index", "eoi_token_index", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert Gemma3Shape.of(ours) == Gemma3Shape.of(theirs)
    if directory != "tiny":
        assert ours.text_config.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_linear_rope_is_transformers_rotary_embedding():
    """The 4B's global layers scale rope linearly (factor 8): the lean rotary tables equal transformers'."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    ours, _ = lean_config.multimodal_config(json.loads((FOUR_B / "config.json").read_text()))
    mine, reference = lean.Rotary.of_config(ours.text_config), Gemma3RotaryEmbedding(_theirs(FOUR_B).text_config)
    x = torch.zeros(1, dtype=torch.bfloat16)
    positions = torch.tensor([[0, 1, 1023, 1024, 30_000, 131_071]])
    for kind in ("sliding_attention", "full_attention"):
        for got, expected in zip(mine(x, positions, kind), reference(x, positions, kind)):
            assert torch.equal(got, expected), kind
    unscaled = {kind: {"rope_type": "default", "rope_theta": rope["rope_theta"]} for kind, rope in ours.text_config.rope_parameters.items()}
    default = lean.Rotary.of_config(dataclasses.replace(ours.text_config, rope_parameters=unscaled))
    assert not torch.equal(default(x, positions, "full_attention")[0], mine(x, positions, "full_attention")[0])


def test_the_lean_multimodal_tree_holds_transformers_tensors(both):
    ours, theirs = both
    assert "Gemma3" not in type(ours.model).__name__ and type(theirs.model).__name__ == "Gemma3ForConditionalGeneration"
    mine, reference = dict(ours.model.named_parameters()), dict(theirs.model.named_parameters())
    assert mine.keys() == reference.keys()
    assert any(name.startswith("model.vision_tower.encoder.layers.1.") for name in mine)
    for name, tensor in mine.items():
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name
    assert ours.model.lm_head.weight is ours.model.model.language_model.embed_tokens.weight
    assert ours.model.config.image_token_id == theirs.model.config.image_token_id
    assert ours.model.config.mm_tokens_per_image == theirs.model.config.mm_tokens_per_image


def test_image_features_are_transformers(both):
    """The vision tower and projector on random pixels (and in bfloat16): transformers' soft tokens."""
    ours, theirs = both
    pixels = torch.randn(2, 3, 896, 896, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = ours.model.model.get_image_features(pixels)
        expected = theirs.model.model.get_image_features(pixels).pooler_output
    assert got.shape == (2, 256, 640)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    tower, projector = ours.model.model.vision_tower, ours.model.model.multi_modal_projector
    with torch.inference_mode():
        hidden = tower(pixels[:1])
        assert torch.equal(hidden, theirs.model.model.vision_tower(pixel_values=pixels[:1]).last_hidden_state)
        assert torch.equal(projector(hidden), theirs.model.model.multi_modal_projector(hidden))
        bf16 = hidden.to(torch.bfloat16)
        projector.to(torch.bfloat16), theirs.model.model.multi_modal_projector.to(torch.bfloat16)
        try:
            assert torch.equal(projector(bf16), theirs.model.model.multi_modal_projector(bf16))
        finally:
            projector.to(torch.float32), theirs.model.model.multi_modal_projector.to(torch.float32)


def _image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@pytest.mark.parametrize("width, height, mode, scan", [
    (400, 300, "RGB", False), (37, 1100, "RGB", False), (1000, 300, "RGB", True), (300, 1300, "RGBA", True),
    (896, 896, "L", True), (640, 480, "RGBA", False), (2000, 500, "RGB", True),
])
def test_the_projects_preprocessing_is_transformers(both, width, height, mode, scan):
    """Pixels, crops and the prompt's token ids as transformers' Gemma3Processor makes them."""
    ours, theirs = both
    assert isinstance(ours.processor, Processor)
    image = _image(width, height, mode)
    defaults = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
    got = ours.processor.image_processor(images=[image], do_pan_and_scan=scan, return_tensors="pt")
    expected = theirs.processor.image_processor(images=[image], do_pan_and_scan=scan, return_tensors="pt", do_convert_rgb=True,
                                                **defaults)  # as Gemma3Processor calls it
    assert got["pixel_values"].dtype == expected["pixel_values"].dtype == torch.float32
    assert torch.equal(got["pixel_values"], expected["pixel_values"])
    assert got["num_crops"].tolist() == torch.as_tensor(expected["num_crops"]).tolist()
    prompt = render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                        {"type": "text", "text": "What is this?"}]}]).prompt
    image = _to_rgb(image)  # as the server decodes it (chat/images.py)
    mine, reference = (expand_images(p, prompt, [image], [scan]) for p in (ours.processor, theirs.processor))
    assert mine.token_ids == reference.token_ids and mine.crop_keys == reference.crop_keys
    assert torch.equal(mine.pixel_values, reference.pixel_values)


def test_an_engine_on_the_lean_tree_answers_an_image_as_one_on_transformers(both):
    ours, theirs = both
    image = _image(500, 260, "RGB", seed=3)
    prompt = render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                        {"type": "text", "text": "Describe it."}]}]).prompt
    vision = expand_images(ours.processor, prompt, [image], [True])
    config = EngineConfig(
        model=ModelConfig(max_model_len=2048),
        scheduler=SchedulerConfig(max_num_seqs=2, max_prefill_tokens=128),
    )
    results = []
    for loaded in (ours, theirs):
        engine, loop = Engine(loaded, config), asyncio.new_event_loop()
        engine.start(loop)

        async def collect():
            request = GenerationRequest("v", vision.token_ids, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
                                        pixel_values=vision.pixel_values, crop_keys=tuple(vision.crop_keys))
            return [(e.token_id, e.logprob, e.top_logprobs) async for e in engine.generate(request) if e.token_id is not None]

        try:
            results.append(loop.run_until_complete(collect()))
        finally:
            engine.shutdown()
            loop.close()
    assert len(results[0]) == 6 and results[0] == results[1]


def test_a_lean_multimodal_load_and_image_never_import_transformers(tiny_vision_dir):
    script = (
        "import sys, torch\n"
        "from PIL import Image\n"
        "from oai_gemma.chat.vision import expand_images\n"
        "from oai_gemma.engine.model.loader import load\n"
        "from oai_gemma.settings import ModelSettings\n"
        f"loaded = load(ModelSettings(source={str(tiny_vision_dir)!r}, dtype='float32'), lean=True)\n"
        "vision = expand_images(loaded.processor, 'a <start_of_image> b', [Image.new('RGB', (900, 300))], [True])\n"
        "with torch.inference_mode():\n"
        "    features = loaded.model.model.get_image_features(vision.pixel_values)\n"
        "assert features.shape == (4, 256, 640), features.shape  # the image and its 3 crops\n"
    )
    assert_runs_without_transformers(script)


def test_released_and_transformers_checkpoint_names_both_map_to_the_modules():
    from oai_gemma.engine.model.lean_vision import checkpoint_name

    for saved, module in (("language_model.model.layers.0.mlp.up_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"),
                          ("vision_tower.vision_model.post_layernorm.bias", "model.vision_tower.post_layernorm.bias"),
                          ("multi_modal_projector.mm_input_projection_weight", "model.multi_modal_projector.mm_input_projection_weight"),
                          ("language_model.lm_head.weight", "lm_head.weight")):
        assert checkpoint_name(saved) == module and checkpoint_name(module) == module
