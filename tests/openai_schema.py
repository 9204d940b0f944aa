"""Validate JSON objects against OpenAI's own definitions of its wire format (tests only).

Two sources, the stricter one when it is there:

* the official OpenAI OpenAPI spec, `../shared/openai-openapi.yaml` next to the repo (override with env
  `OAI_OPENAPI_SPEC`; point it at a missing file to force the fallback). Only the team's machines have it.
* otherwise the official `openai` package's own pydantic types (`ChatCompletion`, `ChatCompletionChunk`,
  `Completion`, `Model`, `ErrorObject`, and `openai.types.responses`' `Response`, `ResponseStreamEvent`,
  `ResponseItemList`), which the tests install anyway (`SDK_TYPE_NAMES` lists them; a test checks that every
  schema name the tests validate against has one), validated in pydantic's strict JSON mode:
  the types, literals and required fields the SDK itself parses. They are laxer than the spec in one way: a
  key that is nullable and required in the spec (`choices[].logprobs`, `message.refusal`, a chunk choice's
  `finish_reason`, `error.param`/`error.code`) may be left out. `backend()` says which source is in use.

The spec is OpenAPI 3.1 (JSON Schema 2020-12 dialect) with a few 3.0 leftovers: `nullable: true` is turned into
`anyOf: [<schema>, {"type": "null"}]`; OpenAPI-only keywords (`discriminator`, `x-*`, `example`, `deprecated`,
`format: unixtime`) are ignored by jsonschema anyway. The parsed spec is cached as a pickle in
`~/.cache/oai-gemma/` keyed by the file's size and mtime, so later test sessions skip the 3 MB YAML parse.

What the spec really requires (no `additionalProperties: false` on any of these, so extra fields pass):

* `CreateChatCompletionResponse`: `id` (str), `object` == "chat.completion", `created` (int), `model` (str),
  `choices` (array). Each choice requires `index` (int), `message`, `finish_reason` (one of stop, length,
  tool_calls, content_filter, function_call; NOT nullable) and `logprobs` (an object with both `content` and
  `refusal`, or null: the key must be present). `message` requires `role` == "assistant", `content`
  (str|null) and `refusal` (str|null): `refusal: null` must be sent. Optional: `usage` (`CompletionUsage`:
  requires `prompt_tokens`, `completion_tokens`, `total_tokens`, ints), `system_fingerprint` (str, not
  nullable: omit it rather than send null), `service_tier` (auto|default|flex|scale|priority|fast or null),
  `metadata`, `moderation`.
* `CreateChatCompletionStreamResponse` (a chunk): `id`, `object` == "chat.completion.chunk", `created`,
  `model`, `choices` (may be empty, e.g. the final usage chunk). Each choice requires `index`, `delta` (an
  object, all fields optional: `role`, `content` str|null, `refusal` str|null, `tool_calls`) and
  `finish_reason` (same enum or null: the key must be present). `logprobs` is optional (object or null).
  `usage` is optional and nullable (`CompletionUsage` when present); `system_fingerprint`, `service_tier`,
  `obfuscation` optional.
* `ListModelsResponse`: `object` == "list", `data` (array of `Model`). `Model` requires `id` (str),
  `object` == "model", `created` (int), `owned_by` (str).
* `ErrorResponse`: `error` (`Error`), which requires all four of `message` (str), `type` (str),
  `param` (str|null) and `code` (str|null): `param` and `code` must be present, null allowed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pydantic
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_URI = "urn:openai-openapi"
_DEFAULT_SPEC = Path(__file__).resolve().parents[1].parent / "shared" / "openai-openapi.yaml"
_CACHE_VERSION = 1  # bump when _normalise changes


def spec_path() -> Path:
    return Path(os.environ.get("OAI_OPENAPI_SPEC") or _DEFAULT_SPEC)


def _normalise(node: Any) -> Any:
    """OpenAPI 3.0 `nullable` -> JSON Schema null union, recursively; the rest is left as it is."""
    if isinstance(node, list):
        return [_normalise(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _normalise(value) for key, value in node.items()}
    nullable = out.get("nullable")
    if isinstance(nullable, bool):  # a keyword, not a property that happens to be called "nullable"
        del out["nullable"]
        if nullable:
            return {"anyOf": [out, {"type": "null"}]}
    return out


def _cache_file(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_VERSION}".encode()).hexdigest()
    return Path.home() / ".cache" / "oai-gemma" / f"openai-openapi-{key[:16]}.pickle"


@functools.cache
def load_spec() -> dict[str, Any]:
    """The parsed, normalised spec; parsed once per cache key, then unpickled."""
    path = spec_path()
    if not path.is_file():
        raise FileNotFoundError(f"OpenAI OpenAPI spec not found at {path} (set OAI_OPENAPI_SPEC)")
    cache = _cache_file(path)
    try:
        with cache.open("rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError):
        pass
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with path.open("rb") as f:
        spec = _normalise(yaml.load(f, Loader=loader))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            pickle.dump(spec, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home only costs the parse next time
    return spec


@functools.cache
def _registry() -> Registry:
    resource = Resource(contents=load_spec(), specification=DRAFT202012)
    return Registry().with_resource(SPEC_URI, resource)


@functools.cache
def _validator(component_name: str) -> jsonschema.Draft202012Validator:
    schema_of(component_name)  # a clear KeyError for an unknown name
    root = {"$ref": f"{SPEC_URI}#/components/schemas/{component_name}"}
    return jsonschema.Draft202012Validator(root, registry=_registry())


def schema_of(component_name: str) -> dict[str, Any]:
    """The (normalised) schema of `#/components/schemas/<component_name>`, `$ref`s left unresolved."""
    schemas = load_spec()["components"]["schemas"]
    if component_name not in schemas:
        raise KeyError(f"no schema {component_name!r} in {spec_path()}")
    return schemas[component_name]


def _where(error: jsonschema.ValidationError) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _closest_branch(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """Of an anyOf/oneOf's failed branches, the one whose type fit the instance (fewest errors wins)."""
    branches: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in error.context or ():
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)

    def wrong_type(errs: list[jsonschema.ValidationError]) -> bool:
        return any(e.validator == "type" and not e.relative_path for e in errs)

    fitting = [errs for errs in branches.values() if not wrong_type(errs)]
    return min(fitting, key=len) if fitting else []


