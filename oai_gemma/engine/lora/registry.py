"""The adapters a server knows, and the few resident in its slots (`max_loras`, least recently used out).

A name is registered (at start-up, or by the load endpoint) once its directory was read and checked; a request
names it, and the engine thread `acquire`s a slot for it when the scheduler first tries to admit the request to a
batch row (before its prefix-cache lookup, which needs the slot's `digest`): the adapter is then read from disk if
it is not resident (an idle one, pinned by no sequence, makes room), and pinned until the sequence ends
(`release`). When every slot is pinned, the request waits for one, as it waits for a row. A slot is a small
integer: `StepItem.adapter`, what the runner gathers by.

The prefix cache keys an adapter's KV by the content hash of the files its slot's weights were read from
(`digest`): the same prompt under two adapters, or under one whose files changed on disk before it was read
again, never shares KV. Unloading removes the name for new requests; the requests already admitted or waiting
keep their registration and finish on it; its slot is freed after them.
The event loop (names, the endpoints, metrics) and the engine thread (acquire, release) share it under one lock;
only the engine thread reads a slot's weights, and only slots its sequences pin.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .adapter import AdapterError, AdapterLinears, LoraModule, pack, read_adapter
from .stack import Stack, build_stack

log = logging.getLogger("oai_gemma.engine")

_KEYS = itertools.count(1)


@dataclass(eq=False)
class Registration:
    """A name bound to an adapter directory, as read when it was registered."""

    module: LoraModule
    rank: int
    key: int = field(default_factory=lambda: next(_KEYS))
    """Unique per registration: its resident slot's entry."""
    ready: AdapterLinears | None = None
    """The weights read at registration, kept for its first acquire (no second read right after a load)."""
    unloaded: bool = False

    @property
    def name(self) -> str:
        return self.module.name


@dataclass(eq=False)
class _Resident:
    registration: Registration
    slot: int
    pins: int = 0


