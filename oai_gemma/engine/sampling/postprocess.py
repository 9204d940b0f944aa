"""After sampling: each sampled token becomes its sequence's next TokenEvent, and ends it when it should.

One function, as nano-vllm's `postprocess`: append the token, turn it into text (incremental detokenizer,
stop strings), advance the grammar, check the end conditions (stop token, stop string, complete document,
max_tokens, context), and say which sequences finished: the engine core has the scheduler free their slots
(sampling/ knows nothing of the scheduler, as in vLLM v1, where the core hands the output to the scheduler).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..sequence import Sequence
from ..speculative.prediction import prediction_counts
from ..types import TokenEvent, completion_room

Events = list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]
"""(the sequence's sink, its event): what a step hands to the event loop."""


@dataclass(frozen=True)
class Limits:
    eos_token_ids: frozenset[int]
    max_model_len: int


def postprocess(limits: Limits, sampled: list[Sequence], runs, now: float) -> tuple[Events, list[Sequence]]:
    """(The events of one step's tokens, the sequences they finished): `runs[i]` holds sequence `sampled[i]`'s
    (token, logprob entry, accepted draft) in order, several when drafts were accepted (speculative/verify.py); a
    sequence's tokens after the one that ends it are dropped. The caller frees the finished sequences' slots."""
    events: Events = []
    finished: list[Sequence] = []
    for seq, run in zip(sampled, runs):
        for token, entry, drafted in run:
            event = _event(limits, seq, token, entry, now)
            event.drafted = drafted
            events.append((seq.sink, event))
            if event.finish_reason:
                finished.append(seq)
                break
    return events, finished


def _event(limits: Limits, seq: Sequence, token: int, entry, now: float) -> TokenEvent:
    first = not seq.output_ids
    error = None
    if seq.sampling.max_tokens == 0:  # only the prompt's logprobs were wanted (`echo`): drop the sampled token
        token = entry = None
        text, finish = "", "length"
    else:
        seq.output_ids.append(token)
        if _ends_turn(limits, seq, token):
            entry = None  # the stop token is not part of the output, nor of its logprobs
        text, finish, error = _outcome(limits, seq, token)
    event = make_event(seq, token, text, now, finish, error)
    if entry is not None:
        event.logprob, event.top_logprobs = entry
    if first:
        event.scheduled_time = seq.scheduled_time
        event.prompt_logprobs = seq.prompt_logprobs
    return event


def _ends_turn(limits: Limits, seq: Sequence, token: int) -> bool:
    return token in limits.eos_token_ids and not seq.sampling.ignore_eos


def _outcome(limits: Limits, seq: Sequence, token: int) -> tuple[str, str | None, str | None]:
    """(the text `token` completes, the finish reason if it ends the sequence, an error) once appended."""
    # a document closed early to fit its token budget ends as the budget would have ended it
    done = "length" if seq.matcher is not None and seq.matcher.cut_short else "stop"
    if _ends_turn(limits, seq, token):
        failure = seq.matcher.failure() if seq.matcher is not None else None
        if failure is not None:  # the end was all a failed grammar allowed: not a document
            return "", "invalid_grammar", f"the requested JSON schema cannot be followed: {failure}"
        return seq.stopper.flush(), done, None
    text, stopped = seq.stopper.feed(seq.detokenizer.push(token))
    if stopped:
        return text, "stop", None
    if seq.matcher is not None and not seq.matcher.consume_token(token):
        return "", "error", f"the grammar rejected token {token}: {seq.matcher.get_error()}"
    if seq.matcher is not None and seq.matcher.is_stopped():  # the document is complete
        return text + seq.stopper.flush(), done, None
    if len(seq.output_ids) >= seq.sampling.max_tokens or completion_room(limits.max_model_len, len(seq.prompt_ids) + len(seq.output_ids)) < 1:
        return text + seq.stopper.flush(), "length", None
    return text, None, None


def make_event(seq: Sequence, token, text: str, now: float, finish, error: str | None = None) -> TokenEvent:
    prediction = seq.request.prediction
    accepted, rejected = prediction_counts(prediction, seq.output_ids) if prediction and finish else (0, 0)
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
        accepted_prediction_tokens=accepted,
        rejected_prediction_tokens=rejected,
    )


def last_events(seq: Sequence, reason: str, error: str | None = None) -> list[tuple[Sequence, TokenEvent]]:
    """A sequence ended outside the token path (cancelled, failed, aborted): its last event, then those of its
    request's choices that never started (ParentRequest.pending), which end with the one they waited for. The
    caller frees each sequence's slot and delivers each event."""
    ended = [(seq, make_event(seq, None, "", time.perf_counter(), reason, error))]
    for child in seq.parent.take_pending() if seq.parent is not None else ():
        ended += last_events(child, reason, error)
    return ended
