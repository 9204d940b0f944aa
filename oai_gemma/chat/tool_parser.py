"""Recognising Gemma-3 tool calls in generated text: whole answers (`parse_tool_calls`), and the pieces the stream
that reads them token by token (tool_stream.py's `ToolCallStream`) uses.

The format (see `tools.py`) is the JSON variant of Google's documented Gemma function-calling prompt. The parser
is tolerant of what models write: a single object or a list, `arguments` for `parameters` (also as a JSON
string), the Python-style `[get_weather(city="Paris"), ...]` of the other documented variant, all inside an
optional ```` ``` ```` / ```` ```json ```` / ```` ```tool_code ```` fence. A call must open the answer (after
whitespace): an answer that starts as prose is prose, which lets `ToolCallStream` pass plain text through from
its first token. Anything after a complete call is not part of the answer (the prompt asks for nothing else).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

_FENCE_LANGUAGES = ("json", "tool_code", "python", "tool_call", "")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARTIAL_TAIL = re.compile(r"|t|tr|tru|f|fa|fal|fals|n|nu|nul|-|[.eE][+-]?")
"""Where JSON that is merely cut short stops parsing: at its end, or inside a literal or number."""
_PARTIAL_ESCAPE = re.compile(r"u[0-9a-fA-F]{0,4}")  # json's "Invalid \\uXXXX escape" at a string cut in a \\u escape


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict
    raw: str | None = field(default=None, compare=False)
    """The arguments object as the model wrote it (a JSON call), which is what a stream sends as it comes."""

    @property
    def arguments_json(self) -> str:
        """OpenAI's `function.arguments`: the arguments as a JSON text (the model's own, when it wrote JSON)."""
        return self.raw if self.raw is not None else json.dumps(self.arguments, ensure_ascii=False)


class NotACall(Exception):
    """The text is not a call."""


class Incomplete(Exception):
    """The text could still become a call."""


def parse_tool_calls(text: str, names: frozenset[str] | set[str], *, parallel: bool = True) -> list[ParsedCall] | None:
    """The calls the answer `text` opens with, or None when it is not a (complete) call of one of `names`."""
    try:
        calls = parse_block(text, names)
    except (NotACall, Incomplete):
        return None
    return calls if parallel else calls[:1]


def parse_block(text: str, names) -> list[ParsedCall]:
    """Calls, or Incomplete (could still become one), or NotACall."""
    body = unfenced(text.lstrip())
    if not body:
        raise Incomplete
    if is_json(body):
        return _json_calls(body, names)
    return _python_calls(body, names)


def is_json(body: str) -> bool:
    """The answer is in the JSON format (an object, or a list of objects), not Python-style."""
    return body[0] == "{" or (body[0] == "[" and body[1:].lstrip()[:1] in ("{", ""))


def unfenced(text: str) -> str:
    """The text after an opening code fence (```json\\n...), or the text itself without one."""
    if not text.startswith("`"):
        return text
    if not "```".startswith(text[:3]):
        raise NotACall
    opener, newline, rest = text.partition("\n")
    if not newline:
        if opener[:3] == "```" and not any(lang.startswith(opener[3:].strip()) for lang in _FENCE_LANGUAGES):
            raise NotACall
        raise Incomplete
    if opener[3:].strip() not in _FENCE_LANGUAGES:
        raise NotACall
    return rest.lstrip()


def _json_calls(body: str, names) -> list[ParsedCall]:
    try:
        value, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        cut_escape = exc.msg.startswith("Invalid \\u") and _PARTIAL_ESCAPE.fullmatch(body, exc.pos)
        if exc.msg.startswith("Unterminated string") or cut_escape or _PARTIAL_TAIL.fullmatch(body[exc.pos:].rstrip()):
            raise Incomplete from None
        raise NotACall from None
    items = value if isinstance(value, list) else [value]
    if not items:
        raise NotACall
    calls = [_json_call(item, names) for item in items]
    spans = json_spans(body)
    return [
        ParsedCall(call.name, call.arguments, body[span.start : span.end] if span.end is not None else None)
        for call, span in zip(calls, spans)
    ]


@dataclass
class _CallSpan:
    """Where one call object of a JSON answer has its name, and its arguments object (`start` to `end`)."""

    name: str | None = None
    start: int | None = None
    end: int | None = None
    """One past the arguments' closing brace, once written."""


def json_spans(body: str) -> list[_CallSpan]:
    """The call objects of a JSON answer, complete or cut short: each one's name once its string is complete,
    and the span of its arguments when they are an object (`parameters` or `arguments`). A scan over the text,
    not a parse: it never fails, it only finds less in text that is not a call."""
    return _SpanScan(body).run()


class _SpanScan:
    """The scanner behind `json_spans`: nesting depth, and the key being read at a call object's own level."""

    def __init__(self, body: str):
        self.body = body
        self.spans: list[_CallSpan] = []
        self.call_depth = 1 if body[:1] == "{" else 2
        self.depth, self.key, self.at_key = 0, None, False

    def run(self) -> list[_CallSpan]:
        i: int | None = 0
        while i is not None and i < len(self.body):
            i = self._step(i)
        return self.spans

    def _step(self, i: int) -> int | None:
        """Read what starts at `i`; where to go on, or None to stop (an unterminated string, the value's end)."""
        ch = self.body[i]
        if ch == '"':
            return self._string(i)
        if ch in "{[":
            self._open(ch, i)
        elif ch in "}]":
            if self._close(i):
                return None
        elif ch == "," and self.depth == self.call_depth:
            self.key, self.at_key = None, True
        return i + 1

    def _string(self, i: int) -> int | None:
        end = _string_end(self.body, i)
        if end is None or self.depth != self.call_depth:
            return end
        if self.at_key:
            self.key, self.at_key = _json_string(self.body[i:end]), False
        elif self.key == "name" and self.spans:
            self.spans[-1].name = _json_string(self.body[i:end])
        return end

    def _open(self, ch: str, i: int) -> None:
        self.depth += 1
        if ch != "{":
            return
        if self.depth == self.call_depth:
            self.spans.append(_CallSpan())
            self.key, self.at_key = None, True
        elif self.depth == self.call_depth + 1 and self.key in ("parameters", "arguments") and self.spans:
            if self.spans[-1].start is None:
                self.spans[-1].start = i

    def _close(self, i: int) -> bool:
        """True when the answer's value is complete: what follows is not part of it."""
        span = self.spans[-1] if self.spans else None
        if self.depth == self.call_depth + 1 and span is not None and span.start is not None and span.end is None:
            span.end = i + 1
        self.depth -= 1
        return self.depth == 0


def _string_end(text: str, start: int) -> int | None:
    """One past the closing quote of the JSON string that opens at `start`, or None when it is unterminated."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None


def _json_call(item: Any, names) -> ParsedCall:
    if not isinstance(item, dict) or item.get("name") not in names:
        raise NotACall
    extra = set(item) - {"name", "parameters", "arguments"}
    if extra:
        raise NotACall
    arguments = item.get("parameters", item.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise NotACall from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise NotACall
    return ParsedCall(item["name"], arguments)


def _python_calls(body: str, names) -> list[ParsedCall]:
    """`[f(a=1), g()]` or a bare `f(a=1)`: the shortest prefix that parses as Python is the block."""
    bracketed = body[0] == "["
    head = body[1:].lstrip() if bracketed else body
    if not head:
        raise Incomplete
    identifier = _IDENTIFIER.match(head)
    if not identifier:
        raise NotACall
    name, rest = identifier.group(), head[identifier.end():].lstrip()
    if not rest:  # the name may still be growing, or its "(" be on its way
        if any(n.startswith(name) for n in names):
            raise Incomplete
        raise NotACall
    if name not in names or not rest.startswith("("):
        raise NotACall
    closer = "]" if bracketed else ")"
    for end in (i + 1 for i, ch in enumerate(body) if ch == closer):
        try:
            tree = ast.parse(body[:end], mode="eval").body
        except SyntaxError:
            continue
        nodes = tree.elts if bracketed and isinstance(tree, ast.List) else [tree]
        return [_python_call(node, names) for node in nodes]
    raise Incomplete


def _python_call(node: ast.AST, names) -> ParsedCall:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name) or node.func.id not in names:
        raise NotACall
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise NotACall
        arguments[keyword.arg] = _literal(keyword.value)
    return ParsedCall(node.func.id, arguments)


_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A Python literal; JSON's true/false/null too, which models write in Python-style calls."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise NotACall
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    try:
        value = ast.literal_eval(node)
    except ValueError:
        raise NotACall from None
    return list(value) if isinstance(value, tuple) else value


# ---- streaming ---------------------------------------------------------------------------------------
