"""The next-token logits' error of weight layouts against float32 on a fixed text, at any checkpoint's shape: the
measure random-weight checkpoints allow (their distributions are flat, so perplexity says nothing; the ratio of two
layouts' errors does). Each layout runs every call through its kernels (batch-invariant mode: the prefill chunks
too, activations quantized as a decode step's are). A layout is a `model.quantization` value (`int8`, `q4`, ...)
of `--model-dir`, or another checkpoint directory read as float32 `none` (llama.cpp's GGUF dequantized to float32
by `--dequantize FILE.gguf DIR`: its weight quantization alone, as ours is measured).

    C=~/.cache/oai-gemma-bench/gemma-3-1b-random
    python benchmarks/logit_error.py --model-dir $C --reference /tmp/ref-1b.pt \
        --dequantize $C/gguf/gemma-3-1b-random-q4_k_m.gguf /tmp/q4km-1b /tmp/q4km-1b int8 q4 q4-mix

Mean KL divergence (float32 || layout, nats a position), RMS and largest logit difference, top-1 agreement;
the first layout is the one the others' ratios are taken against. docs/engine.md, "Quality at the 1B shape".
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from pathlib import Path

import torch

from oai_gemma.engine.factory import configure, load_weights, measure_invariance
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.quality import LogitError, chunk_logits
from oai_gemma.engine.model.runner import ModelRunner
from oai_gemma.settings import EngineSettings, ModelSettings, Settings

TEXT = Path(__file__).parent.parent / "tests" / "data" / "apache-2.0.txt"
COPIED = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def runner_for(source: str, quantization: str, cache_dir: str = "") -> tuple[ModelRunner, object]:
    invariant = "off" if quantization == "none" else "on"  # on: a prefill chunk runs the kernels, as decode does
    settings = Settings(model=ModelSettings(source=source, dtype="float32", quantization=quantization, max_model_len=2048,
                                            cache_dir=cache_dir),
                        engine=EngineSettings(max_num_seqs=1, max_prefill_tokens=256, batch_invariant=invariant))
    loaded = load(settings.model, lean=True, stream=True)
    config = configure(settings, loaded)
    weights = load_weights(loaded, config.model, True)
    return ModelRunner(weights, config, loaded.model, measure_invariance(weights, config)[0]), loaded.tokenizer


def reference_logits(model_dir: str, tokens: int, kept: str) -> tuple[list[torch.Tensor], list[int]]:
    """float32 `none`'s logits of the text's first `tokens` positions (read from `kept` where a run saved them)."""
    if kept and os.path.exists(kept):
        saved = torch.load(kept)
        if saved["model_dir"] == model_dir and len(saved["ids"]) == tokens + 1:
            return saved["logits"], saved["ids"]
    runner, tokenizer = runner_for(model_dir, "none")
    ids = tokenizer.encode(TEXT.read_text())[: tokens + 1]
    logits = list(chunk_logits(runner, ids))
    del runner
    gc.collect()
    if kept:
        torch.save({"model_dir": model_dir, "ids": ids, "logits": logits}, kept)
    return logits, ids


def dequantize(gguf: Path, model_dir: Path, target: Path) -> None:
    """The GGUF's weights as a float32 checkpoint in `target`, with `model_dir`'s tokenizer files."""
    from oai_gemma.engine.model.gguf_convert import convert

    target.mkdir(parents=True, exist_ok=True)
    convert(gguf, None, target, torch.float32)[0].close()
    for name in COPIED:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, target / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reference", default="", help="a file float32's logits are kept in between runs")
    parser.add_argument("--cache-dir", default="", help="the model cache (default: the server's)")
    parser.add_argument("--dequantize", nargs=2, metavar=("GGUF", "DIR"), help="write DIR from GGUF first")
    parser.add_argument("layouts", nargs="+", help="model.quantization values, or checkpoint directories (float32 none)")
    args = parser.parse_args()
    model_dir = os.path.expanduser(args.model_dir)
    if args.dequantize:
        dequantize(Path(args.dequantize[0]).expanduser(), Path(model_dir), Path(args.dequantize[1]).expanduser())
    reference, ids = reference_logits(model_dir, args.tokens, args.reference)
    print(f"{model_dir}, {len(ids) - 1} positions of {TEXT.name}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| layout | mean KL (nats) | vs first | RMS logit error | vs first | max logit error | top-1 agrees | resident weights (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    for layout in args.layouts:
        source, quantization = (layout, "none") if os.path.isdir(os.path.expanduser(layout)) else (model_dir, layout)
        runner, _ = runner_for(os.path.expanduser(source), quantization, args.cache_dir)
        error = LogitError()
        for ref, out in zip(reference, chunk_logits(runner, ids)):
            error.add(ref, out)
        got, size = error.summary(), runner.weight_bytes()
        first = first or got
        print(f"| {layout} | {got['mean_kl']:.5f} | {got['mean_kl'] / first['mean_kl']:.2f} | {got['rms']:.4f} | "
              f"{got['rms'] / first['rms']:.2f} | {got['max']:.3f} | {got['top1_agree']:.1%} | {size / 1e6:.0f} |", flush=True)
        del runner
        gc.collect()


if __name__ == "__main__":
    main()
