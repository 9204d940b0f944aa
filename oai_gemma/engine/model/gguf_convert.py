"""A Gemma-3 GGUF (and its mmproj) converted into a Hugging Face checkpoint directory, one tensor at a time.

What llama.cpp's `convert_hf_to_gguf.py` (Gemma3Model, Gemma3VisionModel; gguf-py's tensor_mapping.py) did is
undone: its tensor names mapped back to the released checkpoints' (`model.layers.N.self_attn.q_proj.weight`, or
under `language_model.` / `vision_tower.vision_model.` / `multi_modal_projector.` for a multimodal one), the 1 it
added to every Gemma RMSNorm weight (they scale by 1 + w; llama.cpp's by w) taken off again, the embedding rows
for ids the GGUF's vocabulary lacks (`<image_soft_token>`) added as zeros. Gemma-3 needs no Q/K permutation (only
llama.cpp's Llama class permutes). Quantized tensors are dequantized (any type `gguf.quants` reads) into
`quantized_dtype`; F32/F16/BF16 ones keep their type. The safetensors file is written as it goes, a few MB of rows
at a time, so converting a 4B takes memory for one chunk, not for the model (transformers' GGUF loading holds every
tensor in float32: 16 GB). tests/engine/test_gguf.py checks the names against GGUFs written as the converter writes them
(verified against llama.cpp's own converter output, see its docstring).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .gguf_config import check_pair, image_token_ids, multimodal_config, multimodal_vocab, processor_configs, text_config
from .gguf_file import BF16, F16, F32, GGUFError, GGUFFile, Tensor

LAYER = {  # llama.cpp's name after `blk.N.` -> the checkpoint's after `model.layers.N.`
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
VISION_LAYER = {  # after `v.blk.N.` -> after `vision_tower.vision_model.encoder.layers.N.`
    "ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}
VISION_TOP = {
    "v.patch_embd": "vision_tower.vision_model.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.vision_model.embeddings.position_embedding",
    "v.post_ln": "vision_tower.vision_model.post_layernorm",
    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
}
PROJECTION = ("mm.input_projection.weight", "multi_modal_projector.mm_input_projection_weight")
SAFETENSORS = {F32: "F32", F16: "F16", BF16: "BF16"}
TORCH_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
CHUNK_BYTES = 32 << 20
"""float32 bytes dequantized at once."""


@dataclass
class Planned:
    name: str
    """The checkpoint's name."""
    source: Tensor
    file: GGUFFile
    dtype: str
    """safetensors' dtype name."""
    shift: float = 0.0
    """Added to every value (-1 for Gemma's norms)."""
    rows: int = 0
    """Rows to write: the source's, or more (zeros after it)."""


