"""Image prefill chunks run apart from the step, a few units between steps (engine/model/prefill_units.py).

An image block is one prefill chunk (never cut: its tokens attend to each other both ways); at 4B its ~270 tokens
took one ~10 s step, during which every running stream waited. Such a chunk is taken out of its step here and run
as units under the same per-step budget as an image's encode (engine/encoding.py), so the running streams keep
their steps; when its last unit is done, the chunk's logits go through the engine's sampling as a step of its own.
"""

from __future__ import annotations

import functools
import time

from .model.prefill_units import PrefillUnits
from .model.vision_encode import UnitCosts
from .sequence import Sequence, Step


class ApartPrefills:
    def __init__(self, runner, enabled: bool = False, worked: dict[str, float] | None = None):
        """`enabled`: false, or a runner whose step is not one dynamic forward on one device (the GPU's static decode,
        layers over several GPUs): image chunks stay in their steps. `worked`: request id -> when its chunk last
        advanced (engine/encoding.py's `worked`, read by its Submission: the idle timeout does not take a prefill of
        minutes for a request gone quiet)."""
        self.runner = runner
        self.worked = {} if worked is None else worked
        self.jobs: dict[Sequence, tuple[Step, PrefillUnits]] = {}
        self.costs = UnitCosts()
        """The units' recent times, across images: what a step's budget expects the next one to take."""
        self.enabled = enabled and runner.static is None and len(set(runner.layer_devices)) == 1

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def take(self, step: Step) -> Step:
        """`step` without its image chunks (each becomes a job; its sequence is skipped by the scheduler meanwhile).
        Chunks that keep their hidden states (prompt logprobs) or run under an adapter stay in the step."""
        if not self.enabled:
            return step
        kept = ([], [])
        for seq, item in zip(step.prefill_owners, step.prefills):
            if item.image_embeds is None or item.keep_hidden or seq.adapter:
                kept[0].append(item)
                kept[1].append(seq)
                continue
            seq.apart = True
            self.jobs[seq] = (Step([item], [], [seq], []), PrefillUnits(self.runner, item, self.costs))
        if len(kept[0]) == len(step.prefills):
            return step
        return Step(kept[0], step.decodes, kept[1], step.decode_owners)

    def run(self, seconds: float):
        """Work on the oldest job for about `seconds`: once done, (its step, a call giving its logits, or raising
        what its units raised: the engine's sampling fails that sequence alone), else None. A job whose sequence
        ended meanwhile (cancelled, failed) is dropped first."""
        for seq in [seq for seq in self.jobs if seq.finished]:
            self._drop(seq)
        if not self.jobs:
            return None
        seq, (step, units) = next(iter(self.jobs.items()))
        try:
            if not units.run(seconds):
                self.worked[seq.request_id] = time.perf_counter()
                return None
        except Exception as exc:
            self._drop(seq)
            return step, functools.partial(_raise, exc)
        self._drop(seq)
        return step, lambda: units.logits

    def _drop(self, seq: Sequence) -> None:
        del self.jobs[seq]
        seq.apart = False
        self.worked.pop(seq.request_id, None)


def _raise(exc: Exception):
    raise exc
