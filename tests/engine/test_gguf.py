"""`--model FILE.gguf [--mmproj FILE.gguf]` (issue 37 item 5): tiny Gemma-3 GGUFs written as llama.cpp's converter
writes them (oai_gemma/testing/tiny_gguf.py, which says how that was checked against the real converter), converted
by the server's own converter and held against the same models in transformers: the logits equal, quantized and
F16 tensors included. Then one real server on the GGUF and its mmproj answers a chat and an image chat."""

from __future__ import annotations

import base64
import io
import json

import gguf
import openai
import pytest
import torch
from PIL import Image

from conftest import ServerProcess

Q = gguf.GGMLQuantizationType
TEXT = dict(vocab_size=262_144, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
TYPES = {"token_embd.weight": Q.F16, "blk.1.ffn_up.weight": Q.Q8_0, "blk.2.attn_q.weight": Q.Q4_0,
         "blk.5.ffn_down.weight": Q.F16}
"""Tensors stored other than F32 (the rest), each read back as the file holds it."""
DEQUANTIZED = ("layers.1.mlp.up_proj.weight", "layers.2.self_attn.q_proj.weight")
"""TYPES' quantized tensors: the converter writes them in bfloat16."""


def _as_converted(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.bfloat16().float() if k in DEQUANTIZED else v) for k, v in stored.items()}


def _randomize(model, seed: int) -> None:
    """Every tensor random (norms too: their stored +1 must be taken off again)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


@pytest.fixture(scope="module")
def cache():
    from oai_gemma.settings import ModelSettings

    return ModelSettings().cache_path  # the servers' own: they find what the tests converted


@pytest.fixture(scope="module")
def vocabulary():
    from oai_gemma.testing.tiny_gguf import embedded_vocabulary

    return embedded_vocabulary()


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, vocabulary, one_torch_thread):
    """(the reference Gemma3ForCausalLM, its GGUF)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from oai_gemma.testing.tiny_gguf import write_text_gguf

    model = Gemma3ForCausalLM(Gemma3TextConfig(**TEXT)).eval()
    _randomize(model, 0)
    path = tmp_path_factory.mktemp("gguf") / "tiny-text.gguf"
    stored = write_text_gguf(model, path, vocabulary, TYPES)
    with torch.no_grad():
        for key, value in _as_converted(stored).items():
            model.get_parameter(f"model.{key}").copy_(value)
    return model, path


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory, vocabulary, one_torch_thread):
    """(the reference Gemma3ForConditionalGeneration, its text GGUF, its mmproj)."""
    from transformers import Gemma3ForConditionalGeneration

    from oai_gemma.testing.tiny_gguf import write_mmproj, write_text_gguf
    from oai_gemma.testing.tiny_vision import tiny_config

    model = Gemma3ForConditionalGeneration(tiny_config({**TEXT, "model_type": "gemma3_text"})).eval()
    _randomize(model, 1)
    directory = tmp_path_factory.mktemp("gguf-vision")
    stored = write_text_gguf(model, directory / "tiny-vision.gguf", vocabulary, TYPES)
    with torch.no_grad():
        for key, value in _as_converted(stored).items():
            model.get_parameter(f"model.language_model.{key}")[: value.shape[0]].copy_(value)
    write_mmproj(model, directory / "mmproj-tiny-vision.gguf")
    return model, directory / "tiny-vision.gguf", directory / "mmproj-tiny-vision.gguf"


def _convert(cache, model, mmproj=""):
    from oai_gemma.engine.model.loader import EMBEDDED_DIR_NAME, embedded_gguf, embedded_model_dir
    from oai_gemma.engine.model.gguf_source import gguf_model_dir

    embedded_model_dir()  # its tokenizer serves these GGUFs: their vocabulary is its
    return gguf_model_dir(cache, str(model), str(mmproj), (embedded_gguf(), cache / EMBEDDED_DIR_NAME))


def _load(directory):
    from oai_gemma.engine.model.loader import load
    from oai_gemma.settings import ModelSettings

    return load(ModelSettings(source=str(directory), dtype="float32", device="cpu"))


def test_the_test_vocabulary_is_the_embedded_models_so_its_tokenizer_comes_from_the_cache(text_model, vocabulary):
    from oai_gemma.engine.model.gguf_file import GGUFFile
    from oai_gemma.engine.model.gguf_tokenizer import fingerprint
    from oai_gemma.engine.model.loader import embedded_gguf

    ours, embedded = GGUFFile(text_model[1]), GGUFFile(embedded_gguf())
    assert fingerprint(ours) == fingerprint(embedded)
    assert ours.tensors["blk.1.ffn_up.weight"].kind == Q.Q8_0 and ours.tensors["token_embd.weight"].kind == Q.F16


