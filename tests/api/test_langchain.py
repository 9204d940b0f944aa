"""LangChain's `ChatOpenAI` against the real server: the way many apps reach an OpenAI-compatible API."""

import pytest

from conftest import MODEL

langchain_openai = pytest.importorskip("langchain_openai")


@pytest.fixture(scope="module")
def chat(server):
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=8, max_retries=0
    )


def test_invoke_returns_the_same_text_as_the_openai_client(chat, client):
    message = chat.invoke("Name a color.")
    direct = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], temperature=0, max_tokens=8
    )
    assert message.content == direct.choices[0].message.content
    assert message.usage_metadata["output_tokens"] == direct.usage.completion_tokens


def test_stream_with_usage_concatenates_to_invoke_and_reports_tokens(server, chat):
    streaming = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=8, max_retries=0,
        stream_usage=True,
    )
    chunks = list(streaming.stream("Name an animal."))
    assert len([c for c in chunks if c.content]) > 1  # token by token, not one blob
    assert "".join(c.content for c in chunks) == chat.invoke("Name an animal.").content
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] >= 1
    assert usage[-1]["total_tokens"] == usage[-1]["input_tokens"] + usage[-1]["output_tokens"]


def test_batch_answers_each_prompt_like_invoke(chat):
    prompts = ["Name a fruit.", "Name a city.", "Name a tree."]
    answers = chat.batch(prompts)
    assert [a.content for a in answers] == [chat.invoke(p).content for p in prompts]


def test_with_structured_output_json_schema_returns_a_valid_object(server):
    schema = {
        "title": "City", "description": "A city and its country.", "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"], "additionalProperties": False,
    }
    chat = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=40, max_retries=0
    )
    answer = chat.with_structured_output(schema, method="json_schema", strict=True).invoke("Name a city, as JSON.")
    assert set(answer) == {"city", "country"}
    assert all(isinstance(v, str) for v in answer.values())
