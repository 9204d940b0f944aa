"""Images a tool returns (a Responses `function_call_output` with `input_image`, the Agents SDK's `ToolOutputImage`,
a chat `tool` message with `image_url` parts): the model reads them as it reads a user's, on the tiny multimodal
model's server (conftest's `vision_server`)."""

import asyncio
import base64
import io

import openai
import pytest
from PIL import Image
from pydantic import BaseModel

from conftest import VISION_API_KEY, VISION_MODEL as MODEL
from oai_gemma.chat import render_chat
from openai_schema import validate

pytestmark = pytest.mark.slow


def png_url(color=(200, 30, 30)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), color).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def vclient(vision_server):
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key=VISION_API_KEY, max_retries=0, timeout=120)


ASK = {"role": "user", "content": "What is on my screen?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}


def chat_with_tool_image(url: str | None) -> list[dict]:
    content = [{"type": "text", "text": "The screen:"}]
    if url:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return [ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": content}]


def test_an_image_in_a_tool_result_is_rendered_inside_its_output_block():
    rendered = render_chat(chat_with_tool_image("data:image/png;base64,AAAA"))
    assert "```tool_output\nThe screen:<start_of_image>\n```" in rendered.prompt
    assert [image.param for image in rendered.images] == ["messages[2].content[1]"]


def test_a_tool_result_image_is_read_in_chat_and_responses_alike(vclient):
    url = png_url()
    without = vclient.chat.completions.create(model=MODEL, messages=chat_with_tool_image(None), max_tokens=4, temperature=0)
    chat = vclient.chat.completions.create(model=MODEL, messages=chat_with_tool_image(url), max_tokens=4, temperature=0)
    assert chat.usage.prompt_tokens >= without.usage.prompt_tokens + 256, "the image's soft tokens are in the prompt"
    raw = vclient.responses.with_raw_response.create(model=MODEL, max_output_tokens=4, temperature=0, input=[
        ASK,
        {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "The screen:"}, {"type": "input_image", "image_url": url, "detail": "auto"}]},
    ])
    validate("Response", raw.http_response.json())
    response = raw.parse()
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_a_tool_result_image_without_a_url_is_400_naming_the_part(vclient):
    with pytest.raises(openai.BadRequestError) as info:
        vclient.responses.create(model=MODEL, max_output_tokens=4, input=[
            ASK,
            {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_image", "file_id": "file_1"}]},
        ])
    assert info.value.body["param"] == "input[2].output[0]" and "image_url" in info.value.body["message"]


class Screen(BaseModel):
    red: bool


def test_an_agents_sdk_tool_returning_an_image_runs_to_a_final_answer(vision_server):
    """The SDK sends the image as the tool's `function_call_output`; the final answer is a structured one (the random
    model would not end prose by itself, and the SDK fails a run cut by `max_output_tokens`)."""
    agents = pytest.importorskip("agents")
    shots = []

    @agents.function_tool
    def screenshot() -> agents.ToolOutputImage:
        """Takes a screenshot of the user's screen."""
        shots.append(1)
        return agents.ToolOutputImage(image_url=png_url(), detail="auto")

    client = openai.AsyncOpenAI(base_url=vision_server.url + "/v1", api_key=VISION_API_KEY, max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="screen", instructions="Look at the screen, then answer.", tools=[screenshot], model=model, output_type=Screen,
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=24),
    )
    result = asyncio.run(agents.Runner.run(agent, "Is my screen red?", run_config=agents.RunConfig(tracing_disabled=True), max_turns=4))
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert shots == [1] and isinstance(result.final_output, Screen)
    first, second = result.raw_responses
    assert second.usage.input_tokens >= first.usage.input_tokens + 256, "the tool's image reached the model"
