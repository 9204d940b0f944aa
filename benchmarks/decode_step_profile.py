"""Where a decode step's time goes: `ModelRunner.forward` over N decode rows plus the greedy pick, with the step's
parts timed by wrapping the functions the runner calls (the native kernels are ctypes calls, which torch.profiler
does not see): the projections, the lm_head, decode attention (and the KV gather inside it), the KV writes, the
norms, rope, the residual adds, the GELU, the pack, the sampling; "other" is the rest (Python per layer, views). It
first prints the bandwidth floor: the weights' bytes a one-row step reads over the measured read bandwidth.

    python benchmarks/decode_step_profile.py --model-dir ~/.cache/oai-gemma-bench/gemma-3-1b-random \
        --quantization q8 --rows 8 --context 40 --threads 1,2
    python benchmarks/decode_step_profile.py ... --native-ab --steps 40   # native decode attention and gelu vs torch's

Fractions are meaningful on a loaded machine at one thread (`--cpu-time`: the main thread's CPU time, so waits for
a core drop out); with two threads on a shared 2-core machine every
parallel region waits for a core, so compare threads only on a quiet one (`uptime`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from oai_gemma.bench.floor import read_bandwidth
from oai_gemma.engine.factory import configure, load_weights, measure_invariance
from oai_gemma.engine.model import attention, gemma3, runner as runner_module
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.runner import ModelRunner, StepItem
from oai_gemma.engine.sampling.sampler import PlainRow, RowRandom, sample_with_logprobs
from oai_gemma.engine.types import SamplingParams
from oai_gemma.settings import EngineSettings, ModelSettings, Settings


class Clock:
    """Seconds and calls per part; a part called inside another timed part counts in the outer one only, unless
    it is `nested` (then it is shown indented, as a share of its parent)."""

    def __init__(self, timer=time.perf_counter):
        self.seconds, self.calls, self.depth, self.timer = collections.defaultdict(float), collections.Counter(), 0, timer

    def wrap(self, name: str, fn, nested: bool = False):
        def timed(*args, **kwargs):
            if self.depth and not nested:
                return fn(*args, **kwargs)
            self.depth += not nested
            started = self.timer()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += self.timer() - started
                self.calls[name] += 1
                self.depth -= not nested
        return timed


class _Gelu:
    """gemma3's `F`, with its gelu timed (the layer calls `F.gelu`)."""

    def __init__(self, clock: Clock):
        self.gelu = clock.wrap("gelu", torch.nn.functional.gelu)


def _timed_linear(clock: Clock, linear):
    """The step's linear (batch-invariant mode's TiledLinear or RoleLinear, or call_linear) timed as the projections,
    keeping its `fuses` (fused q/k/v and gate/up stay one call)."""
    timed = clock.wrap("projections", linear)
    timed.fuses = getattr(linear, "fuses", False)
    return timed


def instrument(runner: ModelRunner, clock: Clock) -> None:
    runner_module.call_linear = clock.wrap("projections", runner_module.call_linear)
    step_linear = runner._step_linear
    runner._step_linear = lambda batch: _timed_linear(clock, step_linear(batch))
    runner_module.decode_attention = clock.wrap("decode attention", runner_module.decode_attention)
    gemma3.rms_norm = clock.wrap("RMSNorms", gemma3.rms_norm)
    gemma3.rope = clock.wrap("rope", gemma3.rope)
    gemma3.qk_norm_rope = clock.wrap("q/k norms and rope", gemma3.qk_norm_rope)
    gemma3.residual_norm = clock.wrap("residual adds and their norms", gemma3.residual_norm)
    gemma3.F = _Gelu(clock)
    runner.lm_head_linear = clock.wrap("lm_head", runner.lm_head_linear)
    runner.cache.blocks = clock.wrap("  of which the KV gather", runner.cache.blocks, nested=True)
    runner.cache.write = clock.wrap("KV writes", runner.cache.write)
    runner._pack = clock.wrap("pack (Python, tensors of ids and tables)", runner._pack)
    runner.rotary = clock.wrap("rope cos/sin", runner.rotary)
    runner.gemma.norm = clock.wrap("final norm", runner.gemma.norm)


def profile(runner: ModelRunner, clock: Clock, rows: int, context: int, steps: int) -> list[float]:
    length = -(-(context + rows + 1) // runner.cache.block_size) * runner.cache.block_size
    decodes = [StepItem(runner.sequence_blocks(r, length), [1234], context + r) for r in range(rows)]
    sampled = [PlainRow(SamplingParams(max_tokens=32, temperature=0.0), RowRandom(0)) for _ in range(rows)]
    pick = clock.wrap("sampling (greedy)", sample_with_logprobs)
    for _ in range(3):
        pick(runner.forward([], decodes), sampled)
    clock.seconds.clear()
    clock.calls.clear()
    times = []
    for _ in range(steps):
        started = clock.timer()
        pick(runner.forward([], decodes), sampled)
        times.append(clock.timer() - started)
    return times


def _torch_steps() -> None:
    """Decode attention and the MLP's gelu * up through torch's ops (the native calls' `--native-ab` baseline)."""
    attention._native_decode = lambda *args: None
    gemma3._gelu_times = lambda gate, up: torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)


