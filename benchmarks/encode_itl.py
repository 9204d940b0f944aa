"""A text stream's inter-token times while an image is encoded, with the engine's own account of each gap: the decode
steps' and the encode slices' times inside it (issue 37 item 4; engine/encoding.py's `SHARE`).

    PYTHONPATH=. python benchmarks/encode_itl.py --model-dir ~/.cache/oai-gemma-bench/gemma-3-4b-random [--rounds 2]

The engine is the server's (load_engine: the defaults, speculation off), in this process. Each round: a stream's ITLs
alone (40 tokens), then a 400-token stream with a new 896x896 image request sent after its 10th token; the gaps from
then to the image's first token, those without the image's prefill step ("encode-only"), their ratios to alone, the
decode steps and slices (with the budget each slice got), and the longest gaps taken apart.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from image_prefill_itl import pct, stream

from oai_gemma.cpu import configure_cpu
from oai_gemma.settings import load_settings


def traced(engine) -> list[tuple]:
    """Wrap the engine's encode slices and forwards: ("slice", start, seconds, budget) and ("fwd", start, seconds,
    prefill rows, decode rows) appended to the returned list as they run."""
    log: list[tuple] = []
    encoding, runner = engine.core.encoding, engine.core.runner
    run, budget, forward = encoding.run, encoding.budget, runner.forward

    def timed_run(busy):
        given, started = budget(busy), time.perf_counter()
        result = run(busy)
        log.append(("slice", started, time.perf_counter() - started, given))
        return result

    def timed_forward(prefills, decodes):
        started = time.perf_counter()
        result = forward(prefills, decodes)
        log.append(("fwd", started, time.perf_counter() - started, len(prefills), len(decodes)))
        return result

    encoding.run, runner.forward = timed_run, timed_forward
    return log


async def one_round(engine, log: list[tuple], image_ids: list[int], text_ids: list[int], number: int) -> None:
    import torch

    from oai_gemma.engine.types import GenerationRequest, SamplingParams

    def text(name: str, most: int) -> GenerationRequest:
        return GenerationRequest(f"{name}{number}", text_ids, SamplingParams(max_tokens=most, temperature=0.0, ignore_eos=True))

    alone, times, image_times = [], [], []
    await stream(engine, text("a", 40), alone)
    task = asyncio.ensure_future(stream(engine, text("b", 400), times))
    while len(times) < 10:
        await asyncio.sleep(0.002)
    log.clear()
    sent = time.perf_counter()
    pixels = torch.randn(1, 3, 896, 896, generator=torch.Generator().manual_seed(number))
    image = GenerationRequest(f"i{number}", image_ids, SamplingParams(max_tokens=2, temperature=0.0), pixel_values=pixels,
                              crop_keys=((1 << 40) + number,))  # a new image each round: no prefix-cache hit
    await stream(engine, image, image_times)
    task.cancel()
    first = image_times[0]
    gaps_alone = [b - a for a, b in zip(alone[10:], alone[11:])]
    gaps = []  # (gap, its forwards' seconds, its slices' seconds, a prefill among them)
    for a, b in zip(times, times[1:]):
        if b > sent and a < first:
            inside = [entry for entry in log if a <= entry[1] < b]
            gaps.append((b - a, sum(e[2] for e in inside if e[0] == "fwd"), sum(e[2] for e in inside if e[0] == "slice"),
                         any(e[0] == "fwd" and e[3] for e in inside)))
    encode_only = [gap for gap, _, _, prefill in gaps if not prefill]
    decodes = [e[2] for e in log if e[0] == "fwd" and not e[3]]
    slices, budgets = [e[2] for e in log if e[0] == "slice"], [e[3] for e in log if e[0] == "slice"]
    print(f"round {number}: alone p50 {pct(gaps_alone, .5):.1f} p99 {pct(gaps_alone, .99):.1f} ms; encode-only gaps p50 "
          f"{pct(encode_only, .5):.1f} p99 {pct(encode_only, .99):.1f} max {max(encode_only) * 1e3:.1f} ms over "
          f"{len(encode_only)} (p99 / alone p99 {pct(encode_only, .99) / pct(gaps_alone, .99):.2f}, / alone p50 "
          f"{pct(encode_only, .99) / pct(gaps_alone, .5):.2f}); image TTFT {first - sent:.2f} s", flush=True)
    print(f"   decode steps p50 {pct(decodes, .5):.1f} p90 {pct(decodes, .9):.1f} ms; slices p50 {pct(slices, .5):.1f} p90 "
          f"{pct(slices, .9):.1f} max {max(slices) * 1e3:.1f} ms, budget p50 {pct(budgets, .5):.1f} ms", flush=True)
    longest = sorted(gaps, reverse=True)[:5]
    print("   longest gaps (gap, forwards, slices ms, prefill):",
          [(round(g * 1e3), round(f * 1e3), round(s * 1e3), p) for g, f, s, p in longest], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = load_settings(None, {"model": {"source": str(args.model_dir)}, "engine": {"speculative": "off", "kv_cache_gib": 4.25}})
    configure_cpu(settings.engine)
    from oai_gemma.engine.factory import load_engine

    engine = load_engine(settings, grammars=False)
    core, log = engine.core, traced(engine)
    tokenizer = core.tokenizer
    question = tokenizer.encode("Describe this image in one sentence.", add_special_tokens=False)
    image_ids = [2, 105, *tokenizer.encode("user\n", add_special_tokens=False), 255999, *[core.image_token_id] * 256, 256000,
                 *question, 106, 107]
    text_ids = tokenizer.encode("Write a long story about a lighthouse keeper who finds a message in a bottle.")
    loop = asyncio.new_event_loop()
    engine.start(loop)
    try:
        for number in range(args.rounds):
            loop.run_until_complete(one_round(engine, log, image_ids, text_ids, number))
    finally:
        engine.shutdown()
        loop.close()


if __name__ == "__main__":
    main()
