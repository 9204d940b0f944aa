"""An output format (chat's `response_format`, Responses' `text.format`) or a forced tool call -> the grammar the
engine enforces, compiled off the event loop; schema errors as 400s naming the field that asked.

`json_schema_grammar` is the generic piece: anything that must constrain a request to a JSON schema
(tool calls too) can use it with its own `param`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..chat.tools import ToolPlan
from ..engine.engine import Engine
from ..engine.sampling.grammar import Grammar, InvalidSchema, StructuredOutputUnavailable, UnsupportedSchema
from .errors import invalid_request
from .protocol import JSONObjectFormat, JSONSchemaResponseFormat, ResponseFormat


@dataclass(frozen=True)
class OutputFormat:
    """A JSON schema the answer must follow, and the request field that asked for it (named in its errors)."""

    schema: dict
    field: str


def chat_output_format(response_format: ResponseFormat | None) -> OutputFormat | None:
    """Chat's `response_format`; None for free text (unset or `{"type": "text"}`)."""
    if isinstance(response_format, JSONObjectFormat):
        return OutputFormat({"type": "object"}, "response_format")
    if isinstance(response_format, JSONSchemaResponseFormat):
        schema = response_format.json_schema.schema
        return OutputFormat({} if schema is None else schema, "response_format")
    return None


async def json_schema_grammar(engine: Engine, schema: dict, param: str) -> Grammar:
    """The compiled grammar for `schema` (cached by the compiler), or a 400 naming `param`."""
    try:
        return await asyncio.to_thread(lambda: engine.grammars.json_schema(schema))
    except UnsupportedSchema as exc:
        raise invalid_request(f"{exc} (`{exc.feature}`)", param, "unsupported_schema_feature") from None
    except InvalidSchema as exc:
        raise invalid_request(f"invalid JSON schema: {exc}", param, "invalid_json_schema") from None
    except StructuredOutputUnavailable as exc:
        raise invalid_request(f"{exc}; send the request without `{param}`", param, "structured_output_unavailable") from None


async def request_grammar(engine: Engine, tools: ToolPlan | None, output: OutputFormat | None) -> Grammar | None:
    """The one grammar an answer follows, decided once: a forced tool call's schema (the answer is the call),
    else the output format's, else none."""
    schema = tools.forced_schema() if tools is not None else None
    chosen = None if output is None else await json_schema_grammar(engine, output.schema, output.field)  # a bad one is a 400 either way
    if schema is not None:
        return await json_schema_grammar(engine, schema, "tools")
    return chosen
