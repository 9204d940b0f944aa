"""What models of one process may share instead of building again: the Rust tokenizer of a tokenizer.json and the
grammar compiler's token trie (engine/sampling/grammar.py), each keyed by the content of the files it is built from.

Why: each build holds the GIL for 1-2 s (Rust code called without releasing it), so a second model's load stalled
the streams of the models already loaded that long, twice (issue 41: their ITL p99 14-20x during the load). Every
Gemma-3 size ships the same tokenizer.json, so a second model finds both built. A shared object lives as long as a
model that uses it (weak references: unloading the last one frees it).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_built: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_locks: dict[Hashable, list] = {}
"""Per key being built or asked for now: [its lock, how many callers hold or wait on it]; gone with its last caller."""
_guard = threading.Lock()
_digests: dict[tuple, str] = {}


def shared(key: Hashable, build: Callable[[], T]) -> T:
    """The object built for `key`, built now by `build()` if no living one has it (two loads asking at once build
    it once: the second waits for the first)."""
    with _guard:
        entry = _locks.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        with entry[0]:
            found = _built.get(key)
            if found is None:
                found = build()
                _built[key] = found
            return found
    finally:
        with _guard:
            entry[1] -= 1
            if not entry[1]:
                del _locks[key]


def file_digest(path: Path) -> str:
    """The sha256 of a file's content (hashlib releases the GIL over large buffers: no stall), remembered by its
    path, size and modification time."""
    stat = path.stat()
    stamp = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if stamp not in _digests:
        with open(path, "rb") as f:
            _digests[stamp] = hashlib.file_digest(f, "sha256").hexdigest()
    return _digests[stamp]


class Holder:
    """A weak-referenceable box for what cannot be weakly referenced itself (a Rust object)."""

    def __init__(self, value):
        self.value = value
