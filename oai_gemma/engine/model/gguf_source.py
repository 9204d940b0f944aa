"""`--model FILE.gguf [--mmproj FILE.gguf]`: the GGUF converted once into a checkpoint directory in the model cache.

The directory is keyed by each file's path, size and modification time (a file replaced in place converts again),
built in a temporary sibling renamed into place once whole, under a file lock (two servers starting on one file
convert once). A conversion drops the converted directories whose GGUF is gone from where it was, so the cache
does not keep every file ever served. The embedded gemma-3-270m goes through the same converter (loader.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ...progress import Phase
from .gguf_convert import convert
from .gguf_tokenizer import cached_tokenizer, fingerprint, remember, write_tokenizer

log = logging.getLogger("oai_gemma.loader")

CACHE = "gguf"
MARKER = ".converted-gguf.json"
FORMAT = 1
WEIGHTS = "model.safetensors"


def is_converted(target: Path) -> bool:
    return (target / WEIGHTS).exists() and (target / "tokenizer.json").exists()


def _stamp(path: Path) -> dict:
    info = path.stat()
    return {"path": str(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def converted_dir(cache_root: Path, model: str, mmproj: str = "") -> Path:
    """Where the conversion of `model` (with `mmproj`) lives in the cache."""
    files = [_stamp(Path(p).expanduser().resolve()) for p in (model, mmproj) if p]
    key = hashlib.sha256(json.dumps([files, FORMAT]).encode()).hexdigest()[:16]
    return cache_root / CACHE / f"{Path(model).stem}-{key}"


def gguf_model_dir(cache_root: Path, model: str, mmproj: str = "", reference: tuple[Path, Path] | None = None) -> Path:
    """The converted directory of `model` (and `mmproj`), converting them first where it is not there yet.
    `reference`: (a GGUF, its converted directory) whose tokenizer files serve any GGUF of the same vocabulary
    (the embedded model's, converted on every machine)."""
    target = converted_dir(cache_root, model, mmproj)

    def convert_it() -> None:
        model_path = Path(model).expanduser().resolve()
        mmproj_path = Path(mmproj).expanduser().resolve() if mmproj else None
        name = f"converting {model_path.name}{f' with {mmproj_path.name}' if mmproj_path else ''} into {target} (once)"
        convert_into(target, model_path, mmproj_path, cache_root, torch.bfloat16, name, reference)
        _drop_orphans(target.parent)

    return converted_once(target, convert_it)


def converted_once(target: Path, convert_it) -> Path:
    """`target`, made by `convert_it()` first where it is not converted yet, under a file lock beside it: concurrent
    first starts (a server and a test, say) convert once."""
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_converted(target):
            convert_it()
    return target


def convert_into(target: Path, model: Path, mmproj: Path | None, cache_root: Path, quantized_dtype: torch.dtype,
                 name: str, reference: tuple[Path, Path] | None = None, usually: float | None = None) -> None:
    """Convert into a temporary sibling of `target`, then rename it into place: a half-made directory is never
    taken for a converted one."""
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with Phase(log, name, usually=usually) as phase:
            gguf, _ = convert(model, mmproj, staging, quantized_dtype,
                              progress=lambda done, total: phase.count(done >> 20, total >> 20))  # in MB
        try:
            _seed_tokenizer(gguf, cache_root, reference)
            write_tokenizer(gguf, staging, cache_root, vision=mmproj is not None)
            _write_generation_config(staging, gguf.get("tokenizer.ggml.tokens") or [])
        finally:
            gguf.close()
        sources = [_stamp(p) for p in (model, mmproj) if p]
        (staging / MARKER).write_text(json.dumps({"format": FORMAT, "sources": sources, "at": time.time()}) + "\n")
        staging.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _seed_tokenizer(gguf, cache_root: Path, reference: tuple[Path, Path] | None) -> None:
    """The reference's tokenizer files kept for this GGUF's vocabulary where both are the same (checked by the
    reference GGUF's own fingerprint: about a second), so transformers need not build them again."""
    if reference is None or not is_converted(reference[1]) or not reference[0].exists():
        return
    key = fingerprint(gguf)
    if cached_tokenizer(cache_root, key):
        return
    from .gguf_file import GGUFFile

    other = GGUFFile(reference[0])
    try:
        if fingerprint(other) == key:
            remember(cache_root, key, reference[1])
    finally:
        other.close()


def _write_generation_config(target: Path, tokens: list[str]) -> None:
    """`<end_of_turn>` among the end tokens, as the released checkpoints have it."""
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    eos = [text.get("eos_token_id", 1)] + ([tokens.index("<end_of_turn>")] if "<end_of_turn>" in tokens else [])
    generation = {"bos_token_id": text.get("bos_token_id"), "eos_token_id": eos, "pad_token_id": text.get("pad_token_id")}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _drop_orphans(directory: Path) -> None:
    """Converted directories whose GGUF file is no longer where it was (a test's temporary file, say)."""
    for entry in directory.iterdir():
        try:
            sources = json.loads((entry / MARKER).read_text())["sources"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if any(not Path(source["path"]).exists() for source in sources):
            log.info("dropping %s: its GGUF is gone", entry)
            shutil.rmtree(entry, ignore_errors=True)
            (directory / f".{entry.name}.lock").unlink(missing_ok=True)
