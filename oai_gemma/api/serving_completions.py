"""`/v1/completions`: the legacy text-completions endpoint (LangChain's `OpenAI`, lm-eval-harness, scripts).

A prompt is raw text (or token ids) continued as is, with `<bos>` first: no chat template. Each prompt is
one engine request (with `n` choices: choice k of prompt p has index p * n + k), all admitted together in one
submission; they run concurrently and their events make one `text_completion` whose choices are in that order,
or one SSE stream whose chunks carry each choice's `index`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..chat import Prompt
from ..engine.submission import Submission
from ..engine.types import GenerationRequest, TokenEvent
from .choices import ChoiceAssembler, ChoiceDelta, Finish, TextDelta, assemble
from .errors import APIError, generation_failure, invalid_request, over_limit
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
from .plan import GenerationPlan
from .sampling import choice_count, completion_budget
from .exchange import Exchange
from .serving import DONE, OpenAIServing, sse, sse_error

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy endpoint (chat's is the server's `default_max_tokens`)."""
LOWEST_LOGPROB = -9999.0
"""What OpenAI (and vLLM) send instead of -inf, which JSON cannot carry."""


@dataclass(frozen=True)
class PlannedPrompt:
    index: int
    prompt_text: str
    """What `echo` puts before the completion: the prompt string, or the token ids decoded."""
    prompt_ids: list[int]
    bos_added: bool
    """The server put `<bos>` before a text prompt: the echoed text does not hold it."""
    generation: GenerationRequest | None
    """None for `echo` with `max_tokens: 0`: the prompt comes back, nothing is generated."""


@dataclass(frozen=True)
class PreparedCompletion:
    request: CompletionRequest
    id: str
    created: int
    prompts: list[PlannedPrompt]
    n: int
    """Choices per prompt."""


@dataclass
class ChoiceOutput:
    """One choice: its prompt, its assembler (None when nothing is generated) and where its next token's text
    starts in the choice's text (`text_offset`)."""

    plan: PlannedPrompt
    index: int
    assembler: ChoiceAssembler | None
    offset: int = 0

    @property
    def finish_reason(self) -> str | None:
        if self.assembler is None:
            return "length"  # echo with max_tokens 0: the budget of 0 tokens is used up
        return self.assembler.finish_reason


