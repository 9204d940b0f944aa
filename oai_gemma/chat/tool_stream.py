"""Gemma-3 tool calls read token by token (`ToolCallStream`): prose passed through at once, calls sent as they are
written, in OpenAI's delta shape (`CallDelta`); tool_parser.py recognises what it reads."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .tool_parser import Incomplete, NotACall, ParsedCall, is_json, json_spans, parse_block, parse_tool_calls, unfenced


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: `name` on the call's first piece, then fragments of its arguments JSON."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """Splits a generated answer, delta by delta, into plain text (passed on at once) or calls.

    `feed` and `finish` return what can be emitted now: strings of content and/or `CallDelta`s. The answer is held
    back only while it could still be a call: leading whitespace, an opening fence, a `{` or `[`, or a name some
    tool's name starts with. A JSON call streams as it is written: its first delta once its name (a tool's) is
    complete and its arguments object has opened, then the arguments text as it comes. A Python-style call is
    sent whole once complete. `done` turns true once the calls are complete, or when a call that had started
    streaming breaks off (the generation ended, or the text stopped being a call): the calls are then what was
    sent (`complete` false: arguments cut short, as OpenAI's are when `max_tokens` cuts a call). The rest of the
    generation can be dropped.
    """

    def __init__(self, names: frozenset[str] | set[str], *, parallel: bool = True, forced: bool = False):
        """`forced`: a grammar held the answer to calls (`tool_choice` required or named), so what the generation
        ended on is never content: at most a call whose arguments had not opened yet."""
        self.names = frozenset(names)
        self.parallel = parallel
        self.forced = forced
        self.buffer = ""
        self.state = "undecided"  # -> "text" | "done"
        self.calls: list[ParsedCall] = []
        self.complete = False
        """The calls parsed whole (not cut short)."""
        self.sent: list[tuple[str, str]] = []
        """Per call streamed so far: (name, the arguments text sent)."""

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> list[str | CallDelta]:
        if self.state == "text":
            return [text] if text else []
        if self.state == "done" or not text:
            return []
        self.buffer += text
        try:
            calls = parse_block(self.buffer, self.names)
        except Incomplete:
            return self._progress()
        except NotACall:
            return self._cut_short() if self.sent else self._as_text()
        return self._called(calls)

    def finish(self) -> list[str | CallDelta]:
        """The end of the generation: what was held back is content unless it is a complete call."""
        if self.state != "undecided":
            return []
        calls = parse_tool_calls(self.buffer, self.names, parallel=self.parallel)
        if calls:
            return self._called(calls)
        if self.forced and not self.sent:  # the budget ended the call before its arguments opened
            body = self._json_body()
            self.sent = [(span.name, "") for span in json_spans(body)[:1] if body and span.name in self.names]
            return [CallDelta(0, name, "") for name, _ in self.sent] + self._cut_short()
        return self._cut_short() if self.sent else self._as_text()

    def _json_body(self) -> str:
        """The JSON answer held so far, its fence taken off; "" while it is not one."""
        try:
            body = unfenced(self.buffer.lstrip())
        except (Incomplete, NotACall):
            return ""
        return body if body and is_json(body) else ""

    def _progress(self) -> list[str | CallDelta]:
        """The deltas of the JSON calls written so far, in order: a call starts once the one before it is sent."""
        body = self._json_body()
        if not body:
            return []
        out: list[str | CallDelta] = []
        for index, span in enumerate(json_spans(body)[: None if self.parallel else 1]):
            arguments = body[span.start : span.end or len(body)] if span.start is not None else None
            if index < len(self.sent):
                name, sent = self.sent[index]
                if len(arguments) > len(sent):
                    out.append(CallDelta(index, arguments=arguments[len(sent) :]))
                    self.sent[index] = (name, arguments)
            elif span.name in self.names and arguments is not None:
                out.append(CallDelta(index, span.name, arguments))
                self.sent.append((span.name, arguments))
            else:
                break
        return out

    def _as_text(self) -> list[str | CallDelta]:
        self.state = "text"
        text, self.buffer = self.buffer, ""
        return [text] if text else []

    def _called(self, calls: list[ParsedCall]) -> list[str | CallDelta]:
        """The calls are complete: send what is left of each (all of those that had not started)."""
        self.state, self.complete = "done", True
        self.calls = calls if self.parallel else calls[:1]
        out: list[str | CallDelta] = []
        for index, call in enumerate(self.calls):
            arguments = call.arguments_json
            if index < len(self.sent):
                sent = self.sent[index][1]
                if len(arguments) > len(sent):
                    out.append(CallDelta(index, arguments=arguments[len(sent) :]))
            else:
                out.append(CallDelta(index, call.name, arguments))
        return out

    def _cut_short(self) -> list[str | CallDelta]:
        """A call that had started streaming broke off: the calls are what was sent; nothing more is."""
        self.state = "done"
        self.calls = [ParsedCall(name, _json_object(arguments), arguments) for name, arguments in self.sent]
        return []


def _json_object(text: str) -> dict:
    """The arguments a cut-short call's text holds, if it still parses; else none."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
