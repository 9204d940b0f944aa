"""CPU threads for the engine: how many, and how they wait (`engine.threads`, `engine.cpu_wait`).

Issue 18 reported 61 tokens/s alone and 4.9 beside one `nice -n 10` busy loop, and `passive` became the default
for it. But `serve` imported torch (and with it libgomp, which reads OMP_WAIT_POLICY once, when it loads) before
setting the variable, so every measurement since ran OpenMP's own default (spin briefly, then sleep). Measured
2026-12-04 on a quiet 2-core Xeon, that default gives 179.0 tok/s alone and 142.6 beside the busy loop (0.80),
while an effective PASSIVE costs 28% alone (c=1 18.8 vs 26.2 tok/s, c=8 126.8 vs 174.4): each of a step's many
parallel regions then wakes a sleeping thread. So `auto` (the runtime's default) is the default; `passive` is
there for hosts crowded with other work, `active` spins without end. The thread count defaults to the CPUs this process may run on (its
affinity mask, which a container's cpuset or `taskset` narrows), not the machine's core count.

Only the compute threads (the engine's, and the loader's while it loads and warms up) compute with that many
threads; every other thread computes with one. libgomp gives each thread that starts a parallel region its own
pool of workers, and once the process holds more OpenMP threads than CPUs, every waiting worker spins only 100
times before it sleeps: each of a step's ~400 parallel regions then wakes its workers through the kernel. Measured
2026-12-04 on the 2-core Xeon (int4, one decode row): 22.6 ms a step on the main thread, 38.6 ms on another thread
once the main thread held a pool (400 voluntary context switches a step instead of 0), 23.0 ms with the main thread
at one thread. A thread of the event loop's executor that converted one image would otherwise slow every later step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .settings import EngineSettings

log = logging.getLogger("oai_gemma.cpu")


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_fast_bf16() -> bool:
    """Whether bf16 matrix products run at the cores' bf16 rate (AVX512-BF16 or AMX: oneDNN's bf16 GEMM then runs
    ~4x float32's, measured on a 2-core AVX512-bf16 EPYC); elsewhere they are emulated, slower than float32."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


_compute_threads: int | None = None
"""The compute threads' thread count, once `configure_cpu` has run."""


def configure_cpu(settings: EngineSettings) -> int:
    """Set the wait policy (env vars, read once when torch's OpenMP runtime loads, so call this before torch
    is imported; a variable the operator set is kept) and the compute threads' thread count (returned); every
    other thread, this one included, computes with one."""
    global _compute_threads
    if settings.cpu_wait == "passive":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("KMP_BLOCKTIME", "0")
    elif settings.cpu_wait == "active":
        os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    import torch

    threads = _compute_threads = settings.threads or available_cpus()
    torch.set_num_threads(1)
    torch.get_num_threads()  # this thread's count is fixed now: torch reads the process default once per thread
    log.info("CPU: %d compute threads (%d CPUs available), OMP_WAIT_POLICY=%s", threads, available_cpus(),
             os.environ.get("OMP_WAIT_POLICY"))
    return threads


MATMUL_SETTINGS = threading.Lock()
"""Held while a thread computes under a process-wide matmul setting other than the process's own (the bf16 vision
tower's attention: engine/model/vision_weights.py's `mkldnn_fp32_precision`), and by a load's `Turns.aside` stretches,
which compute beside the engine's steps: so neither computes under the other's setting (a load's invariance check
timed under another model's setting, a weight packed for it)."""

LOAD_SHARE = 0.5
"""A load's turn lasts at most this share of the last step's seconds (then the unit of work it is in)."""


