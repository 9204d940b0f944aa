"""The engine as its users see it: admit requests, get an async stream of their TokenEvents; cancel; drain.

`Engine` is the facade the API holds (and the tests, the benchmark, a notebook): the event-loop side of
submission (capacity, the places in flight, timeouts, the observer) and the few model facts a route needs
(tokenizer, processor, vocabulary size, context length, grammars); engine/factory.py builds it from the
resolved configuration. The model itself runs on one thread owned by `EngineCore` (engine/core.py); requests and
cancellations reach it through its inbox, and its events come back onto each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from ..version import provenance
from .config import EngineConfig
from .core import EngineCore
from .lora.adapter import LoraModule
from .lora.registry import LoraRegistry
from .sampling.detokenizer import TokenBytes
from .sampling.grammar import GrammarCompiler, StructuredOutputUnavailable
from .ops import native
from .model.loader import LoadedModel
from .model.runner import ModelRunner
from .observer import RequestObserver
from .submission import Submission
from .types import GenerationRequest
from .warmup import build_grammars, warm_up

log = logging.getLogger("oai_gemma.engine")
KV_COUNT_MAX_AGE = 1.0
"""Seconds a count of the KV cache's resident bytes serves /health before it is taken again."""


class EngineDeadError(RuntimeError):
    pass


