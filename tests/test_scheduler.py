"""The scheduler and its slot pool on their own: no model, no tensors beyond the image-row bookkeeping."""

import torch

from oai_gemma.engine.scheduler import Scheduler, Sequence, SlotPool, reusable_prefix
from oai_gemma.engine.types import GenerationRequest, SamplingParams


def seq(prompt: list[int], request_id: str = "r", prompt_logprobs: int | None = None, **fields) -> Sequence:
    request = GenerationRequest(request_id, prompt, SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs))
    return Sequence(request=request, sink=None, random=None, detokenizer=None, stopper=None, cache_keys=list(prompt), **fields)


def run_prefill(scheduler: Scheduler, now: float = 0.0):
    """Schedule one step and count its tokens as computed (what the engine does after a forward)."""
    step = scheduler.schedule(now)
    step.advance()
    return step


# ---- the slot pool -------------------------------------------------------------------------------


def test_reusable_prefix_always_leaves_one_prompt_token_to_compute():
    assert reusable_prefix([1, 2, 3], [1, 2, 3], window=100) == 2
    assert reusable_prefix([1, 2, 3, 4, 5], [1, 2, 3], window=100) == 2


def test_reusable_prefix_stops_at_the_first_difference():
    assert reusable_prefix([1, 2, 9, 4], [1, 2, 3, 4, 5], window=100) == 2
    assert reusable_prefix([], [1, 2, 3], window=100) == 0


def test_a_slot_that_outgrew_the_sliding_window_serves_only_a_prefix_covering_all_of_it():
    cached = list(range(10))
    assert reusable_prefix(cached, cached[:6] + [99, 98], window=8) == 0  # its ring lost positions 0 and 1
    assert reusable_prefix(cached, cached + [10, 11], window=8) == 10  # the whole of it: the ring holds the end


def test_acquire_takes_the_slot_with_the_longest_shared_prefix():
    pool = SlotPool(3, window=1 << 30)
    for slot in range(3):
        pool.acquire([])
    pool.release(0, [5, 6, 7])
    pool.release(1, [1, 2, 3, 4])
    pool.release(2, [1, 2])
    assert pool.acquire([1, 2, 3, 4, 8]) == (1, 4)
    assert len(pool) == 2


def test_acquire_without_a_shared_prefix_takes_the_oldest_freed_slot():
    pool = SlotPool(2, window=1 << 30)
    pool.acquire([])
    pool.acquire([])
    pool.release(1, [7, 7])
    pool.release(0, [8, 8])
    assert pool.acquire([1, 2, 3]) == (1, 0)
    assert pool.acquire([1, 2, 3]) == (0, 0)
    assert len(pool) == 0


# ---- the scheduler -------------------------------------------------------------------------------


def test_requests_beyond_the_free_slots_wait_and_join_when_one_finishes():
    scheduler = Scheduler(num_slots=2, max_prefill_tokens=100)
    a, b, c = seq([1, 2], "a"), seq([3, 4], "b"), seq([5, 6], "c")
    for s in (a, b, c):
        scheduler.add(s)
    step = run_prefill(scheduler)
    assert step.prefill_owners == [a, b] and list(scheduler.waiting) == [c]
    b.output_ids.append(42)  # sampled at the end of its prefill
    scheduler.finish(a)
    assert a.finished and a.slot is None and a not in scheduler.running
    step = scheduler.schedule(1.0)
    assert c in scheduler.running and c.scheduled_time == 1.0
    assert step.prefill_owners == [c] and step.decode_owners == [b]


