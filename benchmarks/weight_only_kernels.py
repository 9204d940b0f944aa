"""Weight-only kernels on this CPU, on gemma-3-270m's linear shapes: what a decode step's matmuls cost with
float32 / bf16 weights (oneDNN-packed, as the engine runs them today) and with int8 / int4 weights through
PyTorch's own CPU kernels, fbgemm's dynamic int8 and the project's own AVX2 kernel (engine/ops/native). Issue 13 asks
for this table before any kernel is chosen. `--step` times instead a whole decode step's 126 projections, each
with its own weights, so they stream from memory as in the engine (the per-shape table reuses one weight, which
the cache keeps).

    python benchmarks/weight_only_kernels.py --rows 1,8,32 --markdown
    python benchmarks/weight_only_kernels.py --step --rows 1,2,4,8,16,32 [--lm-head]

Run it on a quiet machine (`uptime`): it reports the median of many calls per cell.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from oai_gemma.engine.ops import native
from oai_gemma.engine.ops.native import native_unavailable
from oai_gemma.engine.ops.quantized import DynamicInt8Linear, NativeInt8Linear

# (name, out_features, in_features) of gemma-3-270m: 18 layers of q/k/v/o and gate/up/down, one lm_head
SHAPES = [
    ("q_proj", 1024, 640),
    ("k_proj / v_proj", 256, 640),
    ("o_proj", 640, 1024),
    ("gate / up", 2048, 640),
    ("down", 640, 2048),
    ("lm_head", 262144, 640),
]
PER_LAYER = {"q_proj": 1, "k_proj / v_proj": 2, "o_proj": 1, "gate / up": 2, "down": 1}
LAYERS = 18


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` after two warm-up calls."""
    fn(), fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def packed(weight: torch.Tensor):
    w = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def int8_channel(weight: torch.Tensor):
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def int8_pack_mm(weight: torch.Tensor, dtype: torch.dtype):
    q, scale = int8_channel(weight.float())
    scale = scale.to(dtype)
    return lambda x: torch._weight_int8pack_mm(x, q, scale)