def native_ab(runner: ModelRunner, rows: int, context: int, steps: int, timer) -> None:
    """Whole steps with the native decode attention and gelu * up (engine/ops/native attention.c, layer.c) and with
    torch's ops for them, alternating step by step: the change's A/B in one process."""
    length = -(-(context + rows + 1) // runner.cache.block_size) * runner.cache.block_size
    decodes = [StepItem(runner.sequence_blocks(r, length), [1234], context + r) for r in range(rows)]
    sampled = [PlainRow(SamplingParams(max_tokens=32, temperature=0.0), RowRandom(0)) for _ in range(rows)]
    native = (attention._native_decode, gemma3._gelu_times)
    times = {"native": [], "torch": []}
    try:
        for step in range(2 * steps + 4):
            name = "native" if step % 2 else "torch"
            attention._native_decode, gemma3._gelu_times = native
            if name == "torch":
                _torch_steps()
            started = timer()
            sample_with_logprobs(runner.forward([], decodes), sampled)
            if step >= 4:
                times[name].append((timer() - started) * 1e3)
    finally:
        attention._native_decode, gemma3._gelu_times = native
    print(f"native decode attention and gelu A/B, {rows} rows at context ~{context}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.1f}: " + "; ".join(f"{name} median {statistics.median(t):.1f} ms, min {min(t):.1f} ms"
                                                          for name, t in times.items()))


def report(times: list[float], clock: Clock, title: str, floor_ms: float) -> None:
    total, steps = sum(times), len(times)
    print(f"{title}: step median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms "
          f"({statistics.median(times) * 1e3 / floor_ms:.2f}x the bandwidth floor); "
          f"{time.strftime('%H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    print("| part | ms a step | share | calls a step |\n|---|---:|---:|---:|")
    counted = 0.0
    for name, seconds in sorted(clock.seconds.items(), key=lambda kv: -kv[1]):
        counted += 0 if name.startswith(" ") else seconds
        print(f"| {name} | {seconds / steps * 1e3:.2f} | {seconds / total:.1%} | {clock.calls[name] / steps:.0f} |")
    print(f"| other | {(total - counted) / steps * 1e3:.2f} | {(total - counted) / total:.1%} | |\n")


def load_runner(model_dir: str, quantization: str, rows: int):
    """The model (`model_dir`, else the embedded one) in float32 at `quantization`, as a runner for `rows` rows, and
    its engine configuration."""
    model = ModelSettings(dtype="float32", quantization=quantization, max_model_len=2048)
    settings = Settings(model=model if not model_dir else ModelSettings(
        source=os.path.expanduser(model_dir), dtype="float32", quantization=quantization, max_model_len=2048),
        engine=EngineSettings(max_num_seqs=max(8, rows)))
    loaded = load(settings.model)
    config = configure(settings, loaded)
    weights = load_weights(loaded, config.model)
    return ModelRunner(weights, config, loaded.model, measure_invariance(weights, config)[0]), config


def step_inputs(runner: ModelRunner, rows: int, context: int) -> tuple[list, list]:
    """`rows` decode rows at context ~`context`, and their greedy sampling."""
    length = -(-(context + rows + 1) // runner.cache.block_size) * runner.cache.block_size
    decodes = [StepItem(runner.sequence_blocks(r, length), [1234], context + r) for r in range(rows)]
    sampled = [PlainRow(SamplingParams(max_tokens=32, temperature=0.0), RowRandom(0)) for _ in range(rows)]
    return decodes, sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--threads", default="1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu-time", action="store_true",
                        help="the main thread's CPU time instead of wall time (a loaded machine, one thread: no waits for a core)")
    parser.add_argument("--native-ab", action="store_true",
                        help="whole steps alternating the native decode attention and gelu with torch's (no per-part timing)")
    args = parser.parse_args()
    runner, config = load_runner(args.model_dir, args.quantization, args.rows)
    clock = Clock(time.thread_time if args.cpu_time else time.perf_counter)
    if args.native_ab:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            native_ab(runner, args.rows, args.context, args.steps, clock.timer)
        return
    instrument(runner, clock)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bandwidth, read = read_bandwidth(), runner.decode_bytes()
        print(f"{threads} threads: {read / 1e6:.0f} MB of weights a token, read bandwidth {bandwidth / 1e9:.1f} GB/s: "
              f"floor {read / bandwidth * 1e3:.1f} ms a step")
        times = profile(runner, clock, args.rows, args.context, args.steps)
        report(times, clock, f"{config.model.quantization}, {args.rows} rows at context ~{args.context}, {threads} threads",
               read / bandwidth * 1e3)


if __name__ == "__main__":
    main()
