"""Continuous batching: which sequences run in the next step.

Between any two steps waiting requests are admitted while there is a batch row and KV memory for them; their
prompts are prefilled in chunks under a per-step token budget, in the same step as every running sequence's
decode token, so a long prompt never stalls running streams for more than one chunk. An admitted prompt starts
from the longest prefix any earlier or running request has written into the KV cache (engine/cache/block_pool.py).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from .cache.block_pool import BlockPool
from .cache.prefix_hash import CacheSpace, block_hashes
from .sequence import Sequence, Step, StepItem

if TYPE_CHECKING:
    from .lora.registry import LoraRegistry


def _chunk_end(start: int, end: int, spans) -> int:
    """Never cut an image block: its tokens attend to each other both ways, so they prefill together."""
    for block_start, block_end in spans:
        if block_start < end < block_end:
            return block_start if block_start > start else block_end
    return end


def _chunk_embeds(seq: Sequence, start: int, end: int):
    """(rows in the chunk, vision embeddings) for the image tokens in prompt[start:end]."""
    if seq.image_embeds is None:
        return None
    rows, parts, first = [], [], 0
    for block_start, block_end in seq.image_spans:
        lo, hi = max(block_start, start), min(block_end, end)
        if lo < hi:
            rows.extend(range(lo - start, hi - start))
            parts.append(seq.image_embeds[first + lo - block_start : first + hi - block_start])
        first += block_end - block_start
    return (torch.tensor(rows), torch.cat(parts)) if rows else None


class Scheduler:
    def __init__(
        self, pool: BlockPool, max_seqs: int, max_prefill_tokens: int, max_len: int, reuse_decoded: bool = True,
        adapters: LoraRegistry | None = None, speculator=None, kernel_prompts_below: int = 0,
    ):
        """`reuse_decoded`: generated tokens' blocks are offered to later requests too, not only prompts' (off in
        batch-invariant mode: a decoded token's KV differs in its last bits from the same token prefilled).
        `adapters`: the LoRA registry; a sequence with an adapter is admitted once a slot holds it.
        `speculator`: gives decoding sequences their drafts each step (engine/speculative/planner.py).
        `kernel_prompts_below`: prompts of fewer tokens run their rows through the row-exact kernel (batch-invariant
        mode's choice per request, by its prompt alone: engine/ops/invariance.py `PROMPT_KERNEL_TOKENS`); 0: none."""
        self.pool = pool
        self.speculator = speculator
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.reuse_decoded = reuse_decoded
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.max_prefill_tokens = max_prefill_tokens
        self.adapters = adapters
        self.kernel_prompts_below = kernel_prompts_below

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> list[Sequence]:
        """Every running or waiting sequence of a request (one per choice)."""
        return [seq for seq in (*self.running, *self.waiting) if seq.request_id == request_id]

    @property
    def size(self) -> int:
        return self.pool.block_size

    def _most_blocks(self, seq: Sequence) -> int:
        return -(-min(len(seq.prompt_ids) + seq.sampling.max_tokens, self.max_len) // self.size)

    def _room(self) -> int:
        """Blocks that can be handed out beyond what running sequences may still claim."""
        return self.pool.available - sum(seq.most_blocks - len(seq.blocks) for seq in self.running)

    def _admit(self, seq: Sequence, now: float) -> bool | None:
        """Start `seq` from its longest cached prefix (True); False: no room now; None: part of that prefix is
        being written by a running step, so `seq` waits for it rather than computing it again, or its adapter's
        files are being read (engine/lora/registry.py): later requests may start meanwhile."""
        if len(self.running) >= self.max_seqs:
            return False
        if seq.lora is not None and not seq.adapter:  # first: its cache space names the weights it will run with
            seq.adapter = self.adapters.acquire(seq.lora)  # pinned until it ends
            if not seq.adapter:  # its files are being read (others may start meanwhile), or every slot is pinned
                return None if seq.lora.loading else False
        if seq.space is None:  # once per sequence: neither its prompt nor its pinned adapter changes while it waits
            seq.space = self._space(seq)
            seq.hashes = block_hashes(seq.cache_keys, self.size, seq.space.root)
        hashes = seq.hashes
        usable = (len(seq.prompt_ids) - 1) // self.size  # at least one prompt token is computed, for the logits
        hit, wait = ([], False) if seq.scores_prompt else self.pool.lookup(hashes[:usable], seq.cache_keys, seq.space)
        if wait:
            return None
        seq.most_blocks = self._most_blocks(seq)
        if self._room() - sum(self.pool.refs[b] == 0 for b in hit) < seq.most_blocks - len(hit):
            return False
        self.pool.take(hit)
        seq.blocks = hit + self.pool.allocate(-(-len(seq.prompt_ids) // self.size) - len(hit))
        for index in range(len(hit), len(hashes)):
            self._index(seq, index, seq.cache_keys, pending=True)
        seq.num_computed = seq.num_cached = len(hit) * self.size
        seq.scheduled_time = now
        self.running.append(seq)
        return True

    def _space(self, seq: Sequence) -> CacheSpace:
        """The request's tenant and salt, the content hash of the adapter weights in its slot (a prefix computed under
        other weights, another adapter's or this one's files since changed on disk, is never reused) and its prompt's
        path (`kernel_prompts_below`)."""
        adapter = self.adapters.digest(seq.adapter) if seq.adapter else b""
        kernel = len(seq.prompt_ids) < self.kernel_prompts_below
        return CacheSpace(seq.request.cache_scope, seq.request.cache_salt, adapter, kernel)

    def fork(self, seq: Sequence, now: float) -> list[tuple[Sequence, int | None]]:
        """Start the choices waiting for `seq`'s prompt (its ParentRequest's pending children) now that the prompt
        is in the cache: each that gets room shares its full prompt blocks and is returned with the block to which
        the caller copies `seq`'s last, partial one (or None); the others wait and start like any request (from
        the cached prompt)."""
        started = []
        full = len(seq.prompt_ids) // self.size
        for child in seq.parent.take_pending() if seq.parent is not None else ():
            child.most_blocks = self._most_blocks(child)
            if len(self.running) >= self.max_seqs or self._room() < child.most_blocks - full:
                self.waiting.append(child)
                continue
            self.pool.take(seq.blocks[:full])
            if seq.adapter:
                child.adapter = seq.adapter
                self.adapters.pin(seq.adapter)
            copy = self.pool.allocate(1)[0] if len(seq.blocks) > full else None
            child.blocks = seq.blocks[:full] + ([copy] if copy is not None else [])
            child.hashes, child.space = list(seq.hashes), seq.space
            child.num_computed, child.num_cached = len(child.prompt_ids), seq.num_cached
            child.scheduled_time = now
            self.running.append(child)
            started.append((child, copy))
        return started

    def finish(self, seq: Sequence, cache_valid: bool = True) -> None:
        """Remove a sequence at once and let go of its blocks (cached ones stay for later requests)."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.blocks, valid=cache_valid)
        seq.blocks = []
        if seq.adapter:
            self.adapters.release(seq.adapter)
            seq.adapter = 0

    def advance(self, step: Step) -> None:
        """Count the tokens the step wrote into the cache; the blocks it filled become reusable.
        A drafted decode item was cut back to its accepted positions (engine/speculative/verify.py) before this."""
        decoding = [False] * len(step.prefills) + [True] * len(step.decodes)
        for seq, item, decode in zip(step.prefill_owners + step.decode_owners, step.prefills + step.decodes, decoding):
            before = seq.num_computed // self.size
            seq.num_computed += len(item.token_ids)
            for index in range(before, seq.num_computed // self.size):
                self.pool.written(seq.blocks[index])
                if index == len(seq.hashes) and self.reuse_decoded:  # a block of generated tokens filled up
                    self._index_generated(seq, index, item.token_ids[1:] if decode else [])

    def _index_generated(self, seq: Sequence, index: int, accepted: list[int]) -> None:
        """`accepted`: drafts this step kept, not in `output_ids` yet."""
        keys = seq.cache_keys + seq.output_ids + accepted
        tokens = keys[index * self.size : (index + 1) * self.size]
        seq.hashes += block_hashes(tokens, self.size, seq.hashes[-1] if seq.hashes else seq.space.root)
        if len(seq.hashes) > index:
            self._index(seq, index, keys, pending=False)

    def _index(self, seq: Sequence, index: int, keys: list[int], pending: bool) -> None:
        """Offer `seq`'s block `index` (holding keys[index * size:][:size]) to later requests."""
        after = seq.blocks[index - 1] if index else seq.space
        tokens = keys[index * self.size : (index + 1) * self.size]
        self.pool.index(seq.blocks[index], seq.hashes[index], tokens, after, pending)

    def schedule(self, now: float) -> Step:
        for seq in list(self.waiting):
            admitted = self._admit(seq, now)
            if admitted is False:
                break
            if admitted:
                self.waiting.remove(seq)
        prefills, decodes, prefill_seqs, decode_seqs = [], [], [], []
        budget = self.max_prefill_tokens
        if self.speculator is not None:
            prefill = sum(len(seq.prompt_ids) - seq.num_computed for seq in self.running if seq.in_prefill)
            self.speculator.plan([seq for seq in self.running if not seq.in_prefill], self.max_len, min(prefill, budget))
        for seq in self.running:
            if not seq.in_prefill:
                tokens = [seq.output_ids[-1], *seq.draft]
                missing = -(-(seq.num_computed + len(tokens)) // self.size) - len(seq.blocks)
                if missing > 0:
                    seq.blocks += self.pool.allocate(missing)  # kept free for it since admission
                decodes.append(StepItem(seq.blocks, tokens, seq.num_computed, num_logits=len(tokens)))
                decode_seqs.append(seq)
            elif budget > 0 and not seq.apart:
                start = seq.num_computed
                end = _chunk_end(start, min(start + budget, len(seq.prompt_ids)), seq.image_spans)
                chunk = seq.prompt_ids[start:end]
                done = end == len(seq.prompt_ids)
                prefills.append(StepItem(
                    seq.blocks, chunk, start, done, seq.image_spans, _chunk_embeds(seq, start, end),
                    keep_hidden=seq.scores_prompt, kernel=seq.space.kernel,
                ))
                prefill_seqs.append(seq)
                budget -= len(chunk)
        return Step(prefills, decodes, prefill_seqs, decode_seqs)