def int4_pack_mm(weight: torch.Tensor, group: int, dtype: torch.dtype):
    w = weight.float()
    n, k = w.shape
    grouped = w.view(n, k // group, group)
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((grouped - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed_q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel computes (q - 8) * scale + zero per group: zero = lo + 8 * scale
    scales_and_zeros = torch.stack([scale, lo + 8 * scale], dim=2).transpose(0, 1).contiguous().to(dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed_q, group, scales_and_zeros)


def candidates(weight: torch.Tensor, bf16: bool):
    yield "float32 packed", torch.float32, packed(weight.float())
    if bf16:
        yield "bf16 packed", torch.bfloat16, packed(weight.bfloat16())
    yield "int8 (float32 act.)", torch.float32, int8_pack_mm(weight, torch.float32)
    yield "int8 fbgemm dynamic (float32 act.)", torch.float32, DynamicInt8Linear(weight)
    if native_unavailable() is None:
        yield "int8 native AVX2 (float32 act.)", torch.float32, NativeInt8Linear(weight)
    if bf16:
        yield "int8 (bf16 act.)", torch.bfloat16, int8_pack_mm(weight, torch.bfloat16)
    for group in (32, 128):
        act = torch.bfloat16 if bf16 else torch.float32
        yield f"int4 g{group} ({'bf16' if bf16 else 'float32'} act.)", act, int4_pack_mm(weight, group, act)


def _native(weight: torch.Tensor, isa: str):
    """A NativeInt8Linear held to one instruction set's variant of the kernel."""
    linear = NativeInt8Linear(weight)
    kernel = getattr(native._library("woq_int8"), "woq_int8_linear_avx512" if isa == "AVX512" else "woq_int8_linear")
    n, k = weight.shape

    def call(x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], n)
        kernel(x.data_ptr(), x.shape[0], k, linear.packed.data_ptr(), linear.scale.data_ptr(), n, y.data_ptr(), 0, 0)
        return y

    return call


def step(rows: list[int], repeats: int, lm_head: bool) -> list[str]:
    """A decode step's projections (18 layers x q, k, v, o, gate, up, down), each its own weight (and with
    `lm_head`, the 262k-row lm_head too), through each layout this CPU has: median ms of the whole step, the
    layouts' repetitions interleaved so that a busy machine's load falls on all of them alike. The bf16 rows take
    bf16 activations, the native rows float32 (cast from bf16 and back in the bf16 engine: not included)."""
    shapes = [(n, k) for name, n, k in SHAPES if name != "lm_head" for _ in range(PER_LAYER[name])] * LAYERS
    if lm_head:
        shapes.append(SHAPES[-1][1:])
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    kinds = {"float32 packed": (torch.float32, [packed(w) for w in weights])}
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        kinds["bf16 packed"] = (torch.bfloat16, [packed(w.bfloat16()) for w in weights])
    if native_unavailable() is None:
        kinds["int8 native AVX2"] = (torch.float32, [_native(w, "AVX2") for w in weights])
        if native.cpu_has_avx512():
            kinds["int8 native AVX512"] = (torch.float32, [_native(w, "AVX512") for w in weights])
    del weights
    what = "126 projections" + (" and the lm_head" if lm_head else "")
    lines = [f"| a step's {what} | " + " | ".join(f"{m} row{'s' if m > 1 else ''} (ms)" for m in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    cells: dict[str, list[str]] = {label: [] for label in kinds}
    for m in rows:
        calls = {}
        for label, (dtype, linears) in kinds.items():
            inputs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes}}
            calls[label] = lambda linears=linears, inputs=inputs: [f(inputs[k]) for f, (_, k) in zip(linears, shapes)]
            calls[label](), calls[label]()
        samples: dict[str, list[float]] = {label: [] for label in kinds}
        for _ in range(repeats):
            for label, call in calls.items():
                start = time.perf_counter()
                call()
                samples[label].append((time.perf_counter() - start) * 1e3)
        for label in kinds:
            cells[label].append(f"{statistics.median(samples[label]):.2f}")
    lines += [f"| {label} | " + " | ".join(row) + " |" for label, row in cells.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--step", action="store_true", help="a whole decode step's projections, streamed from memory")
    parser.add_argument("--lm-head", action="store_true", help="with --step: the lm_head in the step too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    rows = [int(r) for r in args.rows.split(",")]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split() if f.startswith(("avx2", "avx512f", "avx512_bf16", "amx"))})
    print(f"CPU: {cpu}; flags: {' '.join(flags)}; torch {torch.__version__}, {torch.get_num_threads()} threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    torch.manual_seed(0)
    if args.step:
        print("\n".join(step(rows, args.repeats, args.lm_head)))
        return
    totals: dict[tuple[str, int], float] = {}
    lines = ["| shape (out x in) | kernel | " + " | ".join(f"{m} row{'s' if m > 1 else ''} (ms)" for m in rows) + " |",
             "|---|---|" + "---:|" * len(rows)]
    for name, n, k in SHAPES:
        weight = torch.randn(n, k) * 0.02
        for label, dtype, fn in candidates(weight, bf16):
            cells = []
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                try:
                    ms = timed(lambda: fn(x), args.repeats if n < 100_000 else max(5, args.repeats // 3))
                except RuntimeError as error:
                    cells.append(f"error: {str(error).splitlines()[0][:40]}")
                    continue
                cells.append(f"{ms:.3f}")
                totals[(label, m)] = totals.get((label, m), 0.0) + ms * (LAYERS * PER_LAYER.get(name, 0) or 1)
            lines.append(f"| {name} ({n} x {k}) | {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("All matmuls of one decode step (18 layers' projections plus the lm_head), summed from the rows above:")
    lines.append("")
    lines.append("| kernel | " + " | ".join(f"{m} row{'s' if m > 1 else ''} (ms)" for m in rows) + " |")
    lines.append("|---|" + "---:|" * len(rows))
    for label in dict.fromkeys(label for label, _ in totals):
        lines.append(f"| {label} | " + " | ".join(f"{totals.get((label, m), float('nan')):.1f}" for m in rows) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
