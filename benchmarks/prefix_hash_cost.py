"""What the prefix cache's keys cost per 16-token block, in microseconds (issue 29 item 1, issue 39 item 1).

(a) the engine's chain: BLAKE2b-128 keyed with a per-process secret over the parent digest and the block's tokens
    as int64 bytes (engine/cache/prefix_hash.py), then on a hit a comparison of the block's tokens and
    predecessor against the stored copy (engine/cache/block_pool.py);
(b) what it replaced: Python's tuple hash chained from a per-process secret (its collisions can be crafted offline).
Run: python benchmarks/prefix_hash_cost.py
"""

from __future__ import annotations

import random
import secrets
import timeit

from oai_gemma.engine.cache.block_pool import BlockPool
from oai_gemma.engine.cache.prefix_hash import CacheSpace, block_hashes

BLOCK = 16
TOKENS = 2048
SECRET = secrets.randbits(64)


def tuple_hashes(keys: list[int]) -> list[int]:
    parent, hashes = hash((SECRET, "")), []
    for start in range(0, len(keys) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(keys[start : start + BLOCK])))
        hashes.append(parent)
    return hashes


def main() -> None:
    keys = [random.randrange(262_144) for _ in range(TOKENS)]
    blocks, space = TOKENS // BLOCK, CacheSpace()
    pool = BlockPool(blocks, BLOCK)
    hashes = block_hashes(keys, BLOCK, space.root)
    held = pool.allocate(blocks)
    for i, (block, h) in enumerate(zip(held, hashes)):
        pool.index(block, h, keys[i * BLOCK : (i + 1) * BLOCK], held[i - 1] if i else space, pending=False)
    assert pool.lookup(hashes, keys, space)[0] == held

    def per_block(fn) -> float:
        runs = 200
        return min(timeit.repeat(fn, number=runs, repeat=5)) / runs / blocks * 1e6

    rows = {
        "keyed blake2b-128 chain (engine)": per_block(lambda: block_hashes(keys, BLOCK, space.root)),
        "python tuple-hash chain (before)": per_block(lambda: tuple_hashes(keys)),
        "lookup comparing tokens": per_block(lambda: pool.lookup(hashes, keys, space)),
    }
    print(f"{TOKENS}-token prompt, {blocks} blocks of {BLOCK}; microseconds per block:")
    for name, us in rows.items():
        print(f"  {name:34s} {us:6.3f}")
    total = rows["keyed blake2b-128 chain (engine)"] + rows["lookup comparing tokens"]
    print(f"hash + hit: {total:.3f} us/block, {total * blocks / 1000:.3f} ms for the prompt")


if __name__ == "__main__":
    main()
