"""The 4B warm-up's native quantized calls on a load's thread (issue 41): each call's CPU time whole, and split into
spans of outputs (ops/quantized.py `in_units`) the count, total and longest span between two turn offers.

    PYTHONPATH=. python benchmarks/load_call_spans.py

Random weights at the 4B's shapes (hidden 2560, intermediate 10240, 8 + 4 + 4 heads of 256, vocab 262,144), one
torch thread as a load beside loaded models has; CPU seconds (`time.thread_time`), so a busy machine stretches them
less than wall time (not at all only when quiet). Memory: ~1.2 GB (the q8 lm_head is 671 MB).
"""

from __future__ import annotations

import threading
import time

import torch

from oai_gemma.cpu import TURNS
from oai_gemma.engine.ops import quantized
from oai_gemma.engine.ops.fused import Fused
from oai_gemma.engine.ops.int_dot import Q4Linear, Q8Linear


def made(cls, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return cls.from_rows((n, k), lambda lo, hi: torch.randn(hi - lo, k, generator=generator) * 0.02, 4096)


def a_step() -> None:
    with TURNS.step():
        pass


def run() -> None:
    torch.set_num_threads(1)
    cases = [("q and k fused (q4)", Fused([made(Q4Linear, 2048, 2560), made(Q4Linear, 1024, 2560)]), 2560, (128,)),
             ("o (q4)", made(Q4Linear, 2560, 2048), 2048, (128,)),
             ("gate + up fused (q4)", Fused([made(Q4Linear, 10240, 2560), made(Q4Linear, 10240, 2560)]), 2560, (128,)),
             ("down (q8)", made(Q8Linear, 2560, 10240), 10240, (128,)), ("down (q4)", made(Q4Linear, 2560, 10240), 10240, (128,)),
             ("lm_head (q8)", made(Q8Linear, 262144, 2560), 2560, (1, 4))]
    unit, marks = quantized.UNIT_MACS, []
    quantized.TURNS.offer = lambda: marks.append(time.thread_time())  # only counted: the step below waits throughout
    with TURNS.load():
        threading.Thread(target=a_step).start()  # waits for its turn throughout, as a stream's steps beside a load
        while not TURNS.waiting:
            time.sleep(0.01)
        for name, linear, k, all_rows in cases:
            for rows in all_rows:
                x = torch.randn(rows, k)
                linear.rowwise(x)  # once before: first-touch page faults are not the call's
                quantized.UNIT_MACS = 1 << 62
                started = time.thread_time()
                linear.rowwise(x)
                whole = time.thread_time() - started
                quantized.UNIT_MACS = unit
                marks.clear()
                linear.rowwise(x)
                spans = [b - a for a, b in zip(marks, marks[1:] + [time.thread_time()])]
                print(f"{name:22s} {rows:3d} rows: whole {whole * 1e3:6.1f} ms; {len(spans):3d} spans {sum(spans) * 1e3:6.1f} ms, "
                      f"the longest {max(spans) * 1e3:5.1f} ms", flush=True)


if __name__ == "__main__":
    loader = threading.Thread(target=run)
    loader.start()
    loader.join()
