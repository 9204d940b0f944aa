"""Issue 29 item 1 on a real server process: with every prefix-cache block hash forced to one value
(tests/fault_server.py), a prompt never takes another prompt's KV and answers as it does with nothing shared."""

from __future__ import annotations

import openai
import pytest

from conftest import MODEL, user

pytestmark = pytest.mark.slow

STORY = "The keeper logged the tide, the wind and the lamp's oil every hour of the long winter night. " * 8


def ask(client: openai.OpenAI, text: str, salt: str | None = None) -> tuple[str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=user(text), max_tokens=12, temperature=0,
                                           extra_body={"cache_salt": salt} if salt else None)
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def test_with_every_block_hash_colliding_a_prompt_never_gets_another_prompts_kv(fault_server, fault_switches):
    # the shared fault server (conftest): these prompts are new to it, and collide only from here on
    fault_switches.touch("hash_collide")
    first, second = "Summarise: " + STORY, "Translate: " + STORY.upper()
    client = openai.OpenAI(base_url=fault_server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    assert ask(client, first)[1] == 0
    answer, cached = ask(client, second)
    assert cached == 0  # every block's hash finds `first`'s block, whose tokens differ
    assert answer == ask(client, second, salt="nothing shared")[0]  # what it answers with no cache at all
    assert ask(client, first)[1] <= 16  # colliding for real: one entry per hash, so at most one block is found
