"""Images end to end: the tiny multimodal Gemma-3 served by a second real server, driven by the openai client (a
LoRA adapter on its language model included); and the engine's own multimodal prefill held against transformers'
forward."""

import asyncio
import base64
import io
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
import torch
from PIL import Image

from conftest import (VISION_ADAPTER, VISION_API_KEY, VISION_MAX_DOWNLOAD, VISION_MAX_IMAGES, VISION_MAX_PIXELS,
                      VISION_MODEL)
from lora_adapters import merged_model
from oai_gemma.chat import render_chat
from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings
from openai_schema import validate

pytestmark = pytest.mark.slow

MODEL, ADAPTER = VISION_MODEL, VISION_ADAPTER
MAX_IMAGES, MAX_PIXELS, MAX_DOWNLOAD = VISION_MAX_IMAGES, VISION_MAX_PIXELS, VISION_MAX_DOWNLOAD


def png(width=320, height=200, color=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def image_part(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def ask(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, *parts]}]


@pytest.fixture(scope="module")
def image_host():
    """A local web server for http image URLs (loopback: allowed by the vision server's allowed_hosts)."""
    noise = io.BytesIO()
    Image.frombytes("RGB", (1000, 700), random.Random(0).randbytes(1000 * 700 * 3)).save(noise, "PNG")
    files = {"/red.png": png(), "/blue.jpg": png(color=(0, 0, 250), fmt="JPEG"), "/noise.png": noise.getvalue()}
    assert len(files["/noise.png"]) > MAX_DOWNLOAD

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"no")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def vision_loaded(tiny_vision_dir):
    """The tiny multimodal model in float32, loaded once for the module's in-process references."""
    return load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"))


# the server: conftest's `vision_server` (the adapter, these limits, an API key), shared with the playground's image test
@pytest.fixture
def vclient(vision_server):
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key=VISION_API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def processor(tiny_vision_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vision_dir)


def expected_prompt_tokens(processor, messages, images, pan_and_scan=False) -> int:
    rendered = render_chat(messages).prompt
    inputs = processor(text=rendered, images=images or None, add_special_tokens=False, do_pan_and_scan=pan_and_scan)
    return len(inputs["input_ids"][0])


def complete(vclient, messages, **kw):
    return vclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, **kw)


def test_models_say_the_model_and_its_adapter_read_images(vclient):
    cards = {card.id: card.model_dump() for card in vclient.models.list().data}
    for name in (VISION_MODEL, VISION_ADAPTER):
        assert cards[name]["modalities"] == ["text", "image"] and "vision" in cards[name]["capabilities"], cards[name]
        assert cards[name]["status"] == {"value": "loaded"}


def test_one_base64_image_is_answered_with_exact_token_accounting(vclient, processor):
    messages = ask(image_part(data_url(png())))
    response = complete(vclient, messages)
    validate("CreateChatCompletionResponse", response.model_dump(exclude_unset=True))
    assert response.choices[0].message.content
    image = Image.open(io.BytesIO(png()))
    assert response.usage.prompt_tokens == expected_prompt_tokens(processor, messages, [image])
    assert response.usage.prompt_tokens >= 256
    chunks = list(complete(vclient, messages, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == response.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == response.usage.prompt_tokens


def test_http_url_on_an_allowed_host_streams_an_answer(vclient, image_host):
    messages = ask(image_part(image_host + "/blue.jpg"))
    stream = complete(vclient, messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == complete(vclient, messages).choices[0].message.content
    assert chunks[-1].usage.prompt_tokens >= 256


def test_several_images_in_one_message_and_in_earlier_turns(vclient, processor, image_host):
    red, blue = png(), png(color=(0, 0, 250))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "First:"}, image_part(data_url(red))]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": [image_part(data_url(blue)), {"type": "text", "text": "and"}, image_part(image_host + "/red.png")]},
    ]
    response = complete(vclient, messages)
    images = [Image.open(io.BytesIO(b)) for b in (red, blue, red)]
    assert response.usage.prompt_tokens == expected_prompt_tokens(processor, messages, images)
    assert response.usage.prompt_tokens >= 3 * 256


def test_detail_high_turns_on_pan_and_scan_and_counts_every_crop(vclient, processor):
    wide = png(1800, 600)
    image = Image.open(io.BytesIO(wide))
    low = complete(vclient, ask(image_part(data_url(wide), "low"))).usage.prompt_tokens
    high = complete(vclient, ask(image_part(data_url(wide), "high"))).usage.prompt_tokens
    assert low == expected_prompt_tokens(processor, ask(image_part("x")), [image])
    assert high == expected_prompt_tokens(processor, ask(image_part("x")), [image], pan_and_scan=True)
    assert high - low >= 2 * 256  # at least two extra 256-token crops


