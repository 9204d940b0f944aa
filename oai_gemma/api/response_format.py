"""`response_format` (or a forced tool call) -> the grammar the engine enforces, compiled off the event loop; schema errors as 400s.

`json_schema_grammar` is the generic piece: anything that must constrain a request to a JSON schema
(tool calls too) can use it with its own `param`.
"""

from __future__ import annotations

import asyncio

from ..chat.tools import ToolPlan
from ..engine.engine import Engine
from ..engine.sampling.grammar import Grammar, InvalidSchema, StructuredOutputUnavailable, UnsupportedSchema
from .errors import invalid_request
from .protocol import JSONObjectFormat, JSONSchemaResponseFormat, ResponseFormat


async def response_format_grammar(engine: Engine, response_format: ResponseFormat | None) -> Grammar | None:
    """None for free text (unset or `{"type": "text"}`)."""
    if isinstance(response_format, JSONObjectFormat):
        return await json_schema_grammar(engine, {"type": "object"}, "response_format")
    if isinstance(response_format, JSONSchemaResponseFormat):
        schema = response_format.json_schema.schema
        return await json_schema_grammar(engine, {} if schema is None else schema, "response_format")
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


async def request_grammar(engine: Engine, tools: ToolPlan | None, response_format: ResponseFormat | None) -> Grammar | None:
    """The one grammar an answer follows, decided once: a forced tool call's schema (the answer is the call),
    else `response_format`'s, else none."""
    schema = tools.forced_schema() if tools is not None else None
    chosen = await response_format_grammar(engine, response_format)  # checked either way: a bad one is a 400
    if schema is not None:
        return await json_schema_grammar(engine, schema, "tools")
    return chosen
