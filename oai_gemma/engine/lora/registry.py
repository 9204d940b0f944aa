"""The adapters a server knows, and the few resident in its slots (`max_loras`, least recently used out).

Everything that changes the registry runs on the engine thread, as messages through the engine core's inbox
(engine/core.py): a name is registered (at start-up, or by the load endpoint, which reads and checks the
directory first, off the engine thread) or unregistered; the scheduler `acquire`s a slot for a request's adapter
when it first tries to admit it (before its prefix-cache lookup, which needs the slot's `digest`), pinned until the
sequence ends (`release`). When the adapter is not resident and its weights are not in hand, `acquire` starts
reading its files on the registry's own reader thread and answers 0: the request waits (parked: the engine
thread sleeps on its inbox when nothing else can run) while the other streams keep streaming; the weights come
back through the inbox (`read_done`) and the next `acquire` installs them into a slot (an idle one, pinned by no
sequence, makes room). When every slot is pinned, the request waits for one, as it waits for a row. A slot is a
small integer: `StepItem.adapter`, what the runner gathers by through its read-only view (`ResidentAdapters`).

The prefix cache keys an adapter's KV by the content hash of the files its slot's weights were read from
(`digest`): the same prompt under two adapters, or under one whose files changed on disk before it was read
again, never shares KV. Unloading removes the name for new requests; the requests already admitted or waiting
keep their registration and finish on it; its slot is freed after them.
The event loop only reads: `known` (a dict the engine thread replaces, never changes) and each registration's
`slot`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .adapter import AdapterError, AdapterLinears, LoraModule, pack, read_adapter
from .stack import Stack, build_stack

log = logging.getLogger("oai_gemma.engine")

_KEYS = itertools.count(1)


class NameTaken(AdapterError):
    """A load under a name that an adapter has (another load of it may have won the race)."""


@dataclass(eq=False)
class Registration:
    """A name bound to an adapter directory, as read when it was registered."""

    module: LoraModule
    rank: int
    key: int = field(default_factory=lambda: next(_KEYS))
    """Unique per registration: its resident slot's entry."""
    ready: AdapterLinears | None = None
    """Weights read and not installed yet (at registration, or by a reload): the next `acquire` installs them."""
    loading: bool = False
    """Its files are being read on the reader thread."""
    slot: int = 0
    """Its resident slot, 0 while not resident."""
    unloaded: bool = False

    @property
    def name(self) -> str:
        return self.module.name


@dataclass(eq=False)
class _Resident:
    registration: Registration
    slot: int
    pins: int = 0


class ResidentAdapters:
    """What the runner reads (engine/lora/apply.py): each slot's weights, and the resident adapters' stack in a
    dtype, built on first use after a change (on the engine thread, like every change: `LoraRegistry`'s)."""

    def __init__(self, text_config, dtype: torch.dtype, max_loras: int):
        self.text_config, self.dtype = text_config, dtype
        self.slots: list[AdapterLinears | None] = [None] * (max_loras + 1)
        """Slot -> the resident adapter's weights; slot 0 is the base model (no adapter)."""
        self._stacks: dict[torch.dtype, Stack | None] = {}

    def stack(self, dtype: torch.dtype) -> Stack | None:
        """The resident adapters stacked in `dtype` (engine/lora/stack.py)."""
        if dtype not in self._stacks:
            resident = {slot: (adapter.rank, adapter.tensors) for slot, adapter in enumerate(self.slots) if adapter is not None}
            self._stacks[dtype] = build_stack(resident, self.text_config.num_hidden_layers, dtype)
        return self._stacks[dtype]

    def digest(self, slot: int) -> bytes:
        """The content hash of the adapter files whose weights `slot` holds (its sequences' prefix-cache key)."""
        return self.slots[slot].digest

    def _put(self, slot: int, adapter: AdapterLinears | None) -> None:
        self.slots[slot], self._stacks = adapter, {}


ReadDone = Callable[[Registration, "AdapterLinears | AdapterError"], None]
"""Where the reader thread hands a read's result: the engine core puts it into its inbox."""


