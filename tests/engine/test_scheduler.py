"""The scheduler and its block pool on their own: no model, no tensors beyond the image-row bookkeeping."""

from dataclasses import replace

import pytest
import torch

from oai_gemma.engine.cache.block_pool import BlockPool
from oai_gemma.engine.cache.prefix_hash import CacheSpace, block_hashes
from oai_gemma.engine.sampling.postprocess import last_events
from oai_gemma.engine.scheduler import Scheduler
from oai_gemma.engine.sequence import ParentRequest, Sequence
from oai_gemma.engine.types import GenerationRequest, SamplingParams

SIZE = 4  # tokens per block in these tests
BASE = CacheSpace()
"""The space of a request with no tenant, salt or adapter."""
ROOT = BASE.root


def seq(
    prompt: list[int], request_id: str = "r", prompt_logprobs: int | None = None, max_tokens: int = 8, cache_salt: str = "", **fields
) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    request = GenerationRequest(request_id, prompt, params, cache_salt=cache_salt)
    return Sequence(request=request, sink=None, random=None, detokenizer=None, stopper=None, cache_keys=list(prompt), **fields)


def scheduler_of(max_seqs: int = 2, max_prefill_tokens: int = 100, blocks: int = 64, caching: bool = True, **kwargs) -> Scheduler:
    return Scheduler(BlockPool(blocks, SIZE, caching), max_seqs, max_prefill_tokens, max_len=1000, **kwargs)


def run_prefill(scheduler: Scheduler, now: float = 0.0):
    """Schedule one step and count its tokens as computed (what the engine does after a forward)."""
    step = scheduler.schedule(now)
    scheduler.advance(step)
    return step


def admitted(scheduler: Scheduler, s: Sequence):
    """Queue one sequence and schedule the next step (which admits it, if it can be)."""
    scheduler.add(s)
    return scheduler.schedule(0.0)


