"""The official openai client, sync, async and streaming, against the real server and model."""

import asyncio
import time

import httpx

from conftest import MODEL, user


def greedy(client, text, **kw):
    return client.chat.completions.create(model=MODEL, messages=user(text), temperature=0, **kw)


def test_sync_completion_returns_text_and_usage(client):
    response = greedy(client, "Write a sentence about cats.", max_tokens=12)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_with_the_client_concatenates_to_the_non_stream_text(client):
    plain = greedy(client, "Name three colors.", max_tokens=16).choices[0].message.content
    stream = greedy(client, "Name three colors.", max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain


def test_async_client_runs_concurrent_requests(async_client):
    async def main():
        calls = [
            async_client.chat.completions.create(model=MODEL, messages=user(f"Count to {i}."), max_tokens=6, temperature=0)
            for i in range(4)
        ]
        return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    assert [r.usage.completion_tokens for r in responses] == [6, 6, 6, 6]


def test_max_tokens_cap_gives_length_exactly_at_the_cap(client):
    response = greedy(client, "Write a long essay about rivers.", max_tokens=5)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = greedy(client, "Write a long essay about rivers.", max_tokens=20, max_completion_tokens=3)
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_temperature_zero_is_deterministic(client):
    texts = {greedy(client, "Describe the sky.", max_tokens=10).choices[0].message.content for _ in range(2)}
    assert len(texts) == 1


def test_seed_makes_sampling_reproducible(client):
    def sampled(seed):
        return client.chat.completions.create(
            model=MODEL, messages=user("Invent a name."), max_tokens=12, temperature=1.0, seed=seed
        ).choices[0].message.content

    assert sampled(7) == sampled(7)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1


def test_schema_boundary_values_are_accepted(client):
    response = client.chat.completions.create(
        model=MODEL, messages=user("Hello"), max_tokens=2, temperature=0, top_p=1.0,
        presence_penalty=-2, frequency_penalty=2, n=1, stream_options=None,
    )
    assert response.choices[0].message.content is not None


def test_unknown_fields_are_ignored(client):
    response = greedy(client, "Hello", max_tokens=2, extra_body={"some_future_field": {"x": 1}, "user_tag": 5})
    assert response.usage.completion_tokens == 2


def _stream_pieces(client, text, max_tokens):
    stream = greedy(client, text, max_tokens=max_tokens, stream=True)
    return [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]


def test_stop_string_split_across_tokens_never_leaks(client):
    prompt = "Write a story about a dragon and a knight."
    pieces = _stream_pieces(client, prompt, 40)
    full = "".join(pieces)
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    expected = full[: full.find(stop)]
    streamed = _stream_pieces_with_stop(client, prompt, stop)
    plain = greedy(client, prompt, max_tokens=40, stop=[stop, "zzzz-never"])
    assert "".join(streamed) == expected
    assert plain.choices[0].message.content == expected
    assert plain.choices[0].finish_reason == "stop"
    assert all(stop not in piece for piece in streamed)


def _stream_pieces_with_stop(client, prompt, stop):
    stream = greedy(client, prompt, max_tokens=40, stream=True, stop=stop)
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_utf8_text_streams_whole_characters(client):
    prompt = "Repeat exactly: 你好，世界！🙂🦩ꙮ𓀀 Привет"  # the last three stream as UTF-8 byte tokens
    pieces = _stream_pieces(client, prompt, 40)
    assert pieces
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == greedy(client, prompt, max_tokens=40).choices[0].message.content


def _engine_load(http):
    return http.get("/health").json()


def test_client_disconnect_cancels_the_stream(http, server):
    payload = {"model": MODEL, "messages": user("Write a very long story."), "max_tokens": 1000, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/chat/completions", json=payload) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert _engine_load(http)["running"] == 1
    deadline = time.monotonic() + 5
    while _engine_load(http)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = {"status": "ok", "model": MODEL, "running": 0, "waiting": 0, "kv_cache_usage": 0}
    load = _engine_load(http)
    assert {key: load[key] for key in idle} == idle


def test_health_was_503_while_loading_then_200(server, http):
    assert 503 in server.health_seen
    assert server.health_seen[-1] == 200
    assert http.get("/health").status_code == 200


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    forced_id = tokenizer.encode(" lighthouse", add_special_tokens=False)[0]
    forced = greedy(client, "Describe the sky.", max_tokens=3, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == tokenizer.decode([forced_id] * 3)
    plain = greedy(client, "Describe the sky.", max_tokens=1).choices[0].message.content
    first_id = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = greedy(client, "Describe the sky.", max_tokens=1, logit_bias={str(first_id): -100})
    assert banned.choices[0].message.content != plain


def test_vllm_sampling_extensions_are_accepted_and_honoured(client):
    base = dict(model=MODEL, messages=user("Invent a name."), max_tokens=8, temperature=0.8, seed=3)
    extra = {"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 2, "ignore_eos": True}
    response = client.chat.completions.create(**base, extra_body=extra)
    assert response.usage.completion_tokens == 8
    greedy_penalised = client.chat.completions.create(**{**base, "temperature": 0}, extra_body={"repetition_penalty": 1.3})
    assert response.choices[0].message.content == greedy_penalised.choices[0].message.content  # top_k=1 is greedy


def test_logprobs_in_non_stream_match_the_tokens_and_the_top_list(client):
    response = greedy(client, "Describe the sea.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy takes the most likely token


def test_logprobs_stream_in_chunks_and_agree_with_non_stream(client):
    plain = greedy(client, "Describe the sea.", max_tokens=6, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    stream = greedy(client, "Describe the sea.", max_tokens=6, logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in plain]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in plain]


def test_no_logprobs_unless_asked(client):
    assert greedy(client, "Hello", max_tokens=2).choices[0].logprobs is None
