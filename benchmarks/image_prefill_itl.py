"""A text stream's inter-token times while an image's prefill chunk runs: as units between steps (engine/prefilling.py)
against in one step (`engine.image_prefill_units = false`), alternated in one process, so a shared machine's load
falls on both alike (issue 37 item 4; docs/benchmarks.md).

    PYTHONPATH=. python benchmarks/image_prefill_itl.py --model-dir ~/.cache/oai-gemma-bench/gemma-3-4b-random [--rounds 2]

The engine is the server's (load_engine: the defaults, speculation off). The image's features are random and handed
over at once (the vision tower is skipped: `Encoding.submit` is replaced), so a round is the text side alone: a
stream's ITLs alone (its 30 tokens after 10), then a stream with the image request sent after its 10th token: its ITLs
from then to the image's first token (the prefill), p50 / p99 / longest, their ratio to alone, the image's TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from oai_gemma.cpu import configure_cpu
from oai_gemma.settings import load_settings


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3


async def stream(engine, request, times: list[float]) -> None:
    async for event in engine.generate(request):
        if event.token_id is not None:
            times.append(time.perf_counter())
        if event.error:
            raise RuntimeError(f"{request.request_id}: {event.error}")


async def one_round(engine, image_ids: list[int], text_ids: list[int], number: int, tokens: int) -> dict:
    from oai_gemma.engine.types import GenerationRequest, SamplingParams

    def text(name: str, most: int) -> GenerationRequest:
        return GenerationRequest(f"t{name}{number}", text_ids, SamplingParams(max_tokens=most, temperature=0.0, ignore_eos=True))

    alone: list[float] = []
    await stream(engine, text("a", 40), alone)
    times: list[float] = []
    task = asyncio.ensure_future(stream(engine, text("b", tokens), times))
    while len(times) < 10:
        await asyncio.sleep(0.002)
    sent, image_times = time.perf_counter(), []
    crop = (1 << 40) + number  # a new image each round: no prefix-cache hit
    await stream(engine, GenerationRequest(f"i{number}", image_ids, SamplingParams(max_tokens=2, temperature=0.0),
                                           pixel_values=engine.fake_pixels, crop_keys=(crop,)), image_times)
    await task
    first = image_times[0]
    gaps_alone = [b - a for a, b in zip(alone[10:], alone[11:])]
    during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < first]
    return {"alone_p50": pct(gaps_alone, 0.5), "alone_p99": pct(gaps_alone, 0.99), "during_p50": pct(during, 0.5),
            "during_p99": pct(during, 0.99), "during_max": max(during) * 1e3, "during_tokens": len(during),
            "ttft": first - sent, "outlasted": times[-1] > first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternated (units first)")
    parser.add_argument("--tokens", type=int, default=400, help="the text stream's tokens: it must outlast the prefill")
    args = parser.parse_args()
    settings = load_settings(None, {"model": {"source": str(args.model_dir)}, "engine": {"speculative": "off", "kv_cache_gib": 4.25}})
    configure_cpu(settings.engine)
    import torch

    from oai_gemma.engine.factory import load_engine

    engine = load_engine(settings, grammars=False)
    core = engine.core
    hidden, image_token = core.runner.text_shape.hidden, core.image_token_id
    features = torch.randn(256, hidden, generator=torch.Generator().manual_seed(0)) * 0.02

    def submit(seq) -> None:  # the tower skipped: features at once, scheduled as `_encode` schedules them
        seq.image_embeds = features
        core.scheduler.add(seq)

    core.encoding.submit = submit
    engine.fake_pixels = torch.zeros(1, 3, 8, 8)
    tokenizer = core.tokenizer
    question = tokenizer.encode("Describe this image in one sentence.", add_special_tokens=False)
    image_ids = [2, 105, *tokenizer.encode("user\n", add_special_tokens=False), 255999, *[image_token] * 256, 256000, *question, 106, 107]
    text_ids = tokenizer.encode("Write a long story about a lighthouse keeper who finds a message in a bottle.")
    loop = asyncio.new_event_loop()
    engine.start(loop)
    results: dict[str, list[dict]] = {"units": [], "one step": []}
    try:
        for number in range(2 * args.rounds):
            mode = "units" if number % 2 == 0 else "one step"
            core.apart.enabled = mode == "units"  # read between steps only: the engine thread takes no chunk apart now
            result = loop.run_until_complete(one_round(engine, image_ids, text_ids, number, args.tokens))
            results[mode].append(result)
            print(f"{mode}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()), flush=True)
    finally:
        engine.shutdown()
        loop.close()
    for mode, rounds in results.items():
        ratio = [r["during_p99"] / r["alone_p99"] for r in rounds]
        print(f"{mode}: during the prefill p99 / alone p99 median {statistics.median(ratio):.2f} (each {[round(x, 2) for x in ratio]}), "
              f"longest gap median {statistics.median(r['during_max'] for r in rounds):.0f} ms, TTFT median "
              f"{statistics.median(r['ttft'] for r in rounds):.2f} s", flush=True)


if __name__ == "__main__":
    main()
