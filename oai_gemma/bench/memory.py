"""A server's resident memory as the benchmark reports it: its process tree's RSS (the server and any process it
started), when ready and at its peak during the sweep, sampled from /proc. Issue 37 compares sizes by it: ours
against llama-server's with the same KV token capacity."""

from __future__ import annotations

import threading
from pathlib import Path

MB = 2**20


def tree_rss(pid: int) -> int | None:
    """Bytes resident in `pid` and its descendants now; None once `pid` is gone (or where /proc is missing)."""
    total, seen, todo = 0, set(), [pid]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            if current == pid:
                return None
    return total


def high_water_mark(pid: int) -> int | None:
    """The most bytes `pid` itself ever had resident (the kernel's VmHWM): loading included, which a sampler
    started once the server is ready cannot see; None where it cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


class PeakRss:
    """`with PeakRss(pid, every=0.1) as peak:` ... `peak.bytes`: the largest tree RSS seen while the block ran."""

    def __init__(self, pid: int, every: float = 0.1):
        self.pid, self.every, self.bytes = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss(self.pid) or 0)
            if self._stop.wait(self.every):
                return
