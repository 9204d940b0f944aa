"""The engine thread: it owns the model and runs the step loop.

Each step: take every queued request and cancellation (the inbox), admit waiting requests into free KV
slots, run one forward pass over every running sequence's next token plus prefill chunks of new prompts,
sample all rows at once, turn the tokens into events (sampling/postprocess.py) and hand them to the event
loop with one `loop.call_soon_threadsafe`. No thread per request, no polling, no lock around the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future

import torch

from ..cpu import TURNS, compute_thread
from .sampling.detokenizer import IncrementalDetokenizer, StopMatcher
from .sampling.grammar import GrammarMasks
from .model.loader import LoadedModel
from .cache.block_pool import BlockPool
from .cache.memory import release_free_memory
from .config import ConfigError, EngineConfig
from .encoding import Encoding, token_runs
from .prefilling import ApartPrefills
from .sampling.prompt_scores import prompt_logprobs
from .lora.adapter import AdapterError
from .lora.registry import LoraRegistry, Registration, start_registry
from .sampling.postprocess import Events, Limits, last_events, postprocess
from .model.runner import ModelRunner
from .sampling.sampler import RowRandom, sample_with_logprobs
from .scheduler import Scheduler
from .speculative.planner import Speculator
from .speculative.verify import accept, sampler_rows
from .sequence import ParentRequest, Sequence, Step
from .types import GenerationRequest, TokenEvent, completion_room

log = logging.getLogger("oai_gemma.engine")


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, own_weights: bool = False, runner: ModelRunner | None = None):
        """`runner`: built already (engine/factory.py: from weights and a batch-invariant mode decided first); else
        built here (`ModelRunner.of`)."""
        self.tokenizer = loaded.tokenizer
        model_config = loaded.model.config
        self.image_token_id = getattr(model_config, "image_token_id", None) or getattr(model_config, "image_token_index", None)
        # multimodal checkpoints have more logits than tokens (image soft token, unused rows): never sample them
        self.vocab_limit = min(len(loaded.tokenizer), self.image_token_id or len(loaded.tokenizer))
        self.limits = Limits(frozenset(loaded.eos_token_ids), config.model.max_model_len)
        self.grammar_masks = GrammarMasks(len(loaded.tokenizer), min(loaded.eos_token_ids))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.adapters = self._adapters(loaded, config)
        """The LoRA adapters served (engine/lora/registry.py), or None: then no step pays anything for them. Changed
        on this thread only: the load and unload endpoints send messages (`load_adapter`, `unload_adapter`)."""
        self.runner = runner or ModelRunner.of(loaded, config, own_weights)
        self.runner.lora = self.adapters.resident if self.adapters is not None else None  # a read-only view
        cache = self.runner.cache
        log.info("KV cache: %d blocks x %d tokens, %.2f GiB; prefix caching %s", cache.num_blocks, cache.block_size,
                 cache.nbytes / 2**30, "on" if config.cache.prefix_caching else "off")
        self.speculator = Speculator(config.speculative)
        self.scheduler = Scheduler(
            BlockPool(cache.num_blocks, cache.block_size, caching=config.cache.prefix_caching), config.scheduler.max_num_seqs,
            config.scheduler.max_prefill_tokens, config.model.max_model_len, reuse_decoded=not self.runner.batch_invariant,
            adapters=self.adapters,
            speculator=self.speculator if self.speculator.on else None, kernel_prompts_below=self.runner.kernel_prompts_below,
        )
        self.encoding = Encoding(self.runner.gemma.vision, self.runner.device, self.runner.dtype,
                                 config.scheduler.vision_step_seconds)
        """Requests whose images are being encoded, a slice a step (engine/encoding.py)."""
        self.apart = ApartPrefills(self.runner, config.scheduler.image_prefill_units, self.encoding.worked)  # as units
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self.steps = 0
        self.loop_turns = 0
        """Turns of the engine loop: it sleeps on its inbox whenever no step can run (a request parked on an adapter's
        read included), so this grows with steps and messages, never while it waits."""
        self.step_seconds = 0.0
        """Wall time the engine thread spent in steps (model, sampling, events): `oai-gemma bench` sets it against the
        client's inter-token time to measure the per-token work around the engine (issue 27)."""

    def _adapters(self, loaded: LoadedModel, config: EngineConfig) -> LoraRegistry | None:
        """The configured adapters read and checked before anything else is built: a bad one fails start-up at once."""
        if not config.lora.enabled:
            return None
        try:
            return start_registry(config.lora.modules, loaded.text_config, loaded.dtype, loaded.device, config.lora.max_loras,
                                  config.lora.max_lora_rank, on_read=lambda *read: self._inbox.put(("adapter_read", read, None)))
        except AdapterError as exc:  # a configured adapter that cannot be served: the operator must fix it
            raise ConfigError(f"{exc} (--lora-modules)") from None

    # ---- called from the event loop (thread-safe: messages through the inbox) ---------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = compute_thread(self._run, "oai-gemma-engine")
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.adapters is not None:
            self.adapters.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def add(self, request: GenerationRequest, sink: asyncio.Queue) -> None:
        self._inbox.put(("add", request, sink))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None))

    def abort_all(self, reason: str) -> None:
        self._inbox.put(("abort_all", reason, None))

    def load_adapter(self, registration: Registration) -> Future:
        """Register an adapter already read and checked (`LoraRegistry.read`, off this thread): the Future's result is
        None, or its exception an AdapterError (the name is taken)."""
        return self._ask("load_adapter", registration)

    def unload_adapter(self, name: str) -> Future:
        """Stop serving `name` to new requests: the Future's exception is a KeyError when no adapter has that name."""
        return self._ask("unload_adapter", name)

    def _ask(self, kind: str, payload) -> Future:
        answer: Future = Future()
        if not self.alive:
            answer.set_exception(RuntimeError(self.dead_reason or "the engine is not running"))
        else:
            self._inbox.put((kind, payload, answer))
        return answer

    def stats(self) -> dict[str, float]:
        """A snapshot read from the event loop, not a lock. `kv_cache_usage`: the share of KV blocks running
        sequences hold (0..1); `prefix_cache_usage`: the share only cached prefixes hold."""
        pool = self.scheduler.pool
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting) + len(self.encoding),
            "steps": self.steps, "step_seconds": self.step_seconds, "loop_turns": self.loop_turns,
            "vision_encodes": self.encoding.encodes, "vision_seconds": self.encoding.seconds,
            "kv_cache_usage": 1 - pool.available / pool.num_blocks, "prefix_cache_usage": len(pool.cached) / pool.num_blocks,
            **self.speculator.stats(),
        }

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                stepped = False
                while not self._stopping:
                    self.loop_turns += 1
                    if not self._busy():
                        release_free_memory()
                    # nothing ran last turn (nothing waiting can start, a request parked on its adapter's read
                    # included): only a message can change that, so sleep until one comes
                    self._take_inbox(block=not stepped)
                    if self._busy():
                        with TURNS.step():  # one engine steps at a time: torch's threads serve the whole process
                            stepped = self._step()
                    else:
                        stepped = False
        except BaseException as exc:  # the loop itself broke: fail everyone, report dead
            self.dead_reason = f"engine loop died: {exc!r}"
            log.exception("engine loop died")
            self._fail_all(self.dead_reason)
            self._fail_inbox(self.dead_reason)

    def _busy(self) -> bool:
        return self.scheduler.has_work() or bool(self.encoding)

    def _take_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(block=block)
            while True:
                if message is None:
                    return
                self._handle(*message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, kind: str, payload, sink) -> None:
        """One inbox message; `sink`: a request's event queue, or the Future an adapter change answers."""
        if kind == "add":
            self._admit(payload, sink)
        elif kind == "abort_all":
            self._fail_all(payload, "aborted")
        elif kind == "cancel":
            # its consumer is gone (that is why it cancelled): no event to send; an encode only it waited for is dropped
            for seq in self.scheduler.find(payload) + self.encoding.cancel(payload):
                self._end(seq, "cancelled", [])
        elif kind == "adapter_read":
            self._adapter_read(*payload)
        else:
            try:
                sink.set_result(self.adapters.register(payload) if kind == "load_adapter" else self.adapters.unregister(payload))
            except (AdapterError, KeyError) as exc:
                sink.set_exception(exc)

    def _adapter_read(self, registration, result) -> None:
        """An adapter read again off this thread: its waiting requests start at the next step, or end on its error."""
        error = self.adapters.read_done(registration, result)
        if error is not None:
            events: Events = []
            for seq in [seq for seq in self.scheduler.waiting if seq.lora is registration and not seq.adapter]:
                self._end(seq, "error", events, error=str(error))
            self._deliver(events)

    def _sequence(self, request: GenerationRequest, sink, index: int) -> Sequence:
        seed = request.sampling.seed
        seq = Sequence(
            request=request,
            sink=sink,
            # each choice its own stream of uniforms, still reproducible from the request's seed
            random=RowRandom(seed if seed is None or index == 0 else hash((seed, index))),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            stopper=StopMatcher(request.sampling.stop),
            cache_keys=list(request.prompt_token_ids),
            index=index,
            matcher=None if request.grammar is None else request.grammar.matcher(
                budget=min(request.sampling.max_tokens, completion_room(self.limits.max_model_len, len(request.prompt_token_ids)))
            ),
        )
        seq.speculation = self.speculator.start(request, grammar=seq.matcher is not None)
        return seq

    def _admit(self, request: GenerationRequest, sink) -> None:
        prompt = request.prompt_token_ids
        lora, error = self._lora(request)
        seq = ParentRequest.fan_out(request, lambda index: self._sequence(request, sink, index))
        for child in seq.parent.children if seq.parent else (seq,):
            child.lora = lora
        if error:
            pass  # the adapter is not served
        elif not prompt or completion_room(self.limits.max_model_len, len(prompt)) < 1:
            error = f"prompt of {len(prompt)} tokens does not fit the context"
        elif request.pixel_values is not None:
            try:
                self._mark_images(seq)
            except Exception as exc:  # a bad image fails its own request only
                error = f"image processing failed: {exc}"
        if error:
            events: Events = []  # an adapter unloaded after the route found it: `not_found`, a 404 as the route's own
            self._end(seq, "not_found" if lora is None and request.adapter else "error", events, error=error)
            self._deliver(events)
        elif request.pixel_values is not None:
            self.encoding.submit(seq)  # scheduled once its features are ready (`_encode`)
        else:
            self.scheduler.add(seq)

    def _encode(self) -> None:
        """A slice of the oldest image encode; the sequences whose features are ready go to the scheduler."""
        ready, failed = self.encoding.run(busy=self.scheduler.has_work())
        for seq, features in ready:
            seq.image_embeds = features
            for child in seq.parent.pending if seq.parent else ():  # one that prefills on its own after all needs these
                child.cache_keys, child.image_spans, child.image_embeds = seq.cache_keys, seq.image_spans, seq.image_embeds
            self.scheduler.add(seq)
        if failed:
            events: Events = []
            for seq, error in failed:
                self._end(seq, "error", events, error=error)
            self._deliver(events)

    def _lora(self, request: GenerationRequest):
        """(The registration of the adapter the request names, or None; an error when it is not served.)"""
        if request.adapter is None:
            return None, None
        lora = self.adapters.lookup(request.adapter) if self.adapters is not None else None
        return lora, None if lora is not None else f"the LoRA adapter '{request.adapter}' is not loaded"

    def _mark_images(self, seq: Sequence) -> None:
        """Mark each image block for the mask and the prefix cache (the vision tower runs later, in slices)."""
        spans = token_runs(seq.prompt_ids, self.image_token_id)
        keys = seq.request.crop_keys
        if len(spans) != len(keys):
            raise ValueError(f"{len(spans)} image blocks in the prompt but {len(keys)} crops")
        seq.image_spans = tuple(spans)
        for (start, end), key in zip(spans, keys):
            seq.cache_keys[start:end] = [-1 - key % 2**62] * (end - start)

    def _step(self) -> bool:
        """A slice of an image's prefill or encode, and one step of the running and startable sequences; False when
        none ran."""
        sliced = self._slice()
        if sliced and not self.scheduler.has_work():
            return True
        started = time.perf_counter()
        step = self.scheduler.schedule(started)
        if not (step.prefills or step.decodes):  # what waits cannot start (its adapter is being read)
            return sliced or bool(self.apart)
        if self.adapters is not None:
            for seq, item in zip(step.prefill_owners + step.decode_owners, step.prefills + step.decodes):
                item.adapter = seq.adapter  # the runner gathers each row's adapter by its slot
        step = self.apart.take(step)  # an image's chunk runs apart, as units (engine/prefilling.py)
        if step.prefills or step.decodes:
            self._sample(step, lambda: self.runner.forward(step.prefills, step.decodes))
            self.step_seconds += time.perf_counter() - started
            self.encoding.stepped(time.perf_counter() - started)
        return True

    def _slice(self) -> bool:
        """A slice of the oldest image prefill run apart, else of the oldest image encode; False when neither."""
        if self.apart:
            done = self.apart.run(self.encoding.budget(busy=any(not seq.apart for seq in self.scheduler.running)))
            if done is not None:  # its logits (or what its units raised) sampled as a step of its own
                self._sample(*done)
            return True
        if self.encoding:
            self._encode()
            return True
        return False

    def _sample(self, step: Step, forward) -> None:
        """Sample the step's rows from `forward()`'s logits, then advance and deliver."""
        try:
            logits = forward()[:, : self.vocab_limit]
            prompt_logprobs(step, self.runner.logits_of, self.vocab_limit, self.runner.row_buckets[-1])
            logits, sampled = self._fork(logits, step.sampled)
            rows = sampler_rows(sampled)  # a drafted sequence has a row per draft, and one more
            logits = self.grammar_masks.apply(logits, [row.matcher for row in rows])
            tokens, logprobs = sample_with_logprobs(logits, rows, self.limits.eos_token_ids)
            runs = accept(sampled, step, tokens, logprobs, self.speculator)
        except Exception as exc:  # the culprits fail alone; the engine keeps serving
            log.exception("engine step failed")
            # a new prompt (huge, or with a bad image) is the likely cause: fail the prefills and let the
            # decodes run again next step (rewriting their KV entry is harmless); a decode-only step that
            # failed has no better suspect than all of it
            events: Events = []
            for seq in step.prefill_owners or step.decode_owners:
                self._end(seq, "error", events, error=f"engine step failed: {exc}", cache_valid=False)
            self._deliver(events)
            return
        self.scheduler.advance(step)
        self.steps += 1
        events, finished = postprocess(self.limits, sampled, runs, time.perf_counter())
        for seq in finished:  # the core tells the scheduler: sampling/ does not know it
            self.scheduler.finish(seq)
        self._deliver(events)

    def _fork(self, logits: torch.Tensor, sampled: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Choices 1..n-1 of a request whose prompt just finished prefilling: they share its prompt's KV (a copy
        of its last, partial block) and sample from its logits row, each with its own randomness."""
        rows, children = [], []
        for row, seq in enumerate(sampled):
            if seq.parent is not None and seq.parent.pending:
                for child, copy in self.scheduler.fork(seq, time.perf_counter()):
                    if copy is not None:
                        self.runner.cache.copy_block(seq.blocks[-1], copy)
                    child.prompt_logprobs = seq.prompt_logprobs
                    rows.append(row)
                    children.append(child)
        if not children:
            return logits, sampled
        return torch.cat((logits, logits[rows])), sampled + children

    def _fail_all(self, reason: str, finish_reason: str = "error") -> None:
        events: Events = []
        for seq in (*self.scheduler.running, *self.scheduler.waiting, *self.encoding.take_all()):
            self._end(seq, finish_reason, events, error=reason)
        self._deliver(events)

    def _fail_inbox(self, reason: str) -> None:
        """End the requests sent to a dead engine before it was seen dead (an error event per choice)."""
        events: Events = []
        while not self._inbox.empty():
            message = self._inbox.get_nowait()
            if message is not None and message[0] == "add":
                _, request, sink = message
                now = time.perf_counter()
                events += [(sink, TokenEvent(request.request_id, None, "", now, "error", i, error=reason)) for i in range(request.n)]
            elif message is not None and isinstance(message[2], Future):
                message[2].set_exception(RuntimeError(reason))
        self._deliver(events)

    def _end(self, seq: Sequence, reason: str, events: Events, error: str | None = None, cache_valid: bool = True) -> None:
        """End a sequence outside the token path (cancelled, failed, aborted), and its request's choices that never
        started: their slots freed, their last events added to `events`."""
        for ended, event in last_events(seq, reason, error):
            self.scheduler.finish(ended, cache_valid)
            events.append((ended.sink, event))

    def _deliver(self, events: Events) -> None:
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, events)


def _put_all(events: Events) -> None:
    for sink, event in events:
        sink.put_nowait(event)
