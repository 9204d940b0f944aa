"""CPU threads for the engine: how many, and how they wait (`engine.threads`, `engine.cpu_wait`).

Issue 18 reported 61 tokens/s alone and 4.9 beside one `nice -n 10` busy loop, and `passive` became the default
for it. But `serve` imported torch (and with it libgomp, which reads OMP_WAIT_POLICY once, when it loads) before
setting the variable, so every measurement since ran OpenMP's own default (spin briefly, then sleep). Measured
2026-12-04 on a quiet 2-core Xeon, that default gives 179.0 tok/s alone and 142.6 beside the busy loop (0.80),
while an effective PASSIVE costs 28% alone (c=1 18.8 vs 26.2 tok/s, c=8 126.8 vs 174.4): each of a step's many
parallel regions then wakes a sleeping thread. So `auto` (the runtime's default) is the default; `passive` is
there for hosts crowded with other work, `active` spins without end. The thread count defaults to the CPUs this process may run on (its
affinity mask, which a container's cpuset or `taskset` narrows), not the machine's core count.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from .settings import EngineSettings

log = logging.getLogger("oai_gemma.cpu")


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def configure_cpu(settings: EngineSettings) -> int:
    """Set the wait policy (env vars, read once when torch's OpenMP runtime loads, so call this before torch
    is imported; a variable the operator set is kept) and the thread count. Returns the thread count."""
    if settings.cpu_wait == "passive":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("KMP_BLOCKTIME", "0")
    elif settings.cpu_wait == "active":
        os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    import torch

    threads = settings.threads or available_cpus()
    torch.set_num_threads(threads)
    log.info("CPU: %d compute threads (%d CPUs available), OMP_WAIT_POLICY=%s", threads, available_cpus(),
             os.environ.get("OMP_WAIT_POLICY"))
    return threads


def compute_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that runs torch work with the thread count configured now (`configure_cpu`).

    OpenMP keeps the thread count per thread: a new thread starts from OMP_NUM_THREADS, not from what
    `torch.set_num_threads` told the thread that configured the CPU. Ray sets OMP_NUM_THREADS=1 in its workers,
    so an engine replica's step ran on one core of two (found measuring the Ray Serve proxy); the thread says it
    again itself."""
    import torch

    threads = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(threads)
        target()

    return threading.Thread(target=run, name=name, daemon=True)
