"""One choice's token events -> deltas, the same for every wire format and for stream and non-stream.

    engine TokenEvents --ChoiceAssembler.feed--> [TextDelta | ToolCallStart | ToolCallArguments | Finish]
        streaming:     each route's encoder sends the deltas as they come (chat chunks, completions chunks,
                       Responses events)
        non-streaming: `ChoiceAssembler.text` / `.tool_calls` / `.tokens` / `.finish_reason`, folded as it went

Every delta carries `tokens`: the events whose logprobs are reported with it (empty unless logprobs were asked
for), so a token's logprob goes out with the first delta at or after it. An event whose text is held back (a
possible tool call) adds its token to the next delta.

`assemble(events, assemblers)` drives several choices (`n`) from one event stream: it feeds each event to its
choice, yields what came out, stops once every choice is done (which cancels what the engine would still
generate: text after complete calls is dropped), and raises the `APIError` of a choice that failed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..chat.tool_parser import ParsedCall
from ..chat.tool_stream import CallDelta, ToolCallStream
from ..chat.tools import ToolPlan
from ..engine.types import TokenEvent
from .errors import generation_failure

FINISHED = ("stop", "length")
"""A choice that ended with one of these succeeded."""


@dataclass(frozen=True)
class TextDelta:
    """Answer text (content), in order."""

    text: str
    tokens: tuple[TokenEvent, ...] = ()


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its position among the answer's calls, a fresh call id, the function's name."""

    call: int
    id: str
    name: str
    tokens: tuple[TokenEvent, ...] = ()


@dataclass(frozen=True)
class ToolCallArguments:
    """The next fragment of call `call`'s arguments JSON."""

    call: int
    arguments: str
    tokens: tuple[TokenEvent, ...] = ()


@dataclass(frozen=True)
class Finish:
    """The choice is over: OpenAI's `finish_reason` (`stop`, `length`, `tool_calls`). Always its last delta."""

    reason: str
    tokens: tuple[TokenEvent, ...] = ()


ChoiceDelta = TextDelta | ToolCallStart | ToolCallArguments | Finish


@dataclass
class ChoiceAssembler:
    """One choice of one request: `feed` each of its events, get the deltas to send.

    `tools`: the request's tool plan (calls are recognised in the answer), or None for text only; `logprobs`:
    keep each event in a delta's `tokens`; `lead`: text sent with the first event whatever it holds (a streamed
    completions `echo` that waits for the prompt's logprobs).
    """

    index: int
    tools: ToolPlan | None = None
    logprobs: bool = False
    lead: str = ""
    finish_reason: str | None = None
    """Set with the `Finish` delta."""
    last: TokenEvent | None = None
    """The event the choice ended with (its token counts are the usage's)."""
    failure: TokenEvent | None = None
    """The event that ended the choice without `stop` or `length` (a timeout, an error, a shutdown)."""
    text_parts: list[str] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    """Every event of the choice, when logprobs were asked for."""
    _held: list[TokenEvent] = field(default_factory=list)
    _calls: ToolCallStream | None = None

    def __post_init__(self) -> None:
        self._calls = self.tools.stream() if self.tools is not None else None

    @property
    def done(self) -> bool:
        """Finished or failed: later events of the choice are dropped."""
        return self.finish_reason is not None or self.failure is not None

    @property
    def text(self) -> str:
        """The content so far (None-free; a called answer's content is not sent)."""
        return "".join(self.text_parts)

    @property
    def tool_calls(self) -> list[ParsedCall] | None:
        """The answer's calls once it ended as calls, else None (the answer is text)."""
        return self._calls.calls if self._calls is not None and self._calls.done else None

    def feed(self, event: TokenEvent) -> list[ChoiceDelta]:
        if self.done:
            return []
        if self.logprobs:
            self._held.append(event)
            self.tokens.append(event)
        deltas = [delta for piece in self._pieces(event) for delta in self._deltas(piece)]
        reason = self._end(event)
        if reason is not None:
            self.finish_reason, self.last = reason, event
            deltas.append(Finish(reason, self._take()))
        return deltas

    def _pieces(self, event: TokenEvent) -> list[str | CallDelta]:
        text = event.text
        if self.lead:
            text, self.lead = self.lead + text, ""
            if self._calls is None:
                return [text]
        if self._calls is None:
            return [text] if text else []
        pieces = self._calls.feed(text)
        if event.finish_reason in FINISHED and not self._calls.done:
            pieces += self._calls.finish()  # the end: held-back text is content, a call cut short stays a call
        return pieces

    def _end(self, event: TokenEvent) -> str | None:
        """The choice's finish reason if this event ends it; a failure is recorded instead."""
        if self._calls is not None and self._calls.done:
            return self.tools.finish_reason(self._calls, event.finish_reason)
        if event.finish_reason is not None and event.finish_reason not in FINISHED:
            self.failure = self.last = event
            return None
        return event.finish_reason

    def _deltas(self, piece: str | CallDelta) -> list[ChoiceDelta]:
        """A call's first piece is its start, then (if it holds any) its first arguments."""
        if isinstance(piece, str):
            self.text_parts.append(piece)
            return [TextDelta(piece, self._take())]
        deltas: list[ChoiceDelta] = []
        if piece.name is not None:
            deltas.append(ToolCallStart(piece.index, call_id(), piece.name, self._take()))
        if piece.arguments:
            deltas.append(ToolCallArguments(piece.index, piece.arguments, self._take()))
        return deltas

    def _take(self) -> tuple[TokenEvent, ...]:
        held, self._held = tuple(self._held), []
        return held


async def assemble(
    events: AsyncIterator[tuple[int, TokenEvent]], assemblers: dict[int, ChoiceAssembler]
) -> AsyncIterator[tuple[ChoiceAssembler, list[ChoiceDelta]]]:
    """Each (choice key, event) fed to its assembler; yields (assembler, deltas) for every event, stops once every
    choice is done, raises the failing choice's `APIError` after its last deltas (closing `events` is the
    caller's: that cancels what the engine would still generate)."""
    async for key, event in events:
        assembler = assemblers[key]
        yield assembler, assembler.feed(event)
        if assembler.failure is not None:
            raise generation_failure(assembler.failure)
        if all(a.done for a in assemblers.values()):
            return


async def indexed(events: AsyncIterator[TokenEvent]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """One submission's events keyed by their choice index (for `assemble`)."""
    async for event in events:
        yield event.index, event


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
