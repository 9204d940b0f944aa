"""An image's vision tower runs a slice per engine step (engine/encoding.py): a real server with the tiny vision
model, its per-step encode budget set to 1 ms so the encode spans many steps."""

import asyncio
import base64
import io
import json
import time

import httpx
import pytest
from PIL import Image

from conftest import ServerProcess

pytestmark = pytest.mark.slow  # a server of its own (docs/testing.md); the fast subset covers the encode in slices (test_vision_encode)

MODEL = "tiny-vision"


def image_url(color=(30, 120, 200), size=(320, 200)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_request(color=(30, 120, 200), wide=False, **kw) -> dict:
    """`wide`: an 1800x600 image at detail high: pan-and-scan crops, so an encode several times as long."""
    part = {"url": image_url(color, (1800, 600) if wide else (320, 200)), **({"detail": "high"} if wide else {})}
    content = [{"type": "image_url", "image_url": part}, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw}


TEXT = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def slow_vision(tiny_vision_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "slow-vision-server.log"
    env = {"OAI_GEMMA_ENGINE__VISION_STEP_MS": "1", "OAI_GEMMA_SERVER__IDLE_TIMEOUT": "0", "OAI_GEMMA_SERVER__REQUEST_TIMEOUT": "0"}
    with ServerProcess("--model", str(tiny_vision_dir), "--served-model-name", MODEL, env=env, log=log) as proc:
        yield proc


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


async def stream_times(client: httpx.AsyncClient, body: dict, times: list[float]) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            chunks = json.loads(line[6:]).get("choices") if line.startswith("data: {") else None
            if any((choice.get("delta") or {}).get("content") for choice in chunks or ()):  # not the role chunk
                times.append(time.monotonic())


def test_a_text_stream_keeps_streaming_while_an_image_is_encoded(slow_vision):
    before = health(slow_vision.url)

    async def main():
        async with httpx.AsyncClient(base_url=slow_vision.url, timeout=300) as client:
            text_times, image_times = [], []
            text = asyncio.create_task(stream_times(client, TEXT, text_times))
            while len(text_times) < 3:
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            await stream_times(client, image_request(stream=True), image_times)
            text.cancel()
            return text_times, sent, image_times[0]

    text_times, sent, first = asyncio.run(main())
    during = [t for t in text_times if sent < t < first]
    after = health(slow_vision.url)
    assert after["vision_encodes"] == before["vision_encodes"] + 1
    # the one-call encode ran at admission, between two steps: at most one text token could arrive meanwhile
    assert len(during) >= 5, (len(during), first - sent)
    metrics = httpx.get(slow_vision.url + "/metrics").text
    assert 'oai_gemma:vision_encode_seconds_count{model_name="tiny-vision"}' in metrics


def test_a_request_cancelled_mid_encode_drops_the_encode(slow_vision):
    before = health(slow_vision.url)

    async def main():
        async with httpx.AsyncClient(base_url=slow_vision.url, timeout=300) as client:
            text_times: list[float] = []
            text = asyncio.create_task(stream_times(client, TEXT, text_times))  # each encode slice waits for its step
            while not text_times:
                await asyncio.sleep(0.01)
            request = asyncio.create_task(client.post("/v1/chat/completions", json=image_request((200, 10, 10), wide=True)))
            deadline = time.monotonic() + 60
            while health(slow_vision.url)["waiting"] < 1:  # it is being encoded
                assert time.monotonic() < deadline and not request.done()
                await asyncio.sleep(0.02)
            request.cancel()  # the client goes away mid-encode
            while (now := health(slow_vision.url))["waiting"] > 0:
                assert time.monotonic() < deadline + 30, now
                await asyncio.sleep(0.05)
            text.cancel()
            return now

    now = asyncio.run(main())
    assert now["vision_encodes"] == before["vision_encodes"]  # dropped, never finished
    deadline = time.monotonic() + 20
    while (now := health(slow_vision.url))["running"] > 0:  # the text stream's cancel too
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    # the engine still serves images
    response = httpx.post(slow_vision.url + "/v1/chat/completions", json=image_request((200, 10, 10)), timeout=300)
    assert response.status_code == 200 and health(slow_vision.url)["vision_encodes"] == before["vision_encodes"] + 1