def test_prefill_is_chunked_under_the_per_step_budget_beside_running_decodes():
    scheduler = Scheduler(num_slots=2, max_prefill_tokens=4)
    short, long = seq([1, 2], "short"), seq(list(range(10, 20)), "long")
    scheduler.add(short)
    run_prefill(scheduler)
    short.output_ids.append(42)  # sampled at the end of its prefill: it decodes from now on
    scheduler.add(long)
    chunks = []
    while long.in_prefill:
        step = run_prefill(scheduler)
        assert [item.token_ids for item in step.decodes] == [[short.output_ids[-1]]]
        assert sum(len(item.token_ids) for item in step.prefills) <= 4
        chunks.append((step.prefills[0].start, step.prefills[0].token_ids, step.prefills[0].want_logits))
    assert chunks == [(0, [10, 11, 12, 13], False), (4, [14, 15, 16, 17], False), (8, [18, 19], True)]
    assert step.sampled == [long, short]  # logits rows: finished prefills first, then decodes


def test_an_image_block_is_never_split_across_prefill_chunks():
    scheduler = Scheduler(num_slots=1, max_prefill_tokens=4)
    s = seq([1, 2, 3, 9, 9, 9, 9, 9, 4], image_spans=((3, 8),), image_embeds=torch.zeros(5, 2))
    scheduler.add(s)
    starts_and_lengths = []
    while s.in_prefill:
        item = run_prefill(scheduler).prefills[0]
        starts_and_lengths.append((item.start, len(item.token_ids)))
        if item.image_embeds is not None:
            assert item.image_embeds[0].tolist() == [0, 1, 2, 3, 4]  # all 5 image rows at once
    assert starts_and_lengths == [(0, 3), (3, 5), (8, 1)]


def test_a_finished_sequence_leaves_its_kv_for_a_follow_up_that_resends_the_conversation():
    scheduler = Scheduler(num_slots=2, max_prefill_tokens=100)
    first = seq([1, 2, 3], "first")
    scheduler.add(first)
    run_prefill(scheduler)
    first.output_ids += [4, 5]
    first.num_computed += 1  # token 4's KV was written by the decode step that sampled 5
    slot = first.slot
    scheduler.finish(first)
    follow_up = seq([1, 2, 3, 4, 6, 7], "follow-up")
    scheduler.add(follow_up)
    step = scheduler.schedule(0.0)
    assert follow_up.slot == slot and follow_up.num_cached == 4
    assert step.prefills[0].start == 4 and step.prefills[0].token_ids == [6, 7]


def test_a_failed_step_frees_the_slot_without_offering_its_kv_again():
    scheduler = Scheduler(num_slots=1, max_prefill_tokens=100)
    broken = seq([1, 2, 3], "broken")
    scheduler.add(broken)
    run_prefill(scheduler)
    scheduler.finish(broken, cache_valid=False)
    again = seq([1, 2, 3], "again")
    scheduler.add(again)
    scheduler.schedule(0.0)
    assert again.num_cached == 0


def test_a_request_for_prompt_logprobs_recomputes_its_whole_prompt():
    scheduler = Scheduler(num_slots=1, max_prefill_tokens=100)
    first = seq([1, 2, 3, 4], "first")
    scheduler.add(first)
    run_prefill(scheduler)
    scheduler.finish(first)
    scored = seq([1, 2, 3, 4], "scored", prompt_logprobs=0)
    scheduler.add(scored)
    step = scheduler.schedule(0.0)
    assert scored.num_cached == 0 and step.prefills[0].start == 0 and step.prefills[0].keep_hidden


def test_forks_take_free_slots_and_the_rest_wait_to_prefill_themselves():
    scheduler = Scheduler(num_slots=2, max_prefill_tokens=100)
    parent = seq([1, 2, 3], "n3")
    children = [seq([1, 2, 3], "n3", index=i) for i in (1, 2)]
    parent.forks = list(children)
    scheduler.add(parent)
    run_prefill(scheduler)
    started = scheduler.fork(parent, 2.0)
    assert started == [children[0]] and parent.forks == []
    assert children[0].num_computed == 3 and children[0].slot not in (None, parent.slot)
    assert list(scheduler.waiting) == [children[1]]
    assert [s.request_id for s in scheduler.find("n3")] == ["n3"] * 3
