"""Every limit the API puts on a request, in one table, and the one phrasing of each kind of refusal (a floor of its
own, beside settings.py: the wire types in api/ and the renderers in chat/ both word their refusals with it).

A row is one bound on one field: `param` is the field as an error's `param` names it (OpenAI's path,
`tools[0].function.name`; `[]` stands for any index), `kind` which bound, `limit` a number (checked by the
decoder: the wire Structs take their `Meta` constraints from `meta()`) or the name of what sets it per server or
per request (`engine.max_num_seqs`, `max_tokens`: checked by hand, worded by `phrase` all the same).

docs/api.md's table is this one (`markdown_table()`; tests/api/test_limits.py keeps them equal and sends a request
one past every row).
"""

from __future__ import annotations

from dataclasses import dataclass

from msgspec import Meta

CHAT, COMPLETIONS, RESPONSES, TOKENIZE, DETOKENIZE = "chat", "completions", "responses", "tokenize", "detokenize"
INPUT_ITEMS = "input_items"
"""`GET /v1/responses/{id}/input_items`"""
LORA = "load_lora_adapter"
SAMPLING = (CHAT, COMPLETIONS, RESPONSES)
PROMPT_CHARS = "max_model_len x the longest token's characters"
FITS = "a longer text cannot fit the context, whatever it says: refused before it is tokenized"
VOCAB = "the vocabulary's last id"
NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's pattern for a function's or a schema's name."""


@dataclass(frozen=True)
class Limit:
    param: str
    kind: str
    """`min`/`max` (a number, inclusive), `above` (a number, exclusive), `min_items`/`max_items` (an array's or an
    object's entries), `min_length`/`max_length` (a string's characters), `pattern` (a string's shape); the
    prompt's `max_chars` (its text, refused as `context_length_exceeded`); a text's `max_tokens` (once tokenized);
    `requires` (another field's value, `limit`, that this one needs); an image's `max_images` (per request),
    `max_bytes`, `max_pixels`."""
    limit: int | float | str
    """A float for a decimal field, an int for an integer or a count."""
    endpoints: tuple[str, ...]
    why: str

    @property
    def static(self) -> bool:
        """Known before the server starts (a number, a pattern): the decoder's `Meta`, or a hand check reading it
        here; else a setting or another field, checked by hand once known."""
        return self.kind == "pattern" or not isinstance(self.limit, str)


def _range(param: str, low, high, endpoints: tuple[str, ...], why: str) -> list[Limit]:
    return [Limit(param, "min", low, endpoints, why), Limit(param, "max", high, endpoints, why)]


