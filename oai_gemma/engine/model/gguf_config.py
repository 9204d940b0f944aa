"""config.json (and the image processor's configs) of a Gemma-3 rebuilt from GGUF metadata, as llama.cpp reads it.

llama.cpp's `convert_hf_to_gguf.py` (class Gemma3Model, Gemma3VisionModel) writes what it needs of the Hugging Face
config under `gemma3.*` and `clip.vision.*`; the rest llama.cpp fixes for every Gemma-3 (src/llama-model.cpp): a
global layer every 6th, queries scaled by 1/sqrt(head_dim) except the 27B's (62 layers: by hidden/heads), and the
SigLIP tower's shape, activation and 4x4 pooling. The text config keeps the values the file holds as they are
(its float32 rms_norm_eps, say), so a model converted from it computes what transformers' own GGUF reading does.
"""

from __future__ import annotations

from .gguf_file import GGUFError, GGUFFile

SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_EVERY = 6
LAYERS_27B = 62
IMAGE_TOKENS = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>"}
IMAGE_TOKEN = "<image_soft_token>"
END_OF_TURN = "<end_of_turn>"
VOCAB_ROUND = 64
"""The released multimodal checkpoints' vocabulary: the tokenizer's 262,144 rounded up past `<image_soft_token>`."""


def text_config(gguf: GGUFFile, vocab_size: int, tied: bool) -> dict:
    """A `Gemma3ForCausalLM` config.json (transformers 5's fields) from the `gemma3.*` metadata."""
    arch = gguf.get("general.architecture")
    if arch != "gemma3":
        raise GGUFError(f"{gguf.path} is a GGUF of architecture {arch!r}: --model takes a Gemma-3 GGUF (gemma3)")

    def key(name: str, default=None):
        value = gguf.get(f"gemma3.{name}", default)
        if value is None:
            raise GGUFError(f"{gguf.path} lacks gemma3.{name}")
        return value.item() if hasattr(value, "item") else value

    layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    full = {"rope_type": "default", "rope_theta": key("rope.freq_base", 1_000_000.0)}
    if gguf.get("gemma3.rope.scaling.type") == "linear" and gguf.get("gemma3.rope.scaling.factor", 1.0) != 1.0:
        full.update(rope_type="linear", factor=key("rope.scaling.factor"))
    tokenizer_id = {name: gguf.get(f"tokenizer.ggml.{key_}") for name, key_ in
                    (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                     ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id"))}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim, "max_position_embeddings": key("context_length", 131_072),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "query_pre_attn_scalar": hidden // heads if layers == LAYERS_27B else head_dim,
        "sliding_window": key("attention.sliding_window", 4096), "_sliding_window_pattern": GLOBAL_EVERY,
        "layer_types": [FULL if (i + 1) % GLOBAL_EVERY == 0 else SLIDING for i in range(layers)],
        "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", 10_000.0)}},
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": gguf.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": None, "attention_bias": False, "attention_dropout": 0.0,
        "use_bidirectional_attention": False, "tie_word_embeddings": tied, "use_cache": True, "initializer_range": 0.02,
        **{name: int(value) for name, value in tokenizer_id.items() if value is not None},
    }


def image_token_ids(tokens: list[str]) -> dict[str, int]:
    """`<start_of_image>`, `<end_of_image>` where the vocabulary has them, and `<image_soft_token>`'s id: its own,
    or the next one (llama.cpp needs no such token, so a GGUF's vocabulary may stop short of it)."""
    index = {token: i for i, token in enumerate(tokens) if token in (*IMAGE_TOKENS.values(), IMAGE_TOKEN)}
    missing = [token for token in IMAGE_TOKENS.values() if token not in index]
    if missing:
        raise GGUFError(f"the model's vocabulary has no {', '.join(missing)}: it is no Gemma-3 a vision tower fits")
    ids = {name: index[token] for name, token in IMAGE_TOKENS.items()}
    ids["image_token_index"] = index.get(IMAGE_TOKEN, len(tokens))
    return ids


def multimodal_vocab(rows: int, image_token: int) -> int:
    """The embedding's rows for a vision model: the file's, or enough to hold the image token's id."""
    return rows if rows > image_token else -(-(image_token + 1) // VOCAB_ROUND) * VOCAB_ROUND


def check_pair(model: GGUFFile, mmproj: GGUFFile) -> None:
    """A GGUFError unless `mmproj` is a Gemma-3 vision tower projecting to `model`'s width."""
    kind = mmproj.get("clip.projector_type") or mmproj.get("clip.vision.projector_type")
    if kind != "gemma3" or not mmproj.get("clip.has_vision_encoder", True):
        raise GGUFError(f"{mmproj.path} is a {kind!r} projector: --mmproj takes Gemma-3's (projector_type gemma3)")
    width, hidden = mmproj.get("clip.vision.projection_dim"), model.get("gemma3.embedding_length")
    if width != hidden:
        raise GGUFError(f"{mmproj.path} projects images to width {width}, {model.path.name}'s hidden size is {hidden}: "
                        "it is another model's vision tower (gemma-3-270m and 1b have none; 4b, 12b and 27b do)")


def multimodal_config(text: dict, mmproj: GGUFFile, ids: dict[str, int]) -> dict:
    """A `Gemma3ForConditionalGeneration` config.json: `text` and a SigLIP tower from the `clip.vision.*` metadata."""
    def key(name: str, default=None):
        value = mmproj.get(f"clip.vision.{name}", default)
        if value is None:
            raise GGUFError(f"{mmproj.path} lacks clip.vision.{name}")
        return value.item() if hasattr(value, "item") else value

    image, patch = key("image_size"), key("patch_size")
    side = image // patch // key("projector.scale_factor", 4)
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"), "image_size": image, "patch_size": patch,
        "num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False,
        "layer_norm_eps": key("attention.layer_norm_epsilon", 1e-6), "attention_dropout": 0.0,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "dtype": text["dtype"],
        "text_config": {k: v for k, v in text.items() if k not in ("architectures", "dtype")},
        "vision_config": vision, "mm_tokens_per_image": side * side, **ids,
        "tie_word_embeddings": text["tie_word_embeddings"], "initializer_range": 0.02,
        "eos_token_id": text.get("eos_token_id"),
    }


def processor_configs(mmproj: GGUFFile, config: dict) -> dict[str, dict]:
    """preprocessor_config.json and processor_config.json as the released -it checkpoints have them."""
    mean = [float(x) for x in mmproj.get("clip.vision.image_mean", [0.5] * 3)]
    std = [float(x) for x in mmproj.get("clip.vision.image_std", [0.5] * 3)]
    size = config["vision_config"]["image_size"]
    tokens = config["mm_tokens_per_image"]
    preprocessor = {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
        "image_mean": mean, "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": tokens,
        "image_std": std, "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
        "rescale_factor": 1 / 255, "size": {"height": size, "width": size},
    }
    return {"preprocessor_config.json": preprocessor,
            "processor_config.json": {"image_seq_length": tokens, "processor_class": "Gemma3Processor"}}