def prefilled(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Admit and prefill these sequences to the end of their prompts; each then holds a sampled token."""
    for s in seqs:
        scheduler.add(s)
    while any(s.in_prefill for s in seqs):
        run_prefill(scheduler)
    for s in seqs:
        s.output_ids.append(100)


# ---- the block pool ------------------------------------------------------------------------------


def test_block_hashes_are_equal_exactly_as_far_as_the_prefixes_are():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, ROOT)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9, 9, 9, 9], 4, ROOT)
    assert len(a) == 2 and len(b) == 3  # full blocks only
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes([5, 6, 7, 8], 4, parent=a[0]) == [a[1]]  # the chain continues from a parent
    assert block_hashes([5, 6, 7, 8], 4, ROOT) != [a[1]]  # the same tokens after another prefix are another block


def indexed(pool: BlockPool, keys: list[int], hashes: list, pending: bool, space: CacheSpace = BASE) -> list[int]:
    """Allocate and index one block per hash, a chain holding `keys` (what the scheduler does at admission)."""
    blocks = pool.allocate(len(hashes))
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        pool.index(block, h, keys[i * SIZE : (i + 1) * SIZE], blocks[i - 1] if i else space, pending)
    return blocks


def test_lookup_finds_the_longest_written_prefix_and_says_when_the_next_block_is_being_written():
    pool = BlockPool(8, SIZE)
    keys = list(range(12))
    hashes = block_hashes(keys, SIZE, ROOT)
    blocks = indexed(pool, keys, hashes, pending=True)
    pool.written(blocks[0])
    assert pool.lookup(hashes, keys, BASE) == ([blocks[0]], True)
    pool.written(blocks[1])
    pool.written(blocks[2])
    assert pool.lookup(hashes + [123], keys + [0] * 4, BASE) == (blocks, False)
    assert pool.lookup([hashes[1]], keys[4:], BASE) == ([], False)  # a chain is only ever found from its start


def test_released_indexed_blocks_stay_cached_until_their_memory_is_needed_oldest_first():
    pool = BlockPool(4, SIZE)
    one, two = list(range(8)), list(range(10, 18))
    first, second = indexed(pool, one, [11, 12], pending=False), indexed(pool, two, [21, 22], pending=False)
    pool.release(first)
    pool.release(second)
    assert pool.available == 4 and not pool.free
    assert pool.lookup([11, 12], one, BASE) == (first, False)
    pool.take(pool.lookup([21, 22], two, BASE)[0])  # in use again: out of the eviction order
    pool.release(second)  # ... and back in, as the most recently used
    new = pool.allocate(2)
    assert sorted(new) == sorted(first)  # the least recently used went first
    assert pool.lookup([11], one, BASE) == ([], False) and pool.lookup([21, 22], two, BASE) == (second, False)
    with pytest.raises(MemoryError):
        pool.allocate(3)


def test_a_pending_block_let_go_before_it_was_written_is_forgotten_and_so_is_an_invalid_one():
    pool = BlockPool(4, SIZE)
    (a,), (b,) = indexed(pool, [1] * 4, [1], pending=True), indexed(pool, [2] * 4, [2], pending=False)
    pool.release([a])
    pool.release([b], valid=False)
    assert pool.lookup([1], [1] * 4, BASE) == ([], False) and pool.lookup([2], [2] * 4, BASE) == ([], False)
    assert len(pool.free) == 4


def test_with_caching_off_nothing_is_indexed_and_released_blocks_are_free():
    pool = BlockPool(4, SIZE, caching=False)
    (a,) = indexed(pool, [1] * 4, [1], pending=False)
    pool.release([a])
    assert pool.lookup([1], [1] * 4, BASE) == ([], False) and len(pool.free) == 4 and not pool.cached


def test_a_hash_collision_is_a_miss_never_another_prompts_block():
    """Every hash the same (a crafted or unlucky collision): only a block whose tokens, predecessor and salt are
    the ones asked for is a hit."""
    pool = BlockPool(8, SIZE)
    keys = [1, 2, 3, 4, 5, 6, 7, 8]
    blocks = indexed(pool, keys, [0, 0], pending=False)
    assert pool.lookup([0, 0], [9, 9, 9, 9, 5, 6, 7, 8], BASE) == ([], False)  # another first block, same hash
    assert pool.lookup([0, 0], keys, BASE) == ([blocks[0]], False)  # the second block's hash points at the first block
    assert pool.lookup([0], keys, CacheSpace(salt="other tenant")) == ([], False)  # the same tokens in another space
    assert block_hashes(keys, SIZE, CacheSpace(salt="a").root) != block_hashes(keys, SIZE, CacheSpace(salt="b").root)


def test_a_block_freed_and_indexed_again_is_not_the_parent_its_old_children_followed():
    pool = BlockPool(2, SIZE)
    parent, child = indexed(pool, list(range(8)), [1, 2], pending=False)
    pool._forget(parent)  # evicted before its child (not the usual order, but possible)
    pool.index(parent, 1, [0, 1, 2, 3], BASE, pending=False)  # the same block id indexed afresh
    assert pool.lookup([1, 2], list(range(8)), BASE) == ([parent], False)


# ---- the scheduler -------------------------------------------------------------------------------


def test_requests_beyond_the_batch_rows_wait_and_join_when_one_finishes():
    scheduler = scheduler_of(max_seqs=2)
    a, b, c = seq([1, 2], "a"), seq([3, 4], "b"), seq([5, 6], "c")
    for s in (a, b, c):
        scheduler.add(s)
    step = run_prefill(scheduler)
    assert step.prefill_owners == [a, b] and list(scheduler.waiting) == [c]
    b.output_ids.append(42)  # sampled at the end of its prefill
    scheduler.finish(a)
    assert a.finished and a.blocks == [] and a not in scheduler.running
    step = scheduler.schedule(1.0)
    assert c in scheduler.running and c.scheduled_time == 1.0
    assert step.prefill_owners == [c] and step.decode_owners == [b]


def test_prefill_is_chunked_under_the_per_step_budget_beside_running_decodes():
    scheduler = scheduler_of(max_seqs=2, max_prefill_tokens=4)
    short, long = seq([1, 2], "short"), seq(list(range(10, 20)), "long")
    scheduler.add(short)
    run_prefill(scheduler)
    short.output_ids.append(42)  # sampled at the end of its prefill: it decodes from now on
    scheduler.add(long)
    chunks = []
    while long.in_prefill:
        step = run_prefill(scheduler)
        assert [item.token_ids for item in step.decodes] == [[short.output_ids[-1]]]
        short.output_ids.append(43)  # sampled by that step, as the engine does
        assert sum(len(item.token_ids) for item in step.prefills) <= 4
        chunks.append((step.prefills[0].start, step.prefills[0].token_ids, step.prefills[0].want_logits))
    assert chunks == [(0, [10, 11, 12, 13], False), (4, [14, 15, 16, 17], False), (8, [18, 19], True)]
    assert step.sampled == [long, short]  # logits rows: finished prefills first, then decodes


def test_an_image_block_is_never_split_across_prefill_chunks():
    scheduler = scheduler_of(max_seqs=1, max_prefill_tokens=4)
    s = seq([1, 2, 3, 9, 9, 9, 9, 9, 4], image_spans=((3, 8),), image_embeds=torch.zeros(5, 2))
    scheduler.add(s)
    starts_and_lengths = []
    while s.in_prefill:
        item = run_prefill(scheduler).prefills[0]
        starts_and_lengths.append((item.start, len(item.token_ids)))
        if item.image_embeds is not None:
            assert item.image_embeds[0].tolist() == [0, 1, 2, 3, 4]  # all 5 image rows at once
    assert starts_and_lengths == [(0, 3), (3, 5), (8, 1)]


def test_any_earlier_or_running_sequence_donates_its_prompt_in_whole_blocks():
    scheduler = scheduler_of(max_seqs=4)
    system = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    first = seq(system + [50, 51], "first")
    prefilled(scheduler, first)
    second = seq(system + [60], "second")  # while `first` still runs
    step = admitted(scheduler, second)
    assert second.num_cached == 8 and second.blocks[:2] == first.blocks[:2]
    assert step.prefills[0].start == 8 and step.prefills[0].token_ids == [9, 10, 60]
    scheduler.advance(step)
    scheduler.finish(first)
    scheduler.finish(second)
    third = seq(system + [50, 51, 52], "third")  # both finished: their blocks are cached
    admitted(scheduler, third)
    assert third.num_cached == 12


def test_sequences_share_cached_blocks_only_under_the_same_salt():
    scheduler = scheduler_of(max_seqs=4)
    prompt = list(range(1, 11))
    requests = {}
    for name, salt in (("a", "tenant a"), ("b", "tenant b"), ("a again", "tenant a"), ("unsalted", "")):
        requests[name] = s = seq(prompt, name, cache_salt=salt)
        prefilled(scheduler, s)
    assert {name: s.num_cached for name, s in requests.items()} == {"a": 0, "b": 0, "a again": 8, "unsalted": 0}


def test_no_scope_or_salt_passes_for_another_space():
    """Issue 39: the parts of a space are never joined into one string, so none can spell another's."""
    spaces = [CacheSpace(), CacheSpace("a/b"), CacheSpace("a", "b"), CacheSpace("a/", "b"), CacheSpace("", "a/b"),
              CacheSpace("a", "/b"), CacheSpace("", "\x00lora:1"), CacheSpace("", "", b"\x00lora:1"), CacheSpace("", "1"),
              CacheSpace("", "", b"1"), CacheSpace("1"), CacheSpace("\x00"), CacheSpace("", "\x00"), CacheSpace("", "\ud800"),
              CacheSpace(kernel=True), CacheSpace("", "", b"kernel"), CacheSpace("", "kernel"), CacheSpace("kernel")]
    assert len({space.root for space in spaces}) == len(spaces)


class Adapters:
    """The LoRA registry as the scheduler sees it: slot n holds weights whose files hash to `digests[n]`."""

    def __init__(self, digests: dict[int, bytes]):
        self.digests = digests

    def acquire(self, registration: int) -> int:
        return registration

    def digest(self, slot: int) -> bytes:
        return self.digests[slot]

    def release(self, slot: int) -> None:
        pass


def test_a_prefix_is_reused_only_under_the_weights_it_was_computed_with():
    """Issue 39: no base request's salt reaches an adapter's space, two adapters share nothing, and an adapter read
    again from changed files never reuses what its old weights computed."""
    adapters = Adapters({1: b"weights one", 2: b"weights two"})
    scheduler = scheduler_of(max_seqs=8, adapters=adapters)
    prompt = list(range(1, 11))
    requests = {}

    def run(name: str, **fields) -> int:
        requests[name] = s = seq(prompt, name, **fields)
        prefilled(scheduler, s)
        scheduler.finish(s)
        return s.num_cached

    for salt in ("\x00lora:1", "\x00lora:2", "weights one", b"weights one".hex()):
        run(f"base {salt!r}", cache_salt=salt)
    assert run("one", lora=1) == 0 and run("two", lora=2) == 0
    assert run("one again", lora=1) == 8  # the control: the same weights reuse their prefix
    adapters.digests[1] = b"weights one, changed on disk and read again"
    assert run("one changed", lora=1) == 0


def test_a_conversation_that_resends_its_history_reuses_the_blocks_of_the_reply_too():
    scheduler = scheduler_of()
    first = seq([1, 2, 3], "first")
    prefilled(scheduler, first)
    for token in (4, 5, 6, 7, 8):  # five decode steps: positions 3..7 written; blocks [1 2 3 100] [4 5 6 7]
        run_prefill(scheduler)
        first.output_ids.append(token)
    scheduler.finish(first)
    follow_up = seq([1, 2, 3, 100, 4, 5, 6, 7, 8, 9], "follow-up")
    step = admitted(scheduler, follow_up)
    assert follow_up.num_cached == 8 and step.prefills[0].token_ids == [8, 9]


def test_in_batch_invariant_mode_only_prompt_blocks_are_reused():
    scheduler = scheduler_of(reuse_decoded=False)
    first = seq([1, 2, 3, 4, 5], "first")
    prefilled(scheduler, first)
    for token in (6, 7, 8, 9):
        run_prefill(scheduler)
        first.output_ids.append(token)
    scheduler.finish(first)
    follow_up = seq([1, 2, 3, 4, 5, 100, 6, 7, 8, 9], "follow-up")
    admitted(scheduler, follow_up)
    assert follow_up.num_cached == 4


def test_a_short_prompt_runs_through_the_kernel_and_never_shares_kv_with_a_long_ones():
    """Batch-invariant mode's path per request (`kernel_prompts_below`): a prompt below it runs its rows through the
    row-exact kernel in every chunk (StepItem `kernel`), a longer one through the matmul; the two paths give a
    block's KV other last bits, so neither reuses the other's blocks, while each reuses its own."""
    scheduler = scheduler_of(max_seqs=4, max_prefill_tokens=6, kernel_prompts_below=10)
    system = list(range(1, 9))  # two blocks
    long, short = seq(system + list(range(20, 30)), "long"), seq(system + [40], "short")
    scheduler.add(long)
    scheduler.add(short)
    kinds = {}
    while long.in_prefill or short.in_prefill:  # 6-token chunks: each prompt in several steps, side by side
        step = run_prefill(scheduler)
        for owner, item in zip(step.prefill_owners, step.prefills):
            kinds.setdefault(owner.request.request_id, set()).add(item.kernel)
            if not owner.in_prefill:
                owner.output_ids.append(100)
    assert kinds == {"long": {False}, "short": {True}}
    assert (long.space.kernel, short.space.kernel) == (False, True) and long.num_cached == short.num_cached == 0
    scheduler.finish(long)
    scheduler.finish(short)
    for name, prompt, cached in (("short again", system + [41], 8), ("long again", system + list(range(50, 60)), 8)):
        again = seq(prompt, name)
        prefilled(scheduler, again)
        scheduler.finish(again)
        assert again.num_cached == cached, name
    assert scheduler_of().kernel_prompts_below == 0  # mode off, or rows all alike: every prompt one path


def test_at_least_one_prompt_token_is_computed_even_when_all_of_it_is_cached():
    scheduler = scheduler_of()
    prefilled(scheduler, seq([1, 2, 3, 4, 5, 6, 7, 8], "first"))
    again = seq([1, 2, 3, 4, 5, 6, 7, 8], "again")
    step = admitted(scheduler, again)
    assert again.num_cached == 4 and step.prefills[0].token_ids == [5, 6, 7, 8]


def test_concurrent_arrivals_with_one_prefix_prefill_it_once():
    scheduler = scheduler_of(max_seqs=4, max_prefill_tokens=8)
    system = list(range(1, 21))  # five blocks
    users = [seq(system + [90 + i], f"user{i}") for i in range(3)]
    for s in users:
        scheduler.add(s)
    step = run_prefill(scheduler)
    assert step.prefill_owners == [users[0]] and users[1] in scheduler.waiting  # they wait for its blocks
    while users[0].in_prefill:
        step = run_prefill(scheduler)
    assert step.prefill_owners == [users[0]]  # its last chunk: the others were still waiting for it
    users[0].output_ids.append(100)
    step = run_prefill(scheduler)
    assert [s.num_cached for s in users[1:]] == [20, 20]
    assert [item.token_ids for item in step.prefills] == [[91], [92]]


def test_a_waiting_request_computes_the_prefix_itself_if_its_writer_goes_away():
    scheduler = scheduler_of(max_seqs=4, max_prefill_tokens=4)
    writer, reader = seq(list(range(1, 13)), "writer"), seq(list(range(1, 13)) + [7], "reader")
    scheduler.add(writer)
    scheduler.add(reader)
    run_prefill(scheduler)  # the writer wrote its first block; the reader waits for the second
    assert reader in scheduler.waiting
    scheduler.finish(writer)  # cancelled
    step = scheduler.schedule(0.0)
    assert reader.num_cached == 4 and step.prefills[0].start == 4


def test_a_request_waits_for_kv_memory_and_a_running_one_always_gets_its_next_block():
    scheduler = scheduler_of(max_seqs=4, blocks=6, caching=False)
    a = seq([1, 2, 3, 4, 5], "a", max_tokens=7)  # may reach 12 tokens: 3 blocks, kept for it
    b = seq([6, 7, 8, 9, 10], "b", max_tokens=8)  # 13 tokens: 4 blocks do not fit beside a's 3
    prefilled(scheduler, a)
    scheduler.add(b)
    for _ in range(5):
        step = run_prefill(scheduler)
        a.output_ids.append(1)
        assert b in scheduler.waiting and step.decode_owners == [a]
    assert len(a.blocks) == 3
    scheduler.finish(a)
    scheduler.schedule(0.0)
    assert b in scheduler.running


def test_cached_prefixes_give_way_to_new_requests():
    scheduler = scheduler_of(max_seqs=1, blocks=4)
    old = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "old", max_tokens=1)
    prefilled(scheduler, old)
    scheduler.finish(old)
    assert len(scheduler.pool.cached) == 2
    new = seq([9] * 15, "new", max_tokens=1)  # all 4 blocks
    admitted(scheduler, new)
    assert new in scheduler.running and not scheduler.pool.cached


