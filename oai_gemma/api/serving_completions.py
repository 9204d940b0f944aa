"""`/v1/completions`: the legacy text-completions endpoint (LangChain's `OpenAI`, lm-eval-harness, scripts).

A prompt is raw text (or token ids) continued as is, with `<bos>` first: no chat template. Each prompt is
one engine submission (with `n` choices: choice k of prompt p has index p * n + k); they run concurrently and
their events are merged into one `text_completion` whose choices are in that order, or into one SSE stream
whose chunks carry each choice's `index`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from ..engine.engine import EngineBusyError, EngineDeadError, Submission
from ..engine.types import GenerationRequest, TokenEvent
from .errors import decode_body, invalid_request, model_not_found, not_supported
from .protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
    completion_decoder,
    encoder,
)
from .sampling import choice_count, completion_budget, sampling_params
from .serving_chat import DONE, FINISHED, ChatService, busy, generation_failure, sse, unavailable

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy endpoint (chat's is the server's `default_max_tokens`)."""
LOWEST_LOGPROB = -9999.0
"""What OpenAI (and vLLM) send instead of -inf, which JSON cannot carry."""


@dataclass
class PlannedPrompt:
    index: int
    prompt_text: str
    """What `echo` puts before the completion: the prompt string, or the token ids decoded."""
    prompt_ids: list[int]
    bos_added: bool
    """The server put `<bos>` before a text prompt: the echoed text does not hold it."""
    generation: GenerationRequest | None
    """None for `echo` with `max_tokens: 0`: the prompt comes back, nothing is generated."""


@dataclass
class PreparedCompletion:
    request: CompletionRequest
    id: str
    created: int
    prompts: list[PlannedPrompt]
    n: int
    """Choices per prompt."""


@dataclass
class ChoiceOutput:
    """One choice as it is produced: its text so far, and the tokens whose logprobs are not reported yet."""

    plan: PlannedPrompt
    index: int
    pieces: list[str] = field(default_factory=list)
    pending: list[TokenEvent] = field(default_factory=list)
    offset: int = 0
    """`text_offset` of the next token: where its text starts in the choice's text."""
    last: TokenEvent | None = None
    echo_pending: bool = False
    """A stream's echo waits for the prompt's logprobs, which come with the choice's first event."""


