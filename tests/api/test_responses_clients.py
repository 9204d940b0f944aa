"""Real client libraries on `/v1/responses`: the OpenAI Agents SDK (its default Responses model, and its chat
completions model) running an agent with a function tool to a final answer, and LangChain's `ChatOpenAI` with
`use_responses_api=True`.

The embedded model is a small base model that would rarely call a tool by itself, so the agents force the first
call with `ModelSettings(tool_choice="required")`; the SDK resets the choice after a tool ran (`reset_tool_choice`),
so the next turn may answer in prose. One call at a time (`parallel_tool_calls=False`): with several allowed, the
forced grammar lets this model repeat its call until `max_tokens`.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import MODEL

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

CALLS: list[str] = []


@agents.function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    CALLS.append(city)
    return f"It is sunny and 21 degrees in {city}."


def weather_agent(model) -> agents.Agent:
    return agents.Agent(
        name="weather",
        instructions="Answer questions about the weather. Use the tool, then answer in one sentence.",
        tools=[get_weather],
        model=model,
        # the base model rarely ends a text by itself, and a streamed run cut by `max_tokens` fails (as on OpenAI):
        # vLLM's `stop` extension ends the final answer at its first sentence
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=48,
            extra_body={"stop": [".", "\n"]},
        ),
    )


@pytest.fixture
def async_openai(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def default_responses_model(async_openai):
    """The SDK's default set-up, only pointed at this server: a string model name resolved by its default
    provider to its Responses model."""
    agents.set_default_openai_client(async_openai, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    yield MODEL
    agents.set_default_openai_api("responses")


def chat_completions_model(client: openai.AsyncOpenAI):
    return agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


RUN = {"max_turns": 4}


def config() -> agents.RunConfig:
    return agents.RunConfig(tracing_disabled=True)


def check_result(result) -> None:
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds, kinds
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str)
    assert CALLS, "the function tool never ran"


def test_agent_runs_a_tool_to_a_final_answer_through_responses(default_responses_model):
    CALLS.clear()
    result = asyncio.run(agents.Runner.run(weather_agent(default_responses_model), "Weather in Paris?", run_config=config(), **RUN))
    check_result(result)
    assert any(r.response_id and r.response_id.startswith("resp_") for r in result.raw_responses)


def test_agent_streams_a_tool_run_through_responses(default_responses_model):
    CALLS.clear()

    async def main():
        run = agents.Runner.run_streamed(weather_agent(default_responses_model), "Weather in Oslo?", run_config=config(), **RUN)
        kinds = [event.type async for event in run.stream_events()]
        return run, kinds

    run, kinds = asyncio.run(main())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    check_result(run)


def test_agent_runs_a_tool_through_chat_completions(async_openai):
    CALLS.clear()
    agent = weather_agent(chat_completions_model(async_openai))
    check_result(asyncio.run(agents.Runner.run(agent, "Weather in Rome?", run_config=config(), **RUN)))


def test_agent_streams_a_tool_run_through_chat_completions(async_openai):
    CALLS.clear()

    async def main():
        agent = weather_agent(chat_completions_model(async_openai))
        run = agents.Runner.run_streamed(agent, "Weather in Lima?", run_config=config(), **RUN)
        return run, [event.type async for event in run.stream_events()]

    run, kinds = asyncio.run(main())
    assert "run_item_stream_event" in kinds
    check_result(run)


# ---- LangChain ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def responses_chat(server):
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=8, max_retries=0,
        use_responses_api=True,
    )


def test_langchain_responses_invoke_matches_the_openai_client(responses_chat, client):
    message = responses_chat.invoke("Name a color.")
    direct = client.responses.create(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=8)
    assert message.text == direct.output_text
    assert message.usage_metadata["output_tokens"] == direct.usage.output_tokens
    assert message.response_metadata.get("id", direct.id).startswith("resp_")


def test_langchain_responses_stream_concatenates_to_invoke(responses_chat):
    chunks = list(responses_chat.stream("Name an animal."))
    text = "".join(c.text for c in chunks)
    assert len([c for c in chunks if c.text]) > 1  # token by token
    assert text == responses_chat.invoke("Name an animal.").text
