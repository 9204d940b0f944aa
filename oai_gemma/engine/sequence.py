"""The ground floor of the engine loop: a `Sequence` (one choice of one request, as it runs), a `Step` (what the
scheduler hands the runner) and its `StepItem`s, and the `ParentRequest` that fans a request's `n` choices out.

The scheduler, the runner, the sampler and postprocess all import this module, and none of them each other
(nano-vllm's `sequence.py`, vLLM v1's `Request`). A row of a step is one sequence's share of it: the fields
speculative decoding (drafts) and adapters will add go here, not into new paths through the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .types import GenerationRequest, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from .cache.prefix_hash import CacheSpace
    from .lora.registry import Registration
    from .sampling.detokenizer import IncrementalDetokenizer, StopMatcher
    from .sampling.json_document import DocumentMatcher
    from .sampling.sampler import RowRandom
    from .speculative.planner import Speculation

PromptLogprobs = list[tuple[float, list[tuple[int, float]]] | None]
"""One entry per prompt token (None for the first): its logprob and the most likely tokens at that position."""


@dataclass
class StepItem:
    """One sequence's share of a step: `token_ids` written at positions `start`, `start + 1`, ... of the sequence
    whose KV lives in `blocks` (its block table: position p in blocks[p // block_size])."""

    blocks: list[int]
    token_ids: list[int]
    start: int
    want_logits: bool = True
    image_spans: tuple[tuple[int, int], ...] = ()
    """[start, end) positions of image soft-token blocks: each attends to itself both ways (Gemma-3)."""
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows within this chunk, their embeddings): the vision tower's output replaces those tokens' embeddings."""
    keep_hidden: bool = False
    """Keep every position's last hidden state in `hidden` (prompt logprobs: see `ModelRunner.logits_of`)."""
    hidden: torch.Tensor | None = None
    adapter: int = 0
    """The LoRA adapter's resident slot its tokens run under (engine/lora/); 0: the base model."""
    num_logits: int = 1
    """How many trailing positions want logits (with `want_logits`): a decode row carrying k draft tokens wants k + 1
    (engine/speculative/)."""
    kernel: bool = False
    """A prompt chunk whose rows run through the row-exact kernel, as decode rows do (batch-invariant mode: a short
    prompt's path, decided once per request: engine/ops/invariance.py `PROMPT_KERNEL_TOKENS`)."""


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    sink: asyncio.Queue[TokenEvent]
    """Where this sequence's events go (the engine hands them to the event loop); a request's choices share one."""
    random: RowRandom
    detokenizer: IncrementalDetokenizer
    stopper: StopMatcher
    blocks: list[int] = field(default_factory=list)
    """Its KV blocks, position p in blocks[p // block_size] (engine/cache/block_pool.py)."""
    hashes: list[bytes] = field(default_factory=list)
    """The prefix hash of each of its full blocks whose tokens are known (engine/cache/prefix_hash.py)."""
    space: CacheSpace | None = None
    """Whose cached prefixes it may reuse and offers its blocks to (set at admission, once its adapter is resident)."""
    most_blocks: int = 0
    """The blocks it may come to hold (prompt and max_tokens): kept free for it from admission on."""
    num_computed: int = 0
    """Prompt + output tokens whose KV is in the cache."""
    num_cached: int = 0
    """Prompt tokens whose KV was reused from an earlier request (prefix cache hit)."""
    cache_keys: list[int] = field(default_factory=list)
    """The prompt as the prefix cache sees it: token ids, with each image block's ids replaced by its hash."""
    image_spans: tuple[tuple[int, int], ...] = ()
    image_embeds: torch.Tensor | None = None
    """[image tokens, hidden] from the vision tower, in prompt order."""
    output_ids: list[int] = field(default_factory=list)
    matcher: DocumentMatcher | None = None
    """This sequence's place in its request's grammar (structured output), else None."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's logprobs so far, chunk by chunk (when the request asks for them)."""
    scheduled_time: float | None = None
    apart: bool = False
    """Its image's prefill chunk runs as units between steps (engine/prefilling.py): the scheduler skips it."""
    finished: bool = False
    index: int = 0
    """Which choice of its request this sequence generates (n > 1)."""
    parent: ParentRequest | None = None
    """The request's fan-out when it asks for n > 1 choices."""
    lora: Registration | None = None
    """The LoRA adapter the request names (engine/lora/registry.py), else None."""
    adapter: int = 0
    """Its adapter's resident slot while it runs (acquired at admission, released when it ends); 0: none."""
    draft: list[int] = field(default_factory=list)
    """Tokens proposed to follow `output_ids` in the next step (speculative decoding), verified by that step."""
    speculation: Speculation | None = None
    """Its draft sources, draft length and acceptance counts; None when it does not speculate."""

    @property
    def sampling(self) -> SamplingParams:
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


@dataclass(eq=False)
class ParentRequest:
    """A request's n choices, fanned out at admission into one Sequence each (vLLM v1's `ParentRequest`).

    The first child prefills the prompt; the others wait in `pending`, outside the scheduler, until it has. They
    then share its prompt's full KV blocks (a copy of its last, partial one) and sample from its last logits row
    (`Scheduler.fork`, `EngineCore._fork`); one that finds no free row then waits and starts like any request,
    from the prompt's blocks in the prefix cache. Should the first end before that (cancelled, failed), the
    pending ones end with it (`EngineCore._end`, `postprocess.last_events`). Every child's events go to the
    request's one sink, tagged with its `index`: the submission gathers them."""

    children: list[Sequence]
    pending: list[Sequence]

    @property
    def first(self) -> Sequence:
        return self.children[0]

    @classmethod
    def fan_out(cls, request: GenerationRequest, make: Callable[[int], Sequence]) -> Sequence:
        """`make(index)` for each of the request's choices, tied together when there are several; returns the
        first, the one to schedule."""
        children = [make(index) for index in range(request.n)]
        if len(children) > 1:
            parent = cls(children, children[1:])
            for child in children:
                child.parent = parent
        return children[0]

    def take_pending(self) -> list[Sequence]:
        """The children still waiting for the prompt, now handed over (to start, or to end with the first)."""
        pending, self.pending = self.pending, []
        return pending


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
