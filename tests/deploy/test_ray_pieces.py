"""The pure parts of the Ray Serve deployment: what the router matches on, and the merged /metrics."""

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="needs the `ray` extra")

from oai_gemma.deploy.ray_asgi import prompt_prefix
from oai_gemma.deploy.ray_metrics import merge
from oai_gemma.deploy.ray_router import block_hashes


def test_prompt_prefix_is_the_prompt_as_sent_whatever_comes_before_it():
    messages = [{"role": "user", "content": "hello"}]
    a = json.dumps({"model": "m", "temperature": 0, "messages": messages}).encode()
    b = json.dumps({"messages": messages, "stream": True}).encode()
    assert prompt_prefix(a) == prompt_prefix(b) == json.dumps(messages).encode()
    assert prompt_prefix(b'{"prompt": "once upon"}') == b'"once upon"'
    assert prompt_prefix(b"not json") == b"" and prompt_prefix(b'{"model": "m"}') == b""


def test_block_hashes_agree_exactly_as_far_as_the_prefixes_do():
    shared = b"x" * 130
    first, second = block_hashes(shared + b"a" * 70, 64), block_hashes(shared + b"b" * 70, 64)
    assert len(first) == len(second) == 3
    assert first[:2] == second[:2] and first[2] != second[2]  # blocks 0-1 lie in the shared 130 bytes
    assert block_hashes(b"short", 64) == []


def test_merged_metrics_keep_every_replicas_series_under_its_label():
    text = "# HELP t Tokens.\n# TYPE t counter\nt_total{model_name=\"m\"} %d\n"
    merged = merge({"r1": text % 3, "r2": text % 5}).decode()
    (family,) = text_string_to_metric_families(merged)
    assert {s.labels["replica"]: s.value for s in family.samples} == {"r1": 3.0, "r2": 5.0}
