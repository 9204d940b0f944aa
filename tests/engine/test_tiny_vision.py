"""The tiny multimodal Gemma-3 (`oai_gemma.testing.tiny_vision`): built offline from the embedded 270m, loadable
with the Auto classes, the real -it processor layout (256 soft tokens per image, pan-and-scan crops), the 270m's
logits on text, and a working image forward."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from oai_gemma.testing import tiny_vision  # noqa: E402
from oai_gemma.engine.model.loader import chat_template_text, embedded_model_dir  # noqa: E402

IMAGE = tiny_vision.IMAGE_TOKEN_ID
BOI = tiny_vision.BOI_TOKEN_ID
EOI = tiny_vision.EOI_TOKEN_ID
TEXT_VOCAB = 262_144


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_dir(tiny_vision_dir):
    return tiny_vision_dir


@pytest.fixture(scope="module")
def processor(tiny_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[0]


def image(width: int, height: int, seed: int = 0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def image_chat(img, text: str = "What is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


def test_directory_layout_and_config(tiny_dir):
    from transformers import AutoConfig

    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "preprocessor_config.json", "processor_config.json", tiny_vision.MARKER} <= names
    assert (tiny_dir / "chat_template.jinja").read_text() == chat_template_text()

    config = AutoConfig.from_pretrained(tiny_dir)
    assert type(config).__name__ == "Gemma3Config" and config.model_type == "gemma3"
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    assert list(config.eos_token_id) == [1, 106]
    assert (config.image_token_index, config.boi_token_index, config.eoi_token_index) == (IMAGE, BOI, EOI)
    assert config.mm_tokens_per_image == 256
    assert config.text_config.vocab_size == 262_208
    vision = config.vision_config
    assert vision.model_type == "siglip_vision_model" and not vision.vision_use_head
    assert (vision.image_size, vision.patch_size) == (896, 14)
    assert vision.hidden_size <= 128 and vision.num_hidden_layers <= 2
    # the text config is the 270m's, only the vocabulary grows
    source = json.loads((embedded_model_dir() / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar"):
        assert getattr(config.text_config, key) == source[key], key

    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]
    # a few MB on top of the 270m's text weights
    size = (tiny_dir / "model.safetensors").stat().st_size
    extra = size - (embedded_model_dir() / "model.safetensors").stat().st_size
    assert 0 < extra < 8 * 2**20


def test_checkpoint_uses_the_real_key_layout_and_loads_cleanly(tiny_dir, loaded):
    from safetensors import safe_open

    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in keys)
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in keys
    assert "language_model.model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    _, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_second_build_is_skipped_and_cli_prints_the_directory(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert tiny_vision.build_tiny_multimodal(tiny_dir) == tiny_dir
    run = subprocess.run([sys.executable, "-m", "oai_gemma.testing.tiny_vision", str(tiny_dir)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tiny_dir)
    assert weights.stat().st_mtime_ns == stamp


def test_tokenizer_has_the_real_image_token_ids(processor):
    tok = processor.tokenizer
    assert len(tok) == TEXT_VOCAB + 1
    assert tok.convert_tokens_to_ids(["<image_soft_token>", "<start_of_image>", "<end_of_image>"]) == [IMAGE, BOI, EOI]
    assert tok.image_token == "<image_soft_token>"
    assert (tok.boi_token, tok.eoi_token) == ("<start_of_image>", "<end_of_image>")
    assert (tok.image_token_id, tok.boi_token_id) == (IMAGE, BOI)
    assert IMAGE in tok.all_special_ids
    ids = tok("a<start_of_image><image_soft_token><end_of_image>b", add_special_tokens=False).input_ids
    assert ids[1:4] == [BOI, IMAGE, EOI]


def test_text_path_is_the_270m_model(model, processor):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    chat = [{"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea."}]}]
    ours = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")
    theirs = ref_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert "pixel_values" not in ours and int(ours["token_type_ids"].sum()) == 0
    with torch.no_grad():
        logits = model(**ours).logits
        ref_logits = reference(input_ids=theirs["input_ids"], attention_mask=theirs["attention_mask"]).logits
    assert logits.shape[-1] == 262_208
    assert (logits[..., :TEXT_VOCAB] - ref_logits).abs().max().item() < 1e-4
    # the 64 rows the -it vocabulary adds have logits near 0: below the real tokens' where the next token matters
    # (they can win where every real logit is very negative, as right after <bos>)
    assert logits[..., TEXT_VOCAB:].abs().max() < 5
    assert logits[0, -1, TEXT_VOCAB:].max() < logits[0, -1, :TEXT_VOCAB].max() - 5
    ours_out = model.generate(**ours, max_new_tokens=6, do_sample=False)
    theirs_out = reference.generate(**theirs, max_new_tokens=6, do_sample=False)
    assert ours_out.tolist() == theirs_out.tolist()
    torch.testing.assert_close(model.model.language_model.embed_tokens.weight[:TEXT_VOCAB],
                               reference.model.embed_tokens.weight, rtol=0, atol=0)


def test_processor_one_image_is_256_soft_tokens(processor):
    inputs = processor.apply_chat_template(image_chat(image(640, 480)), add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert inputs["pixel_values"].shape == (1, 3, 896, 896)
    pixels = inputs["pixel_values"]
    assert pixels.dtype == torch.float32 and -1 <= pixels.min() <= pixels.max() <= 1  # rescaled, normalized 0.5/0.5
    assert int((ids == IMAGE).sum()) == 256
    assert int((ids == BOI).sum()) == 1 and int((ids == EOI).sum()) == 1
    assert inputs["token_type_ids"][0].tolist() == (ids == IMAGE).long().tolist()
    positions = (ids == IMAGE).nonzero()[:, 0]
    assert positions.tolist() == list(range(positions[0], positions[0] + 256))  # one contiguous run
    assert ids[positions[0] - 1] == BOI and ids[positions[-1] + 1] == EOI
    assert ids.tolist().count(2) == 1  # one <bos>: the template's, the tokenizer adds none

    # the text the processor puts in place of each <start_of_image> in the rendered template
    assert processor.full_image_sequence == "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    text = processor.tokenizer.decode(ids)
    assert text == ("<bos><start_of_turn>user\n\n\n<start_of_image>" + "<image_soft_token>" * 256
                    + "<end_of_image>\n\nWhat is in this image?<end_of_turn>\n<start_of_turn>model\n")

    # the same through processor(text=..., images=...) on the rendered template
    rendered = processor.apply_chat_template(image_chat(image(640, 480)), add_generation_prompt=True, tokenize=False)
    assert rendered == ("<bos><start_of_turn>user\n<start_of_image>What is in this image?<end_of_turn>\n"
                        "<start_of_turn>model\n")
    direct = processor(text=rendered, images=image(640, 480), add_special_tokens=False, return_tensors="pt")
    assert direct["input_ids"].tolist() == inputs["input_ids"].tolist()


def test_pan_and_scan_adds_crops_of_256_tokens_each(processor):
    text = "<start_of_image>Describe."
    wide = image(1800, 600)
    plain = processor(text=text, images=wide, return_tensors="pt")
    assert plain["pixel_values"].shape == (1, 3, 896, 896) and int((plain["input_ids"] == IMAGE).sum()) == 256
    scanned = processor(text=text, images=wide, do_pan_and_scan=True, return_tensors="pt")
    crops = scanned["pixel_values"].shape[0] - 1
    assert crops == 3 and scanned["pixel_values"].shape[1:] == (3, 896, 896)
    ids = scanned["input_ids"][0]
    assert int((ids == IMAGE).sum()) == 256 * (crops + 1) == int(scanned["token_type_ids"].sum())
    assert int((ids == BOI).sum()) == int((ids == EOI).sum()) == crops + 1
    decoded = re.sub("(<image_soft_token>){256}", "[256]", processor.tokenizer.decode(ids))
    seq = "\n\n<start_of_image>[256]<end_of_image>\n\n"
    assert decoded == (f"<bos>Here is the original image {seq} and here are some crops to help you see better "
                       f"{seq} {seq} {seq}Describe.")
    # a square image is not scanned
    square = processor(text=text, images=image(900, 900), do_pan_and_scan=True, return_tensors="pt")
    assert square["pixel_values"].shape[0] == 1


def test_forward_with_an_image_and_the_engine_path(model, processor):
    inputs = processor.apply_chat_template(image_chat(image(640, 480)), add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        assert logits.shape == (1, inputs["input_ids"].shape[1], 262_208) and torch.isfinite(logits).all()

        # what an engine with its own forward needs: the soft-token embeddings for the image ...
        features = model.model.get_image_features(inputs["pixel_values"]).pooler_output
        assert features.shape == (1, 256, model.config.text_config.hidden_size) and torch.isfinite(features).all()
        # ... written, unscaled, over the (sqrt(hidden)-scaled) embeddings of the <image_soft_token> positions
        embeds = model.model.get_input_embeddings()(inputs["input_ids"])
        embeds[inputs["input_ids"] == IMAGE] = features.reshape(-1, features.shape[-1])
        manual = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                       token_type_ids=inputs["token_type_ids"]).logits
        torch.testing.assert_close(manual, logits, rtol=0, atol=1e-5)

        # the image's soft tokens attend to each other both ways (token_type_ids == 1 marks the block); without
        # token_type_ids the mask is plain causal: the text before the image is unchanged, the image is not
        causal = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs["pixel_values"]).logits
    first = int((inputs["input_ids"][0] == IMAGE).nonzero()[0])
    torch.testing.assert_close(causal[:, :first], logits[:, :first], rtol=0, atol=1e-5)
    assert (causal[:, first:first + 255] - logits[:, first:first + 255]).abs().max() > 1e-2


def test_generate_with_an_image(model, processor):
    inputs = processor.apply_chat_template(image_chat(image(1800, 600)), add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 4 and all(0 <= t < 262_208 for t in new.tolist())