def _describe(error: jsonschema.ValidationError, depth: int = 0) -> str:
    line = f"{_where(error)}: {_short(error.message)}"
    for sub in _closest_branch(error)[:5]:  # anyOf / oneOf: why the branch of the right type failed
        line += "\n" + "  " * (depth + 3) + "because " + _describe(sub, depth + 1)
    return line


def _spec_errors(component_name: str, obj: Any) -> list[str]:
    found = sorted(_validator(component_name).iter_errors(obj), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [_describe(e) for e in found]


SDK_TYPE_NAMES = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
)


@functools.cache
def _sdk_types() -> dict[str, pydantic.TypeAdapter]:
    """The spec's component names mapped to the `openai` package's types for the same objects."""
    from openai.types import Completion, ErrorObject, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent

    class ListModelsResponse(pydantic.BaseModel):  # the SDK pages lists itself, it has no type for the envelope
        object: Literal["list"]
        data: list[Model]

    class ErrorResponse(pydantic.BaseModel):
        error: ErrorObject

    types = {
        "CreateChatCompletionResponse": ChatCompletion,
        "CreateChatCompletionStreamResponse": ChatCompletionChunk,
        "CreateCompletionResponse": Completion,
        "ListModelsResponse": ListModelsResponse,
        "Model": Model,
        "ErrorResponse": ErrorResponse,
        "Response": Response,
        "ResponseStreamEvent": ResponseStreamEvent,
        "ResponseItemList": ResponseItemList,
    }
    assert set(types) == set(SDK_TYPE_NAMES)
    return {name: pydantic.TypeAdapter(t) for name, t in types.items()}


def _sdk_errors(component_name: str, obj: Any) -> list[str]:
    adapters = _sdk_types()
    if component_name not in adapters:
        raise KeyError(f"no openai SDK type mapped for {component_name!r} (known: {sorted(adapters)})")
    try:  # JSON mode: the objects came off the wire, and strict JSON mode still accepts objects for nested models
        adapters[component_name].validate_json(json.dumps(obj), strict=True)
    except pydantic.ValidationError as exc:
        where = lambda loc: "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)  # noqa: E731
        return sorted(f"{where(e['loc'])}: {_short(e['msg'])}" for e in exc.errors())
    return []


def backend() -> str:
    """"spec" when the OpenAPI spec file is there, else "sdk" (the openai package's types)."""
    return "spec" if spec_path().is_file() else "sdk"


def errors(component_name: str, obj: Any, source: str | None = None) -> list[str]:
    """Readable violations of `obj` against the component, empty when it conforms (`source`: "spec" or "sdk")."""
    source = source or backend()
    return _spec_errors(component_name, obj) if source == "spec" else _sdk_errors(component_name, obj)


def validate(component_name: str, obj: Any, source: str | None = None) -> None:
    """Raise AssertionError listing every violation of `obj` against `#/components/schemas/<component_name>`."""
    source = source or backend()
    problems = errors(component_name, obj, source)
    if problems:
        body = _short(json.dumps(obj, default=str), 2000)
        raise AssertionError(
            f"{len(problems)} violation(s) of OpenAI schema {component_name} ({source}):\n  - "
            + "\n  - ".join(problems)
            + f"\nobject: {body}"
        )
