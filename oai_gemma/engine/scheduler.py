"""Continuous batching: which sequences run in the next step.

Between any two steps waiting requests are admitted into free KV-cache slots; their prompts are
prefilled in chunks under a per-step token budget, in the same step as every running sequence's
decode token, so a long prompt never stalls running streams for more than one chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .runner import StepItem
from .sampler import RowRandom
from .types import GenerationRequest


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    sink: object
    """Where this sequence's events go (the engine hands them to the event loop)."""
    random: RowRandom
    detokenizer: object
    stopper: object
    slot: int | None = None
    num_computed: int = 0
    """Prompt + output tokens whose KV is in the cache."""
    num_cached: int = 0
    """Prompt tokens whose KV was reused from an earlier request (prefix cache hit)."""
    cache_keys: list[int] = field(default_factory=list)
    """The prompt as the prefix cache sees it: token ids, with each image block's ids replaced by its hash."""
    image_spans: tuple[tuple[int, int], ...] = ()
    image_embeds: object | None = None
    """[image tokens, hidden] from the vision tower, in prompt order."""
    output_ids: list[int] = field(default_factory=list)
    matcher: object | None = None
    """This sequence's place in its request's grammar (structured output), else None."""
    prompt_logprobs: list | None = None
    """The prompt's logprobs so far, chunk by chunk (when the request asks for them)."""
    scheduled_time: float | None = None
    finished: bool = False
    index: int = 0
    """Which choice of its request this sequence generates (n > 1)."""
    forks: list["Sequence"] = field(default_factory=list)
    """The request's other choices, waiting for this sequence's prefill to finish: they then take a copy
    of its KV cache and sample from its last logits instead of prefilling the same prompt again."""

    @property
    def sampling(self):
        return self.request.sampling

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def scores_prompt(self) -> bool:
        """The request wants the prompt's logprobs: every position's logits, so no prefix-cache reuse."""
        return self.sampling.prompt_logprobs is not None

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)


@dataclass
class Step:
    prefills: list[StepItem]
    decodes: list[StepItem]
    prefill_owners: list[Sequence]
    decode_owners: list[Sequence]

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order of the logits rows."""
        done = [seq for seq, item in zip(self.prefill_owners, self.prefills) if item.want_logits]
        return done + self.decode_owners

    def advance(self) -> None:
        """Count the tokens this step wrote into the cache."""
        for seq, item in zip(self.prefill_owners + self.decode_owners, self.prefills + self.decodes):
            seq.num_computed += len(item.token_ids)


def reusable_prefix(cached: list[int], prompt: list[int], window: int) -> int:
    """How many leading prompt tokens can take their KV from a slot that holds `cached`.

    Full-attention layers keep every position; a sliding layer's ring keeps only the last `window` of
    `cached`, so the prefix counts only if the window before it is still there. At least one prompt token
    is always left to compute, for the logits.
    """
    limit = min(len(cached), len(prompt) - 1)
    n = 0
    while n < limit and cached[n] == prompt[n]:
        n += 1
    if len(cached) > window and n < len(cached) - 1:
        return 0
    return n


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


class SlotPool:
    """The KV-cache slots. A freed slot keeps its tokens' KV: a follow-up request that resends the same
    conversation (multi-turn) lands in that slot and skips recomputing the shared prefix."""

    def __init__(self, num_slots: int, window: int):
        self.window = window
        self.free: dict[int, list[int]] = {slot: [] for slot in range(num_slots)}  # oldest freed first

    def __len__(self) -> int:
        return len(self.free)

    def acquire(self, prompt: list[int]) -> tuple[int, int]:
        """(slot, number of prompt tokens already cached there)."""
        best, best_len = next(iter(self.free)), 0
        for slot, cached in self.free.items():
            n = reusable_prefix(cached, prompt, self.window)
            if n > best_len:
                best, best_len = slot, n
        del self.free[best]
        return best, best_len

    def release(self, slot: int, cached: list[int]) -> None:
        self.free[slot] = cached


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int, window: int = 1 << 30, reuse_decoded: bool = True):
        """`reuse_decoded`: a freed slot offers the KV of its generated tokens too, not only its prompt's (off in
        batch-invariant mode: a decoded token's KV differs in its last bits from the same token prefilled)."""
        self.reuse_decoded = reuse_decoded
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.slots = SlotPool(num_slots, window)
        self.max_prefill_tokens = max_prefill_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> list[Sequence]:
        """Every running or waiting sequence of a request (one per choice)."""
        return [seq for seq in (*self.running, *self.waiting) if seq.request_id == request_id]

    def fork(self, seq: Sequence, now: float) -> list[Sequence]:
        """Start `seq`'s forks now that its prompt is in the cache: each that gets a free slot is returned
        (the caller copies the KV and samples it from `seq`'s logits); the others wait and prefill themselves."""
        started = []
        for child in seq.forks:
            if self.slots:
                child.slot, _ = self.slots.acquire(child.cache_keys)
                child.num_computed, child.num_cached = len(child.prompt_ids), seq.num_cached
                child.scheduled_time = now
                self.running.append(child)
                started.append(child)
            else:
                self.waiting.append(child)
        seq.forks = []
        return started

    def finish(self, seq: Sequence, cache_valid: bool = True) -> None:
        """Remove a sequence at once and free its slot, which keeps the KV of the tokens it computed."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            cached = (seq.cache_keys + seq.output_ids)[: seq.num_computed] if cache_valid else []
            if not self.reuse_decoded and len(cached) > len(seq.cache_keys):
                # only the prompt's KV, and only while no decoded position has overwritten a sliding layer's ring
                cached = seq.cache_keys if len(cached) <= self.slots.window else []
            self.slots.release(seq.slot, cached)
            seq.slot = None

    def schedule(self, now: float) -> Step:
        while self.waiting and self.slots:
            seq = self.waiting.popleft()
            seq.slot, seq.num_cached = self.slots.acquire(seq.cache_keys)
            if seq.scores_prompt:
                seq.num_cached = 0
            seq.num_computed = seq.num_cached
            seq.scheduled_time = now
            self.running.append(seq)
        prefills, decodes, prefill_seqs, decode_seqs = [], [], [], []
        budget = self.max_prefill_tokens
        for seq in self.running:
            if not seq.in_prefill:
                last = seq.output_ids[-1]
                decodes.append(StepItem(seq.slot, [last], seq.num_computed))
                decode_seqs.append(seq)
            elif budget > 0:
                start = seq.num_computed
                end = _chunk_end(start, min(start + budget, len(seq.prompt_ids)), seq.image_spans)
                chunk = seq.prompt_ids[start:end]
                done = end == len(seq.prompt_ids)
                prefills.append(StepItem(
                    seq.slot, chunk, start, done, seq.image_spans, _chunk_embeds(seq, start, end),
                    keep_hidden=seq.scores_prompt,
                ))
                prefill_seqs.append(seq)
                budget -= len(chunk)
        return Step(prefills, decodes, prefill_seqs, decode_seqs)
