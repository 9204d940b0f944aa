"""GPU check: gemma-3-12b-it shapes with dummy bf16 weights on one GPU, measured at the engine level in one run.

What it measures (issue #3, GPU targets), written to `<out>/gpu_check.json` after every phase:
- the text decoder of the config (gemma-3-12b-it's, 48 layers, hidden 3840; no vision tower);
- device copy bandwidth (a device-to-device copy, bytes read + written) and the weight-streaming floor of a
  decode step: the bytes of the weights a step reads (decoder layers and lm_head) / that bandwidth;
- the raw decode step (`runner.forward`, CUDA-graph replay) at batch 1 and 64;
- through `Engine` (no HTTP): concurrency-1 inter-token latency, TTFT of a 1,000-token prompt, aggregate
  output throughput at concurrency 64;
- each for `compile = off` (CUDA graphs only) first, then `compile = on` (graphs over torch.compile'd layer
  functions) if time is left. No HTTP smoke: a server process would load the model a second time.

Run on the GPU machine from the repository root (no install needed, the repo root is put on sys.path):

    python3 benchmarks/gpu_check.py --out $OUT

It needs torch with CUDA, transformers >= 5 and accelerate (the H200 image has them) and msgspec
(`oai_gemma.settings`), which that image lacks and which cannot be fetched there: bring it as a wheel.
Here, once: `echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all:
--python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec`; then run with
carry [".whl"] and the command
`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site
python3 benchmarks/gpu_check.py --out $OUT`. Elsewhere, `pip install -e .` does it.
Dummy weights come without a tokenizer: `--tokenizer DIR` takes a Gemma-3 tokenizer directory; without it a
word-level stand-in of the model's vocabulary size is built (the measured numbers do not depend on it, the
generated text is noise either way). Expect ~1 min to build and warm up, ~1 min per compile mode measured.

`--smoke` runs the same code on a tiny Gemma-3 on the CPU in seconds (tests/bench/test_gpu_check.py), so the device
run does not fail for a silly reason.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from oai_gemma.engine.engine import Engine  # noqa: E402
from oai_gemma.engine.model.loader import load  # noqa: E402
from oai_gemma.engine.model.runner import StepItem  # noqa: E402
from oai_gemma.engine.types import GenerationRequest, SamplingParams  # noqa: E402
from oai_gemma.settings import ModelSettings  # noqa: E402

CONFIG_12B = ROOT / "configs/hf/gemma-3-12b-it/config.json"
FULL = dict(max_model_len=4096, max_num_seqs=64, max_prefill_tokens=2048, ttft_prompt=1000, itl_tokens=128,
            concurrency=64, throughput_prompt=128, throughput_tokens=256, repeats=5)
SMOKE = dict(max_model_len=256, max_num_seqs=4, max_prefill_tokens=64, ttft_prompt=100, itl_tokens=6,
             concurrency=4, throughput_prompt=8, throughput_tokens=6, repeats=2)
TINY_TEXT_CONFIG = dict(
    model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=32, max_position_embeddings=1024,
    layer_types=["sliding_attention", "full_attention"], bos_token_id=2, eos_token_id=1, pad_token_id=0,
)


# ---- the model directory: a config and a tokenizer, no weights -----------------------------------------

def text_decoder_config(config: dict) -> dict:
    """The text decoder of a multimodal Gemma-3 config (a Gemma3ForCausalLM of the same shapes): a decode step
    never runs the vision tower, and a dummy multimodal model would also need a processor config to load."""
    text = config.get("text_config")
    if text is None:
        return config
    return {**text, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "eos_token_id": config.get("eos_token_id", 1)}


def model_dir(config: dict, tokenizer_dir: str | None) -> str:
    """A temporary source directory for `load_format = "dummy"`: the config, and a tokenizer beside it."""
    directory = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer_dir:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (Path(tokenizer_dir) / name).exists():
                (directory / name).write_bytes((Path(tokenizer_dir) / name).read_bytes())
    else:
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(directory)  # fields the file leaves out take transformers' defaults
        stand_in_tokenizer(getattr(full, "text_config", full).vocab_size).save_pretrained(directory)
    return str(directory)


def stand_in_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id, for dummy weights when no Gemma-3 tokenizer is at hand."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
    )


# ---- device measurements --------------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (median of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times[3:])


def weight_bytes(runner) -> int:
    """Bytes a decode step streams: every decoder layer's weights and the lm_head (the embedding row gather is
    negligible; with tied embeddings the lm_head is that same matrix, counted once)."""
    seen, total = set(), 0
    tensors = [getattr(t, "weight", t) for w in runner.weights for t in w] + [runner.gemma.final_norm]
    tensors += [runner.lm_head_linear.weight]
    for tensor in tensors:
        if tensor is None:  # a layer part this model does not have (Gemma3Weights keeps its slot as None)
            continue
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(runner, batch: int, position: int, repeats: int = 20) -> float:
    """Median wall time of one decode-only `runner.forward` at this batch (sequences 0..batch-1)."""
    fit = runner.cache.num_blocks // -(-(position + 1) // runner.cache.block_size)  # rows beyond share blocks: same work
    items = [StepItem(runner.sequence_blocks(row % fit, position + 1), [5], position) for row in range(batch)]
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        runner.forward([], items)
        synchronize(runner.device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


# ---- engine-level measurements --------------------------------------------------------------------------

class Driver:
    """Runs requests through a started Engine on its own event loop; prompts are random so no prefix is reused."""

    def __init__(self, engine: Engine, vocab: int):
        self.engine = engine
        self.vocab = vocab
        self.loop = asyncio.new_event_loop()
        engine.start(self.loop)
        self.count = 0
        self.random = torch.Generator().manual_seed(0)

    def prompt(self, length: int) -> list[int]:
        return torch.randint(10, self.vocab, (length,), generator=self.random).tolist()

    async def _one(self, length: int, max_tokens: int) -> dict:
        self.count += 1
        request = GenerationRequest(
            f"check-{self.count}", self.prompt(length), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            time.perf_counter(),
        )
        stamps = [e.timestamp async for e in self.engine.generate(request) if e.token_id is not None]
        return {"arrival": request.arrival_time, "stamps": stamps}

    def run(self, lengths_and_tokens: list[tuple[int, int]]) -> list[dict]:
        async def main():
            return await asyncio.gather(*(self._one(n, m) for n, m in lengths_and_tokens))

        return self.loop.run_until_complete(main())

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def engine_numbers(driver: Driver, p: dict) -> dict:
    results = {}
    (one,) = driver.run([(p["throughput_prompt"], p["itl_tokens"])])
    gaps = [b - a for a, b in zip(one["stamps"], one["stamps"][1:])]
    results["c1_itl_ms_median"] = 1000 * statistics.median(gaps)
    results["c1_itl_ms_p90"] = 1000 * sorted(gaps)[int(0.9 * (len(gaps) - 1))]
    ttfts = [1000 * (r["stamps"][0] - r["arrival"]) for _ in range(p["repeats"]) for r in driver.run([(p["ttft_prompt"], 1)])]
    results["ttft_ms_prompt"] = p["ttft_prompt"]
    results["ttft_ms_median"] = statistics.median(ttfts)
    results["ttft_ms_all"] = ttfts
    start = time.perf_counter()
    many = driver.run([(p["throughput_prompt"], p["throughput_tokens"])] * p["concurrency"])
    wall = time.perf_counter() - start
    tokens = sum(len(r["stamps"]) for r in many)
    gaps = [b - a for r in many for a, b in zip(r["stamps"], r["stamps"][1:])]
    results.update(
        concurrency=p["concurrency"], output_tokens=tokens, wall_s=wall, throughput_tok_s=tokens / wall,
        itl_ms_median_at_concurrency=1000 * statistics.median(gaps),
    )
    return results


# ---- the run ----------------------------------------------------------------------------------------------

def measure_mode(loaded, p: dict, compile_mode: str, report: dict) -> None:
    started = time.perf_counter()
    engine = Engine(loaded, EngineConfig(
        model=ModelConfig(max_model_len=p["max_model_len"], compile=compile_mode != "off", static_decode=True),
        scheduler=SchedulerConfig(max_num_seqs=p["max_num_seqs"], max_prefill_tokens=p["max_prefill_tokens"]),
        # one token a step: a drafted step runs the dynamic path (not the graphs), and its accepted tokens share one
        # timestamp (ITL gaps of 0: the smoke test's median ITL came out 0.0 when a random model's greedy text repeated)
        speculative=SpeculativeConfig(method="off"),
    ))
    engine.warm_up()
    runner = engine.core.runner
    result = {
        "warm_up_s": time.perf_counter() - started,
        "static_decode": runner.static is not None,
        "cuda_graphs": bool(runner.static and runner.static.use_graphs),
        "attention": "flash-attn" if runner.static and runner.static.flash else "sdpa",
        "buckets": sorted(runner.static.graphs) if runner.static else [],
        "kv_cache_gib": runner.cache.nbytes / 2**30,
        "step_ms_batch1": step_ms(runner, 1, 200),
        f"step_ms_batch{p['concurrency']}": step_ms(runner, p["concurrency"], 200),
    }
    report.setdefault("weights_bytes", weight_bytes(runner))
    if "copy_bandwidth_bytes_s" in report:
        report["weight_streaming_floor_ms"] = 1000 * report["weights_bytes"] / report["copy_bandwidth_bytes_s"]
    driver = Driver(engine, engine.vocab_limit)
    try:
        result.update(engine_numbers(driver, p))
    finally:
        driver.close()
    if "weight_streaming_floor_ms" in report:
        floor = report["weight_streaming_floor_ms"]
        result["c1_itl_over_floor"] = result["c1_itl_ms_median"] / floor
        result["step_batch1_over_floor"] = result["step_ms_batch1"] / floor
    report["modes"][compile_mode] = result
    del engine, runner, driver
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_check.json")
    parser.add_argument("--config", default=str(CONFIG_12B), help="a Hugging Face config.json (default: 12b)")
    parser.add_argument("--tokenizer", default=None, help="a Gemma-3 tokenizer directory (optional)")
    parser.add_argument("--modes", default="off,on", help="compile modes to measure, in order")
    parser.add_argument("--budget-s", type=float, default=330, help="skip later modes past this many seconds")
    parser.add_argument("--smoke", action="store_true", help="a tiny Gemma-3 on the CPU, to test this script")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = SMOKE if args.smoke else FULL
    config = TINY_TEXT_CONFIG if args.smoke else text_decoder_config(json.loads(Path(args.config).read_text()))
    device = "cpu" if args.smoke else "cuda"
    report: dict = {"smoke": args.smoke, "config": "tiny" if args.smoke else args.config, "params": p, "modes": {}}
    report["torch"] = torch.__version__
    if device == "cuda":
        report["device_name"] = torch.cuda.get_device_name()
        report["copy_bandwidth_bytes_s"] = copy_bandwidth(torch.device("cuda"), 4 << 30)

    def save():
        report["elapsed_s"] = time.perf_counter() - began
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    started = time.perf_counter()
    settings = ModelSettings(
        source=model_dir(config, args.tokenizer), load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
        device=device, max_model_len=p["max_model_len"],
    )
    loaded = load(settings)
    report["load_s"] = time.perf_counter() - started
    save()
    for mode in args.modes.split(","):
        if report["modes"] and time.perf_counter() - began > args.budget_s:
            report["modes"][mode] = {"skipped": f"over the {args.budget_s:.0f} s budget"}
            continue
        try:
            measure_mode(loaded, p, mode, report)
        except Exception as exc:  # one mode failing (say torch.compile) must not lose the others' numbers
            report["modes"][mode] = {"error": repr(exc)}
        save()
        print(json.dumps({mode: report["modes"][mode]}, default=str), flush=True)
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "modes"}, default=str), flush=True)
    return report


if __name__ == "__main__":
    main()