LIMITS: tuple[Limit, ...] = (
    # sampling: chat, completions and Responses alike
    *_range("temperature", 0.0, 2.0, SAMPLING, "OpenAI's range"),
    *_range("top_p", 0.0, 1.0, SAMPLING, "a probability mass"),
    *_range("presence_penalty", -2.0, 2.0, SAMPLING, "OpenAI's range"),
    *_range("frequency_penalty", -2.0, 2.0, SAMPLING, "OpenAI's range"),
    *_range("logit_bias", -100.0, 100.0, SAMPLING, "each bias; OpenAI's range"),
    Limit("stop", "max_items", 16, SAMPLING, "stop strings are matched on every token"),
    Limit("top_k", "min", -1, SAMPLING, "vLLM's: -1 or 0 is off"),
    *_range("min_p", 0.0, 1.0, SAMPLING, "a probability"),
    Limit("repetition_penalty", "above", 0.0, SAMPLING, "a divisor of the logits"),
    Limit("repetition_penalty", "max", 10.0, SAMPLING, "beyond, every repeated token is ruled out"),
    Limit("min_tokens", "min", 0, SAMPLING, "a count"),
    Limit("min_tokens", "max", "max_tokens", SAMPLING, "no completion can be both"),
    Limit("cache_salt", "min_length", 1, SAMPLING, "an empty salt would share with everyone"),
    *_range("seed", -2**63, 2**63 - 1, SAMPLING, "OpenAI's: a 64-bit integer"),
    # choices
    *_range("n", 1, 128, (CHAT, COMPLETIONS), "OpenAI's range"),
    Limit("n", "max", "engine.max_num_seqs", (CHAT, COMPLETIONS), "a request's choices run side by side, in one batch"),
    # chat
    Limit("messages", "min_items", 1, (CHAT,), "a conversation has a message"),
    Limit("messages", "max_chars", PROMPT_CHARS, (CHAT, TOKENIZE), FITS),
    Limit("messages[].content[]", "max_images", "images.max_images", (CHAT, TOKENIZE), "each image is prefilled"),
    Limit("messages[].content[]", "max_bytes", "images.max_download_bytes", (CHAT, TOKENIZE), "an image's file"),
    Limit("messages[].content[]", "max_pixels", "images.max_pixels", (CHAT, TOKENIZE), "checked from the header, before decoding"),
    Limit("max_tokens", "min", 1, (CHAT,), "a completion has a token"),
    Limit("max_completion_tokens", "min", 1, (CHAT,), "a completion has a token"),
    *_range("top_logprobs", 0, 20, (CHAT, RESPONSES), "OpenAI's range"),
    Limit("top_logprobs", "requires", "logprobs: true", (CHAT,), "the alternatives are shown beside each token's logprob"),
    Limit("prediction", "max_tokens", "max_model_len", (CHAT,), "a longer prediction could never be the output"),
    Limit("tools[].function.name", "pattern", NAME, (CHAT,), "OpenAI's function names"),
    Limit("response_format.json_schema.name", "pattern", NAME, (CHAT,), "OpenAI's schema names"),
    # completions
    Limit("prompt", "min_items", 1, (COMPLETIONS,), "a prompt list has a prompt"),
    Limit("prompt[]", "min_items", 1, (COMPLETIONS,), "a token-id prompt has a token"),
    Limit("prompt[]", "min", 0, (COMPLETIONS,), "a token id"),
    Limit("prompt[]", "max", VOCAB, (COMPLETIONS,), "a token id"),
    Limit("prompt", "max_chars", PROMPT_CHARS, (COMPLETIONS, TOKENIZE), FITS),
    Limit("max_tokens", "min", 0, (COMPLETIONS,), "0 only with `echo: true` (the prompt back)"),
    *_range("best_of", 0, 20, (COMPLETIONS,), "OpenAI's range"),
    *_range("logprobs", 0, 5, (COMPLETIONS,), "OpenAI's range"),
    # Responses
    Limit("input", "min_items", 1, (RESPONSES,), "a list of items has an item"),
    Limit("input", "max_chars", PROMPT_CHARS, (RESPONSES,), FITS),
    Limit("max_output_tokens", "min", 1, (RESPONSES,), "a response has a token"),
    Limit("max_tool_calls", "min", 1, (RESPONSES,), "OpenAI's range"),
    Limit("metadata", "max_items", 16, (RESPONSES,), "OpenAI's: 16 pairs"),
    Limit("metadata", "max_length", 512, (RESPONSES,), "OpenAI's: each value 512 characters"),
    Limit("tools[].name", "pattern", NAME, (RESPONSES,), "OpenAI's function names"),
    Limit("text.format.name", "pattern", NAME, (RESPONSES,), "OpenAI's schema names"),
    Limit("input[].call_id", "min_length", 1, (RESPONSES,), "a call is answered by its id"),
    Limit("input[].name", "min_length", 1, (RESPONSES,), "a call names its function"),
    # /v1/load_lora_adapter
    Limit("lora_name", "min_length", 1, (LORA,), "an adapter is named (blanks stripped)"),
    Limit("lora_path", "min_length", 1, (LORA,), "an adapter is read from a path (blanks stripped)"),
    # /detokenize
    Limit("tokens[]", "min", 0, (DETOKENIZE,), "a token id"),
    Limit("tokens[]", "max", VOCAB, (DETOKENIZE,), "a token id"),
    Limit("limit", "min", 1, (INPUT_ITEMS,), "OpenAI's page size"),
    Limit("limit", "max", 100, (INPUT_ITEMS,), "OpenAI's page size"),
)

_META_KEYWORDS = {
    "min": "ge", "above": "gt", "max": "le", "min_items": "min_length", "max_items": "max_length",
    "min_length": "min_length", "max_length": "max_length", "pattern": "pattern",
}


def limits(param: str, endpoint: str) -> list[Limit]:
    return [row for row in LIMITS if row.param == param and endpoint in row.endpoints]


def limit(param: str, endpoint: str, kind: str) -> Limit:
    """The one row for `param`'s `kind` of bound on `endpoint`."""
    (row,) = [row for row in limits(param, endpoint) if row.kind == kind]
    return row


def meta(param: str, endpoint: str, *kinds: str) -> Meta:
    """The decoder's constraints on `param` (`kinds`: only these; a field with two shapes, a count and its items,
    takes one Meta each)."""
    rows = [row for row in limits(param, endpoint) if row.static and (not kinds or row.kind in kinds)]
    assert rows, f"no static limit on {param} ({endpoint})"
    return Meta(**{_META_KEYWORDS[row.kind]: row.limit for row in rows})


