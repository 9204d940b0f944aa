"""Quality and size of each weight setting on the embedded model, against float32 weights: perplexity of the
fixed text (tests/data/apache-2.0.txt, the Apache License 2.0), the share of greedy tokens that agree over the
benchmark's 16 prompts (64 tokens each, compared up to each prompt's first difference), resident weight bytes,
and one decode step's time at one row. Issue 13's table in docs/engine.md.

    python benchmarks/quantization_quality.py [float32:int8 ...]   # default: every row below

Run it on a quiet machine (`uptime`).
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from oai_gemma.bench.prompts import PROMPTS
from oai_gemma.chat import render_chat
from oai_gemma.engine.factory import configure as resolve
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.quality import agreement, greedy_tokens, perplexity
from oai_gemma.engine.model.runner import ModelRunner, StepItem
from oai_gemma.settings import EngineSettings, ModelSettings, Settings

TEXT = Path(__file__).parent.parent / "tests" / "data" / "apache-2.0.txt"
SETTINGS = [("float32", "none"), ("float32", "int8"), ("float32", "int4"), ("bfloat16", "none"), ("bfloat16", "int8"),
            ("bfloat16", "int4")]


def measure(dtype: str, quantization: str) -> tuple[float, list[list[int]], int, float]:
    settings = Settings(model=ModelSettings(dtype=dtype, quantization=quantization, max_model_len=4096),
                        engine=EngineSettings(max_num_seqs=32, max_prefill_tokens=256, batch_invariant="off"))
    loaded = load(settings.model)
    runner = ModelRunner.of(loaded.model, resolve(settings, loaded), own_weights=True)
    ppl = perplexity(runner, loaded.tokenizer.encode(TEXT.read_text()))
    prompts = [loaded.tokenizer.encode(render_chat([{"role": "user", "content": p}]).prompt, add_special_tokens=False) for p in PROMPTS]
    greedy = [greedy_tokens(runner, ids, 64) for ids in prompts]
    steps = []
    for position in range(100, 120):
        started = time.perf_counter()
        runner.forward([], [StepItem(runner.sequence_blocks(0), [1234], position)])
        steps.append((time.perf_counter() - started) * 1e3)
    return ppl, greedy, runner.weight_bytes(), statistics.median(steps)


def main() -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    wanted = [tuple(arg.split(":")) for arg in sys.argv[1:]] or SETTINGS
    results = {setting: measure(*setting) for setting in [("float32", "none"), ("bfloat16", "none"), *wanted]}
    ref_ppl, ref_greedy, _, _ = results[("float32", "none")]
    bf16_bytes = results[("bfloat16", "none")][2]
    print("| weights | perplexity | vs float32 | greedy tokens agreeing with float32 | resident weights (MB) | vs bf16 | decode step, 1 row (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (dtype, quantization), (ppl, greedy, size, step) in results.items():
        print(f"| {dtype}, {quantization} | {ppl:.3f} | {ppl / ref_ppl:.4f} | {agreement(ref_greedy, greedy):.1%} | "
              f"{size / 2**20:.0f} | {size / bf16_bytes:.2f} | {step:.1f} |")


if __name__ == "__main__":
    main()
