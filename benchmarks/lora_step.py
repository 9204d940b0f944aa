"""Cost of LoRA adapters in one engine step (issue 28), without HTTP: a decode step of R rows on the base model alone,
on one adapter for every row, and spread over N adapters (row i on adapter i mod N); and one prefill chunk.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/lora_step.py [--dtype bfloat16] [--quantization per-step]
        [--rows 32] [--adapters 8] [--rank 16]

The adapters are random (bench/lora.py's `make_adapter`), on all seven projections. Prints the median of a few runs
per case, in ms, and the ratios to the base step. A quiet machine is needed for numbers worth quoting.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from oai_gemma.bench.lora import make_adapter
from oai_gemma.engine.factory import configure as resolve
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.lora.adapter import LoraModule
from oai_gemma.engine.model.loader import embedded_model_dir, load
from oai_gemma.engine.sequence import StepItem
from oai_gemma.settings import load_settings


def median_ms(run, repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="lora-step-"))
    modules = tuple(
        LoraModule(f"a{i}", str(make_adapter(directory / f"a{i}", str(embedded_model_dir()), args.rank, i))) for i in range(args.adapters)
    )
    settings = load_settings(overrides={"model": {"dtype": args.dtype, "quantization": args.quantization}, "lora": {
        "max_loras": args.adapters, "modules": [f"{m.name}={m.path}" for m in modules]}})
    loaded = load(settings.model)
    config = resolve(settings, loaded)
    engine = Engine(loaded, config, own_weights=True)
    runner, registry = engine.core.runner, engine.adapters
    slots = [registry.acquire(registry.lookup(m.name)) for m in modules]
    blocks = [runner.sequence_blocks(0, 2048)] * args.rows

    def decode(adapter_of):
        items = [StepItem(blocks[i], [100 + i], 500, adapter=adapter_of(i)) for i in range(args.rows)]
        return lambda: runner.forward([], items)

    def prefill(slot):
        return lambda: runner.forward([StepItem(blocks[0], list(range(1000, 1512)), 0, adapter=slot)], [])

    cases = {
        f"decode {args.rows} rows, base": decode(lambda i: 0),
        f"decode {args.rows} rows, one adapter": decode(lambda i: slots[0]),
        f"decode {args.rows} rows, {args.adapters} adapters": decode(lambda i: slots[i % len(slots)]),
        "decode 1 row, base": lambda: runner.forward([], [StepItem(blocks[0], [100], 500)]),
        "decode 1 row, one adapter": lambda: runner.forward([], [StepItem(blocks[0], [100], 500, adapter=slots[0])]),
        "prefill 512 tokens, base": prefill(0),
        "prefill 512 tokens, one adapter": prefill(slots[0]),
    }
    print(f"{config.model.dtype}, quantization {config.model.quantization}, rank {args.rank}, {torch.get_num_threads()} threads")
    results = {name: median_ms(run, args.repeat) for name, run in cases.items()}
    for name, ms in results.items():
        base = next(v for k, v in results.items() if k.split(",")[0] == name.split(",")[0])
        print(f"{name:40s} {ms:8.2f} ms  {ms / base:5.2f}x")


if __name__ == "__main__":
    main()