# ---- the one phrasing of each kind (OpenAI's words) ------------------------------------------------------

ECHO_CHARS = 256
"""At most this much of a client's value is quoted back in an error message."""


def shown(value: str) -> str:
    """A client's value as quoted in an error message: a megabyte of it is not echoed back."""
    return value if len(value) <= ECHO_CHARS else value[:ECHO_CHARS] + "..."


def number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    return shown(str(value))


def phrase(param: str, kind: str, limit, value=None, note: str = "") -> tuple[str, str]:
    """(message, code) for a value past a limit: the field, the limit and the value, always in these words
    (`value` None: not known, left out; `note`: what sets the limit, after it)."""
    got = "" if value is None else f", but got {_got(kind, value)} instead"
    if kind in ("min", "above", "max"):
        word = "decimal" if isinstance(limit, float) or isinstance(value, float) else "integer"
        side, op = {"min": ("below minimum", ">="), "above": ("below minimum", ">"), "max": ("above maximum", "<=")}[kind]
        code = f"{word}_{'above_max' if kind == 'max' else 'below_min'}_value"
        return f"Invalid '{param}': {word} {side} value. Expected a value {op} {number(limit)}{note}{got}.", code
    if kind in ("min_items", "max_items"):
        shape = "object" if isinstance(value, dict) else "array"
        least = kind == "min_items"
        if least and value is not None and len(value) == 0:
            side = "empty " + shape
        else:
            side = f"{shape} too {'short' if least else 'long'}" if shape == "array" else f"object too {'small' if least else 'large'}"
        size = (f"with {'minimum' if least else 'maximum'} length {limit}" if shape == "array"
                else f"with at {'least' if least else 'most'} {limit} entries")
        code = f"empty_{shape}" if side.startswith("empty") else f"{shape}_{'below_min' if least else 'above_max'}_length"
        return f"Invalid '{param}': {side}. Expected {'an array' if shape == 'array' else 'an object'} {size}{note}{got}.", code
    if kind in ("min_length", "max_length"):
        side, bound = ("too short", "minimum") if kind == "min_length" else ("too long", "maximum")
        code = f"string_{'below_min' if kind == 'min_length' else 'above_max'}_length"
        return f"Invalid '{param}': string {side}. Expected a string with {bound} length {limit}{note}{got}.", code
    if kind in ("max_images", "max_bytes", "max_pixels"):
        what = {"max_images": "too many images", "max_bytes": "image too large", "max_pixels": "image too large"}[kind]
        unit = {"max_images": "images per request", "max_bytes": "bytes", "max_pixels": "pixels"}[kind]
        return f"Invalid '{param}': {what}. Expected at most {limit} {unit}{note}{got}.", "invalid_image"
    if kind == "max_tokens":
        return f"Invalid '{param}': text too long. Expected a text of at most {limit} tokens{note}{got}.", "string_above_max_length"
    if kind == "requires":
        return f"Invalid '{param}': only read with `{limit}`{note}{got}.", "invalid_value"
    if kind == "pattern":
        return f"Invalid '{param}': string does not match pattern. Expected a string that matches the pattern '{limit}'{got}.", "invalid_value"
    raise ValueError(f"no phrasing for {kind!r}")


def _got(kind: str, value) -> str:
    if kind in ("min_items", "max_items"):
        return "an empty " + ("object" if isinstance(value, dict) else "array") if not value else (
            f"an object with {len(value)} entries" if isinstance(value, dict) else f"an array with length {len(value)}")
    if kind in ("min_length", "max_length"):
        return "an empty string" if not value else f"a string with length {len(value)}"
    if kind == "pattern":
        return repr(shown(value))
    if kind == "max_tokens":
        return f"a text of {value} tokens"
    return value if isinstance(value, str) else number(value)


def missing(param: str) -> str:
    """The message for a required field left out (or null)."""
    return f"Missing required parameter: '{param}'."


def markdown_table() -> str:
    """The table as docs/api.md shows it."""
    lines = ["| `param` | bound | limit | endpoints | why |", "|---|---|---|---|---|"]
    for row in LIMITS:
        shown_limit = f"`{row.limit}`" if isinstance(row.limit, str) else number(row.limit)
        lines.append(f"| `{row.param}` | {row.kind} | {shown_limit} | {', '.join(row.endpoints)} | {row.why} |")
    return "\n".join(lines) + "\n"
