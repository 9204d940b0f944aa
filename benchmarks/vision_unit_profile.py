"""Why a layer's first `mix` unit of the vision encode takes longer than its other `mix` units (docs/benchmarks.md):
each unit's time, and torch's profile of a layer's first and second `mix` units, on a model's tower as the server
holds it (`tower_layout`: q8a7 beside the integer text layouts), two images one after the other (the first pays
the lazy quantization at its first call of each linear).

    PYTHONPATH=. python benchmarks/vision_unit_profile.py --model-dir ~/.cache/oai-gemma-bench/gemma-3-4b-random [--threads 2] [--layers 6]

Prints, per image, each kind's median and max unit time (a layer's first `mix` apart), and for the second image the
top ops of layer 4's first and second `mix` units by self CPU time, with their call counts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from oai_gemma.engine.model.streamed import Checkpoint, _vision
from oai_gemma.engine.model.vision_encode import VisionEncode
from oai_gemma.engine.model.vision_layout import tower_layout
from oai_gemma.engine.shape import Gemma3Shape


def encode(weights, pixels, profile_units: tuple[int, ...] = ()) -> tuple[list[tuple[str, float]], dict[int, str]]:
    """[(kind, seconds)] of each unit in order, and the profile table of the units numbered `profile_units`."""
    job, times, tables = VisionEncode(weights, pixels), [], {}
    while not job.done:
        kind = job.next[0]
        number = len(times)
        if number in profile_units:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                started = time.perf_counter()
                job.advance()
            tables[number] = f"unit {number} ({kind}):\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        else:
            started = time.perf_counter()
            job.advance()
        times.append((kind, time.perf_counter() - started))
    return times, tables


def summary(times: list[tuple[str, float]]) -> str:
    kinds: dict[str, list[float]] = {}
    for kind, seconds in times:
        kinds.setdefault(kind, []).append(seconds)
    return "; ".join(f"{kind}: {len(v)} units, median {statistics.median(v) * 1e3:.0f} ms, max {max(v) * 1e3:.0f} ms"
                     for kind, v in kinds.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--quantization", default="q4-mix", help="the text's layout: the tower's follows it (tower_layout)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6, help="the tower's first layers only (the finish unit as ever)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    shape = Gemma3Shape.of(AutoConfig.from_pretrained(args.model_dir))
    weights = tower_layout(_vision(Checkpoint(args.model_dir), shape, torch.float32), args.quantization)
    weights.layers = weights.layers[: args.layers]
    g = torch.Generator().manual_seed(0)
    units: tuple[int, ...] = ()
    for image in range(2):
        pixels = torch.randn(1, 3, shape.vision.image_size, shape.vision.image_size, generator=g)
        with torch.inference_mode():
            times, tables = encode(weights, pixels, units)
        first_mixes = [i for i, (kind, _) in enumerate(times) if kind == "first mix"]
        units = (first_mixes[4], first_mixes[4] + 1)  # the same plan for the next image: layer 4's first two mixes
        print(f"image {image + 1}: {summary(times)}", flush=True)
        for number in sorted(tables):
            print(tables[number], flush=True)


if __name__ == "__main__":
    main()