class EngineBusyError(RuntimeError):
    """Every batch slot is taken and the waiting line is full."""


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), own_weights: bool = False,
                 runner: ModelRunner | None = None):
        """`config`: resolved once (engine/config.py), handed down whole. `own_weights`: the engine may free the
        model's weights it keeps its own copy of (see ModelRunner). `runner`: built already (engine/factory.py)."""
        self.config = config
        self.core = EngineCore(loaded, config, own_weights, runner)
        self.tokenizer = loaded.tokenizer
        self.processor = loaded.processor
        """The multimodal processor (image crops), or None for a text-only model."""
        self.token_text = TokenBytes(loaded.tokenizer)
        """token id -> (its own text, its UTF-8 bytes), as logprobs report them."""
        self.vocab_limit = self.core.vocab_limit
        """Token ids a request may use or be given: [0, vocab_limit)."""
        self.max_model_len = config.model.max_model_len
        self.num_slots = config.scheduler.max_num_seqs
        """Sequences decoded together: also the most choices (`n`) one request may ask for."""
        self.capacity = self.num_slots + config.scheduler.max_waiting
        self.request_timeout = config.server.request_timeout
        """Seconds from arrival to the last token; 0 means no limit."""
        self.idle_timeout = config.server.idle_timeout
        """Longest wait for a request's next event (queue included); 0 means no limit."""
        self.max_backlog = config.server.max_backlog
        """Events a request's consumer may fall behind before the request is cancelled (Submission); 0: no limit."""
        self.admitting = True
        self.in_flight = 0
        """Places taken (one per choice) between `admit` and their submission's end (touched on the event loop only)."""
        self.observer = RequestObserver()
        self.weight_bytes = self.core.runner.weight_bytes()
        """Bytes of the weights held in memory (counted once: they do not change)."""
        self.decode_bytes = self.core.runner.decode_bytes()
        """Bytes of weights one decode step of one row reads (/health: the benchmark's floor)."""
        self.description = f"{loaded.source_dir}, {str(loaded.dtype).removeprefix('torch.')} on {loaded.device}"
        self._grammar_inputs = (loaded.tokenizer, sorted(self.eos_token_ids), self.core.grammar_masks, self.vocab_limit, loaded.device,
                                config.model.cache_dir)
        self._grammars: Future | None = None
        self._grammars_lock = threading.Lock()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a turn (unless a request sets `ignore_eos`)."""
        return self.core.limits.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.core.limits = replace(self.core.limits, eos_token_ids=frozenset(ids))

    @property
    def adapters(self) -> LoraRegistry | None:
        """The LoRA adapters served (engine/lora/registry.py: read them here, change them with `load_adapter` and
        `unload_adapter`), None when adapters are off."""
        return self.core.adapters

    async def load_adapter(self, module: LoraModule) -> None:
        """Read and check the adapter on a worker thread (never the engine's: its streams go on), then register it
        through the engine's inbox; AdapterError if it cannot be served (NameTaken: an adapter has its name)."""
        registration = await asyncio.to_thread(self.adapters.read, module)
        await asyncio.wrap_future(self.core.load_adapter(registration))

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name` to new requests, through the engine's inbox (its requests in flight finish on it);
        KeyError if no adapter has that name."""
        await asyncio.wrap_future(self.core.unload_adapter(name))

    def lora_stats(self) -> dict[str, object] | None:
        """The adapters of running and waiting requests now (vLLM's `lora_requests_info`), None when adapters are off."""
        if self.core.adapters is None:
            return None
        scheduler = self.core.scheduler

        def names(seqs) -> list[str]:
            return sorted({seq.lora.name for seq in list(seqs) if seq.lora is not None})

        return {"running": names(scheduler.running), "waiting": names(scheduler.waiting), "max_lora": self.config.lora.max_loras}

    # ---- lifecycle ------------------------------------------------------------------------------

    def warm_up(self, grammars: bool = True) -> None:
        """Run every step shape once before serving: the first user request must not pay for compilation. Then
        start the grammar compiler's build, unless `grammars` is off (it is built at the first structured request)."""
        warm_up(self.core, lambda: self.grammars)
        if grammars:
            self.build_grammars()

    def build_grammars(self) -> Future:
        """Start the grammar compiler's build, once, on its own thread (seconds holding the GIL: the vocabulary's
        token trie): after warm-up, whose steps it would stall on a 2-core machine, or at the first structured
        request, whichever comes first."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = _in_background(build_grammars, *self._grammar_inputs)
        return self._grammars

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.core.start(loop)

    def shutdown(self) -> None:
        self.core.shutdown()

    @property
    def alive(self) -> bool:
        return self.core.alive

    @property
    def dead_reason(self) -> str | None:
        return self.core.dead_reason

    def stop_admitting(self) -> None:
        """From now on `admit` refuses new requests; running ones go on (graceful shutdown)."""
        self.admitting = False

    def abort_all(self, reason: str) -> None:
        """End every running and waiting request now with finish_reason `aborted` (end of a shutdown grace)."""
        self.core.abort_all(reason)

    # ---- requests -------------------------------------------------------------------------------

    def admit(self, requests: Iterable[GenerationRequest]) -> Submission:
        """Take a place for every choice of every request now, all or none, and start them: one async iterator of
        their events, each request's choices ending with a finish_reason.

        Raises EngineBusyError (not enough free places) or EngineDeadError (no engine, or shutting down) at once,
        before any response has started. The places come back when the submission ends, however it ends;
        closing it early (a client that went away) cancels its requests in the engine.
        """
        now = time.perf_counter()
        requests = [request if request.arrival_time else replace(request, arrival_time=now) for request in requests]
        places = sum(request.n for request in requests)
        self._check_room(places)
        submission = Submission(
            requests, self._release, self.observer, self.request_timeout, self.idle_timeout, self.max_backlog,
            worked_at=self.core.encoding.worked.get,
        )
        self.in_flight += places
        for request in requests:
            self.core.add(request, submission.events)
        return submission

    def generate(self, request: GenerationRequest) -> Submission:
        """`admit` of one request."""
        return self.admit([request])

    def _check_room(self, places: int) -> None:
        if not self.alive:
            self.observer.on_reject("dead")
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if not self.admitting:
            raise EngineDeadError("the server is shutting down")
        free = self.capacity - self.in_flight
        if places > free:
            self.observer.on_reject("busy")
            taken = f"all {self.capacity} places (batch slots and waiting line) are taken" if free <= 0 else (
                f"{places} choices but {free} free places in the engine"
            )
            raise EngineBusyError(f"{taken}; retry shortly")

    def _release(self, places: int, running: list[str]) -> None:
        """A submission ended: its places come back, and what it still had running is cancelled."""
        self.in_flight -= places
        for request_id in running:
            self.core.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    def stats(self) -> dict[str, float]:
        """How busy the engine is right now: running, waiting, steps, kv_cache_usage (the share of KV blocks held by
        running requests), prefix_cache_usage (the share holding only cached prefixes), in_flight (the places
        admitted and not given back yet: one per choice)."""
        return {**self.core.stats(), "in_flight": self.in_flight}

    def server_info(self) -> dict[str, object]:
        """What `/health` and `/v1/server_info` show: what runs (version, git commit, torch, the kernels' ISA), the
        configuration as resolved (what each `auto` became) and the weights as built (`batch_invariant`: the mode as the start-up check on the weights found it)."""
        adapters = {"lora_adapters": self.adapters.describe()} if self.adapters is not None else {}
        return {**provenance(), "kernel_isa": self.kernel_isa, "engine_config": self.config.as_dict(), **self.weights_report(),
                **adapters}

    @functools.cached_property
    def kernel_isa(self) -> str:
        """The native CPU kernels' instruction set (engine/ops/native), once; `none` on a GPU, which runs none of them."""
        return native.kernel_isa() if self.config.model.device == "cpu" else "none"

    def kv_cache_resident_bytes(self) -> int:
        """Bytes of the KV cache backed by memory now: it grows, up to `engine.kv_cache_gib`, as blocks are first
        written (prefix caching keeps released blocks and hands out never-used ones first), which a memory soak
        tells apart from a leak (`/health`; a pagemap read, 8 bytes a page of the cache, so not in `stats()`, which
        every scrape reads; at most KV_COUNT_MAX_AGE old, so a client polling /health does not take the cores)."""
        return self.core.runner.cache.resident_bytes(max_age=KV_COUNT_MAX_AGE)

    def weights_report(self) -> dict[str, object]:
        """What `/health` says of the weights: resident bytes, `model.quantization`, batch-invariant mode on, and what
        it costs (on) or would cost (off) a prefill chunk's linears as start-up measured it (0.021: 2.1% slower)."""
        runner = self.core.runner
        cost = runner.invariance_cost
        return {"weight_bytes": self.weight_bytes, "quantization": runner.quantization, "batch_invariant": runner.batch_invariant,
                "batch_invariant_cost": None if cost is None else round(cost, 4), "decode_bytes": self.decode_bytes}

    def cache_config(self) -> dict[str, object]:
        """The KV cache's shape, as vLLM's `cache_config_info` names it."""
        runner, pool = self.core.runner, self.core.scheduler.pool
        return {
            "block_size": pool.block_size, "num_gpu_blocks": pool.num_blocks, "num_cpu_blocks": 0,
            "cache_dtype": str(runner.dtype).removeprefix("torch."), "enable_prefix_caching": pool.caching,
        }

    def encode(self, text: str) -> list[int]:
        """Token ids of an already rendered prompt (it carries its own <bos>)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars; built in the background once warmed up (`build_grammars`), so a
        call in the first seconds blocks until it is: call it off the event loop. Raises
        StructuredOutputUnavailable when it could not be built (a tokenizer the grammar engine cannot read)."""
        try:
            return (self._grammars or self.build_grammars()).result()
        except Exception as exc:
            raise StructuredOutputUnavailable(f"structured output is unavailable for this model's tokenizer ({exc})") from exc


def _in_background(build, *args) -> Future:
    """Run `build(*args)` on its own thread; the Future holds its result (or its exception)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="oai-gemma-build")
    future = pool.submit(build, *args)
    pool.shutdown(wait=False)
    return future
