"""The web playground in a real browser: Playwright driving the system's Chromium against the real server
process (the session's server; a second one for images and API keys: the tiny multimodal model behind a key).

Chromium comes from the distribution (`apt-get install chromium`, done by `.ci/run`), not from Playwright's
download; without it these tests skip and say why.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient
from PIL import Image
from playwright.sync_api import expect, sync_playwright

from conftest import MODEL, VISION_API_KEY, VISION_MODEL
from oai_gemma.api.app import create_app
from oai_gemma.settings import load_settings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    # the test machine has no network: nothing in the background may try to reach it
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
browser_tests = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium); the playground's browser tests drive the system's Chromium")
TOKENS = 48
"""Each answer's tokens: enough that a stream spans several of the page's animation frames even when the browser
draws few of them (16 tokens came in 3 frames once in a full run beside the other suite's worker)."""
ANSWER_TIMEOUT = 300_000  # ms; the shared test machine can be slow, the assertions never time the model
KEY = VISION_API_KEY  # the key of conftest's vision server

# records, on every animation frame, how long the last answer's text is: a streamed answer grows over many frames
FRAME_RECORDER = """
window.__frames = [];
const tick = () => {
  const answers = document.querySelectorAll('.msg.assistant .content');
  if (answers.length) window.__frames.push(answers[answers.length - 1].textContent.length);
  requestAnimationFrame(tick);
};
requestAnimationFrame(tick);
"""


def png(color=(200, 30, 30), size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Page:
    """A page with its JavaScript errors and its chat-completion request bodies recorded."""

    def __init__(self, browser, url: str, viewport=(1200, 860)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        self.context.add_init_script(FRAME_RECORDER)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._request)
        self.page.goto(url)

    def _request(self, request):
        if request.url.endswith("/v1/chat/completions"):
            self.bodies.append(request.post_data_json)
            self.headers.append(request.headers)

    def answers(self):
        return self.page.locator(".msg.assistant")

    def wait_answered(self, count: int) -> None:
        expect(self.page.locator(".msg.assistant[data-done]")).to_have_count(count, timeout=ANSWER_TIMEOUT)

    def stat(self, answer, name: str) -> str:
        return answer.locator(f'[data-stat="{name}"]').inner_text()

    def exported(self) -> dict:
        with self.page.expect_download() as info:
            self.page.click("#export")
        return json.loads(Path(info.value.path()).read_text())

    def close(self) -> None:
        self.context.close()


def running(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["running"]


# ---- a two-turn conversation on the session's server, inspected by the tests below --------------------------

@pytest.fixture(scope="module")
def chat(browser, server, tmp_path_factory):
    page = Page(browser, server.url + "/")
    p = page.page
    expect(p.locator("#model")).to_have_text(MODEL)
    p.fill("#system", "You are a poet.")
    p.fill("#temperature", "0")
    p.fill("#max_tokens", str(TOKENS))
    p.fill("#seed", "7")
    p.fill("#extra", '{"ignore_eos": true}')  # exactly TOKENS tokens, whatever the model says
    # keyboard only: Shift+Enter is a new line, Enter sends
    p.focus("#prompt")
    p.keyboard.type("Write a haiku")
    p.keyboard.press("Shift+Enter")
    p.keyboard.type("about the sea.")
    assert p.input_value("#prompt") == "Write a haiku\nabout the sea."
    p.keyboard.press("Enter")
    page.wait_answered(1)
    page.first_frames = p.evaluate("window.__frames.splice(0)")
    p.keyboard.type("Another one, about rain.")
    p.keyboard.press("Enter")
    page.wait_answered(2)
    page.shot = tmp_path_factory.mktemp("playground") / "playground.png"
    p.screenshot(path=str(page.shot))
    yield page
    page.close()


@browser_tests
def test_text_streams_over_many_animation_frames(chat):
    lengths = [n for n in chat.first_frames if n > 0]
    growth = sorted(set(lengths))
    assert len(growth) >= 4, f"the answer did not grow token by token: lengths per frame {growth}"
    assert lengths == sorted(lengths), "the text only grows while it streams"
    assert not chat.errors


@browser_tests
def test_requests_stream_with_usage_and_send_the_history_and_parameters(chat):
    first, second = chat.bodies[:2]
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["model"] == MODEL
    assert (first["temperature"], first["max_tokens"], first["seed"], first["ignore_eos"]) == (0, TOKENS, 7, True)
    assert first["messages"] == [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write a haiku\nabout the sea."},
    ]
    answer = second["messages"][2]
    assert answer["role"] == "assistant" and answer["content"].strip()
    assert second["messages"] == [*first["messages"], answer, {"role": "user", "content": "Another one, about rain."}]


@browser_tests
@pytest.mark.slow
def test_timing_panel_shows_numbers_and_one_mark_per_token(chat):
    for answer in chat.answers().all():
        assert float(chat.stat(answer, "ttft")) > 0
        assert float(chat.stat(answer, "tps")) > 0
        assert int(chat.stat(answer, "tokens")) == TOKENS
        assert int(chat.stat(answer, "completion")) == TOKENS  # the server's usage
        assert int(chat.stat(answer, "prompt")) > 5
        assert int(chat.stat(answer, "cached")) >= 0
        median, peak = (float(v) for v in chat.stat(answer, "gap").split("/"))
        assert 0 <= median <= peak
        expect(answer.locator("svg.plot rect.mark")).to_have_count(TOKENS)
        # the chart's scale (its tallest gap, in ms) and legend; the prefix-cache count explained on hover
        assert re.fullmatch(r"[\d.]+ ms", answer.locator('[data-axis="top"]').inner_text())
        assert "wait since the token before (ms" in answer.locator(".legend").inner_text()
        assert "prefix cache" in answer.locator('.stat:has([data-stat="cached"])').get_attribute("title")
    # the second turn resends the first: its prompt is longer
    first, second = chat.answers().all()
    assert int(chat.stat(second, "prompt")) > int(chat.stat(first, "prompt"))


@browser_tests
@pytest.mark.slow
def test_export_is_the_request_an_sdk_would_send(chat):
    exported = chat.exported()
    second = chat.bodies[1]
    assert exported["model"] == MODEL and exported["max_tokens"] == TOKENS and exported["seed"] == 7
    assert exported["messages"][:4] == second["messages"]
    assert exported["messages"][4]["role"] == "assistant" and len(exported["messages"]) == 5
    assert "stream" not in exported


@browser_tests
@pytest.mark.slow
def test_copy_button_copies_the_answer(chat):
    chat.context.grant_permissions(["clipboard-read", "clipboard-write"])
    answer = chat.answers().first
    answer.get_by_role("button", name="Copy answer").click()
    expect(answer.get_by_role("button", name="Copy answer")).to_have_text("Copied")
    assert chat.page.evaluate("navigator.clipboard.readText()") == chat.bodies[1]["messages"][2]["content"]


@browser_tests
@pytest.mark.slow
def test_regenerate_resends_the_same_conversation(chat):
    before = len(chat.bodies)
    chat.page.click("#regenerate")
    expect(chat.page.locator(".msg.assistant[data-done]")).to_have_count(1)  # the last answer is being replaced
    chat.wait_answered(2)
    assert chat.bodies[before]["messages"] == chat.bodies[1]["messages"]
    expect(chat.answers()).to_have_count(2)


@browser_tests
@pytest.mark.slow
def test_every_control_has_a_label_and_the_keyboard_reaches_them(chat):
    unnamed = chat.page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea')]
        .filter((el) => !(el.labels?.length || el.getAttribute('aria-label') || (el.tagName === 'BUTTON' && el.textContent.trim())))
        .map((el) => el.outerHTML)""")
    assert not unnamed
    chat.page.focus("#system")
    seen = set()
    for _ in range(40):
        chat.page.keyboard.press("Tab")
        seen.add(chat.page.evaluate("document.activeElement.id"))
    assert {"temperature", "top_p", "max_tokens", "seed", "format", "extra", "prompt", "attach", "send"} <= seen


@browser_tests
@pytest.mark.slow
def test_phone_width_has_no_horizontal_scroll(chat):
    chat.page.set_viewport_size({"width": 390, "height": 844})
    try:
        assert chat.page.evaluate("document.documentElement.scrollWidth <= innerWidth")
        for selector in ("#prompt", "#send", "#attach", "svg.plot"):
            box = chat.page.locator(selector).first.bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, selector
    finally:
        chat.page.set_viewport_size({"width": 1200, "height": 860})


@browser_tests
@pytest.mark.slow
def test_json_schema_mode_answers_valid_json(chat):
    p = chat.page
    p.click("#clear")
    p.select_option("#format", "json_schema")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    p.fill("#schema", json.dumps(schema))
    p.fill("#extra", "")
    p.fill("#max_tokens", "32")
    p.fill("#prompt", "Is the sea wet? Answer in JSON.")
    p.press("#prompt", "Enter")
    chat.wait_answered(1)
    body = chat.bodies[-1]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "playground", "schema": schema, "strict": True}}
    assert body["messages"] == [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Is the sea wet? Answer in JSON."}]
    assert set(json.loads(chat.answers().first.locator(".content").inner_text())) == {"ok"}


@browser_tests
@pytest.mark.slow
def test_markdown_is_rendered_safely(chat):
    html = chat.page.evaluate("""async () => {
        const { renderMarkdown } = await import('/playground/markdown.js');
        const text = '# Title\\n\\n**bold** <script>alert(1)</script> <img src=x onerror=alert(1)> [x](javascript:alert(1))' +
            ' [ok](https://example.com)\\n\\n- one\\n- two\\n\\n```python\\nprint("<b>")\\n```\\n\\n```js\\nunfinished';
        const box = document.createElement('div');
        box.innerHTML = renderMarkdown(text);
        return { html: box.innerHTML, scripts: box.querySelectorAll('script, img, [onerror]').length,
                 links: [...box.querySelectorAll('a')].map((a) => a.getAttribute('href')),
                 code: [...box.querySelectorAll('pre code')].map((c) => c.textContent),
                 tags: [...box.querySelectorAll('h1, strong, li')].map((e) => e.tagName) };
    }""")
    assert html["scripts"] == 0
    assert html["links"] == ["https://example.com"]
    assert html["code"] == ['print("<b>")', "unfinished"]  # an open fence (mid-stream) is a code block too
    assert html["tags"] == ["H1", "STRONG", "LI", "LI"]
    assert "&lt;script&gt;" in html["html"]


def set_up_plain_answers(p) -> None:
    p.click("#clear")
    p.select_option("#format", "text")
    p.fill("#max_tokens", str(TOKENS))
    p.fill("#extra", '{"ignore_eos": true}')


@browser_tests
def test_no_key_notice_on_a_server_without_keys(chat):
    expect(chat.page.locator("#key-row")).to_be_hidden()  # /v1/models answered 200 without a key


@browser_tests
@pytest.mark.slow
def test_an_exported_conversation_imports_back_and_goes_on(chat, tmp_path):
    exported = {  # what Export JSON writes
        "model": MODEL, "temperature": 0, "top_p": 1, "max_tokens": TOKENS, "seed": 7, "ignore_eos": True,
        "messages": [
            {"role": "system", "content": "You are a poet."}, {"role": "user", "content": "A haiku about fog."},
            {"role": "assistant", "content": "Grey **fog** on the bay"},
        ],
    }
    p = chat.page
    p.click("#clear")
    p.fill("#system", "")
    (tmp_path / "conversation.json").write_text(json.dumps(exported))
    p.set_input_files("#import-file", str(tmp_path / "conversation.json"))
    expect(p.locator(".msg")).to_have_count(2)  # the system prompt goes to its field
    expect(p.locator(".msg.assistant strong")).to_have_text("fog")  # rendered as an answer is
    assert p.input_value("#system") == "You are a poet." and p.input_value("#format") == "text"
    assert chat.exported() == exported  # imported as it was exported
    p.fill("#prompt", "And one about snow.")
    p.press("#prompt", "Enter")
    expect(p.locator(".msg.assistant[data-done]")).to_have_count(1, timeout=ANSWER_TIMEOUT)
    assert chat.bodies[-1]["messages"] == [*exported["messages"], {"role": "user", "content": "And one about snow."}]
    assert not chat.errors


@browser_tests
@pytest.mark.slow
def test_compare_mode_answers_with_two_settings_side_by_side(chat):
    p = chat.page
    set_up_plain_answers(p)
    p.fill("#temperature", "0")
    p.click("#compare-mode")
    p.fill("#compare", '{"temperature": 1.5, "seed": 11}')
    before = len(chat.bodies)
    p.fill("#prompt", "Name three rivers.")
    p.press("#prompt", "Enter")
    pair = p.locator(".pair")
    expect(pair.locator(".msg.assistant[data-done]")).to_have_count(2, timeout=ANSWER_TIMEOUT)
    a, b = chat.bodies[before:]
    assert (a["temperature"], b["temperature"], b["seed"]) == (0, 1.5, 11) and a["messages"] == b["messages"]
    for answer in pair.locator(".msg.assistant").all():
        expect(answer.locator("svg.plot rect.mark")).to_have_count(TOKENS)
        assert int(chat.stat(answer, "completion")) == TOKENS
    expect(pair.locator(".variant")).to_have_text(["A: the settings", 'B: {"temperature": 1.5, "seed": 11}'])
    chat.page.screenshot(path=str(chat.shot.with_name("compare.png")))
    p.click("#compare-mode")  # off again: one answer per message
    assert not chat.errors


@browser_tests
@pytest.mark.slow
def test_screenshot_after_an_answer(chat):
    """The README's picture comes from benchmarks/playground_screenshot.py, the same steps on a quiet machine."""
    assert chat.shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chat.shot.stat().st_size > 20_000  # a page with content, not a blank one


# ---- speculative decoding in the timing plot ------------------------------------------------------------------

LOOP = "Repeat the word 'banana' forty times, separated by commas."
LOOP_TOKENS = 64


@browser_tests
@pytest.mark.slow
def test_accepted_drafts_are_marked_in_the_plot_and_none_without_speculation(browser, server):
    """The tokens of one engine step (a draft the model accepted, and its own token) arrive back to back, so the
    plot marks every token after the first of a step as drafted. A greedy answer that repeats itself is drafted
    by prompt lookup (most of its tokens); the same request with `"speculative": false` gets one token a step,
    milliseconds apart, so only a browser that fell behind and read two steps at once could mark one: fewer."""
    page = Page(browser, server.url + "/")
    p = page.page
    try:
        expect(p.locator("#model")).to_have_text(MODEL)
        p.fill("#temperature", "0")
        p.fill("#max_tokens", str(LOOP_TOKENS))
        drafted = []
        for extra in ({"ignore_eos": True}, {"ignore_eos": True, "speculative": False}):
            p.click("#clear")
            p.fill("#extra", json.dumps(extra))
            p.fill("#prompt", LOOP)
            p.press("#prompt", "Enter")
            page.wait_answered(1)
            plot = page.answers().first.locator("svg.plot")
            expect(plot.locator("rect.mark")).to_have_count(LOOP_TOKENS)
            drafted.append(plot.locator("rect.mark.drafted").count())
        on, off = drafted
        assert page.bodies[-1]["speculative"] is False and "speculative" not in page.bodies[-2]
        assert on >= 1, "a repeating greedy answer should have come with accepted drafts"
        assert off < on, (on, off)
        assert not page.errors
    finally:
        page.close()


# ---- stop, images, keys --------------------------------------------------------------------------------------

@browser_tests
@pytest.mark.slow
def test_stop_cancels_the_request_on_the_server(browser, server):
    page = Page(browser, server.url + "/playground")
    p = page.page
    try:
        expect(p.locator("#model")).to_have_text(MODEL)
        p.fill("#max_tokens", "1500")
        p.fill("#extra", '{"ignore_eos": true}')
        p.fill("#prompt", "Tell me a very long story.")
        p.press("#prompt", "Enter")
        expect(p.locator("svg.plot rect.mark").nth(2)).to_be_attached(timeout=ANSWER_TIMEOUT)
        assert running(server.url) >= 1
        p.click("#stop")
        deadline = time.monotonic() + 30
        while running(server.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running(server.url) == 0
        page.wait_answered(1)
        expect(p.locator(".msg.assistant .finish")).to_have_text("stopped")
        expect(p.locator("#send")).to_be_visible()
        assert int(page.stat(page.answers().first, "tokens")) < 1500
        assert not page.errors
    finally:
        page.close()


def attach_by_upload_and_paste(p) -> None:
    p.set_input_files("#image", files=[{"name": "red.png", "mimeType": "image/png", "buffer": png()}])
    p.evaluate("""(bytes) => {
        const data = new DataTransfer();
        data.items.add(new File([new Uint8Array(bytes)], 'pasted.png', { type: 'image/png' }));
        document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', { clipboardData: data, bubbles: true }));
    }""", list(png(color=(20, 20, 220))))
    expect(p.locator(".attachment img")).to_have_count(2)


@browser_tests
@pytest.mark.slow
def test_images_on_a_text_only_model_give_a_clear_message(browser, server):
    page = Page(browser, server.url + "/")
    p = page.page
    try:
        expect(p.locator("#model")).to_have_text(MODEL)
        attach_by_upload_and_paste(p)
        p.fill("#prompt", "What is in these pictures?")
        p.press("#prompt", "Enter")
        expect(p.locator("#error")).to_be_visible(timeout=60_000)
        message = p.locator("#error").inner_text()
        assert "400" in message and "text-only" in message and "gemma-3-4b-it" in message, message
        parts = page.bodies[0]["messages"][0]["content"]
        assert [part["type"] for part in parts] == ["text", "image_url", "image_url"]
        assert all(part["image_url"]["url"].startswith("data:image/png;base64,") for part in parts[1:])
        # nothing is lost: the message and its images are back in the composer
        assert p.input_value("#prompt") == "What is in these pictures?"
        expect(p.locator(".attachment img")).to_have_count(2)
        expect(page.answers()).to_have_count(0)
    finally:
        page.close()


@browser_tests
@pytest.mark.slow
def test_api_key_is_asked_once_and_an_image_is_answered(browser, vision_server):
    """On the tiny multimodal model behind an API key (conftest's vision server, shared with chat/test_vision.py)."""
    page = Page(browser, vision_server.url + "/")
    p = page.page
    try:
        form = p.locator("#key-form")
        expect(form).to_be_visible()
        expect(p.locator("#key-message")).to_contain_text("401")
        expect(p.locator("#key-message")).to_contain_text("needs an API key")
        p.fill("#api-key", "wrong")
        p.press("#api-key", "Enter")
        expect(form).to_be_visible()  # asked again, with the server's reason
        expect(p.locator("#key-message")).to_contain_text("Incorrect API key")
        p.fill("#api-key", KEY)
        p.press("#api-key", "Enter")
        expect(p.locator("#model")).to_have_text(VISION_MODEL)
        expect(form).to_be_hidden()
        assert p.evaluate("localStorage.getItem('oai-gemma.api-key')") == KEY
        expect(p.locator("#key-row")).to_be_visible()  # a server with keys: the notice says one is stored
        expect(p.locator("#key-state")).to_have_text("API key stored in this browser")

        p.fill("#max_tokens", "6")
        attach_by_upload_and_paste(p)
        p.fill("#prompt", "Describe these pictures.")
        p.press("#prompt", "Enter")
        page.wait_answered(1)
        answer = page.answers().first
        assert int(page.stat(answer, "prompt")) > 2 * 256  # both images reached the model: 256 tokens each
        assert 1 <= int(page.stat(answer, "completion")) <= 6
        expect(answer.locator(".content")).not_to_be_empty()
        expect(p.locator(".msg.user img.thumb")).to_have_count(2)
        assert page.headers[-1]["authorization"] == f"Bearer {KEY}"

        p.reload()  # kept in local storage: not asked again
        expect(p.locator("#model")).to_have_text(VISION_MODEL)
        expect(form).to_be_hidden()
        assert not page.errors
    finally:
        page.close()


# ---- the routes, in-process (no model is loaded: the routes answer before it is) ----------------------------

def app_client(environ: dict[str, str]) -> TestClient:
    return TestClient(create_app(load_settings(environ=environ)))


def test_page_and_files_are_served_without_a_cdn():
    client = app_client({})
    for path in ("/", "/playground"):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
    sources = re.findall(r'(?:src|href)="([^"]+)"', client.get("/").text)
    assert sources and all(s.startswith("/playground/") for s in sources), sources
    for name in ("app.js", "api.js", "markdown.js", "timing.js"):
        script = client.get(f"/playground/{name}")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        imports = re.findall(r'from "([^"]+)"', script.text)
        assert all(i.startswith("./") for i in imports), imports  # modules of the package, nothing from the network
    assert client.get("/playground/missing.js").status_code == 404
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml" and icon.text.startswith("<svg")


def test_playground_off_is_404():
    client = app_client({"OAI_GEMMA_SERVER__PLAYGROUND": "false"})
    for path in ("/", "/playground", "/playground/app.js"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"


def test_with_api_keys_the_page_is_open_but_the_api_is_not():
    client = app_client({"OAI_GEMMA_API_KEYS": KEY})
    assert client.get("/").status_code == 200
    assert client.get("/playground/app.js").status_code == 200 and client.get("/favicon.ico").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/chat/completions", json={}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