class LoraRegistry:
    def __init__(self, text_config, dtype: torch.dtype, device: torch.device, max_loras: int, max_rank: int,
                 on_read: ReadDone | None = None):
        self.text_config, self.dtype, self.device = text_config, dtype, device
        self.max_loras, self.max_rank = max_loras, max_rank
        self.known: dict[str, Registration] = {}
        """Name -> registration: replaced whole on each change, so the event loop reads it without a lock."""
        self.resident = ResidentAdapters(text_config, dtype, max_loras)
        self._resident: OrderedDict[int, _Resident] = OrderedDict()
        """Registration key -> its slot, least recently used first."""
        self._free = list(range(max_loras, 0, -1))
        self.on_read = on_read
        self._reader: ThreadPoolExecutor | None = None
        self.loads = 0
        """Reads from disk for a slot (start-up's and the load endpoint's excepted): evictions show here."""

    # ---- any thread ------------------------------------------------------------------------------

    def read(self, module: LoraModule) -> Registration:
        """Read and check `module` (seconds at most: never on the engine thread); AdapterError if it cannot be served."""
        linears = self._read(module)
        return Registration(module, linears.rank, ready=linears)

    def _read(self, module: LoraModule) -> AdapterLinears:
        return pack(read_adapter(module.name, module.path, self.text_config, self.max_rank), self.dtype, self.device)

    def lookup(self, name: str) -> Registration | None:
        return self.known.get(name)

    def names(self) -> list[str]:
        return list(self.known)

    def describe(self) -> list[dict[str, object]]:
        """What /health lists: each adapter's name, path, rank, and its slot while resident (else None)."""
        return [{"name": r.name, "path": r.module.path, "rank": r.rank, "resident": bool(r.slot), "slot": r.slot or None}
                for r in self.known.values()]

    # ---- the engine thread: names ----------------------------------------------------------------

    def register(self, registration: Registration) -> None:
        """Serve `registration` under its name; NameTaken if an adapter has that name."""
        if registration.name in self.known:
            raise NameTaken(registration.name, "an adapter of that name is already loaded")
        if sum(r.ready is not None for r in self.known.values()) >= self.max_loras:  # many loaded, none asked for yet
            registration.ready = None  # read again from disk when they are
        self.known = {**self.known, registration.name: registration}
        log.info("LoRA adapter '%s' (rank %d) from %s", registration.name, registration.rank, registration.module.path)

    def unregister(self, name: str) -> Registration:
        """Stop serving `name` to new requests (KeyError if unknown); its running and waiting requests finish on it."""
        known = dict(self.known)
        registration = known.pop(name)
        self.known = known
        registration.unloaded, registration.ready = True, None
        resident = self._resident.get(registration.key)
        if resident is not None and resident.pins == 0:
            self._drop(resident)
        log.info("LoRA adapter '%s' unloaded", name)
        return registration

    # ---- the engine thread: slots ----------------------------------------------------------------

    def acquire(self, registration: Registration) -> int:
        """A slot holding `registration`'s weights, pinned once more; 0: not now (its files are being read, see
        `registration.loading`, or every slot is pinned)."""
        resident = self._resident.get(registration.key)
        if resident is not None:
            resident.pins += 1
            self._resident.move_to_end(registration.key)
            return resident.slot
        if registration.ready is None:
            self._read_in_background(registration)
            return 0
        if not self._free:
            idle = next((r for r in self._resident.values() if r.pins == 0), None)
            if idle is None:
                return 0
            self._drop(idle)
        slot = self._free.pop()
        self.resident._put(slot, registration.ready)
        registration.ready, registration.slot = None, slot
        self._resident[registration.key] = _Resident(registration, slot, pins=1)
        return slot

    def _read_in_background(self, registration: Registration) -> None:
        if registration.loading:
            return
        registration.loading = True
        self.loads += 1
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="oai-gemma-lora-read")
        module = registration.module
        log.info("LoRA adapter '%s': reading it again from %s (not resident)", module.name, module.path)
        self._reader.submit(self._read_again, registration)

    def _read_again(self, registration: Registration) -> None:
        """On the reader thread: the weights (or the AdapterError), handed to `on_read`."""
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                result = self._read(registration.module)
        except AdapterError as exc:
            result = exc
        except Exception as exc:  # an unexpected failure fails the requests waiting for it, not the reader
            result = AdapterError(registration.name, f"reading it again failed: {exc!r}")
        log.info("LoRA adapter '%s': read again in %.3f s", registration.name, time.perf_counter() - started)
        self.on_read(registration, result)

    def read_done(self, registration: Registration, result: AdapterLinears | AdapterError) -> AdapterError | None:
        """A background read came back: its weights wait for the next `acquire`; its error is returned (the engine
        ends the requests waiting for it; a later request reads the files again)."""
        registration.loading = False
        if isinstance(result, AdapterError):
            return result
        registration.ready = result
        return None

    def digest(self, slot: int) -> bytes:
        return self.resident.digest(slot)

    def pin(self, slot: int) -> None:
        """One more sequence on an already pinned slot (a request's further choices)."""
        self._at(slot).pins += 1

    def release(self, slot: int) -> None:
        """A sequence on `slot` ended; an unloaded adapter's slot is freed with its last sequence."""
        resident = self._at(slot)
        resident.pins -= 1
        if resident.pins == 0 and resident.registration.unloaded:
            self._drop(resident)

    def _at(self, slot: int) -> _Resident:
        return next(r for r in self._resident.values() if r.slot == slot)

    def _drop(self, resident: _Resident) -> None:
        """Free a slot no sequence pins."""
        del self._resident[resident.registration.key]
        resident.registration.slot = 0
        self.resident._put(resident.slot, None)
        self._free.append(resident.slot)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)


def start_registry(modules, text_config, dtype, device, max_loras: int, max_rank: int, on_read: ReadDone | None = None) -> LoraRegistry:
    """The registry with `modules` (the configured adapters) read, checked and registered; AdapterError for the first
    that cannot be served (a start-up error naming it)."""
    registry = LoraRegistry(text_config, dtype, device, max_loras, max_rank, on_read)
    for module in modules:
        registry.register(registry.read(module))
    return registry