def test_image_request_batches_with_concurrent_text_streams(vision_server):
    async def main():
        async with openai.AsyncOpenAI(base_url=vision_server.url + "/v1", api_key=VISION_API_KEY, max_retries=0) as client:
            async def text(i):
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=12, temperature=0, stream=True
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            async def image():
                r = await client.chat.completions.create(model=MODEL, messages=ask(image_part(data_url(png()))), max_tokens=6, temperature=0)
                return r.choices[0].message.content

            together = await asyncio.gather(text(3), image(), text(5), text(7))
            alone = [await text(3), await image(), await text(5), await text(7)]
            return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    assert all(together)


def bad_request(vclient, messages):
    with pytest.raises(openai.BadRequestError) as info:
        complete(vclient, messages)
    return info.value.body


TRUNCATED = png()[:60]


@pytest.mark.parametrize(
    "url, words",
    [
        ("data:image/png;base64,@@@not-base64@@@", "base64"),
        (data_url(b"this is plain text, not an image"), "not an image"),
        (data_url(TRUNCATED), "truncated"),
        (data_url(png(2000, 1500)), "pixels"),
        ("http://10.0.0.1/cat.png", "private"),
        ("http://169.254.169.254/latest/meta-data", "metadata"),
        ("file:///etc/passwd", "file"),
        ("ftp://example.com/cat.png", "unsupported"),
    ],
    ids=["invalid-base64", "not-an-image", "truncated", "decompression-bomb", "private-address", "metadata", "file-url", "ftp"],
)
def test_bad_image_is_400_naming_the_part(vclient, url, words):
    body = bad_request(vclient, ask(image_part(url)))
    assert body["param"] == "messages[0].content[1]"
    assert body["type"] == "invalid_request_error"
    assert words in body["message"].lower(), body["message"]


def test_text_holding_image_tokens_beside_an_image_is_400_naming_the_text(vclient):
    # it was a 500: the tokenizer read them as a second image's tokens, and the engine found two images for one's pixels
    messages = [{"role": "user", "content": [{"type": "text", "text": "<image_soft_token> look"}, image_part(data_url(png()))]}]
    body = bad_request(vclient, messages)
    assert body["param"] == "messages[0].content[0]" and body["type"] == "invalid_request_error"
    assert "<image_soft_token>" in body["message"], body["message"]


def test_too_many_images_is_400_naming_the_first_extra_one(vclient):
    parts = [image_part(data_url(png())) for _ in range(MAX_IMAGES + 1)]
    body = bad_request(vclient, ask(*parts))
    assert body["param"] == f"messages[0].content[{MAX_IMAGES + 1}]"


def test_too_large_download_is_400(vclient, image_host):
    body = bad_request(vclient, ask(image_part(image_host + "/noise.png")))
    assert body["param"] == "messages[0].content[1]"
    assert "large" in body["message"].lower() or "bytes" in body["message"].lower(), body["message"]


def test_unreachable_url_is_400(vclient, image_host):
    body = bad_request(vclient, ask(image_part(image_host + "/missing.png")))
    assert body["param"] == "messages[0].content[1]"
    assert "404" in body["message"]


def greedy_with_image(model, inputs, steps: int) -> list[int]:
    """transformers' greedy tokens after a processed image prompt (as the engine samples: below the image token), up
    to an end of turn (included): the prompt's forward once, image and all, then a token at a time on its KV cache
    (a full recompute a token re-encoded the image each time: 5x the CPU for the same tokens)."""
    ids, types, out = inputs["input_ids"], inputs["token_type_ids"], []
    with torch.inference_mode():
        result = model(input_ids=ids, token_type_ids=types, pixel_values=inputs["pixel_values"], use_cache=True)
        while True:
            out.append(int(result.logits[0, -1, : model.config.image_token_id].argmax()))
            if out[-1] in (1, 106) or len(out) == steps:  # <eos>, <end_of_turn>
                return out
            result = model(input_ids=torch.tensor([[out[-1]]]), token_type_ids=torch.zeros(1, 1, dtype=types.dtype),
                           cache=result.cache, use_cache=True)


