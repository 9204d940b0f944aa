"""OpenAI `image_url` parts -> decoded RGB PIL images, safely.

An image URL is chosen by the client but fetched by the server, so each source is a way in and is fenced:

* `http(s)://` - the host is resolved here and refused if ANY address is private, loopback, link-local, CGNAT,
  multicast, reserved, unspecified (unless `allow_private_networks`) or a cloud metadata endpoint (always, unless
  the host is listed in `allowed_hosts`: reaching a private image store should not also hand out credentials).
  Redirects are followed by hand, each hop checked again. Clients made by `image_client` (the default) check again
  at connect time and connect only to the checked address, so DNS rebinding has no window; with a client of your
  own only the pre-check runs. The body is streamed and cut at `max_download_bytes` (counted after
  Content-Encoding, so a gzip bomb is cut too).
* `file://` - only under `file_root`, after resolving symlinks and `..`.
* `data:` - base64 or percent-encoded; the mime type is ignored, the bytes are sniffed by Pillow.

Decoding accepts PNG, JPEG, WebP and GIF only (Pillow's other plugins, EPS above all, are attack surface) and
checks width*height against `max_pixels` from the header, before any pixel is decoded. Every failure is a
`ChatInputError` whose `param` is the part's (`messages[i].content[j]`); too many images names the first extra one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import httpcore
import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from ..cpu import in_a_turn
from ..limits import phrase
from ..settings import ImageSettings
from .render import ChatInputError, ImagePart

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)


ImagePolicy = ImageSettings  # the [images] settings section is the policy


class _Refused(Exception):
    """A failure whose message the client sees; `_load` adds the part's `param`."""


class _OverLimit(_Refused):
    """An image past one of its limits (`limits.LIMITS`: `max_bytes`, `max_pixels`), worded once its part is known."""

    def __init__(self, kind: str, limit: int, value: str):
        super().__init__(kind)
        self.kind, self.limit, self.value = kind, limit, value


async def load_images(
    parts: list[ImagePart], policy: ImagePolicy, client: httpx.AsyncClient | None = None
) -> list[Image.Image]:
    """All parts fetched and decoded concurrently; the first failure cancels the rest."""
    if len(parts) > policy.max_images:
        param = parts[policy.max_images].param
        raise ChatInputError(phrase(param, "max_images", policy.max_images, len(parts), " (`images.max_images`)")[0], param)
    own = None
    if client is None and any(_scheme(p.url) in ("http", "https") for p in parts):
        client = own = image_client(policy)
    tasks = [asyncio.ensure_future(_load(part, policy, client)) for part in parts]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if own is not None:
            await own.aclose()


def image_client(policy: ImagePolicy) -> httpx.AsyncClient:
    """A client whose connections go only to addresses `policy` allows (share one across requests if you like)."""
    return httpx.AsyncClient(transport=_GuardedTransport(policy), trust_env=False)


async def _load(part: ImagePart, policy: ImagePolicy, client: httpx.AsyncClient | None) -> Image.Image:
    scheme = _scheme(part.url)
    try:
        if scheme == "data":
            data = await asyncio.to_thread(_data_url, part.url, policy)
        elif scheme in ("http", "https"):
            data = await _download(part.url, policy, client)
        elif scheme == "file":
            data = await asyncio.to_thread(_read_file, part.url, policy)
        else:
            raise _Refused(f"unsupported image URL {part.url[:40]!r}: expected a data:, http(s): or file: URL")
        return await asyncio.to_thread(in_a_turn, _decode, data, policy)
    except _OverLimit as exc:
        setting = {"max_bytes": "max_download_bytes", "max_pixels": "max_pixels"}[exc.kind]
        message = phrase(part.param, exc.kind, exc.limit, exc.value, f" (`images.{setting}`)")[0]
        raise ChatInputError(message, part.param) from exc
    except _Refused as exc:
        raise ChatInputError(str(exc), part.param) from exc


def _scheme(url: str) -> str:
    head, sep, _ = url[:32].partition(":")
    return head.strip().lower() if sep else ""