def text_name(name: str, multimodal: bool) -> tuple[str, float]:
    """(the checkpoint's name, the shift) of a text tensor of llama.cpp's name."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match[2] in LAYER:
        hf = f"model.layers.{match[1]}.{LAYER[match[2]]}.{match[3]}"
    elif (top := name.rpartition(".")[0]) in TOP:
        hf = f"{TOP[top]}.{name.rpartition('.')[2]}"
    else:
        raise GGUFError(f"tensor {name} is not one of Gemma-3's (another architecture, or a newer converter?)")
    if multimodal:
        hf = "language_model." + hf
    return hf, (-1.0 if name.endswith("norm.weight") else 0.0)


def vision_name(name: str) -> tuple[str, float]:
    """(the checkpoint's name, the shift) of an mmproj tensor: only the projector's norm is a Gemma RMSNorm."""
    if name == PROJECTION[0]:
        return PROJECTION[1], 0.0
    match = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match[2] in VISION_LAYER:
        return f"vision_tower.vision_model.encoder.layers.{match[1]}.{VISION_LAYER[match[2]]}.{match[3]}", 0.0
    top, _, suffix = name.rpartition(".")
    if top in VISION_TOP:
        return f"{VISION_TOP[top]}.{suffix}", (-1.0 if top == "mm.soft_emb_norm" else 0.0)
    raise GGUFError(f"mmproj tensor {name} is not one of Gemma-3's SigLIP tower or projector")


def plan(model: GGUFFile, mmproj: GGUFFile | None, quantized_dtype: torch.dtype) -> tuple[list[Planned], dict]:
    """Every tensor to write, in the file's order, and config.json."""
    tokens = model.get("tokenizer.ggml.tokens") or []
    embedding = model.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{model.path} has no token_embd.weight")
    tied = "output.weight" not in model.tensors
    vocab, ids = embedding.shape[0], {}
    if mmproj is not None:
        check_pair(model, mmproj)
        ids = image_token_ids(tokens)
        vocab = multimodal_vocab(vocab, ids["image_token_index"])
    config = text_config(model, vocab, tied)
    if mmproj is not None:
        config = multimodal_config(config, mmproj, ids)
    config["dtype"] = "float32" if quantized_dtype == torch.float32 else config["dtype"]
    planned = []
    for tensor in model.tensors.values():
        name, shift = text_name(tensor.name, mmproj is not None)
        rows = vocab if tensor.name in ("token_embd.weight", "output.weight") else tensor.shape[0]
        planned.append(Planned(name, tensor, model, _dtype(tensor, shift, quantized_dtype), shift, rows))
    for tensor in (mmproj.tensors.values() if mmproj is not None else ()):
        name, shift = vision_name(tensor.name)
        planned.append(Planned(name, tensor, mmproj, _dtype(tensor, shift, quantized_dtype), shift, tensor.shape[0]))
    return planned, config


def _dtype(tensor: Tensor, shift: float, quantized_dtype: torch.dtype) -> str:
    if shift:
        return "F32"
    return SAFETENSORS.get(tensor.kind) or TORCH_NAME[quantized_dtype]


def write_safetensors(path: Path, planned: list[Planned], progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """The tensors into one safetensors file, streamed: the header first (it holds only shapes), then each
    tensor's bytes a chunk of rows at a time."""
    header, offset = {}, 0
    for item in planned:
        shape = [item.rows, *item.source.shape[1:]]
        nbytes = int(np.prod(shape, dtype=np.int64)) * (4 if item.dtype == "F32" else 2)
        header[item.name] = {"dtype": item.dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    total, done = sum(item.source.nbytes for item in planned), 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress(done, total)

    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for item in planned:
            _write_tensor(out, item, advance)


def _write_tensor(out, item: Planned, advance: Callable[[int], None]) -> None:
    source = item.source
    rows = source.shape[0] if len(source.shape) > 1 else 1
    if source.kind in SAFETENSORS and not item.shift and SAFETENSORS[source.kind] == item.dtype:
        out.write(item.file.raw(source).tobytes())  # stored as it will be: copied, no float detour
        advance(source.nbytes)
    else:
        width = int(np.prod(source.shape[1:], dtype=np.int64)) if rows > 1 else source.shape[0]
        step = max(1, CHUNK_BYTES // (4 * width))
        for first in range(0, rows, step):
            values = item.file.rows(source, first, min(rows, first + step)) + np.float32(item.shift)
            out.write(_encode(values.astype(np.float32, copy=False), item.dtype))
            advance((min(rows, first + step) - first) * (source.nbytes // rows))
    if item.rows > rows and len(source.shape) > 1:  # the vocabulary's missing rows
        width = int(np.prod(source.shape[1:], dtype=np.int64)) * (4 if item.dtype == "F32" else 2)
        out.write(bytes(width * (item.rows - rows)))


def _encode(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return values.tobytes()
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    return tensor.to(torch.bfloat16 if dtype == "BF16" else torch.float16).view(torch.int16).numpy().tobytes()


def convert(model_path: Path, mmproj_path: Path | None, target: Path, quantized_dtype: torch.dtype = torch.bfloat16,
            progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[GGUFFile, dict]:
    """model.safetensors, config.json (and the processor's configs) of the GGUF(s) into `target` (an existing
    directory); returns the opened model GGUF (its tokenizer is written elsewhere: gguf_tokenizer.py) and config."""
    model = GGUFFile(model_path)
    mmproj = GGUFFile(mmproj_path) if mmproj_path else None
    try:
        planned, config = plan(model, mmproj, quantized_dtype)
        write_safetensors(target / "model.safetensors", planned, progress)
    finally:
        if mmproj is not None:
            mmproj.close()
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if mmproj is not None:
        for name, content in processor_configs(mmproj, config).items():
            (target / name).write_text(json.dumps(content, indent=2) + "\n")
    return model, config
