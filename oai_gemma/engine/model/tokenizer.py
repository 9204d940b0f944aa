"""The tokenizer as the server uses it: the `tokenizers` library's Rust `Tokenizer` read straight from
`tokenizer.json`, behind the few methods of a transformers tokenizer that the engine, the chat renderer and the API
call (encode, decode, the id/token maps, the special tokens' ids, the vocabulary's size).

Why not `AutoTokenizer`: for Gemma-3's 33 MB tokenizer.json it parses the file in Rust and then spends longer in
Python over the vocabulary's 6,000-odd added tokens (measured on the busy 2-core machine, one process: 12.8 s the
Rust parse alone, 32.9 s `AutoTokenizer.from_pretrained`; the same ratio on a quiet one is ~1 s of a warm start).
A source without a local tokenizer.json (a hub id, a sentencepiece-only model) still goes through AutoTokenizer
(`load_tokenizer`). The Rust tokenizer of one tokenizer.json content is built once per process (model/shared.py:
several models, one load not stalling the others' streams); the rest (special tokens, chat template) is each
directory's own."""

from __future__ import annotations

import json
from pathlib import Path

from .shared import Holder, file_digest, shared

SPECIAL = ("bos", "eos", "unk", "pad")


class RustTokenizer:
    """A transformers-like face over `tokenizers.Tokenizer` (`backend_tokenizer`, as a fast tokenizer names it)."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.source_file = directory / "tokenizer.json"
        """Its file: the key of the grammar engine's cached token table (engine/sampling/token_table.py)."""
        self.content_key = file_digest(self.source_file)
        """Its file's content: models with the same one share the Rust tokenizer and the grammar compiler."""
        self._shared = shared(("tokenizer", self.content_key), lambda: Holder(Tokenizer.from_file(str(self.source_file))))
        self.backend_tokenizer = self._shared.value
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        for name in SPECIAL:
            token = config.get(f"{name}_token")
            token = token.get("content") if isinstance(token, dict) else token
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", self.backend_tokenizer.token_to_id(token) if token else None)
        template = directory / "chat_template.jinja"
        self.chat_template = template.read_text() if template.exists() else config.get("chat_template")
        self.vocab_size = self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


def load_tokenizer(source: str):
    """A RustTokenizer where `source` is a directory with a tokenizer.json, else transformers' AutoTokenizer."""
    if (Path(source) / "tokenizer.json").is_file():
        return RustTokenizer(Path(source))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