class Turns:
    """The cores, taken in turns in arrival order by the engines' steps and by a load (several models in one
    process, api/model_router.py): one engine thread's OpenMP team uses every core, and a thread computing beside
    it stalls each of a step's ~400 parallel regions whose worker it displaces. Measured: a load beside a stream on
    two cores, its loader computing on one thread, made the stream's ITL p99 2.9-4.4x its ITL alone (issue 41).

    A step is one turn. A load holds a turn while it loads, and at each `offer` between two units of its work
    (a tensor read, a layer fused, a warm-up step) it hands the cores over to the steps waiting, once its turn has
    lasted `LOAD_SHARE` of the last step: beside streaming models each of their steps waits at most that long and
    the unit in progress (the 1B's longest: a tile of a 128-token MLP call of its warm-up, under 0.09 s of one
    core), while the load gets about a third of the time. A FIFO of tickets, not a lock: an engine that releases
    a lock takes it again before a waiting thread wakes. The load computes on one thread even in its turn: a second
    OpenMP team in the process makes every team's waiting workers sleep at once (see this module's docstring)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0
        self._loader: int | None = None
        self._since = 0.0
        self.step_seconds = 0.0
        """The last step's length (a load's turn is measured against it)."""

    @contextmanager
    def step(self) -> Iterator[None]:
        """One engine step's turn."""
        self._take()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.step_seconds = time.perf_counter() - started
            self._give()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A turn for other work between the steps (`in_a_turn`), not counted as a step."""
        self._take()
        try:
            yield
        finally:
            self._give()

    @contextmanager
    def load(self) -> Iterator[None]:
        """A load's turns, on this thread, for the block (its work calls `offer`)."""
        self._take()
        self._loader = threading.get_ident()
        try:
            yield
        finally:
            self._loader = None
            self._give()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """A stretch of a load with no units to yield between (imports, the source's config and tokenizer, a native
        kernel's compile, the invariance check's timed runs): run beside the steps, as before turns, rather than stall
        them for its length (a no-op on any other thread), holding MATMUL_SETTINGS."""
        if threading.get_ident() != self._loader:
            yield
            return
        self._loader = None
        self._give()
        try:
            with MATMUL_SETTINGS:  # under the process's own matmul settings (a step's unit may change them a while)
                yield
        finally:
            self._take()
            self._loader = threading.get_ident()

    def offer(self) -> None:
        """Between two units of a load's work (a no-op on any other thread): hand the cores over to the steps waiting
        once this turn has lasted its share, then wait for the next turn."""
        if threading.get_ident() != self._loader:
            return
        if self.waiting and time.perf_counter() - self._since >= LOAD_SHARE * self.step_seconds:
            self._give()
            self._take()

    @property
    def loading(self) -> bool:
        """Whether this thread is a load's, in its turn: its long calls then go in units, an `offer` before each."""
        return threading.get_ident() == self._loader

    @property
    def waiting(self) -> int:
        """Threads waiting for a turn (the holder's not counted)."""
        return max(0, self._next - self._serving - 1)

    def _take(self) -> None:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)
        self._since = time.perf_counter()

    def _give(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


TURNS = Turns()


def in_a_turn(work: Callable, *args):
    """`work(*args)` in a turn of its own between the engines' steps (an image's decode and preprocessing: tens of ms
    of one core). Beside a step its thread displaced one of the step's OpenMP workers, and the step waited at each of
    its parallel regions: at 4B on 2 cores a text stream's longest gap while an image arrived was 321 ms against ~65
    ms steps. In a turn the step before it ends first and the next waits for it."""
    with TURNS.turn():
        return work(*args)


def compute_thread_count() -> int:
    """The compute threads' thread count: `configure_cpu`'s, else this thread's."""
    import torch

    return _compute_threads or torch.get_num_threads()


def compute_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that runs torch work with the compute threads' count (`configure_cpu`; without it, the
    count of the thread that creates this one).

    OpenMP keeps the thread count per thread: a new thread starts from OMP_NUM_THREADS, not from what
    `torch.set_num_threads` told the thread that configured the CPU. Ray sets OMP_NUM_THREADS=1 in its workers,
    so an engine replica's step ran on one core of two (found measuring the Ray Serve proxy); the thread says it
    again itself. `torch.set_num_threads` also sets the count that threads computing for the first time take,
    so once this thread has taken its own, that default goes back to one (see the module's docstring)."""
    import torch

    threads = compute_thread_count()

    def run() -> None:
        torch.set_num_threads(threads)
        if _compute_threads is not None:
            torch.get_num_threads()  # this thread has its count now; torch reads the default once per thread
            _set_default_threads(1)
        target()

    return threading.Thread(target=run, name=name, daemon=True)


@contextmanager
def computing_with(count: int) -> Iterator[None]:
    """This thread computes with `count` torch threads inside, with its own count again after (a check that must see
    the kernels the engine's threads will run, from a loader's one-thread thread); threads computing for the first
    time take one again after, as everywhere (the module's docstring)."""
    import torch

    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if _compute_threads is not None:
            _set_default_threads(1)


def _set_default_threads(count: int) -> None:
    """The count a thread takes when it first computes, set from a thread of its own (so no compute thread's
    count changes)."""
    import torch

    setter = threading.Thread(target=torch.set_num_threads, args=(count,), name="oai-gemma-threads")
    setter.start()
    setter.join()
