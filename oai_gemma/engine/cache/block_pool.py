"""Which KV blocks each sequence holds, and the prefix index that lets any later request reuse them.

A block is found for reuse by the hash of every token before and in it (a chain: the hash of the block before
it, then its own tokens; image tokens count as their image's content hash; the chain starts from the root of the
request's `CacheSpace`: its tenant, salt and adapter weights; engine/cache/prefix_hash.py), so two prompts share a
block exactly when they share their space and everything up to its end. A hash only finds a candidate: a hit is
taken only when the block's own tokens and the block before it (or, for a chain's first block, the space) are the
ones asked for, so a collision, by chance or crafted, costs a miss and never serves another prompt's KV (vLLM's
advisory on predictable prefix hashes; docs/engine.md, "Prefix cache integrity"). Only full blocks are indexed. A
block is referenced by each sequence whose table holds it; when the last one lets go, an indexed block stays cached
(least recently used first out) until its memory is needed, and any other block is simply free.

An indexed block is `pending` from the moment a running sequence is given it to fill until that step has run:
a request that would reuse it waits for it instead of computing the same tokens beside it (SGLang's
behaviour), and is admitted once it is ready.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prefix_hash import CacheSpace


class BlockPool:
    """`num_blocks` blocks: free ones, cached ones (unreferenced but indexed) and those sequences hold.
    `caching` off (`engine.prefix_caching = false`): nothing is indexed, a released block is free at once."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.free = list(range(num_blocks - 1, -1, -1))
        """Blocks holding nothing reusable; popped from the end, so low blocks (pages already touched) go first."""
        self.cached: OrderedDict[int, None] = OrderedDict()
        """Unreferenced indexed blocks, least recently used first."""
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, tuple] = {}
        """Indexed block -> (what it follows: the space, or (the block before it, that block's serial), its tokens):
        what a hit must match, whatever the hash says."""
        self.serial_of: dict[int, int] = {}
        """Indexed block -> a number never given twice, so a block freed and indexed again is not its old self."""
        self._serials = itertools.count()
        self.pending: set[int] = set()
        """Indexed blocks whose KV a running step has yet to write."""

    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return len(self.free) + len(self.cached)

    def lookup(self, hashes: list[bytes], keys: list[int], space: CacheSpace) -> tuple[list[int], bool]:
        """(the blocks of the longest indexed prefix of `hashes` (the chain of `keys` in `space`) whose KV is
        written, whether the prefix goes on in a block that is being written: then the caller should wait for it)."""
        blocks: list[int] = []
        after: object = space
        for i, h in enumerate(hashes):
            block = self.block_of.get(h)
            if block is None or self.key_of[block] != (after, tuple(keys[i * self.block_size : (i + 1) * self.block_size])):
                return blocks, False  # not indexed, or a collision: another prefix's block
            if block in self.pending:
                return blocks, True
            blocks.append(block)
            after = (block, self.serial_of[block])
        return blocks, False

    def take(self, blocks: list[int]) -> None:
        """Reference blocks found by `lookup` (a cached one leaves the eviction order)."""
        for block in blocks:
            self.refs[block] += 1
            self.cached.pop(block, None)

    def allocate(self, count: int) -> list[int]:
        """`count` new blocks, referenced once; evicts the least recently used cached blocks when none is free."""
        if count > self.available:
            raise MemoryError(f"{count} KV blocks wanted, {self.available} available")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:
                block, _ = self.cached.popitem(last=False)
                self._forget(block)
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def index(self, block: int, block_hash: bytes, tokens: list[int], after: CacheSpace | int, pending: bool) -> None:
        """Make a held block findable by its prefix hash (unless caching is off or that prefix is indexed already).
        `after`: the space for a chain's first block, else the block before it (which must be indexed itself)."""
        if not self.caching or block_hash in self.block_of or block in self.hash_of:
            return
        if isinstance(after, int):
            if after not in self.serial_of:
                return
            after = (after, self.serial_of[after])
        self.hash_of[block], self.block_of[block_hash] = block_hash, block
        self.key_of[block], self.serial_of[block] = (after, tuple(tokens)), next(self._serials)
        if pending:
            self.pending.add(block)

    def written(self, block: int) -> None:
        """A pending block's KV is in the cache now: waiting requests may reuse it."""
        self.pending.discard(block)

    def release(self, blocks: list[int], valid: bool = True) -> None:
        """A sequence lets go of its blocks. Indexed, written ones stay cached; `valid` False (a failed step: the
        KV may be wrong) forgets those no one else holds."""
        for block in reversed(blocks):  # the chain's tail is evicted before its head
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if block in self.pending or not valid:
                self._forget(block)
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def _forget(self, block: int) -> None:
        self.pending.discard(block)
        block_hash = self.hash_of.pop(block, None)
        if block_hash is not None:
            del self.block_of[block_hash], self.key_of[block], self.serial_of[block]
