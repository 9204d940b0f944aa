"""The prefix cache's keys: whose prefixes a request may reuse (`CacheSpace`), and the chained hash of its blocks.

Every part of a space is its own field, hashed in an unambiguous encoding, never a string joined from parts: a
request's `cache_salt` once ended up spelling an adapter's salt and so wrote the KV that adapter's requests then
reused (issue 39). Hashes are BLAKE2b keyed with a per-process secret, so no one outside can compute or aim at one.
A hash only finds a candidate block: the pool still compares the block's tokens and predecessor on a hit
(engine/cache/block_pool.py).
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from dataclasses import dataclass

_KEY = secrets.token_bytes(32)
_ROOT = hashlib.blake2b(key=_KEY, digest_size=16, person=b"oai-gemma-space")
_BLOCK = hashlib.blake2b(key=_KEY, digest_size=16, person=b"oai-gemma-block")
"""One keyed state per kind of input, copied per hash (cheaper than keying a new one; `person` tells them apart)."""


@dataclass(frozen=True)
class CacheSpace:
    """Requests reuse each other's cached prefixes only within one space: the same tenant (`scope`, the API key's
    owner under `engine.prefix_cache_scope = key`), the same `cache_salt`, and the same adapter weights (`adapter`:
    the content hash of the adapter as read into its slot; empty for the base model). The model needs no field:
    a pool serves one engine's one model, and the hash key is this process's own. `kernel`: the prompt's rows run
    through the row-exact kernel (batch-invariant mode's short prompts, engine/ops/invariance.py
    `PROMPT_KERNEL_TOKENS`), whose KV has other last bits than the dequantized matmul's: never reused across paths."""

    scope: str = ""
    salt: str = ""
    adapter: bytes = b""
    kernel: bool = False

    @property
    def root(self) -> bytes:
        """The hash a chain of blocks in this space continues from."""
        state = _ROOT.copy()
        parts = (self.scope.encode("utf-8", "surrogatepass"), self.salt.encode("utf-8", "surrogatepass"), self.adapter,
                 b"kernel" if self.kernel else b"")
        for part in parts:
            state.update(len(part).to_bytes(8, "little"))
            state.update(part)
        return state.digest()


def block_hashes(keys: list[int], block_size: int, parent: bytes) -> list[bytes]:
    """The chained hash of each full block of `keys` (token ids, or an image's negative content key), continuing
    after `parent` (the hash of the block before them, or a space's root)."""
    data, width = array("q", keys).tobytes(), 8 * block_size  # fixed width: no two token lists encode alike
    hashes = []
    for start in range(0, len(data) - width + 1, width):
        state = _BLOCK.copy()
        state.update(parent)
        state.update(data[start : start + width])
        parent = state.digest()
        hashes.append(parent)
    return hashes