def test_with_prefix_caching_off_nothing_is_reused():
    scheduler = scheduler_of(caching=False)
    prefilled(scheduler, seq([1, 2, 3, 4, 5, 6], "first"))
    again = seq([1, 2, 3, 4, 5, 6], "again")
    admitted(scheduler, again)
    assert again.num_cached == 0


def test_a_failed_step_frees_the_blocks_without_offering_their_kv_again():
    scheduler = scheduler_of(max_seqs=1)
    broken = seq([1, 2, 3, 4, 5], "broken")
    scheduler.add(broken)
    run_prefill(scheduler)
    scheduler.finish(broken, cache_valid=False)
    again = seq([1, 2, 3, 4, 5], "again")
    admitted(scheduler, again)
    assert again.num_cached == 0


def test_a_request_for_prompt_logprobs_recomputes_its_whole_prompt():
    scheduler = scheduler_of(max_seqs=1)
    first = seq([1, 2, 3, 4, 5], "first")
    prefilled(scheduler, first)
    scheduler.finish(first)
    scored = seq([1, 2, 3, 4, 5], "scored", prompt_logprobs=0)
    step = admitted(scheduler, scored)
    assert scored.num_cached == 0 and step.prefills[0].start == 0 and step.prefills[0].keep_hidden


def test_forks_share_the_full_prompt_blocks_and_copy_the_last_one_and_the_rest_wait():
    scheduler = scheduler_of(max_seqs=2)
    parent = seq([1, 2, 3, 4, 5, 6], "n3")
    children = [seq([1, 2, 3, 4, 5, 6], "n3", index=i) for i in (1, 2)]
    fan_out = iter([parent, *children])
    assert ParentRequest.fan_out(replace(parent.request, n=3), lambda index: next(fan_out)) is parent
    prefilled(scheduler, parent)
    started = scheduler.fork(parent, 2.0)
    assert [child for child, _ in started] == [children[0]] and parent.parent.pending == []
    (child, copy), = started
    assert child.num_computed == 6 and child.blocks == [parent.blocks[0], copy] and copy != parent.blocks[1]
    assert list(scheduler.waiting) == [children[1]]
    assert [s.request_id for s in scheduler.find("n3")] == ["n3"] * 3


def test_choices_that_never_started_end_with_the_first():
    scheduler = scheduler_of(max_seqs=2)
    made = iter([seq([1, 2, 3, 4, 5, 6], "n3", index=i) for i in range(3)])
    first = ParentRequest.fan_out(replace(seq([1], "n3").request, n=3), lambda index: next(made))
    scheduler.add(first)
    ended = last_events(first, "cancelled")  # what EngineCore._end does: every one's last event, every slot freed
    for sequence, _ in ended:
        scheduler.finish(sequence)
    assert [(e.index, e.finish_reason) for _, e in ended] == [(0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert first.parent.pending == [] and not scheduler.has_work()
