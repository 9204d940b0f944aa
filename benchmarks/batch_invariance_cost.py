"""What batch-invariant mode costs the engine's steps on this CPU: a 512-token prefill chunk and decode steps
of 1, 8 and 32 rows (at two context lengths) and of 8 drafted rows (speculation), timed with `engine.batch_invariant` off and on, on the embedded
model as the server loads it.

    python benchmarks/batch_invariance_cost.py --dtype bfloat16
    python benchmarks/batch_invariance_cost.py --dtype float32 --quantization int8   # float32's default

Run it on a quiet machine (`uptime`): each cell is the median of several steps.
"""

from __future__ import annotations

import argparse
import platform

import torch

from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.runner import ModelRunner, StepItem
from oai_gemma.settings import ModelSettings
from weight_only_kernels import timed  # this folder's: median ms after warm-up calls


def step_times(loaded, mode: str, quantization: str) -> dict[str, float]:
    runner = ModelRunner.of(loaded, EngineConfig(
        model=ModelConfig(dtype=str(loaded.dtype).removeprefix("torch."), quantization=quantization, max_model_len=2048,
                          batch_invariant=mode),
        scheduler=SchedulerConfig(max_num_seqs=32, max_prefill_tokens=512),
    ))
    assert runner.batch_invariant == (mode == "on")
    if runner.invariance:
        print(f"mode on: {runner.invariance}, start-up's figure {runner.invariance_cost:+.3f}")
    prompt = list(range(1000, 1512))
    times = {"prefill 512 tokens": timed(lambda: runner.forward([StepItem(runner.sequence_blocks(0), prompt, 0)], []), 5)}
    for length in (30, 100):  # a chat's short prompt (the kernel's path in the mode), a prefix-cache remainder's
        item = StepItem(runner.sequence_blocks(0), prompt[:length], 0, kernel=length < runner.kernel_prompts_below)
        times[f"prompt of {length} tokens"] = timed(lambda: runner.forward([item], []), 5)
    beside = [StepItem(runner.sequence_blocks(row), [1234], 100) for row in range(1, 9)]
    times["prefill 504 tokens beside 8 decode rows"] = timed(
        lambda: runner.forward([StepItem(runner.sequence_blocks(0), prompt[:504], 0)], beside), 5)
    for context in (100, 1000):
        for rows in (1, 8, 32):
            decodes = [StepItem(runner.sequence_blocks(row), [1234], context) for row in range(rows)]
            times[f"decode {rows} rows, context {context}"] = timed(lambda: runner.forward([], decodes), 7)
    drafted = [StepItem(runner.sequence_blocks(row), [1234, 1235, 1236, 1237], 1000 + 7 * row, num_logits=4) for row in range(8)]
    times["decode 8 rows with 3 drafts each, context 1000"] = timed(lambda: runner.forward([], drafted), 7)  # the shared set's c=8
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help="none, int8 (float32's default), per-step (bf16's), q8, q4")
    args = parser.parse_args()
    loaded = load(ModelSettings(dtype=args.dtype))
    off, on = step_times(loaded, "off", args.quantization), step_times(loaded, "on", args.quantization)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {loaded.dtype}, {args.quantization}")
    print("| step | off (ms) | on (ms) | on / off |\n|---|---:|---:|---:|")
    for name in off:
        print(f"| {name} | {off[name]:.1f} | {on[name]:.1f} | {on[name] / off[name]:.2f} |")


if __name__ == "__main__":
    main()