def test_vision_prefill_matches_transformers_forward(vision_loaded, processor):
    """Our runner (vision embeddings spliced in, bidirectional attention inside each image, a prefill
    budget smaller than one image) gives transformers' own greedy tokens for an image prompt."""
    loaded = vision_loaded
    engine = Engine(loaded, EngineConfig(
        model=ModelConfig(max_model_len=1024),
        scheduler=SchedulerConfig(max_num_seqs=2, max_prefill_tokens=64),
    ))
    from oai_gemma.chat.vision import expand_images

    messages = ask(image_part("x"))
    image = Image.open(io.BytesIO(png(400, 300, (10, 200, 90))))
    rendered = render_chat(messages).prompt
    vision = expand_images(processor, rendered, [image], [False])
    inputs = processor(text=rendered, images=[image], add_special_tokens=False, return_tensors="pt")
    assert vision.token_ids == inputs["input_ids"][0].tolist()
    assert engine.vocab_limit == loaded.model.config.image_token_id
    reference = greedy_with_image(loaded.model, inputs, 5)

    loop = asyncio.new_event_loop()
    engine.start(loop)
    params = SamplingParams(max_tokens=5, temperature=0.0)

    async def run(request_id: str):
        request = GenerationRequest(
            request_id, vision.token_ids, params, pixel_values=vision.pixel_values, crop_keys=tuple(vision.crop_keys)
        )
        events = [e async for e in engine.generate(request)]
        return [e.token_id for e in events if e.token_id is not None], events[-1].num_cached_tokens

    try:
        (tokens, cached), (again, cached_again) = loop.run_until_complete(run("v")), loop.run_until_complete(run("w"))
    finally:
        engine.shutdown()
        loop.close()
    assert tokens == reference[: len(tokens)]
    assert tokens
    # the same image again: its blocks come from the prefix cache (keyed by the image's content hash), same tokens
    first_image_token = vision.token_ids.index(loaded.model.config.image_token_id)
    assert cached == 0 and cached_again > first_image_token
    assert again == tokens


def test_image_tokens_attend_to_each_other_both_ways_as_in_transformers(vision_loaded, processor):
    from oai_gemma.engine.encoding import token_runs
    from oai_gemma.engine.model.runner import ModelRunner, StepItem

    loaded = vision_loaded
    image = Image.open(io.BytesIO(png(400, 300, (10, 200, 90))))
    inputs = processor(text=render_chat(ask(image_part("x"))).prompt, images=[image], add_special_tokens=False, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    vocab = loaded.model.config.image_token_index
    with torch.inference_mode():
        reference = loaded.model(**inputs).logits[0, -1, :vocab]
        causal_only = loaded.model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0, -1, :vocab]
    runner = ModelRunner.of(loaded.model, EngineConfig(
        model=ModelConfig(max_model_len=1024, batch_invariant="off"),
        scheduler=SchedulerConfig(max_num_seqs=1, max_prefill_tokens=511),
    ))
    spans = tuple(token_runs(ids, vocab))
    rows = torch.tensor([i for start, end in spans for i in range(start, end)])
    ours = runner.forward([StepItem(runner.sequence_blocks(0), ids, 0, True, spans, (rows, runner.image_features(inputs["pixel_values"])))], [])[0, :vocab]
    assert (reference - causal_only).abs().max() > 0.1  # the bidirectional image mask matters for this prompt
    assert (ours - reference).abs().max() < 1e-3


def test_an_image_under_a_lora_adapter_gives_pefts_merged_models_greedy_text(vclient, vision_loaded, vision_adapter, processor):
    """Adapters apply to a multimodal model's language model: an image request naming one answers what PEFT's
    `merge_and_unload()` model answers for the same image prompt, and the base what the base model answers (asked
    first: the adapter's request must not reuse the base's KV of the same image)."""
    raw = png(400, 300, (10, 200, 90))
    messages = ask(image_part(data_url(raw)))
    inputs = processor(text=render_chat(messages).prompt, images=[Image.open(io.BytesIO(raw))], add_special_tokens=False, return_tensors="pt")
    expected = {MODEL: greedy_with_image(vision_loaded.model, inputs, 8),
                ADAPTER: greedy_with_image(merged_model(vision_loaded.model, vision_adapter), inputs, 8)}
    assert expected[MODEL] != expected[ADAPTER]  # the adapter changes the answer (else this test could not fail)
    for model, tokens in expected.items():
        response = vclient.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert response.model == model
        assert response.choices[0].message.content == processor.tokenizer.decode(tokens, skip_special_tokens=True), model


# ---- the Responses API: `input_image` parts take chat's image path ----------------------------------------


def ask_responses(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is in this picture?"}, *parts]}]


def test_responses_input_image_is_answered_as_chat_answers_it(vclient, image_host):
    red = {"type": "input_image", "image_url": data_url(png()), "detail": "auto"}
    blue = {"type": "input_image", "image_url": image_host + "/blue.jpg", "detail": "auto"}
    raw = vclient.responses.with_raw_response.create(
        model=MODEL, input=ask_responses(red, blue), max_output_tokens=6, temperature=0
    )
    validate("Response", raw.http_response.json())
    response = raw.parse()
    chat = complete(vclient, ask(image_part(data_url(png())), image_part(image_host + "/blue.jpg")))
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens >= 2 * 256


def test_responses_bad_image_is_400_naming_the_input_part(vclient):
    with pytest.raises(openai.BadRequestError) as info:
        vclient.responses.create(
            model=MODEL, max_output_tokens=4,
            input=ask_responses({"type": "input_image", "image_url": "http://10.0.0.1/cat.png", "detail": "auto"}),
        )
    assert info.value.body["param"] == "input[0].content[1]"
    assert "private" in info.value.body["message"].lower()
