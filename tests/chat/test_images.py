"""`load_images`: data, http(s) and file URLs to RGB images, and every way it refuses. No model, no network:
images are made in memory and served from a local HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import socket
import struct
import threading
import time
import zlib

import httpx
import pytest
from PIL import Image, features

from oai_gemma.chat import images
from oai_gemma.chat.images import ImagePolicy, load_images
from oai_gemma.chat.render import ChatInputError, ImagePart

LOCAL = ImagePolicy(allow_private_networks=True)


def local(**settings) -> ImagePolicy:
    return ImagePolicy(allow_private_networks=True, **settings)
PARAM = "messages[1].content[0]"


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def png(size=(20, 10), color=(255, 0, 0)) -> bytes:
    return encode(Image.new("RGB", size, color), "PNG")


def noise_png(size=(64, 64)) -> bytes:
    return encode(Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)), "PNG")


def two_frame_gif() -> bytes:
    red, blue = Image.new("RGB", (12, 8), (255, 0, 0)), Image.new("RGB", (12, 8), (0, 0, 255))
    return encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str, param: str = PARAM) -> ImagePart:
    return ImagePart(url, "auto", param)


def load(urls: list[str] | str, policy: ImagePolicy = ImagePolicy(), client=None) -> list[Image.Image]:
    urls = [urls] if isinstance(urls, str) else urls
    return asyncio.run(load_images([part(u, f"messages[0].content[{i}]") for i, u in enumerate(urls)], policy, client))


def refused(url: str, policy: ImagePolicy = ImagePolicy(), client=None) -> ChatInputError:
    with pytest.raises(ChatInputError) as info:
        asyncio.run(load_images([part(url)], policy, client))
    assert info.value.param == PARAM
    return info.value


# ---- a local HTTP server ----

IMAGE = png((30, 20))
SLOW_S = 30.0
"""How long `/slow` waits before it answers."""


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = self.path
        if path == "/image.png":
            self.reply(200, IMAGE)
        elif path == "/redirect":
            self.redirect("/image.png")
        elif path.startswith("/redirect-to?"):
            self.redirect(path.partition("?")[2])
        elif path.startswith("/chain/"):
            hops = int(path.rsplit("/", 1)[1])
            self.redirect(f"/chain/{hops - 1}") if hops else self.reply(200, IMAGE)
        elif path == "/huge":
            self.reply(200, b"\0" * 1_000_000)
        elif path == "/huge-unsized":  # HTTP/1.0, no Content-Length: the body ends when the connection closes
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"\0" * 10_000)
        elif path == "/slow":  # far past the test's timeout (a daemon thread: the server's close does not wait)
            time.sleep(SLOW_S)
            self.reply(200, IMAGE)
        elif path == "/text":
            self.reply(200, b"hello, not an image", "text/plain")
        else:
            self.reply(404, b"not found", "text/plain")

    def reply(self, status: int, body: bytes, content_type: str = "image/png"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    httpd.handle_error = lambda *args: None  # a client that gave up mid-response (timeout, size cap)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class RecordingTransport(httpx.AsyncBaseTransport):
    """Records every request instead of connecting: an empty record proves nothing was sent."""

    def __init__(self):
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request):
        self.requests.append(request)
        return httpx.Response(200, content=IMAGE)


# ---- data: URLs ----

FORMATS = ["PNG", "JPEG", "GIF"] + (["WEBP"] if features.check("webp") else [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_data_url_decodes_each_format_to_rgb_with_its_size(fmt):
    image = Image.new("RGBA" if fmt == "PNG" else "RGB", (33, 17), (10, 200, 30, 255)[: 4 if fmt == "PNG" else 3])
    (decoded,) = load(data_url(encode(image, fmt), f"image/{fmt.lower()}"))
    assert decoded.mode == "RGB" and decoded.size == (33, 17)


def test_data_url_mime_type_is_ignored_content_is_sniffed():
    for url in (data_url(IMAGE, "image/jpeg"), data_url(IMAGE, ""), "data:;base64," + base64.b64encode(IMAGE).decode()):
        assert load(url)[0].size == (30, 20)


def test_gif_gives_its_first_frame():
    (decoded,) = load(data_url(two_frame_gif(), "image/gif"))
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (255, 0, 0)


def test_transparency_becomes_white():
    (decoded,) = load(data_url(encode(Image.new("RGBA", (4, 4), (0, 0, 0, 0)), "PNG")))
    assert decoded.getpixel((0, 0)) == (255, 255, 255)


def test_invalid_base64_is_refused():
    assert "invalid base64" in refused("data:image/png;base64,iVBOR*w0K!!").message


def test_bytes_that_are_not_an_image_are_refused():
    assert "not an image" in refused(data_url(b"just some text, really")).message


def test_unsupported_image_format_is_refused():
    assert "not an image" in refused(data_url(encode(Image.new("RGB", (4, 4)), "BMP"))).message


def test_truncated_png_is_refused():
    data = noise_png()
    assert "truncated" in refused(data_url(data[: len(data) // 2])).message


def test_png_header_claiming_a_huge_image_is_refused_before_decoding():
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
    bomb += chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    assert "too many pixels" in refused(data_url(bomb)).message


def test_image_over_max_pixels_is_refused():
    error = refused(data_url(png((20, 20))), ImagePolicy(max_pixels=399))
    assert "Expected at most 399 pixels (`images.max_pixels`), but got 400 (20x20) instead" in error.message


def test_data_url_over_max_download_bytes_is_refused():
    message = refused(data_url(noise_png()), ImagePolicy(max_download_bytes=1000)).message
    assert "image too large. Expected at most 1000 bytes (`images.max_download_bytes`), but got" in message


def test_too_many_images_names_the_first_extra_one():
    with pytest.raises(ChatInputError) as info:
        load([data_url(IMAGE)] * 3, ImagePolicy(max_images=2))
    assert info.value.param == "messages[0].content[2]"
    assert "too many images. Expected at most 2 images per request (`images.max_images`), but got 3 instead" in info.value.message


def test_several_images_keep_their_order():
    decoded = load([data_url(png((5, 5))), data_url(png((7, 3)))])
    assert [i.size for i in decoded] == [(5, 5), (7, 3)]


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "javascript:alert(1)", "/etc/passwd", "a.png"])
def test_unsupported_scheme_is_refused(url):
    assert "unsupported image URL" in refused(url).message


# ---- http(s): URLs ----


def test_http_image_is_fetched_when_private_networks_are_allowed(server):
    assert load(f"{server}/image.png", LOCAL)[0].size == (30, 20)


def test_allowed_hosts_lets_a_private_host_through(server):
    assert load(f"{server}/image.png", ImagePolicy(allowed_hosts=("127.0.0.1",)))[0].size == (30, 20)


@pytest.mark.parametrize(
    "url, rule",
    [
        ("http://127.0.0.1/a.png", "loopback"),
        ("http://10.0.0.1/a.png", "private"),
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://localhost/a.png", "loopback"),
        ("http://[::ffff:127.0.0.1]/a.png", "loopback"),
        ("http://100.64.0.1/a.png", "carrier-grade NAT"),
        ("http://0.0.0.0/a.png", "unspecified"),
    ],
)
def test_default_policy_refuses_private_addresses_without_connecting(url, rule):
    transport = RecordingTransport()
    error = refused(url, client=httpx.AsyncClient(transport=transport))
    assert rule in error.message and transport.requests == []


def test_cloud_metadata_is_refused_even_when_private_networks_are_allowed():
    transport = RecordingTransport()
    error = refused("http://169.254.169.254/latest/meta-data/", LOCAL, httpx.AsyncClient(transport=transport))
    assert "cloud metadata" in error.message and transport.requests == []


def test_dns_rebinding_after_the_check_is_caught_at_connect_time(monkeypatch, server):
    port = int(server.rsplit(":", 1)[1])
    lookups = []

    async def rebinding_lookup(host, port):  # public for the pre-check, then loopback for the connection
        lookups.append(host)
        address = "93.184.216.34" if len(lookups) == 1 else "127.0.0.1"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(images, "_lookup", rebinding_lookup)
    assert "resolves to 127.0.0.1, a loopback" in refused(f"http://rebind.test:{port}/image.png").message
    assert lookups == ["rebind.test", "rebind.test"]


def test_redirect_is_followed(server):
    assert load(f"{server}/redirect", LOCAL)[0].size == (30, 20)


def test_redirect_to_a_forbidden_address_is_refused(server):
    port = server.rsplit(":", 1)[1]
    policy = ImagePolicy(allowed_hosts=("127.0.0.1",))
    error = refused(f"{server}/redirect-to?http://localhost:{port}/image.png", policy)
    assert "'localhost'" in error.message and "loopback" in error.message


def test_redirect_to_a_file_url_is_refused(server):
    assert "only http(s)" in refused(f"{server}/redirect-to?file:///etc/passwd", LOCAL).message


def test_redirect_chain_within_the_cap_is_followed(server):
    assert load(f"{server}/chain/3", LOCAL)[0].size == (30, 20)


def test_redirect_chain_over_the_cap_is_refused(server):
    assert "more than 3 redirects" in refused(f"{server}/chain/4", LOCAL).message


def test_http_404_is_refused(server):
    assert "HTTP 404" in refused(f"{server}/missing.png", LOCAL).message


def test_http_body_that_is_not_an_image_is_refused(server):
    assert "not an image" in refused(f"{server}/text", LOCAL).message


def test_download_over_declared_length_limit_is_refused(server):
    policy = local(max_download_bytes=100_000)
    assert "Expected at most 100000 bytes (`images.max_download_bytes`), but got 1000000 bytes instead" in refused(f"{server}/huge", policy).message


def test_download_without_length_is_cut_at_the_limit(server):
    policy = local(max_download_bytes=100_000)
    assert "but got more than 100000 instead" in refused(f"{server}/huge-unsized", policy).message


def test_slow_download_times_out(server):
    started = time.monotonic()
    assert "longer than 0.3s" in refused(f"{server}/slow", local(total_timeout=0.3)).message
    # cut at the timeout, not when the reply came: a margin a loaded machine's scheduling cannot use up
    assert 0.3 <= time.monotonic() - started < SLOW_S / 2


def test_unreachable_host_is_refused():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "could not fetch" in refused(f"http://127.0.0.1:{port}/a.png", LOCAL).message


def test_unresolvable_host_is_refused():
    assert "cannot resolve" in refused("http://does-not-exist.invalid/a.png").message


# ---- file: URLs ----


@pytest.fixture
def files(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "in.png").write_bytes(IMAGE)
    (outside / "out.png").write_bytes(IMAGE)
    (root / "link.png").symlink_to(outside / "out.png")
    return root


def test_file_url_is_refused_without_a_root(files):
    assert "disabled" in refused(f"file://{files}/in.png").message


def test_file_url_inside_the_root_is_read(files):
    assert load(f"file://{files}/in.png", ImagePolicy(file_root=str(files)))[0].size == (30, 20)


def test_file_url_escaping_the_root_with_dotdot_is_refused(files):
    assert "outside" in refused(f"file://{files}/../outside/out.png", ImagePolicy(file_root=str(files))).message


def test_file_url_through_a_symlink_out_of_the_root_is_refused(files):
    assert "outside" in refused(f"file://{files}/link.png", ImagePolicy(file_root=str(files))).message


def test_missing_file_inside_the_root_is_refused(files):
    assert "not found" in refused(f"file://{files}/nope.png", ImagePolicy(file_root=str(files))).message
