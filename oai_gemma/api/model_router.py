"""Several models behind one base URL (`[models.<id>]`, `--model ID=SOURCE`): which engine a request's `model`
picks, loading it on first use, and unloading by `router.max_loaded`, the memory budget and `keep_alive`.

A load runs on a worker thread (never the event loop), one at a time in arrival order; a request for a model that
is not loaded waits for it (its place in the load line is logged and is `oai_gemma:model_load_waiting`). Before a
load, the least recently used idle models are unloaded while the loaded ones would pass `max_loaded` or the budget;
a model with requests in flight (admitted, or between routing and admission) is never unloaded: the load waits up
to `router.load_wait` seconds, then answers 503 with Retry-After. A model's memory is its engine's own count:
weights plus the KV cache allocated (`footprint`), known from its first load on (before that only `max_loaded`
applies to it; the budget is checked again once it is loaded). Unloading stops the engine thread, drops every
reference and collects, so the memory is given back (tests/api/test_multi_model.py measures RSS).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from ..cpu import TURNS, compute_thread
from ..engine.cache.memory import release_free_memory, resident_bytes
from ..engine.config import LoraModule, parse_module
from ..engine.engine import Engine
from ..engine.factory import load_engine
from ..settings import RouterSettings, Settings
from .errors import APIError
from .metrics import ServerMetrics
from .services import Services

log = logging.getLogger("oai_gemma.server")
MB = 2**20


class ModelSlot:
    """One configured model: its settings, its engine and services while loaded, how it is used."""

    def __init__(self, name: str, settings: Settings, keep_alive: float):
        self.name, self.settings, self.keep_alive = name, settings, keep_alive
        self.metrics: ServerMetrics | None = None
        """Its engine's observer and series (`model_name` = its id), set by the server."""
        self.engine: Engine | None = None
        self.services: Services | None = None
        self.loading = False
        self.pending = 0
        """Requests routed here and not admitted into its engine yet (waiting for its load, or being prepared)."""
        self.waiting = 0
        """Requests waiting for its load."""
        self.last_used = time.monotonic()
        self.keep_alive_now: float | None = None
        """The last request's `keep_alive`, over the model's own until it is unloaded (Ollama's)."""
        self.footprint = 0
        """Bytes its engine holds: weights plus the KV cache allocated (0 until its first load)."""
        self.facts: dict = {}
        """What `/v1/models` says of it beyond its settings (modalities, capabilities), known once loaded."""
        self.loads = 0
        self.unloads: dict[str, int] = {}
        self.adapters = _modules(settings.lora.modules)
        """Its configured LoRA adapters (`assign_adapters`): a request naming one loads this model."""

    @property
    def busy(self) -> bool:
        return self.pending > 0 or (self.engine is not None and self.engine.in_flight > 0)

    @property
    def status(self) -> str:
        return "loaded" if self.services is not None else "loading" if self.loading else "unloaded"