def test_the_conversion_counts_its_progress_up_to_the_whole(text_model, tmp_path):
    """(The converted directories' Phase lines say how far it got: engine/model/gguf_source.py.)"""
    from oai_gemma.engine.model.gguf_convert import convert

    seen = []
    gguf_file, _ = convert(text_model[1], None, tmp_path, progress=lambda done, total: seen.append((done, total)))
    gguf_file.close()
    total = seen[-1][1]
    assert len(seen) > 10 and seen[-1][0] == total and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_text_gguf_computes_what_the_model_it_was_made_from_does(cache, text_model):
    from oai_gemma.engine.model.lean_config import model_config

    model, path = text_model
    directory = _convert(cache, path)
    config = json.loads((directory / "config.json").read_text())
    assert config["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert config["layer_types"][5] == "full_attention" and config["sliding_window"] == 8
    assert model_config(str(directory))[0] is not None  # the server's lean modules build it
    loaded = _load(directory)
    assert loaded.eos_token_ids == (1, 106)
    ids = torch.tensor([loaded.tokenizer.encode("The GGUF holds the same model, norms and all.")])
    assert ids.shape[1] > TEXT["sliding_window"]  # past the sliding window
    with torch.no_grad():
        expected, got = model(input_ids=ids).logits, loaded.model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # fast subset (issue 36.4): the same subsystem is covered by its lighter tests
def test_a_gguf_and_its_mmproj_compute_what_the_multimodal_model_does(cache, vision_model):
    model, path, mmproj = vision_model
    directory = _convert(cache, path, mmproj)
    assert (directory / "preprocessor_config.json").exists()
    from transformers import AutoModelForImageTextToText

    from oai_gemma.engine.model.tokenizer import load_tokenizer

    # transformers' own loading (the server's lean one is the test below's): no AutoProcessor, whose Python pass over
    # the tokenizer's added tokens would take longer than the rest of this test
    converted = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    config = converted.config
    assert (config.image_token_id, config.text_config.vocab_size, config.mm_tokens_per_image) == (262_144, 262_208, 256)
    assert load_tokenizer(str(directory)).convert_tokens_to_ids("<image_soft_token>") == 262_144
    image = [255_999] + [262_144] * 256 + [256_000]
    ids = torch.tensor([[2, 105, 1645, 108, *image, 107, 106]])
    pixels = torch.randn(1, 3, 896, 896, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # the last positions only (they see the image): every position's 262,208 logits would be 270 MB
        expected = model(input_ids=ids, pixel_values=pixels, logits_to_keep=3).logits
        got = converted(input_ids=ids, pixel_values=pixels, logits_to_keep=3).logits
    vocab = 262_144  # the rows past the GGUF's vocabulary are zeros in ours, random in the reference
    torch.testing.assert_close(got[..., :vocab], expected[..., :vocab], atol=1e-4, rtol=1e-4)


def test_vision_weights_read_from_the_mmproj_compute_the_models_image_features(vision_model):
    """engine/model/vision_weights.py's `from_mmproj`: the tower and projector straight from the mmproj GGUF give
    transformers' soft tokens. Not bitwise: the projector's norm is stored as 1 + w and read back as (1 + w) - 1 in
    float32 (within 6e-8 of w), every other tensor is the model's exactly (its F16 projection rounded in place)."""
    from oai_gemma.engine.model.vision_weights import VisionWeights, from_mmproj, from_modules, image_features
    from oai_gemma.engine.shape import VisionShape

    model, _, mmproj = vision_model
    shape, eps = VisionShape.of(model.config), model.config.vision_config.layer_norm_eps
    weights = from_mmproj(mmproj, shape, eps, torch.float32)
    assert isinstance(weights, VisionWeights) and weights.dtype == torch.float32 and len(weights.layers) == shape.layers
    reference = from_modules(model.model)
    for ours, theirs in zip(weights.tensors(), reference.tensors()):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    pixels = torch.randn(1, 3, 896, 896, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = model.model.get_image_features(pixels).pooler_output.reshape(-1, model.config.text_config.hidden_size)
    got = image_features(weights, pixels)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(image_features(reference, pixels), expected)


@pytest.mark.slow
def test_a_server_on_a_gguf_and_its_mmproj_answers_a_chat_and_an_image_chat(cache, vision_model, tmp_path):
    _, path, mmproj = vision_model
    _convert(cache, path, mmproj)  # converted once, by the test before or here
    # its own log: the default one is the session server's, which tests read (a second writer truncated it)
    with ServerProcess("--model", str(path), "--mmproj", str(mmproj), "--max-num-seqs", "2",
                       "--batch-invariant", "off", log=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-vision"]
        text = client.chat.completions.create(model="tiny-vision", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "Hello"}])
        assert text.choices[0].finish_reason in ("length", "stop") and text.usage.completion_tokens >= 1
        picture = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 30, 30)).save(picture, "PNG")
        url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        image = client.chat.completions.create(model="tiny-vision", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": content}])
        assert image.usage.prompt_tokens > 256 > text.usage.prompt_tokens  # the image's 256 soft tokens
        assert image.choices[0].finish_reason in ("length", "stop")
