"""OpenAI's error envelope; decoder messages turned into the `param` they are about; the chat layer's and the
engine's refusals mapped to their statuses."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import msgspec

from ..chat import ChatInputError, PromptTooLong
from ..limits import LIMITS, limits, missing, phrase, shown
from .protocol import ErrorBody, ErrorResponse, encoder


class APIError(Exception):
    """Any failure a client should see as `{"error": {...}}` with an HTTP status."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers or {}

    def encode(self) -> bytes:
        return encoder.encode(self.body)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_supported(param: str) -> APIError:
    return invalid_request(f"`{param}` is not supported by this server yet; leave it unset", param, "unsupported_parameter")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model `{shown(model)}` does not exist. This server serves `{served}`.", "invalid_request_error", "model", "model_not_found")


def over_limit(param: str, kind: str, limit, value=None, note: str = "", code: str | None = None) -> APIError:
    """A 400 for a value past one of `limits.LIMITS` (or a bound of its kind), in that kind's one phrasing
    (`code`: instead of the kind's own)."""
    message, own = phrase(param, kind, limit, value, note)
    return invalid_request(message, param, code or own)


def check_limits(param: str, endpoint: str, value) -> None:
    """A 400 if `value` is past a constant limit of `param`'s on `endpoint` (a field not checked by the decoder)."""
    for row in limits(param, endpoint):
        if not isinstance(row.limit, str) and _breaks(row.kind, row.limit, value):
            raise over_limit(param, row.kind, row.limit, value)


def context_length_exceeded(max_model_len: int, detail: str, where: str = "messages") -> APIError:
    """`where`: the request field that holds the prompt (`messages`, `prompt`)."""
    return invalid_request(
        f"This model's maximum context length is {max_model_len} tokens. However, {detail}. "
        f"Please reduce the length of the {where} or completion.",
        where, "context_length_exceeded",
    )


def decode_body(decoder: msgspec.json.Decoder, body: bytes):
    """The request Struct, or a 400 naming the offending field (or saying where the JSON is malformed)."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc), body) from None
    except msgspec.DecodeError as exc:
        raise invalid_request(f"We could not parse the JSON body of your request: {_where_malformed(str(exc), body)}.") from None
    except RecursionError:  # msgspec's guard against a stack overflow on `[[[[...` thousands deep
        raise invalid_request("We could not parse the JSON body of your request: it is nested too deeply.") from None


# ---- msgspec's validation messages in OpenAI's words --------------------------------------------------

_NUMBER_BOUND = re.compile(r"Expected `(int|float)` (>=|>|<=) (\S+)")
_LENGTH_BOUND = re.compile(r"Expected `(array|object|str)` of length (>=|<=) (\d+)")
_PATTERN = re.compile(r"Expected `str` matching regex '(.*)'")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_NUMBER_KINDS = {">=": "min", ">": "above", "<=": "max"}
_LENGTH_KINDS = {("str", ">="): "min_length", ("str", "<="): "max_length", (">=",): "min_items", ("<=",): "max_items"}


def validation_error(message: str, document, where: str = "") -> APIError:
    """msgspec's complaint about `document` (the body's bytes, or a value decoded on its own from `where`) as a
    400 naming the field from the request's root; a bound is worded as `limits.phrase` words every limit, with
    the value sent."""
    inner = param_from_validation(message)
    param = where + ("." if where and inner and not inner.startswith("[") else "") + (inner or "") or None
    text = message.split(" - at `")[0]
    if _MISSING.search(text):
        return invalid_request(missing(param), param, "missing_required_parameter")
    if text == "Number out of range" and isinstance(document, bytes):
        return _out_of_range(param, document, message)
    bound = _bound(text)
    if bound is None:
        return invalid_request(openai_wording(message, param), param)
    kind, limit = bound
    at = _AT_PATH.search(message)
    path = at.group(0).removeprefix(" - at `$").removesuffix("`") if at else ""
    value = next((v for v in _values(document, path) if _breaks(kind, limit, v)), None)
    return over_limit(param, kind, limit, value)


class _ExactFloat(Decimal):
    """A JSON decimal read exactly (an integer is a plain Decimal)."""


def _out_of_range(param: str | None, body: bytes, message: str) -> APIError:
    """A number too large for its type (`1e999`, an integer past 64 bits), worded as the field's limit when it has
    one (the value read exactly, as a Decimal), else as the type's range."""
    at = _AT_PATH.search(message)
    path = at.group(0).removeprefix(" - at `$").removesuffix("`") if at else ""
    values = _values(body, path, exact=True)
    rows = [row for row in LIMITS if row.param == re.sub(r"\[\d+\]", "[]", param or "") and row.static
            and row.kind in ("min", "max")]
    for value in values:
        for row in rows:
            if _breaks(row.kind, row.limit, value):
                return over_limit(param, row.kind, row.limit, value)
    decimal = any(isinstance(value, _ExactFloat) for value in values)
    expected = "a finite decimal (at most about 1.8e308 either way)" if decimal else (
        "an integer between -9223372036854775808 and 18446744073709551615")
    got = f", but got {shown(str(values[0]))} instead" if values else ""
    return invalid_request(f"Invalid value for '{param}': number out of range. Expected {expected}{got}.", param)


def _bound(text: str) -> tuple[str, object] | None:
    """(the `limits` kind, the limit) of msgspec's `Expected `int` <= 128`, None for another message."""
    if found := _NUMBER_BOUND.fullmatch(text):
        kind, limit = _NUMBER_KINDS[found.group(2)], found.group(3)
        return kind, float(limit) if found.group(1) == "float" else int(limit)
    if found := _LENGTH_BOUND.fullmatch(text):
        shape, op = found.group(1), found.group(2)
        return _LENGTH_KINDS[(shape, op) if shape == "str" else (op,)], int(found.group(3))
    if found := _PATTERN.fullmatch(text):
        return "pattern", found.group(1)
    return None