class CompletionService:
    def __init__(self, chat: ChatService):
        self.chat = chat
        self.engine = chat.engine

    # ---- request -> engine ------------------------------------------------------------------------

    async def prepare(self, body: bytes, arrival: float) -> PreparedCompletion:
        request: CompletionRequest = decode_body(completion_decoder, body)
        if request.model != self.chat.served_name:
            raise model_not_found(request.model, self.chat.served_name)
        unsupported = request.unsupported_parameter()
        if unsupported == "suffix":
            raise invalid_request(
                "`suffix` is not supported: Gemma-3 has no fill-in-the-middle mode; leave it unset",
                "suffix", "unsupported_parameter",
            )
        if unsupported:
            raise not_supported(unsupported)
        if request.stream_options is not None and not request.stream:
            raise invalid_request("`stream_options` is only allowed when `stream` is true", "stream_options")
        if request.max_tokens == 0 and not request.echo:
            raise invalid_request("`max_tokens` must be at least 1 (0 only with `echo: true`)", "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = choice_count(request.n, self.engine.num_slots)
        prompts = []
        for index, (text, ids, bos_added) in enumerate(await self._prompts(request.prompt)):
            generation = self._generation(request, ids, f"{rid}-{index}", arrival, n)
            prompts.append(PlannedPrompt(index, text, ids, bos_added, generation))
        self._check_capacity(n * sum(p.generation is not None for p in prompts))
        return PreparedCompletion(request, rid, int(time.time()), prompts, n)

    async def _prompts(self, prompt: str | list) -> list[tuple[str, list[int], bool]]:
        """(text, token ids, whether `<bos>` was added) per prompt; text is tokenized with `<bos>` first, token ids
        are taken as they are."""
        if isinstance(prompt, str):
            return [(prompt, await self.chat.encode_prompt(prompt, "prompt", add_special_tokens=True), True)]
        kinds = {type(item) for item in prompt}
        if len(kinds) > 1:
            raise invalid_request(
                "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                "not a mix", "prompt",
            )
        if kinds == {str}:
            return [(text, await self.chat.encode_prompt(text, "prompt", add_special_tokens=True), True) for text in prompt]
        lists = [prompt] if kinds == {int} else prompt
        for ids in lists:
            bad = next((t for t in ids if not 0 <= t < self.engine.vocab_limit), None)  # -1 would fail the whole step
            if bad is not None:
                raise invalid_request(
                    f"token id {bad} in `prompt` is outside the vocabulary (0 to {self.engine.vocab_limit - 1})",
                    "prompt", "invalid_token_id",
                )
        return [(self.engine.tokenizer.decode(ids), list(ids), False) for ids in lists]

    def _generation(
        self, request: CompletionRequest, ids: list[int], rid: str, arrival: float, n: int
    ) -> GenerationRequest | None:
        asked = request.max_tokens
        max_tokens = completion_budget(len(ids), asked, DEFAULT_MAX_TOKENS, self.chat.max_model_len, "prompt")
        prompt_logprobs = request.logprobs if request.echo else None
        if asked == 0:
            if prompt_logprobs is None:
                return None
            max_tokens = 0  # the engine still runs the prompt, for its logprobs
        sampling = sampling_params(request, max_tokens, request.logprobs, self.engine.vocab_limit)
        sampling = dataclasses.replace(sampling, prompt_logprobs=prompt_logprobs)
        return GenerationRequest(rid, ids, sampling, arrival, n=n)

    def _check_capacity(self, submissions: int) -> None:
        """A 429 before the response starts unless every prompt can take its place in the engine now."""
        try:
            self.engine.check_capacity()
        except EngineBusyError as exc:
            raise busy(exc) from None
        except EngineDeadError as exc:
            raise unavailable(exc) from None
        free = self.engine.capacity - self.engine.in_flight
        if submissions > free:
            raise busy(EngineBusyError(f"{submissions} choices but {free} free places in the engine; retry shortly"))

    def _submit(self, prepared: PreparedCompletion) -> dict[int, Submission]:
        """Every generating prompt's submission, all or none."""
        submissions: dict[int, Submission] = {}
        try:
            for prompt in prepared.prompts:
                if prompt.generation is not None:
                    submissions[prompt.index] = self.engine.generate(prompt.generation)
        except BaseException:
            for submission in submissions.values():
                submission.close()
            raise
        return submissions

    # ---- engine -> response -----------------------------------------------------------------------

    async def complete(self, prepared: PreparedCompletion) -> bytes:
        outputs = self._outputs(prepared)
        try:
            submissions = self._submit(prepared)
        except EngineDeadError as exc:
            raise unavailable(exc) from None
        except EngineBusyError as exc:
            raise busy(exc) from None
        async with aclosing(merged(submissions)) as events:
            async for prompt_index, event in events:
                output = outputs[prompt_index * prepared.n + event.index]
                output.pieces.append(event.text)
                output.pending.append(event)
                if event.finish_reason is not None:
                    output.last = event
                    if event.finish_reason not in FINISHED:
                        raise generation_failure(event)
        if any(o.plan.generation is not None and o.last is None for o in outputs):
            raise generation_failure(None)
        choices = [
            CompletionChoice(o.index, "".join(o.pieces), self._logprobs(o, prepared), _finish_reason(o))
            for o in outputs
        ]
        response = Completion(prepared.id, prepared.created, self.chat.served_name, choices, usage=_usage(prepared, outputs))
        return encoder.encode(response)

    async def stream(self, prepared: PreparedCompletion) -> AsyncIterator[bytes]:
        request = prepared.request
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        outputs = self._outputs(prepared)

        def chunk(choices: list[CompletionChoice], **usage) -> bytes:
            return sse(Completion(prepared.id, prepared.created, self.chat.served_name, choices, **usage))

        try:
            submissions = self._submit(prepared)  # takes their places before the first byte
        except (EngineDeadError, EngineBusyError) as exc:
            yield sse(unavailable(exc).body)
            yield DONE
            return
        if request.echo:
            for output in outputs:
                if request.logprobs is None or output.plan.generation is None:
                    yield chunk([CompletionChoice(output.index, output.plan.prompt_text, None, _finish_reason(output))])
                else:
                    output.echo_pending = True
        failed = False
        async with aclosing(merged(submissions)) as events:
            async for prompt_index, event in events:
                output = outputs[prompt_index * prepared.n + event.index]
                output.pending.append(event)
                if event.finish_reason not in (None, *FINISHED):
                    yield sse(generation_failure(event).body)
                    failed = True
                    break
                if event.finish_reason is not None:
                    output.last = event
                text = event.text
                if output.echo_pending:
                    text, output.echo_pending = output.plan.prompt_text + text, False
                if text or event.finish_reason:
                    logprobs = self._logprobs(output, prepared)
                    yield chunk([CompletionChoice(output.index, text, logprobs, event.finish_reason)])
        if include_usage and not failed:
            yield chunk([], usage=_usage(prepared, outputs))
        yield DONE

    def _outputs(self, prepared: PreparedCompletion) -> list[ChoiceOutput]:
        """Every choice, in index order: n per prompt; with `echo`, each starts with its prompt's text."""
        outputs = []
        for prompt in prepared.prompts:
            for k in range(prepared.n):
                output = ChoiceOutput(prompt, prompt.index * prepared.n + k)
                if prepared.request.echo:
                    output.pieces.append(prompt.prompt_text)
                    output.offset = len(prompt.prompt_text)
                outputs.append(output)
        return outputs

    def _logprobs(self, output: ChoiceOutput, prepared: PreparedCompletion) -> CompletionLogprobs | None:
        """The legacy logprobs of the output's pending tokens (stop tokens carry none), which are then reported;
        with `echo`, the prompt's tokens come first (the very first with null logprobs: nothing precedes it).

        Each token's `top_logprobs` holds the `logprobs` most likely tokens and the chosen one, as OpenAI's."""
        events, output.pending = output.pending, []
        if prepared.request.logprobs is None:
            return None
        result = CompletionLogprobs([], [], [], [])
        for event in events:
            if event.prompt_logprobs is not None:
                self._add_prompt(result, output.plan, event.prompt_logprobs)
            if event.logprob is not None:
                output.offset = self._add(result, event.token_id, (event.logprob, event.top_logprobs), output.offset)
        return result

    def _add_prompt(self, result: CompletionLogprobs, plan: PlannedPrompt, entries: list) -> None:
        offset = 0
        for position, (token_id, entry) in enumerate(zip(plan.prompt_ids, entries)):
            end = self._add(result, token_id, entry, offset)
            if not (position == 0 and plan.bos_added):  # text the echo does not hold takes no room in it
                offset = end

    def _add(self, result: CompletionLogprobs, token_id: int, entry, offset: int) -> int:
        """Append one token (`entry`: (logprob, [(id, logprob)]) or None) at `offset`; returns where the next starts."""
        text = self.engine.token_text(token_id)[0]
        result.tokens.append(text)
        result.text_offset.append(offset)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            logprob, top = entry
            chosen = max(logprob, LOWEST_LOGPROB)
            result.token_logprobs.append(chosen)
            result.top_logprobs.append({text: chosen, **{self.engine.token_text(i)[0]: max(lp, LOWEST_LOGPROB) for i, lp in top}})
        return offset + len(text)


async def merged(submissions: dict[int, Submission]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of several submissions as they come, each with its choice index. Closing this iterator
    (the client went away, or a choice failed) closes every submission, which cancels it in the engine."""
    queue: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

    async def pump(index: int, submission: Submission) -> None:
        try:
            async for event in submission:
                queue.put_nowait((index, event))
        finally:
            queue.put_nowait((index, None))  # this one is done, however it ended

    tasks = [asyncio.create_task(pump(index, submission)) for index, submission in submissions.items()]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        for submission in submissions.values():
            submission.close()


def _finish_reason(output: ChoiceOutput) -> str | None:
    if output.plan.generation is None:
        return "length"  # echo with max_tokens 0: the budget of 0 tokens is used up
    return output.last.finish_reason if output.last else None


def _usage(prepared: PreparedCompletion, outputs: list[ChoiceOutput]) -> Usage:
    """Each prompt counted once, however many choices it has; completion tokens add up over every choice."""
    prompt = sum(len(p.prompt_ids) for p in prepared.prompts)
    completion = sum(o.last.num_output_tokens for o in outputs if o.last)
    cached = sum(o.last.num_cached_tokens for o in outputs if o.last and o.index % prepared.n == 0)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))
