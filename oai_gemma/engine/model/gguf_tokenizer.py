"""The tokenizer of a GGUF (tokenizer.json, tokenizer_config.json) and the project's chat template, for its
converted directory.

transformers builds it from the file's `tokenizer.ggml.*` metadata (`AutoTokenizer.from_pretrained(gguf_file=)`,
as the embedded model's first start always has), which takes 20 s to a minute of Python over Gemma-3's 262,144
tokens. Every Gemma-3 GGUF carries the same vocabulary, so the result is kept under the model cache by a hash of
that metadata (`fingerprint`), and the next GGUF with it copies the files in a second. A vision model whose
vocabulary stops short of `<image_soft_token>` (llama.cpp needs none: it inserts the image's embeddings itself)
gets it added as the next id, as the released -it tokenizers have it at 262,144.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from ...progress import Phase
from .gguf_config import IMAGE_TOKEN, IMAGE_TOKENS
from .gguf_file import GGUFFile

log = logging.getLogger("oai_gemma.loader")

FILES = ("tokenizer.json", "tokenizer_config.json")
CACHE = "gguf-tokenizers"
NOT_HASHED = ("tokenizer.chat_template",)


def chat_template_text() -> str:
    return resources.files("oai_gemma.chat").joinpath("gemma3_chat_template.jinja").read_text()


def fingerprint(gguf: GGUFFile) -> str:
    """A hash of everything the tokenizer is built from: two files with the same one make the same tokenizer."""
    digest = hashlib.sha256()
    for key in sorted(k for k in gguf.metadata if k.startswith("tokenizer.") and k not in NOT_HASHED):
        value = gguf.metadata[key]
        digest.update(key.encode() + b"\0")
        if isinstance(value, list):
            digest.update("\0".join(map(str, value)).encode())
        elif hasattr(value, "tobytes"):
            digest.update(value.tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()[:24]


def cached_tokenizer(cache_root: Path, key: str) -> Path | None:
    found = cache_root / CACHE / key
    return found if all((found / name).is_file() for name in FILES) else None


def remember(cache_root: Path, key: str, source: Path) -> None:
    """Keep `source`'s tokenizer files as those of `key` (placed whole, by a rename)."""
    (cache_root / CACHE).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_root / CACHE))
    try:
        for name in FILES:
            shutil.copy(source / name, staging / name)
        target = cache_root / CACHE / key
        if not cached_tokenizer(cache_root, key):
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build(gguf_path: Path, target: Path) -> None:
    """transformers' tokenizer of the GGUF, saved into `target` (slow: see the module's docstring)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(target)
    (target / "chat_template.jinja").unlink(missing_ok=True)  # ours is written after


def write_tokenizer(gguf: GGUFFile, target: Path, cache_root: Path, vision: bool) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into `target`."""
    key = fingerprint(gguf)
    cached = cached_tokenizer(cache_root, key)
    if cached is None:
        with Phase(log, "building the tokenizer from the GGUF's vocabulary (once per vocabulary)", usually=40):
            build(gguf.path, target)
        remember(cache_root, key, target)
    else:
        for name in FILES:
            shutil.copy(cached / name, target / name)
    if vision:
        add_image_tokens(target, gguf.get("tokenizer.ggml.tokens") or [])
    (target / "chat_template.jinja").write_text(chat_template_text())


def add_image_tokens(target: Path, tokens: list[str]) -> None:
    """`<image_soft_token>` added where the vocabulary lacks it, and the image tokens' names in
    tokenizer_config.json (transformers' Gemma3Processor reads `tokenizer.image_token`...)."""
    if IMAGE_TOKEN not in tokens:
        from tokenizers import AddedToken, Tokenizer

        tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
        tokenizer.save(str(target / "tokenizer.json"))
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["extra_special_tokens"] = {"image_token": IMAGE_TOKEN, "boi_token": IMAGE_TOKENS["boi_token_index"],
                                      "eoi_token": IMAGE_TOKENS["eoi_token_index"]}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
