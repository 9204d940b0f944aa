"""The integer dot-product kernels of one decode step, A/B in one process (issue 37: the 1B's one-row step at 2
threads): the step's native calls (every `_DotLinear.kernel` call of one `ModelRunner.forward`: the projections and
the lm_head) are recorded once, then replayed back to back through several builds of int_dot.c in turn, the order
rotating step by step (the shipped build `A`, and each `--b`: compiler defines such as `-DPREFETCH=0`, `-DCHUNKS=16`,
`-DSCHEDULE=guided`, `file=PATH` for another source, `avx2` for the family's flags without what sources.ISA_FLAGS
adds on this CPU: `avx2` alone is the AVX2 build, `avx2 -mavxvnni` the VEX VNNI one), so a shared machine's load
falls on all alike. Every build
is int_dot.c's timing build (`-DTIMING`, no other change), which reports per call where its time went: before the
parallel region (the activations' quantization), the second thread's lag into the tiles, the threads' finishes
apart, after the tiles; and the threads' CPU time in the tiles. Printed: each build's step median and minimum, per
part, the sum of each call's minimum (what a step a load never touched would take), beside a streaming read of the
same bytes at the same thread count (the ceiling).

    python benchmarks/gemv_ab.py --model-dir ~/.cache/oai-gemma-bench/gemma-3-1b-random --threads 2 --steps 40 \
        --b=-DPREFETCH=0 --b=-DCHUNKS=16
    python benchmarks/gemv_ab.py --model-dir ... --b=avx2 --b="avx2 -mavxvnni" --b=-DQ4_DIRECT=0  # VNNI or not
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from oai_gemma.engine.ops import int_dot
from oai_gemma.engine.ops.native import sources

SOURCE = Path(sources.__file__).parent / "int_dot.c"


def build(spec: str, directory: Path, name: str) -> ctypes.CDLL:
    """int_dot.c (or `file=PATH`) compiled with the family's flags (`avx2`: without ISA_FLAGS) and `spec`'s extra ones."""
    words = shlex.split(spec)
    source = next((Path(w[5:]) for w in words if w.startswith("file=")), SOURCE)
    extra = [w for w in words if not w.startswith("file=") and w != "avx2"]
    target = directory / f"{name}.so"
    subprocess.run([sources.compiler(), *sources.flags("int_dot", isa="avx2" not in words), "-DTIMING", *extra, "-I", str(SOURCE.parent), str(source),
                    "-o", str(target)], check=True)
    library = ctypes.CDLL(str(target))
    return library


def record(runner, decodes, sampled, sample) -> list:
    """Every integer dot-product call of one step: (linear, x, out_dtype)."""
    calls, kernel = [], int_dot._DotLinear.kernel

    def recording(self, x, out_dtype):
        calls.append((self, x.clone(), out_dtype))
        return kernel(self, x, out_dtype)

    int_dot._DotLinear.kernel = recording
    try:
        sample(runner.forward([], decodes), sampled)
    finally:
        int_dot._DotLinear.kernel = kernel
    return calls


def interleaved(linear) -> torch.Tensor:
    """A q4 / q5 weight's `packed` with each tile of four groups of 8 outputs laid out block by block (int_dot.c's
    `-DINTERLEAVE=1`: a one-row tile reads one sequential stream instead of four)."""
    groups, blocks, nbytes = linear.packed.shape
    return linear.packed.view(groups // 4, 4, blocks, nbytes).permute(0, 2, 1, 3).contiguous()


def replay(library: ctypes.CDLL, calls: list, outputs: list, split: dict, each: list) -> float:
    """The calls through `library`; seconds of the whole, each call's added to `split` by its kind and kept in
    `each` (the i-th call's (seconds, before the region, lag, finishes apart, after the tiles) at i)."""
    total = 0.0
    for (linear, x, out_dtype), y in zip(calls, outputs):
        run = getattr(library, f"{linear.KIND}_dot_linear")
        tile_rows, tile_groups = int_dot.DOT_TILES[linear.KIND][x.shape[0] > 1]
        weight = library.relaid.get(id(linear), linear.packed) if hasattr(library, "relaid") else linear.packed
        scale = linear.scale if linear.KIND == "q8" else weight
        started = time.perf_counter()
        run(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
            ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(scale.data_ptr()),
            ctypes.c_int64(linear.out_features), ctypes.c_void_p(y.data_ptr()), ctypes.c_int(0),
            ctypes.c_int(out_dtype == torch.bfloat16), ctypes.c_int(tile_rows), ctypes.c_int(tile_groups))
        spent = time.perf_counter() - started
        part = "lm_head" if linear.out_features > 100_000 else "projections"
        split[part] = split.get(part, 0.0) + spent
        marks = (ctypes.c_double * 7)()
        library.int_dot_marks(marks)
        start, region, enter0, exit0, enter1, exit1, end = marks
        if not enter1:  # one thread: no second to wait for
            enter1, exit1 = enter0, exit0
        each.append((spent, region - start, max(enter0, enter1) - region, abs(exit1 - exit0), end - max(exit0, exit1)))
        total += spent
    return total


def stream_read(nbytes: int) -> float:
    """Seconds of a streaming read (torch's sum) of `nbytes` from a buffer far larger than the caches."""
    buffer = torch.ones(max(nbytes, 1 << 28) // 4, dtype=torch.float32)
    buffer.sum()
    started = time.perf_counter()
    buffer.sum()
    return (time.perf_counter() - started) * nbytes / buffer.numel() / 4


def alternate(libraries: dict, calls: list, steps: int) -> tuple[dict, bool]:
    """Each build's steps, the builds' order rotating step by step: {name: [(total, {part: s}, [per call], timing)]},
    and whether every build gave the first's bits."""
    outputs = [torch.empty(x.shape[0], linear.out_features, dtype=dtype) for linear, x, dtype in calls]
    names, results, reference, same = list(libraries), {name: [] for name in libraries}, None, True
    for step in range(steps + 1):
        for name in names[step % len(names):] + names[: step % len(names)]:
            split, each, timing = {}, [], (ctypes.c_double * 3)()
            libraries[name].int_dot_timing(timing)
            total = replay(libraries[name], calls, outputs, split, each)
            libraries[name].int_dot_timing(timing)
            if step:  # the first round warms up
                results[name].append((total, split, each, tuple(timing)))
            if reference is None:
                reference = [y.clone() for y in outputs]
            same = same and all(torch.equal(a, b) for a, b in zip(reference, outputs))
    return results, same


def summary(name: str, runs: list, nbytes: int, threads: int) -> str:
    totals = [r[0] for r in runs]
    parts = {part: [r[1][part] for r in runs] for part in runs[0][1]}
    calls = len(runs[0][2])
    floors = [sum(min(r[2][i][j] for r in runs) for i in range(calls)) * 1e3 for j in range(5)]
    tile_cpu = [r[3][0] * 1e3 for r in runs]
    outside = [(threads * r[3][2] - r[3][1]) * 1e3 for r in runs]
    return (f"{name}: step median {statistics.median(totals) * 1e3:.2f} ms, min {min(totals) * 1e3:.2f} ms "
            f"({nbytes / statistics.median(totals) / 1e9:.1f} GB/s); " + "; ".join(
                f"{part} median {statistics.median(s) * 1e3:.2f} min {min(s) * 1e3:.2f}" for part, s in parts.items())
            + f"\n   each call's minimum, summed: {floors[0]:.2f} ms, of which before the region {floors[1]:.2f}, the "
            f"second thread's lag {floors[2]:.2f}, finishes apart {floors[3]:.2f}, after the tiles {floors[4]:.2f}; "
            f"the threads' CPU time in the tiles median {statistics.median(tile_cpu):.2f} ms (min {min(tile_cpu):.2f}), "
            f"their time in the calls outside the tiles median {statistics.median(outside):.2f} ms (min {min(outside):.2f})")


def main() -> None:
    from decode_step_profile import load_runner, step_inputs
    from oai_gemma.engine.sampling.sampler import sample_with_logprobs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--quantization", default="q4-mix")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--b", action="append", default=[], help="another build's extra compiler flags, or file=PATH")
    args = parser.parse_args()
    runner, _ = load_runner(args.model_dir, args.quantization, args.rows)
    torch.set_num_threads(args.threads)
    decodes, sampled = step_inputs(runner, args.rows, 40)
    calls = record(runner, decodes, sampled, sample_with_logprobs)
    nbytes = sum(sum(t.numel() * t.element_size() for t in c[0].tensors().values()) for c in calls)
    specs = {"A": "", **{f"B{i + 1}": spec for i, spec in enumerate(args.b)}}
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {name: build(spec, Path(tmp), name) for name, spec in specs.items()}
        for name, spec in specs.items():
            if "-DINTERLEAVE=1" in spec:  # that build reads its q4 / q5 weights re-laid out
                libraries[name].relaid = {id(c[0]): interleaved(c[0]) for c in calls if c[0].KIND != "q8"}
        results, same = alternate(libraries, calls, args.steps)
    read = statistics.median(stream_read(nbytes) for _ in range(5))
    print(f"{len(calls)} calls, {nbytes / 1e6:.0f} MB a step, {args.threads} threads, {args.rows} rows, {args.steps} "
          f"steps each; {time.strftime('%H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}; builds "
          + ", ".join(f"{n} {s or 'shipped'!r}" for n, s in specs.items()) + f"; same bits: {same}")
    print(f"streaming read of the same bytes: {read * 1e3:.2f} ms ({nbytes / read / 1e9:.1f} GB/s)")
    base = statistics.median(r[0] for r in results["A"])
    for name, runs in results.items():
        print(summary(name, runs, nbytes, args.threads) + f"\n   median / A's: {statistics.median(r[0] for r in runs) / base:.3f}")


if __name__ == "__main__":
    main()
