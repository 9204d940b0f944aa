"""Predicted Outputs and speculative decoding on the wire (the shared server: float32, batch-invariant mode, speculation
`auto`): the real openai client's `prediction`, its usage counts, the stream, the `speculative: false` opt-out,
refusals, and the spec-decode metrics."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import MODEL
from metrics_scrape import delta, scrape
from test_errors import error_of, post

CODE = '''def merge_ranges(ranges):
    merged = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
'''
EDIT = [{"role": "user", "content": f"Rename the variable merged to joined. Reply with the code only.\n\n```python\n{CODE}```"}]


def ask(client, **kw):
    slow = client.with_options(timeout=600)  # a loaded shared machine: the assertions never time the model
    return slow.chat.completions.create(model=MODEL, messages=EDIT, **{"max_tokens": 80, "temperature": 0, **kw})


def test_prediction_usage_counts_add_up_and_the_output_is_the_same_without_it(client, http, base_url):
    before = scrape(base_url)
    plain = ask(client, extra_body={"speculative": False})
    predicted = ask(client, prediction={"type": "content", "content": CODE})
    after = scrape(base_url)
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    predicted_tokens = len(http.post("/tokenize", json={"model": MODEL, "prompt": CODE, "add_special_tokens": False}).json()["tokens"])
    assert details.accepted_prediction_tokens > 20, details  # the answer copies most of the code
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted_tokens  # OpenAI's meaning
    assert details.accepted_prediction_tokens <= predicted.usage.completion_tokens
    assert plain.usage.completion_tokens_details is None  # sent when the request has a prediction
    for prefix in ("vllm:", "oai_gemma:"):
        labels = {"engine": "0"}
        drafted = delta(before, after, prefix + "spec_decode_num_draft_tokens_total", **labels)
        accepted = delta(before, after, prefix + "spec_decode_num_accepted_tokens_total", **labels)
        assert delta(before, after, prefix + "spec_decode_num_drafts_total", **labels) > 0
        assert drafted >= accepted > 0
        key = (prefix + "spec_decode_num_accepted_tokens_per_pos_total", frozenset({"position": "0", "model_name": MODEL, **labels}.items()))
        first = after.samples[key] - before.samples.get(key, 0.0)  # no series before the server's first draft
        assert 0 < first <= accepted


def test_a_prediction_in_text_parts_streams_the_same_text_and_usage(client):
    whole = ask(client, prediction={"type": "content", "content": CODE})
    parts = [{"type": "text", "text": CODE[:40]}, {"type": "text", "text": CODE[40:]}]
    stream = ask(client, prediction={"type": "content", "content": parts}, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens == whole.usage.completion_tokens_details.accepted_prediction_tokens


def test_the_counts_do_not_depend_on_drafting_or_on_load(client, base_url):
    """OpenAI's counts are about the prediction and the output alone: the same without speculation (which drafts
    nothing), and for each of 8 concurrent requests (the server is batch-invariant: the same output)."""
    alone = ask(client, prediction={"type": "content", "content": CODE}, max_tokens=24)
    before = scrape(base_url)
    off = ask(client, prediction={"type": "content", "content": CODE}, extra_body={"speculative": False}, max_tokens=24)
    assert delta(before, scrape(base_url), "oai_gemma:spec_decode_num_drafts_total", engine="0") == 0
    with ThreadPoolExecutor(8) as pool:
        crowd = list(pool.map(lambda _: ask(client, prediction={"type": "content", "content": CODE}, max_tokens=24), range(8)))
    counts = {(r.usage.completion_tokens_details.accepted_prediction_tokens, r.usage.completion_tokens_details.rejected_prediction_tokens)
              for r in [alone, off, *crowd]}
    assert len(counts) == 1 and next(iter(counts))[0] >= 5, counts


@pytest.mark.parametrize("prediction", [
    {"type": "image", "content": "x"},
    {"type": "content"},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    "just a string",
])
def test_a_malformed_prediction_is_a_400_naming_it(http, prediction):
    error = error_of(post(http, {"model": MODEL, "messages": EDIT, "max_tokens": 1, "prediction": prediction}), 400)
    assert "prediction" in (error["param"] or "") + error["message"], json.dumps(error)


def test_a_prediction_longer_than_the_context_is_a_400(http):
    error = error_of(post(http, {"model": MODEL, "messages": EDIT, "max_tokens": 1,
                                 "prediction": {"type": "content", "content": "word " * 5000}}), 400)
    assert error["param"] == "prediction"


@pytest.mark.slow  # fast subset (issue 36.4): the same subsystem is covered by its lighter tests
def test_a_prediction_with_n_logprobs_penalties_or_tools_gives_what_the_request_gives_without_speculation(client):
    """OpenAI refuses `prediction` with n > 1, logprobs or penalties; here they are served, and exactly: every choice's
    text and logprobs are those of the same request without speculation, and the counts add up over the choices."""
    params = {"n": 2, "seed": 7, "temperature": 0.3, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.2,
              "frequency_penalty": 0.1}
    plain = ask(client, extra_body={"speculative": False}, **params)
    predicted = ask(client, prediction={"type": "content", "content": CODE}, **params)
    for theirs, ours in zip(plain.choices, predicted.choices, strict=True):
        assert ours.message.content == theirs.message.content
        assert [(t.token, t.logprob) for t in ours.logprobs.content] == [(t.token, t.logprob) for t in theirs.logprobs.content]
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 20 and details.accepted_prediction_tokens <= predicted.usage.completion_tokens
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens
    tool = {"type": "function", "function": {"name": "save_file", "description": "Save a file.",
                                             "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}
    plain = ask(client, extra_body={"speculative": False}, tools=[tool])
    predicted = ask(client, prediction={"type": "content", "content": CODE}, tools=[tool])
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    assert predicted.choices[0].message.tool_calls == plain.choices[0].message.tool_calls
    assert predicted.usage.completion_tokens_details is not None  # reported under a tool grammar too
