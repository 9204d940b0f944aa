"""Tiny Gemma-3 models written as GGUF files the way llama.cpp's `convert_hf_to_gguf.py` writes them, for tests
(CI has no llama.cpp): `gguf.GGUFWriter` with the converter's metadata keys and tensor names, Gemma's RMSNorm
weights stored plus 1, the embedding cut to the vocabulary, the mmproj's patch and position embeddings in F32 and
its input projection in F16 (the converter's `tensor_force_quant`).

That this is what the converter writes was checked on the dev machine against llama.cpp's own converter (the tree
llama-server was built in, gguf-py 0.19 beside it; see oai_gemma/bench/checkpoint.py): tiny random 1B- and
4B-shaped checkpoints (`bench.checkpoint.published_config` shrunk to hidden 256, 7 layers; SigLIP 128 wide, 2
layers; random norms) converted at f32, bf16 and (mmproj) f16, then back with engine/model/gguf_convert.py: every
tensor name mapped, every value equal to the checkpoint's within 5e-8 (the norms' +1 -1 in float32), config.json
equal but for the file's float32 epsilons, transformers' logits from the two directories identical (max diff 0.0),
the tokenizer's ids equal. The embedded 270m (Q4_K, Q5_0, Q6_K, Q8_0 tensors) converts to the very tensors,
config and tokenizer files transformers' GGUF loading made before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TOKENIZER_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def embedded_vocabulary() -> dict:
    """The embedded gemma-3-270m GGUF's `tokenizer.ggml.*` metadata (Gemma-3's vocabulary, as the converter wrote
    it): the tiny GGUFs carry it, so their tokenizer is every Gemma-3's."""
    from ..engine.model.gguf_file import GGUFFile
    from ..engine.model.loader import embedded_gguf

    source = GGUFFile(embedded_gguf())
    try:
        return {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.ggml.")}
    finally:
        source.close()


def _tokenizer(writer, vocabulary: dict) -> None:
    import gguf

    key = "tokenizer.ggml."
    writer.add_tokenizer_model(vocabulary[key + "model"])
    writer.add_tokenizer_pre(vocabulary[key + "pre"])
    writer.add_token_list(vocabulary[key + "tokens"])
    writer.add_token_scores(vocabulary[key + "scores"].tolist())
    writer.add_token_types(vocabulary[key + "token_type"].tolist())
    for name in TOKENIZER_KEYS:
        writer.add_uint32(key + name, int(vocabulary[key + name]))
    for name in ("add_bos_token", "add_sep_token", "add_eos_token", "add_space_prefix"):
        if key + name in vocabulary:
            writer.add_key_value(key + name, bool(vocabulary[key + name]), gguf.GGUFValueType.BOOL)


def quantized(values: torch.Tensor, kind) -> tuple[np.ndarray, torch.Tensor]:
    """(the GGUF blocks of `values` in ggml type `kind`, the float32 values they stand for)."""
    from gguf.quants import dequantize, quantize

    blocks = quantize(values.float().numpy(), kind)
    return blocks, torch.from_numpy(dequantize(blocks, kind)).reshape(values.shape)


def write_text_gguf(model, path: Path, vocabulary: dict, types: dict[str, object] | None = None) -> dict[str, torch.Tensor]:
    """`model` (a Gemma3ForCausalLM, or the text of a Gemma3ForConditionalGeneration) as llama.cpp's text GGUF.
    `types`: llama.cpp tensor name -> ggml type for tensors stored quantized or F16 (the rest F32). Returns the
    checkpoint's tensors as the file holds them (quantized ones rounded), to load into the reference model."""
    import gguf

    from ..engine.model.gguf_convert import LAYER, TOP

    config = model.config.get_text_config()
    state = {k.removeprefix("model.language_model.").removeprefix("model."): v for k, v in model.state_dict().items()}
    names = {f"{hf}.weight": f"{ours}.weight" for ours, hf in TOP.items()}
    for i in range(config.num_hidden_layers):
        names.update({f"layers.{i}.{hf}.weight": f"blk.{i}.{ours}.weight" for ours, hf in LAYER.items()})
    names = {k.removeprefix("model."): v for k, v in names.items()}
    writer = gguf.GGUFWriter(str(path), "gemma3")
    rope = config.rope_parameters
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if rope["full_attention"].get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    _tokenizer(writer, vocabulary)
    stored = {}
    vocab = len(vocabulary["tokenizer.ggml.tokens"])
    for key, tensor in state.items():
        if key == "lm_head.weight" or key.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        name, value = names[key], tensor.detach().float()
        if name == "token_embd.weight":
            value = value[:vocab]  # the converter cuts the rows past the vocabulary
        kind = (types or {}).get(name)
        if name.endswith("norm.weight"):
            writer.add_tensor(name, (value + 1).numpy())
        elif kind == gguf.GGMLQuantizationType.F16:
            value = value.half().float()
            writer.add_tensor(name, value.half().numpy())
        elif kind is not None:
            blocks, value = quantized(value, kind)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, value.numpy())
        stored[key] = value
    _finish(writer)
    return stored


def write_mmproj(model, path: Path) -> None:
    """The vision tower and projector of a Gemma3ForConditionalGeneration as llama.cpp's mmproj GGUF (F32, but the
    input projection in F16 as the converter forces it: the model's is rounded to it, in place)."""
    import gguf

    from ..engine.model.gguf_convert import PROJECTION, VISION_LAYER, VISION_TOP

    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type("mmproj")
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(model.config.text_config.hidden_size)
    writer.add_vision_image_size(vision.image_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.num_hidden_layers)
    writer.add_vision_head_count(vision.num_attention_heads)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_clip_projector_type("gemma3")
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    names = {hf: ours for ours, hf in VISION_TOP.items()}
    names.update({f"vision_tower.vision_model.encoder.layers.{i}.{hf}": f"v.blk.{i}.{ours}"
                  for i in range(vision.num_hidden_layers) for ours, hf in VISION_LAYER.items()})
    for key, tensor in model.state_dict().items():
        saved = key.replace("model.vision_tower.", "vision_tower.vision_model.").replace("model.multi_modal_projector.", "multi_modal_projector.")
        if not saved.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        if saved == PROJECTION[1]:
            with torch.no_grad():
                tensor.copy_(tensor.half().float())
            writer.add_tensor(PROJECTION[0], tensor.half().numpy())
            continue
        base, _, suffix = saved.rpartition(".")
        value = tensor.detach().float()
        if base == "multi_modal_projector.mm_soft_emb_norm":
            value = value + 1
        writer.add_tensor(f"{names[base]}.{suffix}", value.numpy())
    _finish(writer)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