class ModelRouter:
    def __init__(self, slots: list[ModelSlot], policy: RouterSettings, store, on_dead: Callable[[ModelSlot, Engine], None]):
        self.store = store
        self.slots = {slot.name: slot for slot in slots}
        self.default = slots[0]
        self.policy = policy
        available = _mem_available()
        self.budget = int(policy.memory_budget_gib * 2**30) or int(policy.memory_fraction * available)
        self.on_dead = on_dead
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """Loads and unloads one at a time, in arrival order (made on the event loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def pick(self, model: str | None) -> ModelSlot:
        """The slot a request's `model` names, or the one whose loaded engine serves it as a LoRA adapter, or the
        one configured with it as an adapter (loaded then, as for its own name); else the default (whose services
        answer a name nobody serves with a 404 `model_not_found`)."""
        if model in self.slots:
            return self.slots[model]
        for slot in self.slots.values():
            adapters = slot.engine.adapters if slot.engine is not None else None
            if model and adapters is not None and adapters.lookup(model) is not None:
                return slot
        return next((slot for slot in self.slots.values() if any(m.name == model for m in slot.adapters)), self.default)

    async def ready(self, slot: ModelSlot, first: bool = False) -> Services:
        """Its services, loading it first if need be (the caller counts itself in `slot.pending`)."""
        if slot.services is not None:
            return slot.services
        slot.waiting += 1
        if not first:
            position = sum(s.waiting for s in self.slots.values())
            log.info("a request for %s waits for its load (place %d in the load line)", slot.name, position)
        try:
            async with self.lock:
                if slot.services is None:
                    await self._make_room(slot)
                    await self._load(slot, first)
        finally:
            slot.waiting -= 1
        return slot.services

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload idle models, least recently used first, until `slot` fits `max_loaded` and the budget; wait for
        busy ones up to `router.load_wait` seconds, then a 503 with Retry-After."""
        deadline = time.monotonic() + self.policy.load_wait
        while True:
            loaded = [s for s in self.slots.values() if s.engine is not None and s is not slot]
            too_many = self.policy.max_loaded and len(loaded) + 1 > self.policy.max_loaded
            too_big = sum(s.footprint for s in loaded) + slot.footprint > self.budget
            if not loaded or not (too_many or too_big):
                return
            idle = self._oldest_idle(slot)
            if idle is not None:
                await self._unload(idle, "evicted")
                continue
            if time.monotonic() >= deadline:
                why = f"router.max_loaded={self.policy.max_loaded}" if too_many else f"the memory budget ({self.budget // MB} MB)"
                raise _busy(f"cannot load {slot.name}: every loaded model has requests in flight and one more would "
                            f"pass {why}; retry shortly")
            await asyncio.sleep(0.1)

    async def _load(self, slot: ModelSlot, first: bool) -> None:
        loop, started, before = asyncio.get_running_loop(), time.monotonic(), resident_bytes()
        slot.loading = True
        beside = any(s.engine is not None for s in self.slots.values())
        def build() -> tuple[Engine, Services]:  # all of it off the event loop, which delivers the others' tokens
            # beside loaded models the grammar compiler waits for the model's first structured request: its token
            # trie holds the GIL for seconds (where a model of the same tokenizer has one, that request finds it built,
            # engine/model/shared.py)
            engine = load_engine(slot.settings, grammars=not beside)
            with TURNS.aside():
                return engine, Services.build(engine, slot.settings, self.store)

        try:  # beside loaded models a load computes on one thread, in turns with their steps (cpu.Turns)
            engine, services = await _in_thread(build, one_thread=beside)
        finally:
            slot.loading = False
        engine.observer = slot.metrics
        engine.start(loop)
        slot.engine, slot.services = engine, services
        slot.footprint = engine.weight_bytes + engine.core.runner.cache.nbytes
        vision = engine.processor is not None
        slot.facts = {"modalities": ["text", "image"] if vision else ["text"],
                      "capabilities": ["completion", "chat", "tools", "structured_output"] + (["vision"] if vision else [])}
        slot.last_used, slot.loads = time.monotonic(), slot.loads + 1
        asyncio.ensure_future(self._watch(slot, slot.loads))
        log.info("loaded %s (%s) in %.1f s: %d MB by its engine's count, resident %d -> %d MB", slot.name, engine.description,
                 time.monotonic() - started, slot.footprint // MB, before // MB, resident_bytes() // MB)
        if not first:
            await self._fit_budget(slot)

    async def _fit_budget(self, keep: ModelSlot) -> None:
        """Its real footprint now known: unload idle others while the budget is passed."""
        while sum(s.footprint for s in self.slots.values() if s.engine is not None) > self.budget:
            idle = self._oldest_idle(keep)
            if idle is None:
                log.warning("the loaded models pass the memory budget (%d MB) and none is idle", self.budget // MB)
                return
            await self._unload(idle, "evicted")

    def _oldest_idle(self, keep: ModelSlot) -> ModelSlot | None:
        """The least recently used loaded model other than `keep` with no request in flight (eviction's choice)."""
        idle = [s for s in self.slots.values() if s.engine is not None and s is not keep and not s.busy]
        return min(idle, key=lambda s: s.last_used, default=None)

    async def unload(self, slot: ModelSlot, reason: str) -> None:
        """`POST /models/unload`: once it has no request in flight (up to `router.load_wait`), else a 503."""
        deadline = time.monotonic() + self.policy.load_wait
        async with self.lock:
            while slot.busy:
                if time.monotonic() >= deadline:
                    raise _busy(f"{slot.name} has requests in flight; retry shortly")
                await asyncio.sleep(0.1)
            await self._unload(slot, reason)

    async def _unload(self, slot: ModelSlot, reason: str) -> None:
        engine, before = slot.engine, resident_bytes()
        if engine is None:
            return
        slot.engine = slot.services = None  # no request reaches it from now on
        slot.keep_alive_now = None
        await asyncio.to_thread(engine.shutdown)  # the engine thread joined
        del engine
        gc.collect()
        release_free_memory()
        slot.unloads[reason] = slot.unloads.get(reason, 0) + 1
        log.info("unloaded %s (%s): resident %d -> %d MB", slot.name, reason, before // MB, resident_bytes() // MB)

    async def reap_idle(self) -> None:
        """Unload each model idle for its keep_alive (checked twice a second; negative: never)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for slot in self.slots.values():
                if slot.engine is None:
                    continue
                if slot.busy:
                    slot.last_used = now
                    continue
                keep = slot.keep_alive if slot.keep_alive_now is None else slot.keep_alive_now
                if keep >= 0 and now - slot.last_used >= keep and not self.lock.locked():
                    async with self.lock:
                        if slot.engine is not None and not slot.busy:
                            await self._unload(slot, "idle")

    async def _watch(self, slot: ModelSlot, load: int) -> None:
        """Until the engine of the slot's `load`-th load dies, or is unloaded. It holds no reference to the engine
        across its sleeps (a cancelled task's traceback would keep it, and its memory, alive)."""
        while slot.loads == load and slot.engine is not None and slot.engine.alive:
            await asyncio.sleep(0.5)
        if slot.loads == load and slot.engine is not None:
            self.on_dead(slot, slot.engine)


def assign_adapters(models: dict[str, tuple[Settings, float]]) -> dict[str, tuple[Settings, float]]:
    """Each model's share of `lora.modules` when several are served: an adapter is the model's its
    `base_model_name` names (vLLM's JSON form), else the first model's; each engine reads only its own (an adapter
    is made for one base's shapes). A bad entry goes to the first model, whose load then says what is wrong."""
    if len(models) < 2:
        return models
    names = list(models)

    def base(spec: str) -> str:
        found = _modules([spec])
        return found[0].base_model_name if found and found[0].base_model_name in models else names[0]

    return {name: (msgspec.structs.replace(own, lora=msgspec.structs.replace(own.lora, modules=tuple(
        spec for spec in own.lora.modules if base(spec) == name))), keep) for name, (own, keep) in models.items()}


def _modules(specs) -> list[LoraModule]:
    """The entries of `lora.modules` that parse (a bad one is the engine's start-up error, engine/config.py)."""
    out = []
    for spec in specs:
        try:
            out.append(parse_module(spec))
        except ValueError:
            pass
    return out


def _in_thread(work: Callable, one_thread: bool) -> asyncio.Future:
    """`work()` on a thread of its own (every compute thread, or one), its result awaited on the event loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        if one_thread:
            import torch

            torch.set_num_threads(1)
        try:
            with TURNS.load():  # loaded models' steps and this load's units of work take turns on the cores
                outcome, error = work(), None
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting request)
            outcome, error = None, exc
        loop.call_soon_threadsafe(_settle, future, outcome, error)

    thread = threading.Thread(target=run, name="oai-gemma-loader", daemon=True) if one_thread else compute_thread(run, "oai-gemma-loader")
    thread.start()
    return future


def _settle(future: asyncio.Future, outcome, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(outcome)


def _mem_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); 64 GiB where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 64 * 2**30


def _busy(message: str) -> APIError:
    """The 503 for a load or unload that waited `router.load_wait` for models with requests in flight."""
    return APIError(503, message, "server_error", None, "model_busy", {"Retry-After": "5"})
