"""`Submission` on its own (issue 25 item 2): however an admission ends, its places come back exactly once,
through its one `release` callback, and what was still running is cancelled. No model: the engine's side is a
list of calls, its events are put on the queue by hand."""

import asyncio
import time

from oai_gemma.engine.observer import RequestObserver
from oai_gemma.engine.submission import Submission
from oai_gemma.engine.types import GenerationRequest, SamplingParams, TokenEvent


class Watcher(RequestObserver):
    def __init__(self):
        self.closed: list[tuple[str, bool]] = []

    def on_close(self, request, cancelled):
        self.closed.append((request.request_id, cancelled))


def admission(*ns: int, timeout: float = 0.0, idle: float = 0.0):
    """A submission of one request per `n` (ids r0, r1, ...), the calls to its release, and its observer."""
    released: list[tuple[int, list[str]]] = []
    watcher = Watcher()
    requests = [GenerationRequest(f"r{i}", [2], SamplingParams(max_tokens=4), arrival_time=1.0, n=n) for i, n in enumerate(ns)]
    submission = Submission(requests, lambda places, running: released.append((places, running)), watcher, timeout, idle)
    return submission, released, watcher


def event(request_id: str, index: int = 0, finish: str | None = None) -> TokenEvent:
    return TokenEvent(request_id, 7, "x", 0.0, finish, index=index)


async def drain(submission: Submission) -> list[TokenEvent]:
    return [e async for e in submission]


def test_every_choice_of_every_request_finishing_gives_all_places_back_once_and_cancels_nothing():
    async def run():
        submission, released, watcher = admission(2, 1)
        for e in (event("r0", 0), event("r1", 0, "stop"), event("r0", 1, "length"), event("r0", 0, "stop")):
            submission.events.put_nowait(e)
        events = await drain(submission)
        submission.close()  # a second close changes nothing
        return events, released, watcher.closed

    events, released, closed = asyncio.run(run())
    assert [e.finish_reason for e in events] == [None, "stop", "length", "stop"]
    assert released == [(3, [])]
    assert closed == [("r1", False), ("r0", False)]


def test_closing_early_gives_the_places_back_and_cancels_what_still_runs():
    async def run():
        submission, released, watcher = admission(1, 2)
        submission.events.put_nowait(event("r0", 0, "stop"))
        async with submission:
            await anext(submission)  # r0 is over; r1's choices never come (the client went away)
        return released, watcher.closed

    released, closed = asyncio.run(run())
    assert released == [(3, ["r1"])]
    assert closed == [("r0", False), ("r1", True)]


def test_a_submission_closed_before_its_first_event_gives_its_places_back():
    submission, released, watcher = admission(4)
    submission.close()
    assert released == [(4, ["r0"])]
    assert watcher.closed == [("r0", True)]


def test_an_idle_timeout_ends_each_running_request_with_a_timeout_event_and_cancels_them():
    async def run():
        submission, released, watcher = admission(2, 1, idle=0.05)
        submission.events.put_nowait(event("r0", 0, "stop"))
        return await drain(submission), released, watcher.closed

    events, released, closed = asyncio.run(run())
    assert [(e.request_id, e.finish_reason) for e in events] == [("r0", "stop"), ("r0", "timeout"), ("r1", "timeout")]
    assert "idle timeout" in events[-1].error
    assert released == [(3, ["r0", "r1"])]
    assert closed == [("r0", False), ("r1", False)]


def test_an_empty_admission_ends_at_once_holding_nothing():
    async def run():
        submission, released, _ = admission()
        return await drain(submission), released

    assert asyncio.run(run()) == ([], [(0, [])])


def test_work_on_a_requests_image_counts_as_progress_and_the_idle_timeout_runs_from_its_last_slice():
    """An image's encode can take minutes before the first token; while the engine works on it (engine/encoding.py
    records each slice), the request is not idle. Once the slices stop, the idle timeout runs from the last one."""
    async def run():
        submission, released, _ = admission(1, idle=0.2)
        worked = {}
        submission.worked_at = worked.get
        started = time.perf_counter()

        async def encode(slices: int):
            for _ in range(slices):
                worked["r0"] = time.perf_counter()
                await asyncio.sleep(0.05)

        encoder = asyncio.create_task(encode(10))  # 0.5 s of slices: more than twice the idle timeout
        events = await drain(submission)
        await encoder
        return events, time.perf_counter() - started, worked["r0"] - started

    events, ended, last_slice = asyncio.run(run())
    assert [(e.request_id, e.finish_reason) for e in events] == [("r0", "timeout")]
    assert ended >= last_slice + 0.2 - 0.01, (ended, last_slice)  # quiet for the whole idle timeout after the last slice
    assert ended < last_slice + 0.2 + 0.15, (ended, last_slice)


def test_a_slice_for_another_request_does_not_keep_this_one_alive():
    async def run():
        submission, _, _ = admission(1, idle=0.1)
        submission.worked_at = {"other": time.perf_counter() + 60}.get
        return await drain(submission)

    assert [e.finish_reason for e in asyncio.run(run())] == ["timeout"]
