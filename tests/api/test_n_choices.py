"""`n`: several choices from one prompt, in stream and non-stream, each with its own finish_reason."""

import pytest

from conftest import MODEL, user
from openai_schema import validate
from sse import post_stream

STORY = user("Write a short story about a lighthouse keeper.")


def sampled(client, n, seed=7, ignore_eos=False, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=STORY, n=n, seed=seed, temperature=1.0, max_tokens=12,
        extra_body={"ignore_eos": ignore_eos}, **kw
    )


def test_n_choices_are_indexed_in_order_and_each_has_its_finish_reason(client):
    response = sampled(client, 3, ignore_eos=True, logprobs=True)
    validate("CreateChatCompletionResponse", response.model_dump(mode="json", exclude_unset=True))
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert [len(c.logprobs.content) for c in response.choices] == [12, 12, 12]


def test_usage_counts_the_prompt_once_and_every_choice_s_tokens(client):
    one = sampled(client, 1, ignore_eos=True)
    three = sampled(client, 3, ignore_eos=True)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 12
    assert three.usage.total_tokens == three.usage.prompt_tokens + 36


def test_seeded_choices_differ_from_each_other_and_repeat_across_requests(client):
    first = [c.message.content for c in sampled(client, 3).choices]
    again = [c.message.content for c in sampled(client, 3).choices]
    assert first == again
    assert len(set(first)) > 1


def test_choice_0_of_a_seeded_request_is_what_n_1_gives(client):
    # both after the prompt is in the prefix cache: each then computes only its last prompt token, the same way.
    # (A prompt computed in one chunk and one taken from the cache round its last logits differently in the
    # last bits, even in float32, which can flip a token sampled at temperature 1 near a boundary.)
    sampled(client, 1)
    assert sampled(client, 3).choices[0].message.content == sampled(client, 1).choices[0].message.content


def test_a_stream_of_n_choices_carries_each_choice_s_deltas_and_finish(http, client):
    body = {"model": MODEL, "messages": STORY, "n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 10,
            "stream": True, "stream_options": {"include_usage": True}}
    stream = post_stream(http, body)
    chunks = stream.chunks
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    texts, finishes, roles = {0: "", 1: ""}, {}, {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta, index = choice["delta"], choice["index"]
            assert index not in finishes, "nothing after a choice's finish chunk"
            roles.setdefault(index, delta.get("role"))
            texts[index] += delta.get("content") or ""
            if choice["finish_reason"]:
                finishes[index] = choice["finish_reason"]
    assert roles == {0: "assistant", 1: "assistant"}
    assert set(finishes) == {0, 1}
    plain = client.chat.completions.create(**{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert [texts[0], texts[1]] == [c.message.content for c in plain.choices]
    assert chunks[-1]["usage"]["completion_tokens"] == plain.usage.completion_tokens


def test_n_beyond_the_batch_size_is_400_naming_n(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": STORY, "n": 64, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"


@pytest.mark.parametrize("n", [0, -1, 1000])
def test_n_out_of_range_is_400(http, n):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": STORY, "n": n, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
