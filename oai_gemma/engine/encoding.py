"""Images being encoded: the engine's side of the resumable vision encode (engine/model/vision_encode.py).

A request with images waits here, outside the scheduler (no batch row, no KV blocks), while its vision tower
runs a slice at a time between the engine's steps; once its features are ready the engine hands it to the
scheduler, which prefills it like any prompt. Each step gives the encode a time budget: `step_seconds` when
set, else `SHARE` of the shorter of the last step with other work and the median of the last `STEPS` -- so a
running text stream's inter-token time stays under twice its time alone while an image encodes, with room for a
unit that runs longer than expected and for steps slowed beside the tower; not the last step alone, so that one
slow step (the image's own preprocessing beside it, a prefill chunk) is not followed by a slice as long, and not
the median alone, which after the steps got shorter (a stream ended, the load dropped) kept the old length for a
few steps -- and `IDLE_SECONDS` when nothing else runs (the inbox is read between slices, so a cancel or a new
request waits at most that long).

One job per distinct image set (the request's crop keys, the same keys the prefix cache uses): a second request
with the same images in flight waits on the first one's job. A job whose every waiter went (cancelled) is
dropped with its work.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .model.vision_encode import UnitCosts, VisionEncode
from .model.vision_weights import VisionWeights
from .sequence import Sequence

log = logging.getLogger("oai_gemma.engine")

IDLE_SECONDS = 0.25
"""A step's encode budget when no sequence runs beside it."""
STEPS = 8
"""The budget beside running sequences: at most the median wall time of this many of their last steps."""
SHARE = 0.6
"""The budget beside running sequences, as a share of their step time. At 1.0 (a slice as long as a step) a 4B text
stream's ITL p99 during an image's encode was 2.4x its ITL alone (decode steps 77 ms beside the tower's units, 70
alone; slices at the budget: 2-core AVX512-bf16 EPYC, benchmarks/encode_itl.py); the issue's bound is 2x."""


@dataclass(eq=False)
class Job:
    work: VisionEncode
    waiters: list[Sequence] = field(default_factory=list)


class Encoding:
    def __init__(self, vision: VisionWeights | None, device, dtype: torch.dtype, step_seconds: float = 0.0):
        """`vision`: the model's vision tower and projector (None: a text-only model, which gets no images)."""
        self.vision, self.device, self.dtype, self.step_seconds = vision, device, dtype, step_seconds
        self.jobs: dict[tuple, Job] = {}
        self.costs = UnitCosts()
        """The tower's unit times, across images: what a step's budget expects the next unit to take."""
        self.encodes = 0
        self.seconds = 0.0
        """Images sets encoded and the vision tower's time on them (for /health and /metrics)."""
        self.steps: deque[float] = deque(maxlen=STEPS)
        """Wall times of the last steps that ran sequences (the auto budget: `stepped`)."""
        self.worked: dict[str, float] = {}
        """Request id -> when its image's encode last advanced (read by its Submission, off this thread, so that
        the idle timeout does not take an encode of minutes for a request gone quiet)."""

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def __len__(self) -> int:
        return sum(len(job.waiters) for job in self.jobs.values())

    def submit(self, seq: Sequence) -> None:
        request = seq.request
        key = (request.crop_keys, tuple(request.pixel_values.shape))
        job = self.jobs.get(key)
        if job is None:
            pixels = request.pixel_values.to(self.device, self.dtype)
            job = self.jobs[key] = Job(VisionEncode(self.vision, pixels, costs=self.costs))
        job.waiters.append(seq)

    def stepped(self, seconds: float) -> None:
        """A step that ran sequences took `seconds`."""
        self.steps.append(seconds)

    def budget(self, busy: bool) -> float:
        if self.step_seconds > 0:
            return self.step_seconds
        return SHARE * min(self.steps[-1], statistics.median(self.steps)) if busy and self.steps else IDLE_SECONDS

    def run(self, busy: bool) -> tuple[list[tuple[Sequence, torch.Tensor]], list[tuple[Sequence, str]]]:
        """Work on the oldest job for one step's budget: ([(sequence, its features)] that are ready, [(sequence,
        error)] whose encode failed)."""
        key, job = next(iter(self.jobs.items()))
        try:
            done = job.work.run(self.budget(busy))
        except Exception as exc:  # a bad image fails the requests waiting on it only
            log.exception("vision tower failed")
            self._drop(key)
            return [], [(seq, f"image processing failed: {exc}") for seq in job.waiters]
        if not done:
            now = time.perf_counter()
            self.worked.update((seq.request_id, now) for seq in job.waiters)
            return [], []
        self._drop(key)
        self.encodes += 1
        self.seconds += job.work.seconds
        log.info("image encoded in %.3f s (%d units)", job.work.seconds, job.work.units_done)
        return [(seq, job.work.features) for seq in job.waiters], []

    def cancel(self, request_id: str) -> list[Sequence]:
        """Take out the waiting sequences of a request; a job nobody waits for any more is dropped."""
        taken = []
        for key, job in list(self.jobs.items()):
            taken += [seq for seq in job.waiters if seq.request_id == request_id]
            job.waiters = [seq for seq in job.waiters if seq.request_id != request_id]
            if not job.waiters:
                del self.jobs[key]
        self.worked.pop(request_id, None)
        return taken

    def take_all(self) -> list[Sequence]:
        waiters = [seq for job in self.jobs.values() for seq in job.waiters]
        self.jobs.clear()
        self.worked.clear()
        return waiters

    def _drop(self, key: tuple) -> None:
        """A job ended: its waiters' encode times go with it."""
        for seq in self.jobs.pop(key).waiters:
            self.worked.pop(seq.request_id, None)


def token_runs(ids: list[int], token: int | None) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