def _values(document, path: str, exact: bool = False) -> list:
    """The values at msgspec's `path` (`.messages[0].content`; `[...]`: any of a dict's values) in `document`
    (`exact`: its numbers as Decimals, so that one too large for a float or an int64 is read as it was sent)."""
    try:
        if exact:
            values = [json.loads(document, parse_float=_ExactFloat, parse_int=Decimal)]
        else:
            values = [msgspec.json.decode(document) if isinstance(document, bytes) else document]
        for key, index in _STEP.findall(path):
            if key:
                values = [v[key] for v in values if isinstance(v, dict) and key in v]
            elif index == "...":
                values = [item for v in values if isinstance(v, dict) for item in v.values()]
            else:
                values = [v[int(index)] for v in values if isinstance(v, list) and int(index) < len(v)]
        return values
    except (msgspec.DecodeError, RecursionError, ValueError):  # a number too large to decode on its own: left unquoted
        return []


def _breaks(kind: str, limit, value) -> bool:
    """Whether `value` is past `limit` (the one at fault among a dict's values)."""
    try:
        if kind == "pattern":
            return isinstance(value, str) and re.search(limit, value) is None
        if kind in ("min", "above", "max"):
            if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
                return False
            return value < limit if kind == "min" else value <= limit if kind == "above" else value > limit
        return len(value) < limit if kind.startswith("min") else len(value) > limit
    except TypeError:
        return False


_TYPE_WORDS = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "object": "an object",
    "array": "an array", "null": "null", "bytes": "a base64 string",
}
_EXPECTED_GOT = re.compile(r"Expected `([^`]+)`, got `([^`]+)`")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`")
_ENUM = re.compile(r"Invalid (?:enum )?value (.+)")
_BYTE = re.compile(r"\(byte (\d+)\)")


def _kind(types: str) -> str:
    """msgspec's `str | array | null` -> `a string, an array or null`."""
    words = [_TYPE_WORDS.get(t, f"`{t}`") for t in types.split(" | ")]
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def openai_wording(message: str, param: str | None) -> str:
    """msgspec's `Expected `int`, got `str` - at `$.n`` as OpenAI says it: `Invalid type for 'n': expected an
    integer, but got a string instead.` (a bound is `validation_error`'s); a message not msgspec's comes back as it is."""
    text = message.split(" - at `")[0]
    name = f"'{param}'" if param else "the request body"
    if _MISSING.match(text.removeprefix("Object ")):
        return missing(param)
    if found := _UNKNOWN_FIELD.fullmatch(text):
        return f"Unrecognized request argument supplied: {param or found.group(1)}"
    if found := _EXPECTED_GOT.fullmatch(text):
        return f"Invalid type for {name}: expected {_kind(found.group(1))}, but got {_kind(found.group(2))} instead."
    if found := _ENUM.fullmatch(text):
        return f"Invalid value for {name}: {found.group(1)} is not one of the supported values."
    if " - at `" in message:  # msgspec's, in no shape above ("Number out of range")
        return f"Invalid value for {name}: {text[:1].lower()}{text[1:]}."
    return message


def _where_malformed(message: str, body: bytes) -> str:
    """msgspec's `JSON is malformed: invalid character (byte 9)` with the line and column a person looks for."""
    detail = message.removeprefix("JSON is malformed: ")
    at = _BYTE.search(detail)
    if at is None:
        return "it ends early" if "truncated" in detail else detail
    offset = int(at.group(1))
    line = body.count(b"\n", 0, offset) + 1
    column = offset - body.rfind(b"\n", 0, offset)
    return f"{detail[: at.start()].strip()} at line {line}, column {column} (byte {offset})"


_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def param_from_validation(message: str) -> str | None:
    """`Expected int, got str - at $.messages[0].content` -> `messages[0].content`."""
    match = _AT_PATH.search(message)
    path = match.group(1).replace("[...]", "") if match else ""  # msgspec's "[...]" is a dict value
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


# ---- what the chat layer and the engine refuse, as the client sees it ----------------------------------


def chat_input_error(exc: ChatInputError, max_model_len: int) -> APIError:
    """A `ChatInputError` (a message, an image, a prompt too long) as a 400 naming its field."""
    if isinstance(exc, PromptTooLong):
        return context_length_exceeded(max_model_len, exc.detail, exc.param)
    return invalid_request(openai_wording(exc.message, exc.param), exc.param, exc.code)


def busy(exc: Exception) -> APIError:
    return APIError(429, str(exc), "requests", None, "rate_limit_exceeded", {"Retry-After": "1"})


def unavailable(exc: Exception) -> APIError:
    return APIError(503, str(exc), "server_error", None, "engine_unavailable")


def generation_failure(event) -> APIError:
    """Why a request ended without `stop` or `length`, as the client sees it (status, or a stream's error event);
    `event`: the choice's last event, None when none came."""
    if event is None:
        return APIError(500, "generation failed: no output", "server_error", None, "generation_failed")
    if event.finish_reason == "timeout":
        return APIError(504, event.error, "server_error", None, "timeout")
    if event.finish_reason == "not_found":  # the adapter the request named was unloaded before it started
        return APIError(404, event.error, "invalid_request_error", "model", "model_not_found")
    if event.finish_reason == "invalid_grammar":
        return APIError(400, event.error, "invalid_request_error", None, "invalid_json_schema")
    if event.finish_reason == "aborted":
        return APIError(503, event.error, "server_error", None, "server_shutting_down")
    return APIError(500, f"generation failed: {event.error or event.finish_reason}", "server_error", None, "generation_failed")