def _data_url(url: str, policy: ImagePolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise _Refused("malformed data URL: no ',' before the data")
    if "base64" in header.lower().split(";"):
        text = "".join(payload.split()).translate(str.maketrans("-_", "+/"))  # wrapped lines, url-safe alphabet
        _check_size(len(text.rstrip("=")) * 3 // 4, policy)
        try:
            return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise _Refused("invalid base64 in data URL") from None
    data = unquote_to_bytes(payload)
    _check_size(len(data), policy)
    return data


def _check_size(size: int, policy: ImagePolicy, whole: bool = True) -> None:
    """`whole`: `size` is the image's (else what has arrived so far)."""
    if size > policy.max_download_bytes:
        raise _OverLimit("max_bytes", policy.max_download_bytes, f"{size} bytes" if whole else f"more than {policy.max_download_bytes}")


def _read_file(url: str, policy: ImagePolicy) -> bytes:
    if policy.file_root is None:
        raise _Refused("file: image URLs are disabled on this server")
    parts = urlsplit(url)
    path = Path(unquote(parts.path))
    if parts.netloc not in ("", "localhost") or not path.is_absolute():
        raise _Refused("a file: image URL needs an absolute local path, file:///...")
    try:  # symlinks and .. resolved before the check
        root, path = Path(policy.file_root).resolve(), path.resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        raise _Refused("invalid file: image path") from None
    if not path.is_relative_to(root):
        raise _Refused("file: image URL points outside the allowed directory")
    if not path.is_file():  # a directory, or a FIFO that would block a thread forever
        raise _Refused("file: image not found or not a regular file")
    try:
        with path.open("rb") as f:
            data = f.read(policy.max_download_bytes + 1)
    except OSError:
        raise _Refused("file: image not found or not readable") from None
    _check_size(len(data), policy)
    return data


async def _download(url_text: str, policy: ImagePolicy, client: httpx.AsyncClient) -> bytes:
    timeout = httpx.Timeout(policy.total_timeout, connect=policy.connect_timeout)
    try:
        url = httpx.URL(url_text)
        async with asyncio.timeout(policy.total_timeout):
            for _ in range(policy.max_redirects + 1):
                if url.scheme not in ("http", "https") or not url.host:
                    raise _Refused(f"cannot fetch {str(url)[:80]!r}: only http(s) URLs with a host")
                await _resolve(url.raw_host.decode("ascii"), url.port or (443 if url.scheme == "https" else 80), policy)
                request = client.build_request("GET", url, headers={"Accept": "image/*"}, timeout=timeout)
                response = await client.send(request, stream=True, follow_redirects=False)
                try:
                    if response.status_code in _REDIRECTS and "location" in response.headers:
                        url = url.join(response.headers["location"])
                        continue
                    if response.status_code >= 400:
                        raise _Refused(f"fetching the image failed: HTTP {response.status_code} from {url.host}")
                    return await _read_body(response, policy)
                finally:
                    await response.aclose()
            raise _Refused(f"fetching the image took more than {policy.max_redirects} redirects")
    except TimeoutError:
        raise _Refused(f"fetching the image took longer than {policy.total_timeout}s") from None
    except httpx.TimeoutException:
        raise _Refused("fetching the image timed out") from None
    except httpx.InvalidURL as exc:
        raise _Refused(f"invalid image URL: {exc}") from None
    except httpx.HTTPError as exc:
        raise _Refused(f"could not fetch the image: {exc or type(exc).__name__}") from None


async def _read_body(response: httpx.Response, policy: ImagePolicy) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        _check_size(int(declared), policy)
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        _check_size(size, policy, whole=False)
        chunks.append(chunk)
    return b"".join(chunks)


async def _lookup(host: str, port: int) -> list[tuple]:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


async def _resolve(host: str, port: int, policy: ImagePolicy) -> list[str]:
    """Every address of `host`, refused if ANY is forbidden: a hostile DNS server may answer with a public and
    a private address and leave the choice to the connection."""
    try:
        addresses = list(dict.fromkeys(info[4][0] for info in await _lookup(host, port)))
    except socket.gaierror as exc:
        raise _Refused(f"cannot resolve image host {host!r}: {exc.strerror}") from None
    if not _host_allowed(host, policy):
        for address in addresses:
            if rule := _forbidden(ipaddress.ip_address(address), policy):
                raise _Refused(f"image host {host!r} resolves to {address}, a {rule} address, which is not allowed")
    return addresses


def _host_allowed(host: str, policy: ImagePolicy) -> bool:
    host = host.lower().rstrip(".")
    for pattern in (p.lower().rstrip(".") for p in policy.allowed_hosts):
        if host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


def _forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, policy: ImagePolicy) -> str | None:
    """The rule `ip` breaks, or None; an IPv4 address embedded in IPv6 (mapped, 6to4, NAT64) is judged as IPv4."""
    if ip.version == 6:
        ip = ip.ipv4_mapped or ip.sixtofour or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else ip)
    if ip in _METADATA:
        return "cloud metadata"
    if policy.allow_private_networks:
        return None
    for rule, hit in (
        ("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast), ("carrier-grade NAT", ip.version == 4 and ip in _CGNAT),
        ("private", ip.is_private), ("reserved", ip.is_reserved), ("non-global", not ip.is_global),
    ):
        if hit:
            return rule
    return None


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolves and checks at connect time, then connects to a checked address: no DNS-rebinding window."""

    def __init__(self, policy: ImagePolicy):
        self._policy, self._inner = policy, httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        error: Exception = httpcore.ConnectError(f"no address for {host}")
        for address in await _resolve(host, port, self._policy):
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.ConnectError("unix sockets are not allowed")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, policy: ImagePolicy):
        ssl_context = httpx.create_ssl_context(trust_env=False)
        super().__init__(verify=ssl_context, trust_env=False)
        # httpx has no public hook for the network backend; its transport keeps the httpcore pool in `_pool`
        self._pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context, network_backend=_GuardedBackend(policy))


def _decode(data: bytes, policy: ImagePolicy) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise _Refused("image has too many pixels (Pillow's decompression-bomb limit)") from None
    except UnidentifiedImageError:
        raise _Refused("not an image: expected PNG, JPEG, WebP or GIF data") from None
    except Exception as exc:
        raise _Refused(f"the image could not be read: {exc}") from None
    width, height = image.size
    if width * height > policy.max_pixels:  # from the header: nothing decoded yet
        raise _OverLimit("max_pixels", policy.max_pixels, f"{width * height} ({width}x{height})")
    try:
        image.seek(0)  # an animation's first frame
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # phone photos are stored sideways plus a rotation tag
        return _to_rgb(image)
    except Exception as exc:
        raise _Refused(f"the image is truncated or corrupt: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """Transparency becomes white (as transformers' `convert_to_rgb` does), not whatever color hides under it."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")
