"""`--prompts image`: one 896x896 image and a short question (issue 37, item 4), against any OpenAI-compatible
server (ours, or llama-server started with `--mmproj`).

Reports, per server:
  one_image   the image request's TTFT (send to first content token, streamed), its prompt tokens, and from ours'
              /health the vision tower's time (`vision_seconds`, summed over the steps it spanned) and so the
              prefill's share (TTFT - vision time: queueing and preprocessing included)
  itl         a text stream's inter-token times alone, then with the image request sent once it has 5 tokens:
              the ITLs that fell between the image's arrival and its first token (p50, p99, their ratio to alone);
              on ours, split at the encode's end (/health's `vision_encodes`, polled every POLL_S) into those
              during the encode and those during the image's prefill (each p99 and longest), and whether the
              stream outlasted the image's first token (else the prefill's gaps were not seen: raise --max-tokens)
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx

QUESTION = "Describe this image in one sentence."
TEXT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def image_data_url(size: int = 896, variant: int = 0) -> str:
    """A fixed, detailed 896x896 PNG (a colour gradient with rings): the same bytes every run for one `variant`, other
    bytes for another, so no request of a run reuses an earlier one's image (llama-server's prompt cache would)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    rings = (np.sin(40 * np.hypot(x - 0.5, y - 0.5) + variant) + 1) / 2
    pixels = np.stack((x, y, rings), axis=-1) * 255
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), "RGB").save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_body(model: str, max_tokens: int, variant: int) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_data_url(variant=variant)}}, {"type": "text", "text": QUESTION}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _text_body(model: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": TEXT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, body: dict, times: list[float], usage: dict | None = None) -> None:
    """Append the arrival time of every content chunk to `times`; the final usage into `usage`."""
    import json

    async with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or ()):
                times.append(time.monotonic())
            if usage is not None and chunk.get("usage"):
                usage.update(chunk["usage"])


def _health(base_url: str) -> dict:
    try:
        return httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3, 1)


async def one_image(client: httpx.AsyncClient, base_url: str, model: str, variant: int) -> dict:
    before = _health(base_url)
    times, usage = [], {}
    sent = time.monotonic()
    await _stream(client, _image_body(model, 16, variant), times, usage)
    after = _health(base_url)
    ttft = times[0] - sent if times else None
    vision = after.get("vision_seconds", 0) - before.get("vision_seconds", 0) if "vision_seconds" in after else None
    return {"ttft_s": round(ttft, 3) if ttft else None, "vision_s": round(vision, 3) if vision is not None else None,
            "prefill_s": round(ttft - vision, 3) if ttft and vision is not None else None,
            "prompt_tokens": usage.get("prompt_tokens"), "e2e_s": round(time.monotonic() - sent, 3)}


POLL_S = 0.1
"""How often the encode's end is looked for on /health: the split of the stream's gaps into encode and prefill is
that coarse. At 20 ms the polls' own CPU (a /health answer counts the KV cache's pages) slowed the steps measured."""


async def _encoded_at(base_url: str, stop: asyncio.Event) -> float | None:
    """When /health's `vision_encodes` went up (polled every POLL_S until `stop`); None: not ours, or never."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/health"
    async with httpx.AsyncClient(timeout=10) as health:
        try:
            before = (await health.get(url)).json().get("vision_encodes")
            while before is not None and not stop.is_set():
                if (await health.get(url)).json().get("vision_encodes", before) > before:
                    return time.monotonic()
                await asyncio.sleep(POLL_S)
        except (httpx.HTTPError, ValueError):
            pass
    return None


def _phase(gaps: list[float], alone_p99: float | None, name: str) -> dict:
    p99 = _pct(gaps, 0.99)
    return {f"{name}_p99_ms": p99, f"{name}_max_ms": _pct(gaps, 1.0), f"{name}_tokens": len(gaps),
            f"{name}_p99_ratio": round(p99 / alone_p99, 2) if p99 and alone_p99 else None}


async def itl_during_image(client: httpx.AsyncClient, model: str, max_tokens: int, base_url: str = "") -> dict:
    alone: list[float] = []
    await _stream(client, _text_body(model, max_tokens), alone)
    times: list[float] = []
    text = asyncio.create_task(_stream(client, _text_body(model, max_tokens), times))
    while len(times) < 5 and not text.done():
        await asyncio.sleep(0.005)
    sent, stop = time.monotonic(), asyncio.Event()
    encoded = asyncio.create_task(_encoded_at(base_url, stop)) if base_url else None
    image_times: list[float] = []
    await _stream(client, _image_body(model, 4, variant=2), image_times)
    stop.set()
    end = await encoded if encoded else None
    await text
    first = image_times[0] if image_times else time.monotonic()
    gaps_alone = [b - a for a, b in zip(alone, alone[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < first]
    p99_alone, p99_during = _pct(gaps_alone, 0.99), _pct(during, 0.99)
    result = {"alone_p50_ms": _pct(gaps_alone, 0.5), "alone_p99_ms": p99_alone, "during_p50_ms": _pct(during, 0.5),
              "during_p99_ms": p99_during, "during_tokens": len(during),
              "p99_ratio": round(p99_during / p99_alone, 2) if p99_alone and p99_during else None,
              "image_ttft_s": round(first - sent, 3), "stream_outlasted_image": bool(times) and times[-1] > first}
    if end is not None:  # a gap across the encode's end counts with the prefill (its first unit runs right after)
        result.update(_phase([b - a for a, b in zip(times, times[1:]) if b > sent and b <= end], p99_alone, "encode"))
        result.update(_phase([b - a for a, b in zip(times, times[1:]) if b > end and a < first], p99_alone, "prefill"))
        result["encode_s"] = round(end - sent, 3)
    return result


async def run_image(base_url: str, model: str, max_tokens: int, timeout: float) -> dict:
    """Both measurements against the server at `base_url` (its /v1 root)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        await one_image(client, base_url, model, variant=0)  # warm-up: the first image pays for one-off work
        return {"one_image": await one_image(client, base_url, model, variant=1),  # each image its own: no cache hit
                "itl": await itl_during_image(client, model, max_tokens, base_url)}


def report(name: str, result: dict) -> str:
    one, itl = result["one_image"], result["itl"]
    return (f"[{name}] one 896x896 image: TTFT {one['ttft_s']} s (vision tower {one['vision_s']} s, prefill "
            f"{one['prefill_s']} s, {one['prompt_tokens']} prompt tokens); text ITL p50/p99 alone "
            f"{itl['alone_p50_ms']}/{itl['alone_p99_ms']} ms, during the image (encode and prefill) {itl['during_p50_ms']}/"
            f"{itl['during_p99_ms']} ms over {itl['during_tokens']} tokens (p99 x{itl['p99_ratio']})" + _phases(itl))


def _phases(itl: dict) -> str:
    if "encode_s" not in itl:
        return ""
    text = "".join(f"; during its {name} p99 {itl[name + '_p99_ms']} ms (x{itl[name + '_p99_ratio']}), longest "
                   f"{itl[name + '_max_ms']} ms over {itl[name + '_tokens']} tokens" for name in ("encode", "prefill"))
    return text + ("" if itl["stream_outlasted_image"] else "; the stream ended before the image's first token")
