"""A load beside a loop of decode steps in one process, with turns (`cpu.Turns`, as the server loads beside loaded
models) and without (the loader computing beside the steps on one thread, as before turns), interleaved in one run
so that both modes see the same machine (issue 41's target: ITL p99 during a load at most 2x alone).

    PYTHONPATH=. python benchmarks/load_turns.py [--second SOURCE] [--quantization int8] [--modes plain,turns,plain,turns]

Modes: `plain` (no turns), `turns`, and `whole` (turns, but a load's native quantized calls each one unit, as before
they went in spans of outputs: ops/quantized.py `in_units`).

The steps are the embedded 270M's (float32, unquantized, two threads: the server's `first` in
benchmarks/multi_model_load_itl.py), one decode row each, every one a turn as the engine's; `second` (default the
1B random checkpoint, int8) loads on one thread. Per mode: the load's seconds, the gaps between steps (p50/p99/max)
over 4 s alone just before and during the load, and the p99 ratio. Run it in a quiet window: figures taken under
other load are void (at load 6-8 a step took 0.9 s instead of ~0.05 s).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from oai_gemma.cpu import TURNS, compute_thread, configure_cpu
from oai_gemma.settings import load_settings, served_models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--second", default=str(Path.home() / ".cache/oai-gemma-bench/gemma-3-1b-random"))
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--modes", default="plain,turns,plain,turns")
    args = parser.parse_args()
    config = Path(tempfile.mkdtemp()) / "models.toml"
    common = 'speculative = "off"\nmax_num_seqs = 4\n'
    config.write_text(f'[models.first]\nsource = "embedded"\nquantization = "none"\n{common}\n'
                      f'[models.second]\nsource = "{args.second}"\nquantization = "{args.quantization}"\n{common}')
    models = served_models(load_settings(config, {}, environ={}))
    configure_cpu(models["first"][0].engine)
    import torch

    from oai_gemma.engine.factory import load_engine
    from oai_gemma.engine.ops import quantized
    from oai_gemma.engine.sequence import StepItem

    first = load_engine(models["first"][0])  # kept: the second shares its tokenizer, as beside a loaded model
    runner = first.core.runner
    scratch, stop, ends = [runner.cache.scratch] * 8, threading.Event(), []

    def steps() -> None:
        with torch.inference_mode():
            while not stop.is_set():
                with TURNS.step():
                    runner.forward([], [StepItem(scratch, [0], 0)])
                ends.append(time.perf_counter())

    def gaps(lo: float, hi: float) -> tuple[float, float, float, int]:
        found = sorted(b - a for a, b in zip(ends, ends[1:]) if b >= lo and a <= hi)
        return statistics.median(found), found[int(0.99 * (len(found) - 1))], found[-1], len(found)

    def load(mode: str) -> None:
        torch.set_num_threads(1)  # as api/model_router.py loads beside loaded models
        quantized.UNIT_MACS = 1 << 62 if mode == "whole" else unit
        if mode != "plain":
            with TURNS.load():
                load_engine(models["second"][0], grammars=False)
        else:
            load_engine(models["second"][0], grammars=False)

    unit = quantized.UNIT_MACS
    stepper = compute_thread(steps, "steps")
    stepper.start()
    time.sleep(3)
    for mode in args.modes.split(","):
        alone_from = time.perf_counter()
        time.sleep(4)
        started = time.perf_counter()
        loader = threading.Thread(target=load, args=(mode,))
        loader.start()
        loader.join()
        ended = time.perf_counter()
        alone, during = gaps(alone_from, started), gaps(started, ended)
        print(f"{mode:6s} load {ended - started:5.2f} s | alone p50 {alone[0] * 1e3:6.1f} p99 {alone[1] * 1e3:6.1f} ms | "
              f"during p50 {during[0] * 1e3:6.1f} p99 {during[1] * 1e3:6.1f} max {during[2] * 1e3:6.1f} ms "
              f"({during[3]} gaps) | p99 ratio {during[1] / alone[1]:.2f}", flush=True)
    stop.set()
    stepper.join()


if __name__ == "__main__":
    main()