class CompletionService(OpenAIServing):
    unsupported_why = {"suffix": "`suffix` is not supported: Gemma-3 has no fill-in-the-middle mode; leave it unset"}

    # ---- request -> engine ------------------------------------------------------------------------

    async def prepare(self, body: bytes, arrival: float, cache_scope: str = "") -> PreparedCompletion:
        request: CompletionRequest = self.decode(completion_decoder, body)
        if request.max_tokens == 0 and not request.echo:
            raise over_limit("max_tokens", "min", 1, 0, " (0 only with `echo: true`)")
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = choice_count(request.n, self.engine.num_slots)  # checked first, generating or not (echo only)
        prompts = []
        for index, (text, ids, bos_added) in enumerate(await self._prompts(request.prompt)):
            generation = await self._generation(request, ids, f"{rid}-{index}", arrival, cache_scope)
            prompts.append(PlannedPrompt(index, text, ids, bos_added, generation))
        return PreparedCompletion(request, rid, int(time.time()), prompts, n)

    async def _prompts(self, prompt: str | list) -> list[tuple[str, list[int], bool]]:
        """(text, token ids, whether `<bos>` was added) per prompt; text is tokenized with `<bos>` first, token ids
        are taken as they are."""
        if isinstance(prompt, str):
            prompt = [prompt]
        kinds = {type(item) for item in prompt}
        if len(kinds) > 1:
            raise invalid_request(
                "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                "not a mix", "prompt",
            )
        if kinds == {str}:
            return [(text, await self.encode(text, "prompt", add_special_tokens=True), True) for text in prompt]
        lists = [prompt] if kinds == {int} else prompt
        for j, ids in enumerate(lists):
            self.check_token_ids(ids, "prompt" if kinds == {int} else f"prompt[{j}]")
        return [(self.engine.tokenizer.decode(ids), list(ids), False) for ids in lists]

    async def _generation(
        self, request: CompletionRequest, ids: list[int], rid: str, arrival: float, cache_scope: str
    ) -> GenerationRequest | None:
        prompt_logprobs = request.logprobs if request.echo else None
        if request.max_tokens == 0 and prompt_logprobs is None:  # the prompt back, nothing to run (if it fits)
            completion_budget(len(ids), 0, DEFAULT_MAX_TOKENS, self.max_model_len, "prompt")
            return None
        plan = GenerationPlan(
            rid, Prompt(ids), request, arrival, request.max_tokens, DEFAULT_MAX_TOKENS, "prompt",
            logprobs=request.logprobs, prompt_logprobs=prompt_logprobs, n=request.n, cache_scope=cache_scope,
            adapter=self.adapter_of(request.model),
        )  # max_tokens 0 with echo and logprobs: the engine still runs the prompt, for its logprobs
        return await self.generation(plan)

    def _submit(self, prepared: PreparedCompletion) -> Submission:
        """Every generating prompt in one admission: all its places or none (a 429 or 503)."""
        return self.submit(*(p.generation for p in prepared.prompts if p.generation is not None))

    def _outputs(self, prepared: PreparedCompletion, lead: bool = False) -> list[ChoiceOutput]:
        """Every choice, in index order: n per prompt; with `echo`, each one's text starts with its prompt's
        (`lead`: the assembler sends it with the first event, as a stream waiting for the prompt's logprobs does)."""
        request, outputs = prepared.request, []
        for prompt in prepared.prompts:
            for k in range(prepared.n):
                assembler = None
                if prompt.generation is not None:
                    assembler = ChoiceAssembler(
                        prompt.index * prepared.n + k, logprobs=request.logprobs is not None,
                        lead=prompt.prompt_text if lead and request.echo else "",
                    )
                offset = len(prompt.prompt_text) if request.echo else 0
                outputs.append(ChoiceOutput(prompt, prompt.index * prepared.n + k, assembler, offset))
        return outputs

    # ---- engine -> response -----------------------------------------------------------------------

    async def complete(self, prepared: PreparedCompletion, exchange: Exchange) -> bytes:
        outputs = self._outputs(prepared)
        assemblers = {o.index: o.assembler for o in outputs if o.assembler is not None}
        async with self._submit(prepared) as submission:
            async for _ in assemble(by_choice(prepared, submission), assemblers):
                pass
        if not all(a.done for a in assemblers.values()):
            raise generation_failure(None)
        echo = prepared.request.echo
        choices = [
            CompletionChoice(
                o.index, (o.plan.prompt_text if echo else "") + (o.assembler.text if o.assembler else ""),
                self._logprobs(o, prepared, o.assembler.tokens if o.assembler else ()), o.finish_reason,
            )
            for o in outputs
        ]
        response = Completion(prepared.id, prepared.created, prepared.request.model, choices, usage=_usage(prepared, outputs))
        return encoder.encode(response)

    def stream(self, prepared: PreparedCompletion, exchange: Exchange) -> AsyncIterator[bytes]:
        """Takes every prompt's place in the engine now (a 429 or 503 before the status line), held by the exchange
        until the stream ends; then the stream's chunks."""
        submission = self._submit(prepared)
        exchange.hold(submission)
        return self._stream(prepared, submission)

    async def _stream(self, prepared: PreparedCompletion, submission: Submission) -> AsyncIterator[bytes]:
        """A chunk per event that brings text or an end; with `echo`, the prompt first (or, with logprobs, with
        the choice's first event, which brings the prompt's logprobs)."""
        request = prepared.request
        waits = request.logprobs is not None  # an echo waits for its prompt's logprobs
        outputs = self._outputs(prepared, lead=waits)
        for output in outputs:
            if request.echo and (output.assembler is None or not waits):
                yield self._chunk(prepared, CompletionChoice(output.index, output.plan.prompt_text, None, output.finish_reason))
        by_index = {o.index: o for o in outputs}
        assemblers = {o.index: o.assembler for o in outputs if o.assembler is not None}
        async with submission:
            try:
                async for assembler, deltas in assemble(by_choice(prepared, submission), assemblers):
                    choice = self._stream_choice(by_index[assembler.index], deltas, prepared)
                    if choice is not None:
                        yield self._chunk(prepared, choice)
            except APIError as exc:
                yield sse_error(exc)
                return
        if request.stream_options and request.stream_options.include_usage:
            yield self._chunk(prepared, usage=_usage(prepared, outputs))
        yield DONE

    def _stream_choice(self, output: ChoiceOutput, deltas: list[ChoiceDelta], prepared) -> CompletionChoice | None:
        """One event's deltas as one chunk's choice: its text, the logprobs of its tokens, its finish reason."""
        text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
        finish = next((d.reason for d in deltas if isinstance(d, Finish)), None)
        if not text and finish is None:
            return None
        tokens = [token for d in deltas for token in d.tokens]
        return CompletionChoice(output.index, text, self._logprobs(output, prepared, tokens), finish)

    def _chunk(self, prepared: PreparedCompletion, *choices: CompletionChoice, **usage) -> bytes:
        return sse(Completion(prepared.id, prepared.created, prepared.request.model, list(choices), **usage))

    def _logprobs(self, output: ChoiceOutput, prepared: PreparedCompletion, events) -> CompletionLogprobs | None:
        """The legacy logprobs of `events` (stop tokens carry none); with `echo`, the prompt's tokens come first
        (the very first with null logprobs: nothing precedes it).

        Each token's `top_logprobs` holds the `logprobs` most likely tokens and the chosen one, as OpenAI's."""
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


async def by_choice(prepared: PreparedCompletion, submission: Submission) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The submission's events, each with its choice index: choice k of prompt p is p * n + k."""
    prompt_index = {p.generation.request_id: p.index for p in prepared.prompts if p.generation is not None}
    async for event in submission:
        yield prompt_index[event.request_id] * prepared.n + event.index, event


def _usage(prepared: PreparedCompletion, outputs: list[ChoiceOutput]) -> Usage:
    """Each prompt counted once, however many choices it has; completion tokens add up over every choice."""
    lasts = [(o.index, o.assembler.last) for o in outputs if o.assembler is not None and o.assembler.last is not None]
    prompt = sum(len(p.prompt_ids) for p in prepared.prompts)
    completion = sum(last.num_output_tokens for _, last in lasts)
    cached = sum(last.num_cached_tokens for index, last in lasts if index % prepared.n == 0)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))
