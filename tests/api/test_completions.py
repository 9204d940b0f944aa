"""`/v1/completions`, the legacy text-completions endpoint, through the official `openai` client and raw SSE."""

import time

import httpx
import openai
import pytest

from conftest import MAX_MODEL_LEN, MODEL
from openai_schema import validate
from sse import post_stream

PATH = "/v1/completions"


def complete(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def stream_of(http, payload):
    stream = post_stream(http, {"model": MODEL, "temperature": 0, "max_tokens": 8, **payload, "stream": True}, PATH)
    assert stream.status == 200, stream.body
    assert stream.events.count(b"data: [DONE]") == 1 and stream.events[-1] == b"data: [DONE]"
    return stream.chunks


def texts_by_index(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def validate_chunk(chunk: dict) -> None:
    """A chunk has the response's shape (the spec says both share it), except that `finish_reason` is null
    until a choice's last chunk, as OpenAI and vLLM send it (the spec does not mark it nullable)."""
    for choice in chunk["choices"]:
        assert choice["finish_reason"] in (None, "stop", "length"), choice
    validate("CreateCompletionResponse", {
        **chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]],
    })


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    validate("ErrorResponse", body)
    return body["error"]


# ---- responses -----------------------------------------------------------------------------------------


def test_response_is_a_text_completion_matching_the_schema(http):
    response = http.post(PATH, json={"model": MODEL, "prompt": "The sea is", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    validate("CreateCompletionResponse", body)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    assert body["choices"][0]["logprobs"] is None


def test_greedy_completion_is_deterministic(client):
    texts = {complete(client, "Once upon a time").choices[0].text for _ in range(2)}
    assert len(texts) == 1
    assert texts.pop()


def test_max_tokens_is_respected_with_finish_length(client):
    response = complete(client, "Write a long essay about rivers.", max_tokens=5, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


def test_default_max_tokens_is_16(client):
    response = client.completions.create(model=MODEL, prompt="Rivers", temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 16


def test_stop_string_ends_the_text_before_it(client):
    full = complete(client, "The history of Rome", max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    response = complete(client, "The history of Rome", max_tokens=24, stop=[stop, "zzzz-never"])
    assert response.choices[0].text == full[: full.find(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sampled(seed):
        return complete(client, "My favourite animal is", temperature=1.0, max_tokens=6, seed=seed).choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1


def test_logit_bias_forces_a_token(client, tokenizer):
    forced_id = tokenizer.encode(" lighthouse", add_special_tokens=False)[0]
    response = complete(client, "The sky", max_tokens=3, logit_bias={str(forced_id): 100})
    assert response.choices[0].text == tokenizer.decode([forced_id] * 3)


def test_usage_counts_prompt_tokens_with_bos_and_sums_over_prompts(client, tokenizer):
    prompts = ["The sea is", "Mountains are tall and"]
    response = complete(client, prompts, max_tokens=3, extra_body={"ignore_eos": True})
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


# ---- prompts ---------------------------------------------------------------------------------------------


def test_several_prompts_give_choices_in_prompt_order(client):
    prompts = ["The capital of France is", "1, 2, 3,", "Dear diary,"]
    response = complete(client, prompts)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [complete(client, p).choices[0].text for p in prompts]


def test_token_id_prompt_equals_the_string_prompt(client, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    assert ids[0] == tokenizer.bos_token_id
    assert complete(client, ids).choices[0].text == complete(client, "The capital of France is").choices[0].text


def test_list_of_token_id_lists_gives_one_choice_each(client, tokenizer):
    prompts = ["Dear diary,", "1, 2, 3,"]
    response = complete(client, [tokenizer.encode(p) for p in prompts])
    assert [c.text for c in response.choices] == [complete(client, p).choices[0].text for p in prompts]


# ---- echo --------------------------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client):
    plain = complete(client, "Once upon a time").choices[0].text
    assert complete(client, "Once upon a time", echo=True).choices[0].text == "Once upon a time" + plain


def test_echo_with_max_tokens_zero_returns_only_the_prompt(client, tokenizer):
    response = complete(client, "Once upon a time", echo=True, max_tokens=0)
    assert response.choices[0].text == "Once upon a time"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))


def test_echo_in_a_stream_is_each_choices_first_chunk(http):
    prompts = ["Once upon a time", "The sea is"]
    chunks = stream_of(http, {"prompt": prompts, "echo": True})
    for index, prompt in enumerate(prompts):
        first = next(c for chunk in chunks for c in chunk["choices"] if c["index"] == index)
        assert first["text"] == prompt
    plain = [c["text"] for c in http.post(PATH, json={"model": MODEL, "prompt": prompts, "max_tokens": 8, "temperature": 0}).json()["choices"]]
    assert texts_by_index(chunks) == {i: p + t for i, (p, t) in enumerate(zip(prompts, plain))}


# ---- logprobs ----------------------------------------------------------------------------------------------


def test_logprobs_lists_are_parallel_and_cover_the_text(client):
    response = complete(client, "Describe the sea.", max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(6)]


def test_logprobs_are_consistent_with_the_chosen_tokens(client):
    logprobs = complete(client, "Describe the sea.", max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}).choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4  # the 3 most likely and the chosen one, as OpenAI's
        assert all(value <= 0 for value in top.values())
        assert top[token] == logprob
        assert logprob == max(top.values())  # greedy takes the most likely token


def test_logprobs_zero_gives_the_chosen_token_only(client):
    logprobs = complete(client, "Describe the sea.", max_tokens=4, logprobs=0).choices[0].logprobs
    assert logprobs.top_logprobs == [{t: lp} for t, lp in zip(logprobs.tokens, logprobs.token_logprobs)]


def test_logprobs_stream_in_chunks_and_agree_with_non_stream(client, http):
    plain = complete(client, "Describe the sea.", max_tokens=6, logprobs=2).choices[0].logprobs
    chunks = stream_of(http, {"prompt": "Describe the sea.", "max_tokens": 6, "logprobs": 2})
    streamed = [c["logprobs"] for chunk in chunks for c in chunk["choices"] if c["logprobs"]]
    assert [t for lp in streamed for t in lp["tokens"]] == plain.tokens
    assert [o for lp in streamed for o in lp["text_offset"]] == plain.text_offset
    assert [round(v, 4) for lp in streamed for v in lp["token_logprobs"]] == [round(v, 4) for v in plain.token_logprobs]


# ---- echo with logprobs: the prompt's own logprobs (lm-eval-harness's loglikelihood) ------------------------


def validate_echo(body: dict) -> None:
    """The spec types each `token_logprobs` item as a number and each `top_logprobs` item as an object, but
    OpenAI's API (and vLLM) send null for the first echoed token, which has nothing before it."""
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        validate("CreateCompletionResponse", {**body, "choices": [{**choice, "logprobs": {
            **logprobs, "token_logprobs": logprobs["token_logprobs"][1:], "top_logprobs": logprobs["top_logprobs"][1:],
        }}]})


def echo_logprobs(http, prompt, **kw) -> dict:
    payload = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 1, "echo": True, "logprobs": 5, **kw}
    response = http.post(PATH, json=payload)
    assert response.status_code == 200, response.text
    body = response.json()
    validate_echo(body)
    return body


def next_token_logprobs(http, prompt_ids: list[int]) -> dict[str, float]:
    """The 5 most likely next tokens after `prompt_ids`, as a generated token's top_logprobs report them."""
    body = http.post(PATH, json={"model": MODEL, "prompt": prompt_ids, "temperature": 0, "max_tokens": 1, "logprobs": 5}).json()
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    return dict(sorted(top.items(), key=lambda kv: -kv[1])[:5])


def assert_same_distribution(a: dict[str, float], b: dict[str, float]) -> None:
    assert list(a) == list(b), (a, b)
    assert all(abs(a[k] - b[k]) < 2e-3 for k in a), (a, b)


def test_echo_logprobs_score_every_prompt_token(http, tokenizer):
    ids = tokenizer.encode("The capital of France is Paris")
    body = echo_logprobs(http, "The capital of France is Paris", max_tokens=0)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert all(lp < 0 for lp in logprobs["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    for position in (1, 3, len(ids) - 1):  # the prompt's entry at p is the distribution after its first p tokens
        top = logprobs["top_logprobs"][position]
        assert top[logprobs["tokens"][position]] == logprobs["token_logprobs"][position]
        expected = next_token_logprobs(http, ids[:position])
        assert_same_distribution(dict(sorted(top.items(), key=lambda kv: -kv[1])[:5]), expected)


def test_echo_logprobs_across_prefill_chunks_match_the_next_token_distribution(http, tokenizer):
    """A prompt longer than one prefill chunk (512 tokens): the positions at and after the chunk boundary,
    computed from different chunks, still give the model's distribution there."""
    ids = tokenizer.encode(" ".join(f"river {i} flows," for i in range(150)))[:560]
    logprobs = echo_logprobs(http, ids, max_tokens=0)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 560
    for position in (511, 512, 513, 559):
        top = dict(sorted(logprobs["top_logprobs"][position].items(), key=lambda kv: -kv[1])[:5])
        assert_same_distribution(top, next_token_logprobs(http, ids[:position]))


def test_echo_logprobs_offsets_point_into_the_echoed_text(http, tokenizer):
    for prompt in ("Once upon a time there was", tokenizer.encode("Once upon a time there was")):
        choice = echo_logprobs(http, prompt, max_tokens=3)["choices"][0]
        logprobs, text = choice["logprobs"], choice["text"]
        assert len(logprobs["tokens"]) == len(tokenizer.encode("Once upon a time there was")) + 3
        shown = [(t, o) for t, o in zip(logprobs["tokens"], logprobs["text_offset"]) if isinstance(prompt, list) or t != "<bos>"]
        assert all(text[o : o + len(t)] == t for t, o in shown), (text, shown)


def test_lm_eval_harness_loglikelihood_request(http, tokenizer):
    """The request lm-eval-harness's `local-completions` model sends for a loglikelihood task, read as it
    reads it: the continuation's log-likelihood is the sum of its tokens' logprobs, and it is greedy when each
    is the most likely token. The model's own greedy continuation must come out greedy, with the logprobs
    its generation reported."""
    context = tokenizer.encode("The history of Rome")
    generated = http.post(PATH, json={
        "model": MODEL, "prompt": context, "temperature": 0, "max_tokens": 4, "logprobs": 1, "ignore_eos": True,
    }).json()["choices"][0]["logprobs"]
    continuation = tokenizer.encode("".join(generated["tokens"]), add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in continuation] == generated["tokens"]  # the same tokens, re-tokenized
    body = http.post(PATH, json={
        "model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True,
    }).json()
    choice = body["choices"][0]["logprobs"]
    ctxlen = len(context)
    scores = choice["token_logprobs"][ctxlen:-1]
    tops = choice["top_logprobs"][ctxlen:-1]
    assert len(scores) == len(continuation)
    is_greedy = all(max(top, key=top.get) == token for top, token in zip(tops, choice["tokens"][ctxlen:-1]))
    assert is_greedy
    assert abs(sum(scores) - sum(generated["token_logprobs"])) < 1e-2


def test_echo_logprobs_compute_the_whole_prompt_even_when_it_is_cached(http):
    prompt = "A prompt sent twice, so that its second run could come from the prefix cache"
    first, second = (echo_logprobs(http, prompt, max_tokens=2) for _ in range(2))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_echo_logprobs_with_n_give_every_choice_the_prompt_scores(http):
    body = echo_logprobs(http, "The river", n=2, temperature=1.0, seed=3, max_tokens=3)
    first, second = (c["logprobs"] for c in body["choices"])
    prompt_len = body["usage"]["prompt_tokens"]
    assert first["token_logprobs"][:prompt_len] == second["token_logprobs"][:prompt_len]
    assert first["tokens"][:prompt_len] == second["tokens"][:prompt_len]


def test_echo_logprobs_stream_puts_the_prompt_in_each_choices_first_chunk(http):
    prompts = ["Once upon a time", "The sea is"]
    payload = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 4}
    chunks = stream_of(http, payload)
    plain = http.post(PATH, json={"model": MODEL, "temperature": 0, **payload}).json()
    for index, prompt in enumerate(prompts):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert mine[0]["text"].startswith(prompt)
        assert mine[0]["logprobs"]["tokens"][0] == "<bos>" and mine[0]["logprobs"]["token_logprobs"][0] is None
        expected = plain["choices"][index]["logprobs"]
        assert [t for c in mine for t in c["logprobs"]["tokens"]] == expected["tokens"]
        assert [o for c in mine for o in c["logprobs"]["text_offset"]] == expected["text_offset"]
        assert "".join(c["text"] for c in mine) == plain["choices"][index]["text"]


def test_no_logprobs_unless_asked(client):
    assert complete(client, "Hello", max_tokens=2).choices[0].logprobs is None


# ---- streaming ---------------------------------------------------------------------------------------------


def test_every_stream_chunk_matches_the_schema_and_shares_one_id(http):
    chunks = stream_of(http, {"prompt": ["The sea is", "Dear diary,"], "logprobs": 1, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        validate_chunk(chunk)
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_stream_concatenates_to_the_non_stream_text(client):
    plain = complete(client, "Name three colors:", max_tokens=8).choices[0].text
    stream = complete(client, "Name three colors:", max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain


def test_stream_of_several_prompts_interleaves_chunks_by_index(http, client):
    prompts = ["The capital of France is", "1, 2, 3,", "Dear diary,"]
    chunks = stream_of(http, {"prompt": prompts})
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    indices = [chunk["choices"][0]["index"] for chunk in chunks]
    assert indices != sorted(indices)  # the prompts ran together, not one after the other
    assert texts_by_index(chunks) == {i: c.text for i, c in enumerate(complete(client, prompts).choices)}
    finishes = [(c["index"], c["finish_reason"]) for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(i for i, _ in finishes) == [0, 1, 2]


def test_stream_include_usage_sends_one_last_usage_chunk(http, client):
    prompts = ["The sea is", "Dear diary,"]
    chunks = stream_of(http, {"prompt": prompts, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == []
    assert all("usage" not in chunk for chunk in chunks[:-1])
    usage = complete(client, prompts).usage
    counts = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert tuple(chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")) == counts


def test_client_disconnect_cancels_every_prompt_of_the_stream(http, server):
    payload = {"model": MODEL, "prompt": ["Write a long story.", "Write a long poem."], "max_tokens": 1000, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", PATH, json=payload) as response:
            lines = response.iter_lines()
            for _ in range(8):
                next(lines)
            assert http.get("/health").json()["running"] == 2
    deadline = time.monotonic() + 5
    while http.get("/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    load = http.get("/health").json()
    assert (load["running"], load["waiting"]) == (0, 0)


# ---- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt[0]"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": [99999999]}, "prompt[0]"),
        ({"prompt": [2.5]}, "prompt[0]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": True, "logprobs": 1, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
        ({"n": 64}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"suffix": "end."}, "suffix"),
        ({"stop": 5}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
    ],
)
def test_bad_parameter_is_400_naming_it(http, patch, param):
    error = error_of(http.post(PATH, json={"model": MODEL, "prompt": "Hi", **patch}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_missing_prompt_is_400_naming_prompt(http):
    assert error_of(http.post(PATH, json={"model": MODEL}), 400)["param"] == "prompt"


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"


def test_prompt_plus_max_tokens_over_context_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, "Hello", max_tokens=MAX_MODEL_LEN)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "prompt"


def test_one_prompt_too_long_in_a_list_is_context_length_exceeded(http):
    prompts = [[2, 9259], [2] + [5] * MAX_MODEL_LEN]
    error = error_of(http.post(PATH, json={"model": MODEL, "prompt": prompts}), 400)
    assert error["code"] == "context_length_exceeded"


# ---- clients -----------------------------------------------------------------------------------------------


def test_langchain_openai_llm_invoke_returns_the_completion(server, client):
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=8, max_retries=0)
    assert llm.invoke("The capital of France is") == complete(client, "The capital of France is").choices[0].text


def test_n_choices_per_prompt_are_indexed_prompt_by_prompt(client):
    prompts = ["The river", "A mountain"]
    response = complete(client, prompts, n=2, temperature=1.0, seed=5, echo=True, max_tokens=6)
    validate("CreateCompletionResponse", response.model_dump(mode="json", exclude_unset=True))
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(prompts[c.index // 2]) for c in response.choices] == [True] * 4
    single = complete(client, prompts, temperature=1.0, seed=5, max_tokens=6)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # each prompt counted once


def test_n_choices_stream_carries_every_index(http):
    chunks = stream_of(http, {"prompt": "Once upon a time", "n": 3, "temperature": 1.0, "seed": 3, "max_tokens": 5})
    finishes = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
    assert set(finishes) == {0, 1, 2}
    assert set(texts_by_index(chunks)) == {0, 1, 2}
