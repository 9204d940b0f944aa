"""llguidance's tokenizer from a cached table of token bytes, instead of from the tokenizer's JSON (issue 27's
start-up).

`llguidance.LLTokenizer(tokenizer_json)` parses Gemma-3's 33 MB tokenizer.json in Rust and builds its token trie
holding the GIL: 2.4 s of a 2-core start-up, plus 0.3 s serializing the JSON. Built from each token's bytes
(`llguidance.TokenizerWrapper`) it takes 0.8 s. The bytes come from llguidance itself: the first start builds the
tokenizer from the JSON as before and writes every token's bytes and the special tokens' ids to the model cache
(3 MB); later starts read that table (tens of ms). It is keyed by the tokenizer file (path, size, mtime), the
vocabulary size, the eos ids and llguidance's version, so any change rebuilds it. Text that llguidance tokenizes
goes through our tokenizer's `encode`, the Rust tokenizer the JSON path runs too (tested equal).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path

import llguidance

log = logging.getLogger("oai_gemma.engine")

MAGIC = b"oai-gemma token table 1\n"


@dataclass(frozen=True)
class TokenTable:
    """Every token's bytes (as llguidance decodes it) and the special tokens' ids."""

    pieces: list[bytes]
    special: list[int]

    @classmethod
    def of(cls, ll_tokenizer: llguidance.LLTokenizer) -> TokenTable:
        size = ll_tokenizer.vocab_size
        return cls([ll_tokenizer.decode_bytes([t]) for t in range(size)], [t for t in range(size) if ll_tokenizer.is_special_token(t)])

    def write(self, path: Path) -> None:
        """Atomically (a crash leaves the old file or none, never half a table)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        lengths, special = array("i", map(len, self.pieces)), array("i", self.special)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:
            out.write(MAGIC + struct.pack("<ii", len(lengths), len(special)))
            out.write(lengths.tobytes() + special.tobytes() + b"".join(self.pieces))
        os.replace(out.name, path)

    @classmethod
    def read(cls, path: Path) -> TokenTable:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError(f"{path} is not a token table")
        at = len(MAGIC)
        count, specials = struct.unpack_from("<ii", data, at)
        at += 8
        lengths = array("i", data[at : at + 4 * count])
        at += 4 * count
        special = array("i", data[at : at + 4 * specials]).tolist()
        at += 4 * specials
        pieces = []
        for length in lengths:
            pieces.append(data[at : at + length])
            at += length
        if at != len(data):
            raise ValueError(f"{path} is truncated or has trailing bytes")
        return cls(pieces, special)


class _Wrapped:
    """What `llguidance.TokenizerWrapper` reads: the table, the special ids, and text -> ids by our tokenizer."""

    def __init__(self, tokenizer, table: TokenTable, eos_token_ids: list[int]):
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = table.pieces
        self.special_token_ids = table.special
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:  # str only: TokenizerWrapper then passes text, not bytes
        if not isinstance(text, str):
            raise TypeError("text")
        return self._encode(text, add_special_tokens=False)


def table_path(cache_dir: Path, tokenizer_file: Path, n_vocab: int, eos_token_ids: list[int]) -> Path:
    stat = tokenizer_file.stat()
    key = f"{tokenizer_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{n_vocab}|{eos_token_ids}|{llguidance.__version__}"
    return cache_dir / "token-tables" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.bin"


def ll_tokenizer(tokenizer, eos_token_ids: list[int], cache_dir: Path | None) -> tuple[llguidance.LLTokenizer, TokenTable]:
    """llguidance's tokenizer and the token table, from the cache when it has them (see the module's docstring).
    A tokenizer without a tokenizer.json file (transformers' AutoTokenizer of a hub id) takes llguidance's own path,
    uncached."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    source = getattr(tokenizer, "source_file", None)
    n_vocab = len(tokenizer)
    path = table_path(cache_dir, source, n_vocab, eos_token_ids) if cache_dir is not None and source is not None else None
    if path is not None and path.is_file():
        try:
            table = TokenTable.read(path)
            wrapper = llguidance.TokenizerWrapper(_Wrapped(tokenizer, table, eos_token_ids))
            return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos_token_ids), table
        except (OSError, ValueError) as exc:
            log.warning("token table %s unreadable (%s): rebuilding it", path, exc)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        from llguidance.hf import from_tokenizer  # imports transformers: only for tokenizers that need it

        built = from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)
    else:  # llguidance.hf would first copy the Rust tokenizer only to switch off padding and truncation (0.9 s)
        built = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos_token_ids)
    table = TokenTable.of(built)
    if path is not None:
        try:
            table.write(path)
        except OSError as exc:  # a read-only cache: every start takes the slow path
            log.warning("could not write the token table %s: %s", path, exc)
    return built, table
