"""The integer dot-product kernels (`model.quantization` q8 / q4, engine/ops/native/int_dot.c) against the native
int8 kernel with float32 activations (`int8`), on gemma-3-1b's linear shapes: milliseconds per call at each row
count. Each weight is held in enough copies (each called in turn) that the set exceeds the L3 cache, so a call
streams its weight from memory as in a decode step; candidates alternate call by call, so load on a shared
machine hits them alike. Reports the minimum and the median over the rounds.

    python benchmarks/int_dot_kernels.py --rows 1,4,8,16,32 [--shapes q,kv,o,gate,down,lm_head] [--rounds 20]
    python benchmarks/int_dot_kernels.py --threads 1 --stream-mb 0 --rounds 40   # a busy machine: one thread, minima

Run it on a quiet machine (`uptime`); on a busy one read the minima.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from oai_gemma.engine.ops.int_dot import Q4Linear, Q5Linear, Q8Linear
from oai_gemma.engine.ops.quantized import NativeInt8Linear, NativeQ8Linear

# name: (out_features, in_features, calls in one decode step of gemma-3-1b: 26 layers)
SHAPES = {
    "q": (1024, 1152, 26), "kv": (256, 1152, 52), "o": (1152, 1024, 26), "gate": (6912, 1152, 52),
    "down": (1152, 6912, 26), "lm_head": (262144, 1152, 1),
}
CANDIDATES = {"int8": NativeInt8Linear, "q8": Q8Linear, "q4": Q4Linear, "q5": Q5Linear}
STREAM_BYTES = 96 << 20
"""Each candidate's copies of a weight together exceed this (3x the EPYC's 32 MiB L3)."""


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c")) or f in ("amx_tile", "avx512_vnni")]
    return f"{model} ({' '.join(sorted(simd))}), {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch's thread count (0: as it is)")
    parser.add_argument("--stream-mb", type=int, default=STREAM_BYTES >> 20,
                        help="each candidate's copies of a weight exceed this (0: one copy, which the cache may keep)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_line()}")
    print("| shape (N x K) | rows | " + " | ".join(f"{c} min / median (ms)" for c in CANDIDATES) + " | q8 vs int8 | q4 vs int8 | q5 vs int8 |")
    print("|---|---:|" + "---:|" * (len(CANDIDATES) + 3))
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k, _ = SHAPES[name]
        copies = max(1, -(-(args.stream_mb << 20) // (n * k)))
        weight = torch.randn(n, k) * 0.02
        linears = {}
        for c, cls in [*CANDIDATES.items(), *([("q8 (lm_head's NativeQ8Linear)", NativeQ8Linear)] if name == "lm_head" else [])]:
            first = cls(weight)  # quantized once, then copied: each copy its own memory
            linears[c] = [first] + [cls.from_tensors({f: t.clone() for f, t in first.tensors().items()}) for _ in range(copies - 1)]
        for rows in rows_list:
            x = torch.randn(rows, k)
            samples: dict[str, list[float]] = {c: [] for c in linears}
            for _ in range(args.rounds):
                for c, copies_of in linears.items():
                    start = time.perf_counter()
                    for linear in copies_of:
                        linear(x)
                    samples[c].append((time.perf_counter() - start) * 1e3 / len(copies_of))
            best = {c: min(s) for c, s in samples.items()}
            cells = " | ".join(f"{best[c]:.3f} / {statistics.median(samples[c]):.3f}" for c in CANDIDATES)
            print(f"| {name} ({n} x {k}) | {rows} | {cells} | {best['int8'] / best['q8']:.2f}x | "
                  f"{best['int8'] / best['q4']:.2f}x | {best['int8'] / best['q5']:.2f}x |", flush=True)
            if name == "lm_head":
                c = "q8 (lm_head's NativeQ8Linear)"
                print(f"|  lm_head, NativeQ8Linear (existing AVX2 q8_linear) | {rows} | {best[c]:.3f} / "
                      f"{statistics.median(samples[c]):.3f} | | | | | | |", flush=True)


if __name__ == "__main__":
    main()
