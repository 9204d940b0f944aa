"""What a prefix-cache hit that cannot be poisoned costs (issue 29 item 1), per 16-token block, in microseconds.

(a) Python's tuple hash chained from a per-process secret, then on a hit a comparison of the block's tokens and
    predecessor against the stored copy (what engine/cache/block_pool.py does);
(b) a keyed collision-resistant hash instead: BLAKE2b-128 keyed with a per-process secret over the parent digest
    and the block's tokens as bytes (no comparison needed).
Run: python benchmarks/prefix_hash_cost.py
"""

from __future__ import annotations

import hashlib
import random
import secrets
import timeit
from array import array

from oai_gemma.engine.cache.block_pool import BlockPool, block_hashes, salt_root

BLOCK = 16
TOKENS = 2048
KEY = secrets.token_bytes(32)


def blake_hashes(keys: list[int], parent: bytes = b"") -> list[bytes]:
    hashes = []
    for start in range(0, len(keys) - BLOCK + 1, BLOCK):
        parent = hashlib.blake2b(parent + array("i", keys[start : start + BLOCK]).tobytes(), key=KEY, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def main() -> None:
    keys = [random.randrange(262_144) for _ in range(TOKENS)]
    blocks = TOKENS // BLOCK
    pool = BlockPool(blocks, BLOCK)
    hashes = block_hashes(keys, BLOCK, salt_root(""))
    held = pool.allocate(blocks)
    for i, (block, h) in enumerate(zip(held, hashes)):
        pool.index(block, h, keys[i * BLOCK : (i + 1) * BLOCK], held[i - 1] if i else "", pending=False)
    assert pool.lookup(hashes, keys)[0] == held
    plain_index = {h: b for h, b in zip(hashes, held)}
    blake_index = {h: b for h, b in zip(blake_hashes(keys), held)}

    def per_block(fn) -> float:
        runs = 200
        return min(timeit.repeat(fn, number=runs, repeat=5)) / runs / blocks * 1e6

    rows = {
        "python hash chain (salted)": per_block(lambda: block_hashes(keys, BLOCK, salt_root(""))),
        "lookup, dict only (no check)": per_block(lambda: [plain_index[h] for h in hashes]),
        "lookup with token comparison": per_block(lambda: pool.lookup(hashes, keys)),
        "blake2b-128 keyed chain": per_block(lambda: blake_hashes(keys)),
        "lookup on blake2b digests": per_block(lambda: [blake_index[h] for h in blake_index]),
    }
    print(f"{TOKENS}-token prompt, {blocks} blocks of {BLOCK}; microseconds per block:")
    for name, us in rows.items():
        print(f"  {name:32s} {us:6.3f}")
    compare = rows["python hash chain (salted)"] + rows["lookup with token comparison"]
    keyed = rows["blake2b-128 keyed chain"] + rows["lookup on blake2b digests"]
    print(f"hash + hit: compare tokens {compare:.3f} us/block, keyed hash {keyed:.3f} us/block")


if __name__ == "__main__":
    main()
