"""Issue 29 item 1 on a real server process: with every prefix-cache block hash forced to one value
(tests/fault_server.py), a prompt never takes another prompt's KV and answers as it does with nothing shared."""

from __future__ import annotations


import openai

from conftest import FAULT_SERVER, MODEL, ServerProcess, user

SMALL = ("--max-num-seqs", "2", "--max-prefill-tokens", "64", "--max-model-len", "1024", "--batch-invariant", "off")
STORY = "The keeper logged the tide, the wind and the lamp's oil every hour of the long winter night. " * 8


def ask(client: openai.OpenAI, text: str, salt: str | None = None) -> tuple[str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=user(text), max_tokens=12, temperature=0,
                                           extra_body={"cache_salt": salt} if salt else None)
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def test_with_every_block_hash_colliding_a_prompt_never_gets_another_prompts_kv(tmp_path):
    trigger = tmp_path / "collide"
    trigger.touch()
    first, second = "Summarise: " + STORY, "Translate: " + STORY.upper()
    with ServerProcess(*SMALL, env={"OAI_GEMMA_FAULT_HASH_COLLIDE": str(trigger)}, log=tmp_path / "server.log",
                       launcher=FAULT_SERVER) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        assert ask(client, first)[1] == 0
        answer, cached = ask(client, second)
        assert cached == 0  # every block's hash finds `first`'s block, whose tokens differ
        assert answer == ask(client, second, salt="nothing shared")[0]  # what it answers with no cache at all
        assert ask(client, first)[1] <= 16  # colliding for real: one entry per hash, so at most one block is found

