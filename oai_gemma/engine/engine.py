"""The engine: one thread owns the model and runs the step loop; requests talk to it through queues.

`generate(request)` is an async iterator of TokenEvents. Requests and cancellations go in through a
thread-safe inbox; each step's events go out in one `loop.call_soon_threadsafe` onto each request's
asyncio queue. No thread per request, no polling, no lock around the model.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .detokenizer import IncrementalDetokenizer, StopMatcher, TokenBytes
from .grammar import GrammarCompiler, GrammarMasks, StructuredOutputUnavailable
from .loader import LoadedModel
from .observer import RequestObserver
from .runner import KVCache, ModelRunner, StepItem
from .sampler import PlainRow, RowRandom, sample_with_logprobs, token_logprobs
from .scheduler import Scheduler, Sequence
from .types import GenerationRequest, SamplingParams, TokenEvent

log = logging.getLogger("oai_gemma.engine")


class EngineDeadError(RuntimeError):
    pass


class EngineBusyError(RuntimeError):
    """Every batch slot is taken and the waiting line is full."""


class Engine:
    def __init__(
        self, loaded: LoadedModel, *, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int,
        kv_cache_gib: float = 0.0, max_waiting: int = 256, request_timeout: float = 0.0, idle_timeout: float = 0.0,
        compile: str = "auto", static_decode: bool | None = None,
    ):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.token_text = TokenBytes(loaded.tokenizer)
        """token id -> (its own text, its UTF-8 bytes), as logprobs report them."""
        config = loaded.model.config
        self.image_token_id = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
        # multimodal checkpoints have more logits than tokens (image soft token, unused rows): never sample them
        self.vocab_limit = min(len(loaded.tokenizer), self.image_token_id or len(loaded.tokenizer))
        self.max_model_len = max_model_len
        self.grammar_masks = GrammarMasks(len(loaded.tokenizer), min(self.eos_token_ids))
        self._grammars = _in_background(self._build_grammars, loaded.tokenizer, sorted(self.eos_token_ids), loaded.device)
        num_slots = slots_within_budget(loaded, max_num_seqs, max_model_len, kv_cache_gib)
        self.num_slots = num_slots
        # a prefill chunk is never cut inside an image block, so one chunk can be a whole image
        longest_chunk = max(max_prefill_tokens, getattr(config, "mm_tokens_per_image", 0))
        self.runner = ModelRunner(
            loaded.model, num_slots=num_slots, max_len=max_model_len, max_tokens_per_step=longest_chunk + num_slots,
            compile=compile, static_decode=static_decode,
        )
        log.info("KV cache: %d slots x %d tokens, %.2f GiB", num_slots, max_model_len, self.runner.cache.nbytes / 2**30)
        self.scheduler = Scheduler(num_slots, max_prefill_tokens, window=min(self.runner.cache.capacity))
        self.capacity = num_slots + max_waiting
        self.request_timeout = request_timeout
        """Seconds from arrival to the last token; 0 means no limit."""
        self.idle_timeout = idle_timeout
        """Longest wait for a request's next event (queue included); 0 means no limit."""
        self.admitting = True
        self.in_flight = 0
        """Requests between submit and their last event (touched on the event loop only)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self.steps = 0
        self.observer = RequestObserver()

    # ---- the event-loop side --------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="oai-gemma-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def generate(self, request: GenerationRequest) -> "Submission":
        """Submit a request now; returns an async iterator of its events, the last one with a finish_reason.

        Raises EngineBusyError / EngineDeadError at once, before any response has started. Closing the
        submission early (a client that went away) cancels the request in the engine.
        """
        self.check_capacity()
        if not request.arrival_time:
            request.arrival_time = time.perf_counter()
        submission = Submission(self, request, self.request_timeout, self.idle_timeout)
        self._inbox.put(("add", request, submission.events))
        self.in_flight += request.n
        return submission

    def check_capacity(self) -> None:
        """Raise unless a new request can be taken now (call before a response starts)."""
        if not self.alive:
            self.observer.on_reject("dead")
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if not self.admitting:
            raise EngineDeadError("the server is shutting down")
        if self.in_flight >= self.capacity:
            self.observer.on_reject("busy")
            raise EngineBusyError(f"all {self.capacity} places (batch slots and waiting line) are taken; retry shortly")

    def load(self) -> dict[str, float]:
        """How busy the engine is right now (read from the event loop: a snapshot, not a lock).

        `kv_cache_usage`: the share of KV-cache slots held by requests (0..1)."""
        slots = self.runner.cache.num_slots
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting), "steps": self.steps,
            "kv_cache_usage": (slots - len(self.scheduler.slots)) / slots,
        }

    def encode(self, text: str) -> list[int]:
        """Token ids of an already rendered prompt (it carries its own <bos>)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars; built in the background from start (seconds: the vocabulary's
        token trie), so a call in the first seconds blocks until it is: call it off the event loop. Raises
        StructuredOutputUnavailable when it could not be built (a tokenizer the grammar engine cannot read)."""
        try:
            return self._grammars.result()
        except Exception as exc:
            raise StructuredOutputUnavailable(f"structured output is unavailable for this model's tokenizer ({exc})") from exc

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None))

    def stop_admitting(self) -> None:
        """From now on `generate` refuses new requests; running ones go on (graceful shutdown)."""
        self.admitting = False

    def abort_all(self, reason: str) -> None:
        """End every running and waiting request now with finish_reason `aborted` (end of a shutdown grace)."""
        self._inbox.put(("abort_all", reason, None))

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    if not self.scheduler.has_work():
                        release_free_memory()
                    self._take_inbox(block=not self.scheduler.has_work())
                    if self.scheduler.has_work():
                        self._step()
        except BaseException as exc:  # the loop itself broke: fail everyone, report dead
            self.dead_reason = f"engine loop died: {exc!r}"
            log.exception("engine loop died")
            self._fail_all(self.dead_reason)

    def _take_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(block=block)
            while True:
                if message is None:
                    return
                kind, payload, sink = message
                if kind == "add":
                    self._admit(payload, sink)
                elif kind == "abort_all":
                    self._fail_all(payload, "aborted")
                else:
                    for seq in self.scheduler.find(payload):  # its consumer is gone (that is why it cancelled): no event to send
                        self._finish(seq, "cancelled", [])
                message = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _sequence(self, request: GenerationRequest, sink, index: int) -> Sequence:
        seed = request.sampling.seed
        return Sequence(
            request=request,
            sink=sink,
            # each choice its own stream of uniforms, still reproducible from the request's seed
            random=RowRandom(seed if seed is None or index == 0 else hash((seed, index))),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            stopper=StopMatcher(request.sampling.stop),
            cache_keys=list(request.prompt_token_ids),
            index=index,
            matcher=None if request.grammar is None else request.grammar.matcher(
                budget=min(request.sampling.max_tokens, self.max_model_len - len(request.prompt_token_ids) - 1)
            ),
        )

    def _admit(self, request: GenerationRequest, sink) -> None:
        prompt = request.prompt_token_ids
        seq = self._sequence(request, sink, 0)
        seq.forks = [self._sequence(request, sink, index) for index in range(1, request.n)]
        error = None
        if not prompt or len(prompt) + 1 > self.max_model_len:
            error = f"prompt of {len(prompt)} tokens does not fit the context"
        elif request.pixel_values is not None:
            try:
                self._attach_images(seq)
            except Exception as exc:  # a bad image fails its own request only
                log.exception("vision tower failed")
                error = f"image processing failed: {exc}"
        if error:
            events: list = []
            self._finish(seq, "error", events, error=error)
            self._deliver(events)
            return
        for fork in seq.forks:  # should a fork prefill on its own after all (no free slot), it needs these too
            fork.cache_keys, fork.image_spans, fork.image_embeds = seq.cache_keys, seq.image_spans, seq.image_embeds
        self.scheduler.add(seq)

    def _attach_images(self, seq: Sequence) -> None:
        """Run the vision tower once at admission; mark each image block for the mask and the prefix cache."""
        spans = token_runs(seq.prompt_ids, self.image_token_id)
        keys = seq.request.crop_keys
        if len(spans) != len(keys):
            raise ValueError(f"{len(spans)} image blocks in the prompt but {len(keys)} crops")
        seq.image_spans = tuple(spans)
        seq.image_embeds = self.runner.image_features(seq.request.pixel_values)
        for (start, end), key in zip(spans, keys):
            seq.cache_keys[start:end] = [-1 - key % 2**62] * (end - start)

    def _step(self) -> None:
        step = self.scheduler.schedule(time.perf_counter())
        events: list[tuple[object, TokenEvent]] = []
        try:
            logits = self.runner.forward(step.prefills, step.decodes)[:, : self.vocab_limit]
            self._prompt_logprobs(step)
            sampled = step.sampled
            logits, sampled = self._fork(logits, sampled)
            logits = self.grammar_masks.apply(logits, [seq.matcher for seq in sampled])
            tokens, logprobs = sample_with_logprobs(logits, sampled, self.eos_token_ids)
        except Exception as exc:  # the culprits fail alone; the engine keeps serving
            log.exception("engine step failed")
            # a new prompt (huge, or with a bad image) is the likely cause: fail the prefills and let the
            # decodes run again next step (rewriting their KV entry is harmless); a decode-only step that
            # failed has no better suspect than all of it
            for seq in step.prefill_owners or step.decode_owners:
                self._finish(seq, "error", events, error=f"engine step failed: {exc}", cache_valid=False)
            self._deliver(events)
            return
        step.advance()
        self.steps += 1
        now = time.perf_counter()
        for seq, token, entry in zip(sampled, tokens, logprobs):
            self._on_token(seq, token, entry, now, events)
        self._deliver(events)

    def _prompt_logprobs(self, step) -> None:
        """Add each flagged prefill chunk's prompt logprobs to its sequence: the hidden state at position p
        predicts prompt token p + 1 (the chunk's last position predicts the next chunk's first token, or,
        on the last chunk, the first output token: that one is sampled, not reported here)."""
        size = self.runner.row_buckets[-1]
        for seq, item in zip(step.prefill_owners, step.prefills):
            if item.hidden is None:
                continue
            if item.start == 0:
                seq.prompt_logprobs = [None]  # the first token has nothing before it
            targets = seq.prompt_ids[item.start + 1 : item.start + len(item.token_ids) + 1]
            top = seq.sampling.prompt_logprobs
            for lo in range(0, len(targets), size):  # a slice at a time: a chunk's full logits would be large
                logits = self.runner.logits_of(item.hidden[lo : lo + size])[:, : self.vocab_limit]
                part = targets[lo : lo + size]
                seq.prompt_logprobs += token_logprobs(logits, part, [top] * len(part))
            item.hidden = None

    def _fork(self, logits: torch.Tensor, sampled: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Choices 1..n-1 of a request whose prompt just finished prefilling: copy its KV into their slots
        and give them its logits row to sample from, each with its own randomness."""
        rows, children = [], []
        for row, seq in enumerate(sampled):
            if seq.forks:
                for child in self.scheduler.fork(seq, time.perf_counter()):
                    self.runner.cache.copy_slot(seq.slot, child.slot)
                    child.prompt_logprobs = seq.prompt_logprobs
                    rows.append(row)
                    children.append(child)
        if not children:
            return logits, sampled
        return torch.cat((logits, logits[rows])), sampled + children

    def _on_token(self, seq: Sequence, token: int, logprobs, now: float, events: list) -> None:
        first = not seq.output_ids
        error = None
        if seq.sampling.max_tokens == 0:  # only the prompt's logprobs were wanted (`echo`): drop the sampled token
            token = logprobs = None
            text, finish = "", "length"
        else:
            seq.output_ids.append(token)
            if self._ends_turn(seq, token):
                logprobs = None  # the stop token is not part of the output, nor of its logprobs
            text, finish, error = self._outcome(seq, token)
        event = self._event(seq, token, text, now, finish, error)
        if logprobs is not None:
            event.logprob, event.top_logprobs = logprobs
        if first:
            event.scheduled_time = seq.scheduled_time
            event.prompt_logprobs = seq.prompt_logprobs
        events.append((seq.sink, event))
        if finish:
            self.scheduler.finish(seq)

    def _ends_turn(self, seq: Sequence, token: int) -> bool:
        return token in self.eos_token_ids and not seq.sampling.ignore_eos

    def _outcome(self, seq: Sequence, token: int) -> tuple[str, str | None, str | None]:
        """(the text `token` completes, the finish reason if it ends the sequence, an error) once appended."""
        params: SamplingParams = seq.sampling
        # a document closed early to fit its token budget ends as the budget would have ended it
        done = "length" if seq.matcher is not None and seq.matcher.cut_short else "stop"
        if self._ends_turn(seq, token):
            return seq.stopper.flush(), done, None
        text, stopped = seq.stopper.feed(seq.detokenizer.push(token))
        if stopped:
            return text, "stop", None
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            return "", "error", f"the grammar rejected token {token}: {seq.matcher.get_error()}"
        if seq.matcher is not None and seq.matcher.is_stopped():  # the document is complete
            return text + seq.stopper.flush(), done, None
        if len(seq.output_ids) >= params.max_tokens or seq.num_computed + 1 >= self.max_model_len:
            return text + seq.stopper.flush(), "length", None
        return text, None, None

    def _event(self, seq: Sequence, token, text: str, now: float, finish, error: str | None = None) -> TokenEvent:
        return TokenEvent(
            request_id=seq.request_id,
            token_id=token,
            text=text,
            timestamp=now,
            finish_reason=finish,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_cached,
            error=error,
            index=seq.index,
        )

    def _finish(self, seq: Sequence, reason: str, events: list, error: str | None = None, cache_valid: bool = True) -> None:
        self.scheduler.finish(seq, cache_valid)
        events.append((seq.sink, self._event(seq, None, "", time.perf_counter(), reason, error)))
        for fork in seq.forks:  # choices that never started end with the one they were waiting for
            self._finish(fork, reason, events, error)
        seq.forks = []

    def _fail_all(self, reason: str, finish: str = "error") -> None:
        events: list = []
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            self._finish(seq, finish, events, error=reason)
        self._deliver(events)

    def _deliver(self, events: list[tuple[object, TokenEvent]]) -> None:
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, events)

    # ---- warm-up ----------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Run every step shape once before serving (each token-count bucket, each logits-row bucket,
        both sampling paths, on a GPU every static decode bucket's CUDA graph): the first user request must not
        pay for kernel compilation."""
        runner = self.runner
        for size in runner.token_buckets:
            runner.forward([StepItem(0, [0] * min(size, self.max_model_len), 0)], [])
        for rows in runner.row_buckets:
            logits = runner.forward([], [StepItem(slot % runner.cache.num_slots, [0], 0) for slot in range(rows)])
        runner.capture_decode_graphs()
        rows = [
            PlainRow(SamplingParams(max_tokens=1, temperature=0.0), RowRandom(0)),
            PlainRow(
                SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.1, logprobs=5),
                RowRandom(1),
            ),
        ]
        sample_with_logprobs(logits[:1].repeat(2, 1), rows, self.eos_token_ids)
        if runner.device.type != "cpu":  # a GPU's mask kernel compiles on its first call: pay that before ready
            try:
                self.grammar_masks.apply(logits[:1, : self.vocab_limit].clone(), [self.grammars.json_object().matcher()])
            except StructuredOutputUnavailable:
                pass  # logged by _build_grammars; the server serves without structured output

    def _build_grammars(self, tokenizer, eos_token_ids: list[int], device: torch.device) -> GrammarCompiler:
        """The grammar compiler (seconds of one core: the vocabulary's token trie). It runs beside warm-up and
        serving: on a CPU the server is ready without it, and a structured request in the first seconds waits for
        it (off the event loop). The CPU mask kernel is warmed here too; a GPU's is warmed on the engine thread,
        which owns the device (`warm_up`)."""
        try:
            compiler = GrammarCompiler(tokenizer, eos_token_ids)
            if device.type == "cpu":
                self.grammar_masks.apply(torch.zeros(1, self.vocab_limit), [compiler.json_object().matcher()])
        except Exception as exc:  # a tokenizer llguidance cannot read (e.g. a stand-in): serve without it
            log.warning("structured output is unavailable for this tokenizer: %s", exc)
            raise
        return compiler


class Submission:
    """One request's events as an async iterator, and its place in the engine until closed.

    A class, not an async generator: closing must free the place even if iteration never started.
    A request that runs past its total time, or waits too long for its next event, ends with a last
    event of finish_reason `timeout` (and is cancelled in the engine).
    """

    def __init__(self, engine: Engine, request: GenerationRequest, timeout: float = 0.0, idle_timeout: float = 0.0):
        self.engine = engine
        self.request = request
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.unfinished = request.n
        """Choices still generating: the submission ends with the last one's last event."""
        self.finished = False
        self.closed = False
        self.deadline = request.arrival_time + timeout if timeout else None
        self.idle_timeout = idle_timeout or None

    def __aiter__(self) -> "Submission":
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        limit, wait = "idle", self.idle_timeout  # whichever limit comes first is the one armed
        if self.deadline is not None:
            left = self.deadline - time.perf_counter()
            if wait is None or left < wait:
                limit, wait = "total", left
        if not self.events.empty():
            event = self.events.get_nowait()
        elif wait is None:
            event = await self.events.get()
        else:
            try:
                event = await asyncio.wait_for(self.events.get(), max(wait, 0.0))
            except TimeoutError:
                event = self._timed_out(limit)
                self.engine.cancel(self.request.request_id)
                self.unfinished = 1  # the timeout ends every choice
        self.engine.observer.on_event(self.request, event)
        if event.finish_reason is not None:
            self.unfinished -= 1
            if not self.unfinished:
                self.finished = True
                self.close()
        return event

    def _timed_out(self, limit: str) -> TokenEvent:
        why = (
            f"the request ran past the server's request timeout ({self.deadline - self.request.arrival_time:g} s)"
            if limit == "total" else f"no token for {self.idle_timeout:g} s (the server's idle timeout)"
        )
        return TokenEvent(self.request.request_id, None, "", time.perf_counter(), "timeout", error=why)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.in_flight -= self.request.n
        if not self.finished:
            self.engine.cancel(self.request.request_id)
        self.engine.observer.on_close(self.request, cancelled=not self.finished)

    async def __aenter__(self) -> "Submission":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def token_runs(ids: list[int], token: int | None) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS when the engine goes idle: each step's logits and
    activations come in many sizes, and glibc would otherwise keep the high-water mark for good."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def slots_within_budget(loaded: LoadedModel, max_num_seqs: int, max_model_len: int, kv_cache_gib: float) -> int:
    """All of the KV cache is allocated once at start, so memory never grows with traffic."""
    if not kv_cache_gib:
        return max_num_seqs
    per_slot = KVCache.bytes_per_slot(loaded.text_config, max_model_len, loaded.dtype)
    slots = int(kv_cache_gib * 2**30 // per_slot)
    if slots < 1:
        raise ValueError(
            f"kv_cache_gib={kv_cache_gib} cannot hold one sequence of max_model_len={max_model_len} "
            f"({per_slot / 2**30:.3f} GiB); raise it or lower max_model_len"
        )
    return min(slots, max_num_seqs)


def _in_background(build, *args) -> Future:
    """Run `build(*args)` on its own thread; the Future holds its result (or its exception)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="oai-gemma-build")
    future = pool.submit(build, *args)
    pool.shutdown(wait=False)
    return future


def _put_all(events: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for sink, event in events:
        sink.put_nowait(event)
