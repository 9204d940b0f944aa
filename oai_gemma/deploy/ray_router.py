"""Ray Serve request routers for the engine replicas (Ray Serve's `RequestRouter` API).

`LeastOngoingRouter`: every request to the replica with the fewest ongoing requests (Ray's default picks the
better of two random replicas; with many replicas that is only close to the least loaded).

`PrefixAffinityRouter`: a request whose prompt starts like an earlier one goes to the replica that served it,
so a conversation's next turn finds its prefix in that replica's KV cache (`cached_tokens`), as Ray Serve LLM's
`PrefixCacheAffinityRouter` and llm-d do; unless that replica has `imbalanced_threshold` more ongoing requests
than the least loaded one, then load wins. The prompt is matched in blocks of `block_bytes` bytes, each block's
hash chained to the one before, so a hit means the whole prefix up to that block is the same.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)


def least_loaded_first(router: RequestRouter, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    """One replica per rank, fewest ongoing requests first (ties in random order).

    A replica whose queue length the router does not know yet counts as idle, so Ray probes it; one rank with
    them all would not do: Ray then picks among the known ones only, and a fresh replica gets nothing."""
    cache = router.replica_queue_len_cache
    shuffled = random.sample(candidates, len(candidates))
    return [[r] for r in sorted(shuffled, key=lambda r: cache.get(r.replica_id) or 0)]


class LeastOngoingRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: Ray retries with backoff, not a busy loop
        return least_loaded_first(self, candidate_replicas)


def block_hashes(prefix: bytes, block_bytes: int) -> list[bytes]:
    """Chained hashes of the prompt's whole blocks: the i-th names the first i+1 blocks."""
    hashes, previous = [], b""
    for start in range(0, len(prefix) - block_bytes + 1, block_bytes):
        previous = hashlib.blake2b(previous + prefix[start : start + block_bytes], digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = 4, block_bytes: int = 64, max_blocks: int = 200_000, **_) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.owner: OrderedDict[bytes, ReplicaID] = OrderedDict()
        """Block hash -> the replica that last served a prompt with that prefix (least recently used first)."""

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        call = pending_request.args[0] if pending_request is not None and pending_request.args else None
        return block_hashes(getattr(call, "prefix", b"") or b"", self.block_bytes)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id: r for r in candidate_replicas}
        holder = None
        for h in reversed(self._hashes(pending_request)):  # the longest cached prefix first
            owner = self.owner.get(h)
            if owner in by_id:
                holder = by_id[owner]
                break
        if holder is None:
            return least_loaded_first(self, candidate_replicas)
        cache = self.replica_queue_len_cache
        loads = [cache.get(r.replica_id) for r in candidate_replicas]
        known = [q for q in loads if q is not None]
        holder_load = cache.get(holder.replica_id)
        ranked = least_loaded_first(self, candidate_replicas)
        if holder_load is not None and known and holder_load - min(known) > self.imbalanced_threshold:
            return ranked
        return [[holder], *ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for h in self._hashes(pending_request):
            self.owner[h] = replica_id
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_blocks:
            self.owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, owner in self.owner.items() if owner == replica_id]:
            del self.owner[h]
