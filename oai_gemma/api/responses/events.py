"""The choice assembler's deltas -> the Responses API's output items and stream events.

The third encoder of the same deltas (chat chunks and completions chunks are the others): text opens a
`message` item with one `output_text` part, a tool call start opens a `function_call` item; the events are
the ones OpenAI sends, in its order, numbered from 0:

    response.created, response.in_progress,
      per item: response.output_item.added
        message:       response.content_part.added, response.output_text.delta ..., response.output_text.done,
                       response.content_part.done
        function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete | response.failed

A non-streamed response folds the same deltas and drops the events, so both have the same output.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct
from msgspec.structs import replace

from ..choices import ChoiceDelta, Finish, TextDelta, ToolCallArguments, ToolCallStart
from .protocol import (
    FunctionToolCall,
    OutputItem,
    OutputMessage,
    OutputTextContent,
    Response,
)
from .input import new_id

# ---- the events (wire types) ------------------------------------------------------------------------------


class _Lifecycle(Struct):
    sequence_number: int
    response: Response


class ResponseCreated(_Lifecycle, tag="response.created", tag_field="type"):
    pass


class ResponseInProgress(_Lifecycle, tag="response.in_progress", tag_field="type"):
    pass


class ResponseCompleted(_Lifecycle, tag="response.completed", tag_field="type"):
    pass


class ResponseIncomplete(_Lifecycle, tag="response.incomplete", tag_field="type"):
    pass


class ResponseFailed(_Lifecycle, tag="response.failed", tag_field="type"):
    pass


class _ItemEvent(Struct):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemAdded(_ItemEvent, tag="response.output_item.added", tag_field="type"):
    pass


class OutputItemDone(_ItemEvent, tag="response.output_item.done", tag_field="type"):
    pass


class _PartEvent(Struct):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputTextContent


class ContentPartAdded(_PartEvent, tag="response.content_part.added", tag_field="type"):
    pass


class ContentPartDone(_PartEvent, tag="response.content_part.done", tag_field="type"):
    pass


class OutputTextDelta(Struct, tag="response.output_text.delta", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(Struct, tag="response.output_text.done", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class FunctionCallArgumentsDelta(Struct, tag="response.function_call_arguments.delta", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Struct, tag="response.function_call_arguments.done", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(Struct, tag="error", tag_field="type"):
    sequence_number: int
    code: str | None
    message: str
    param: str | None = None


STREAM_EVENTS = (
    ResponseCreated, ResponseInProgress, ResponseCompleted, ResponseIncomplete, ResponseFailed, OutputItemAdded,
    OutputItemDone, ContentPartAdded, ContentPartDone, OutputTextDelta, OutputTextDone, FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone, ErrorEvent,
)
"""Every event a Responses stream may send (the OpenAPI document lists them)."""



# ---- the encoder ------------------------------------------------------------------------------------------

FINAL_EVENTS = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete, "failed": ResponseFailed}


class ResponseEvents:
    """One response's output, built from its deltas; every method returns the events to send, in order."""

    def __init__(self, response: Response, logprobs=None):
        """`logprobs`: the deltas' tokens -> their logprob entries, when the request asked for them."""
        self.response = response
        """The response being built: `output` grows as items close; status and usage are set by `finish`."""
        self.sequence = 0
        self.logprobs = logprobs
        self._item: OutputMessage | FunctionToolCall | None = None
        self._text: list[str] = []
        self._entries: list = []

    def start(self) -> list:
        return [self._event(ResponseCreated, self._snapshot()), self._event(ResponseInProgress, self._snapshot())]

    def feed(self, delta: ChoiceDelta) -> list:
        entries = self.logprobs(delta.tokens) if self.logprobs is not None and delta.tokens else []
        if isinstance(delta, TextDelta):
            return self._text_delta(delta.text, entries) if delta.text or entries else []
        if isinstance(delta, Finish) and isinstance(self._item, OutputMessage):
            self._entries += entries  # the tokens of text held back to the end (a stop string's start)
        if isinstance(delta, ToolCallStart):
            events = self._close("completed")
            self._item = FunctionToolCall(id=new_id("fc"), call_id=delta.id, name=delta.name, arguments="", status="in_progress")
            return events + [self._event(OutputItemAdded, len(self.response.output), self._copy(self._item))]
        if isinstance(delta, ToolCallArguments) and isinstance(self._item, FunctionToolCall):
            self._item.arguments += delta.arguments
            return [self._event(FunctionCallArgumentsDelta, self._item.id, len(self.response.output), delta.arguments)]
        return []  # Finish: the service ends the response with `finish`

    def finish(self, status: str) -> list:
        """Close the open item (an empty message if the answer was empty) and send the final event; `status`
        (completed, incomplete, failed), usage and error are set on `self.response` by the caller first."""
        if self._item is None and not self.response.output and status != "failed":
            events = self._text_delta("", [])
        else:
            events = []
        events += self._close("incomplete" if status == "incomplete" else "completed")
        self.response.status = status
        self.response.output_text = "".join(
            part.text for item in self.response.output if isinstance(item, OutputMessage) for part in item.content
        )
        return events + [self._event(FINAL_EVENTS[status], self.response)]

    def refinish(self, status: str) -> list:
        """After `finish`, another outcome after all (the response could not be stored): the final event that
        replaces the one `finish` returned (with its sequence number)."""
        self.response.status = status
        self.sequence -= 1
        return [self._event(FINAL_EVENTS[status], self.response)]

    # ---- items ---------------------------------------------------------------------------------------

    def _text_delta(self, text: str, entries: list) -> list:
        events = []
        if not isinstance(self._item, OutputMessage):
            events += self._close("completed")
            self._item = OutputMessage(id=new_id("msg"), content=[], status="in_progress")
            self._text, self._entries = [], []
            index = len(self.response.output)
            events.append(self._event(OutputItemAdded, index, self._copy(self._item)))
            events.append(self._event(ContentPartAdded, self._item.id, index, 0, OutputTextContent("")))
        self._entries += entries
        if text:
            self._text.append(text)
            events.append(self._event(OutputTextDelta, self._item.id, len(self.response.output), 0, text, entries))
        return events

    def _close(self, status: str) -> list:
        item, self._item = self._item, None
        if item is None:
            return []
        index = len(self.response.output)
        events = []
        if isinstance(item, OutputMessage):
            part = OutputTextContent("".join(self._text), logprobs=self._entries)
            events.append(self._event(OutputTextDone, item.id, index, 0, part.text, part.logprobs))
            events.append(self._event(ContentPartDone, item.id, index, 0, part))
            item.content = [part]
        else:
            events.append(self._event(FunctionCallArgumentsDone, item.id, index, item.name, item.arguments))
        item.status = status
        self.response.output.append(item)
        return events + [self._event(OutputItemDone, index, item)]

    # ---- events --------------------------------------------------------------------------------------

    def _event(self, kind, *fields):
        event = kind(self.sequence, *fields)
        self.sequence += 1
        return event

    def _snapshot(self) -> Response:
        """The response as it stands now (its `output` list grows later)."""
        return replace(self.response, output=list(self.response.output))

    @staticmethod
    def _copy(item):
        """An item as it stands now: `_close` later sets its status and content, which must not rewrite this event."""
        return replace(item)
