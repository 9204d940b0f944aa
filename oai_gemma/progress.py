"""Progress of a long start-up phase, as log lines in the console's one format instead of a progress bar: the phase
says it started, then every few seconds how far it got (percent and time left where its parts are counted, else
the time so far against what it usually takes), then that it is done. Nothing stays silent for longer than
`EVERY` seconds, which a bar would (and a bar cuts through the log's lines)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

EVERY = 4.0
"""Seconds between two progress lines of one phase."""


class Phase:
    """`with Phase(log, "converting the GGUF", usually=45) as phase:` ... `phase.count(done, total)` as parts finish."""

    def __init__(self, log: logging.Logger, name: str, usually: float | None = None, every: float = EVERY):
        self.log, self.name, self.usually, self.every = log, name, usually, every
        self.done = self.total = 0
        self._stop = threading.Event()
        self._started = 0.0

    def __enter__(self) -> Phase:
        self._started = time.monotonic()
        hint = f" (usually about {self.usually:.0f} s)" if self.usually else ""
        self.log.warning("%s%s", self.name, hint)
        threading.Thread(target=self._tick, name="oai-gemma-progress", daemon=True).start()
        return self

    def __exit__(self, kind, error, trace) -> None:
        self._stop.set()
        if kind is None:
            self.log.warning("%s: done in %.0f s", self.name, time.monotonic() - self._started)

    def count(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def track(self, parts: Iterable, total: int | None = None) -> Iterator:
        """`parts` as they are, counted as each is taken (its `len` unless `total` is given)."""
        total = len(parts) if total is None else total
        for index, part in enumerate(parts):
            self.count(index, total)
            yield part
        self.count(total, total)

    def line(self) -> str:
        """How far the phase got, as its next progress line says it."""
        spent = time.monotonic() - self._started
        if self.total and self.done:
            share = self.done / self.total
            return f"{self.name}: {share:.0%} ({self.done}/{self.total}), about {spent / share - spent:.0f} s left"
        if self.usually:
            return f"{self.name}: {spent:.0f} s of usually about {self.usually:.0f}"
        return f"{self.name}: {spent:.0f} s so far"

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self.log.warning("%s", self.line())