class LoraRegistry:
    def __init__(self, text_config, dtype: torch.dtype, device: torch.device, max_loras: int, max_rank: int):
        self.text_config, self.dtype, self.device = text_config, dtype, device
        self.max_loras, self.max_rank = max_loras, max_rank
        self.known: dict[str, Registration] = {}
        self.slots: list[AdapterLinears | None] = [None] * (max_loras + 1)
        """Slot -> the resident adapter's weights; slot 0 is the base model (no adapter)."""
        self._resident: OrderedDict[int, _Resident] = OrderedDict()
        """Registration key -> its slot, least recently used first."""
        self._free = list(range(max_loras, 0, -1))
        self._lock = threading.Lock()
        self._stacks: dict[torch.dtype, Stack | None] = {}
        self._stack_stale = True
        self.loads = 0
        """Reads from disk into a slot (start-up's and the load endpoint's excepted): evictions show here."""

    # ---- the event loop's side: names ------------------------------------------------------------

    def read(self, module: LoraModule) -> Registration:
        """Read and check `module` (seconds at most: run it off the event loop); AdapterError if it cannot be served."""
        linears = pack(read_adapter(module.name, module.path, self.text_config, self.max_rank), self.dtype, self.device)
        return Registration(module, linears.rank, ready=linears)

    def register(self, registration: Registration) -> None:
        """Serve `registration` under its name; AdapterError if the name is taken."""
        with self._lock:
            if registration.name in self.known:
                raise AdapterError(registration.name, "an adapter of that name is already loaded")
            waiting = sum(r.ready is not None for r in self.known.values())
            if waiting >= self.max_loras:  # many loaded, none asked for yet: read again from disk when they are
                registration.ready = None
            self.known[registration.name] = registration
        log.info("LoRA adapter '%s' (rank %d) from %s", registration.name, registration.rank, registration.module.path)

    def unregister(self, name: str) -> Registration:
        """Stop serving `name` to new requests (KeyError if unknown); its running requests finish on it."""
        with self._lock:
            registration = self.known.pop(name)
            registration.unloaded, registration.ready = True, None
            resident = self._resident.get(registration.key)
            if resident is not None and resident.pins == 0:
                self._drop(resident)
        log.info("LoRA adapter '%s' unloaded", name)
        return registration

    def lookup(self, name: str) -> Registration | None:
        return self.known.get(name)

    def names(self) -> list[str]:
        return list(self.known)

    def describe(self) -> list[dict[str, object]]:
        """What /health lists: each adapter's name, path, rank and whether it is resident now."""
        with self._lock:
            resident = {r.registration.key for r in self._resident.values()}
            return [{"name": r.name, "path": r.module.path, "rank": r.rank, "resident": r.key in resident} for r in self.known.values()]

    # ---- the engine thread's side: slots ---------------------------------------------------------

    def acquire(self, registration: Registration) -> int:
        """A slot holding `registration`'s weights, pinned once more; 0 when every slot is pinned (wait). Reads it
        from disk when not resident (AdapterError if that now fails)."""
        with self._lock:
            resident = self._resident.get(registration.key)
            if resident is not None:
                resident.pins += 1
                self._resident.move_to_end(registration.key)
                return resident.slot
            if not self._free:
                idle = next((r for r in self._resident.values() if r.pins == 0), None)
                if idle is None:
                    return 0
                self._drop(idle)
            slot = self._free.pop()
        try:
            linears = registration.ready or self._reload(registration)
        except Exception:
            with self._lock:
                self._free.append(slot)
            raise
        registration.ready = None
        with self._lock:
            self.slots[slot] = linears
            self._resident[registration.key] = _Resident(registration, slot, pins=1)
            self._stack_stale = True
        return slot

    def stack(self, dtype: torch.dtype) -> Stack | None:
        """The resident adapters stacked in `dtype` (engine/lora/stack.py), rebuilt here (the engine thread) after a change."""
        with self._lock:
            if self._stack_stale:
                self._stack_stale, self._stacks = False, {}
            slots = None if dtype in self._stacks else list(self.slots)
        if slots is not None:
            resident = {slot: (adapter.rank, adapter.tensors) for slot, adapter in enumerate(slots) if adapter is not None}
            self._stacks[dtype] = build_stack(resident, self.text_config.num_hidden_layers, dtype)
        return self._stacks[dtype]

    def _reload(self, registration: Registration) -> AdapterLinears:
        module = registration.module
        self.loads += 1
        log.info("LoRA adapter '%s': reading it again from %s (not resident)", module.name, module.path)
        return pack(read_adapter(module.name, module.path, self.text_config, self.max_rank), self.dtype, self.device)

    def digest(self, slot: int) -> bytes:
        """The content hash of the adapter files whose weights `slot` holds (its sequences' prefix-cache key)."""
        return self.slots[slot].digest

    def pin(self, slot: int) -> None:
        """One more sequence on an already pinned slot (a request's further choices)."""
        with self._lock:
            next(r for r in self._resident.values() if r.slot == slot).pins += 1

    def release(self, slot: int) -> None:
        """A sequence on `slot` ended; an unloaded adapter's slot is freed with its last sequence."""
        with self._lock:
            resident = next(r for r in self._resident.values() if r.slot == slot)
            resident.pins -= 1
            if resident.pins == 0 and resident.registration.unloaded:
                self._drop(resident)

    def _drop(self, resident: _Resident) -> None:
        """Free a slot no sequence pins (the lock held)."""
        del self._resident[resident.registration.key]
        self.slots[resident.slot] = None
        self._free.append(resident.slot)
        self._stack_stale = True


def start_registry(modules, text_config, dtype, device, max_loras: int, max_rank: int) -> LoraRegistry:
    """The registry with `modules` (the configured adapters) read, checked and registered; AdapterError for the first
    that cannot be served (a start-up error naming it)."""
    registry = LoraRegistry(text_config, dtype, device, max_loras, max_rank)
    for module in modules:
        registry.register(registry.read(module))
    return registry
