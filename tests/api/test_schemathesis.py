"""Schemathesis against the server's own OpenAPI document: every generated request, valid or not, gets a
documented status with a body matching the documented schema, and never a 5xx.

A dedicated server with a 128-token context and 8 default completion tokens, so any valid generated request
finishes in about a second. Schemathesis's pytest plugin does not run under pytest 9 (it sets the removed
`Node._nodeid`), so the tests drive its Python API: one hypothesis run per operation of the document.
"""

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import MODEL, ServerProcess

pytestmark = pytest.mark.slow

CONFORMANCE = [
    not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
    response_schema_conformance,
]
EXAMPLES_PER_OPERATION = 20


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    env = {"OAI_GEMMA_ENGINE__DEFAULT_MAX_TOKENS": "8"}
    log = tmp_path_factory.mktemp("logs") / "schemathesis-server.log"
    with ServerProcess("--max-model-len", "128", env=env, log=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def api_schema(small_server):
    return schemathesis.openapi.from_url(small_server.url + "/schema/openapi.json")


NOT_HONOURED = ("tools", "tool_choice", "functions", "function_call", "audio", "prediction", "reasoning_effort",
                "web_search_options", "modalities", "suffix", "best_of", "n")


def reaching_the_engine(case):
    """Most generated requests are valid by the schema yet refused by rules it cannot say (an unknown model, a
    parameter or message role not honoured yet, an image for this text-only model: all tested elsewhere). Make
    them servable, keeping the generated values, so that valid generated requests reach the engine."""
    body = case.body
    if isinstance(body, dict) and "model" in body:
        body["model"] = MODEL
        for name in NOT_HONOURED:
            body.pop(name, None)
        if not body.get("stream"):
            body.pop("stream_options", None)
        for message in body.get("messages") or []:
            message["role"] = "user" if message.get("role") in ("tool", "function") else message.get("role")
            message.pop("tool_calls", None)
            content = message.get("content")
            if isinstance(content, list):
                content = [part for part in content if part.get("type") == "text"]
            message["content"] = content or "hi"
    return case


def fuzz_every_operation(api_schema, base_url: str, mode: GenerationMode, checks) -> tuple[list[str], Counter]:
    """Run each operation's generated cases through `checks`: the failures (one line per operation) and the
    statuses seen per operation. An operation with nothing to make invalid (no body, free-form strings) is skipped
    in negative mode."""
    failures, statuses = [], Counter()
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert operations, "the document lists no operations"
    for operation in operations:

        strategy = operation.as_strategy(generation_mode=mode)

        @given(case=strategy.map(reaching_the_engine) if mode is GenerationMode.POSITIVE else strategy)
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case):
            response = case.call_and_validate(base_url=base_url, checks=checks, timeout=30)
            statuses[operation.label, response.status_code] += 1

        try:
            run()
        except Unsatisfiable:
            if mode is GenerationMode.POSITIVE:
                failures.append(f"{operation.label}: no valid request could be generated")
        except Exception as exc:  # noqa: BLE001 - report every operation, not just the first failing one
            failures.append(f"{operation.label}: {exc}")
    return failures, statuses


def test_generated_valid_requests_get_documented_answers_and_no_5xx(api_schema, small_server):
    failures, statuses = fuzz_every_operation(api_schema, small_server.url, GenerationMode.POSITIVE, CONFORMANCE)
    assert not failures, "\n\n".join(failures)
    assert statuses["POST /v1/chat/completions", 200] > 0, statuses  # some generated chats really ran


def test_generated_invalid_requests_are_rejected_with_documented_4xx(api_schema, small_server):
    checks = [*CONFORMANCE, negative_data_rejection]
    failures, statuses = fuzz_every_operation(api_schema, small_server.url, GenerationMode.NEGATIVE, checks)
    assert not failures, "\n\n".join(failures)
    assert statuses["POST /v1/chat/completions", 400] > 0, statuses


def test_every_route_documents_its_wire_types(small_server):
    """A new route that forgets `operation_class=documented(...)` would be fuzzed blind: catch it here."""
    document = httpx.get(small_server.url + "/schema/openapi.json").json()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            ok = [media["schema"] for media in operation["responses"]["200"]["content"].values()]
            assert all(ok), f"{method.upper()} {path} documents no response body"
            if method == "post":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].removeprefix("#/components/schemas/") in document["components"]["schemas"]
