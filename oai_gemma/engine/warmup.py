"""Warm-up: every step shape run once before the server says it is ready, so that no user request pays
for kernel compilation (oneDNN per shape on a CPU, CUDA graphs and the grammar mask kernel on a GPU)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..cpu import TURNS
from .model.shared import shared
from .sampling.grammar import GrammarCompiler, GrammarMasks, StructuredOutputUnavailable
from .sequence import StepItem
from .sampling.sampler import PlainRow, RowRandom, sample_with_logprobs
from .types import SamplingParams

if TYPE_CHECKING:
    from .core import EngineCore

log = logging.getLogger("oai_gemma.engine")


def warm_up(core: EngineCore, grammars: Callable[[], GrammarCompiler]) -> None:
    """Each token-count bucket, each logits-row bucket, both sampling paths, on a GPU every static decode
    bucket's CUDA graph and the grammar mask kernel (`grammars()` waits for the compiler's build)."""
    runner = core.runner
    scratch = [runner.cache.scratch] * -(-core.limits.max_model_len // runner.cache.block_size)  # no real block is touched
    layers = runner.warm_layers  # a shape's kernels serve every layer of its kind: 2 of 18 layers, 0.5 s instead of 1.7 s
    for size in runner.warm_token_buckets:  # every bucket where a shape builds kernels; no logits: the lm_head's
        # one-row shape is a decode row's, warmed below
        runner.forward([StepItem(scratch, [0] * min(size, core.limits.max_model_len), 0, want_logits=False)], [], layers)
    for rows in runner.row_buckets:
        logits = runner.forward([], [StepItem(scratch, [0], 0) for _ in range(rows)], layers)
    for rows in runner.logits_buckets[len(runner.row_buckets) :]:  # draft rows beyond the batch's (speculative decoding)
        runner.logits_of(torch.zeros(rows, runner.text_shape.hidden, dtype=runner.dtype))
    runner.capture_decode_graphs()
    rows = [
        PlainRow(SamplingParams(max_tokens=1, temperature=0.0), RowRandom(0)),
        PlainRow(
            SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.1, logprobs=5),
            RowRandom(1),
        ),
    ]
    TURNS.offer()  # (each layer, MLP call and lm_head call above a unit of a load's work too: cpu.Turns)
    sample_with_logprobs(logits[:1].repeat(2, 1), rows, core.limits.eos_token_ids)
    if runner.device.type != "cpu":  # a GPU's mask kernel compiles on its first call: pay that before ready
        try:
            core.grammar_masks.apply(logits[:1, : core.vocab_limit].clone(), [grammars().json_object().matcher()])
        except StructuredOutputUnavailable:
            pass  # logged by build_grammars; the server serves without structured output


def shared_compiler(tokenizer, eos_token_ids: list[int], cache_dir: Path | None) -> GrammarCompiler:
    """The compiler of a tokenizer's content and eos ids, built once per process (model/shared.py: a second model
    of the same tokenizer does not hold the GIL a second for its token trie); a tokenizer with no file (a hub id's
    AutoTokenizer) gets its own."""
    key = getattr(tokenizer, "content_key", None)
    if key is None:
        return GrammarCompiler(tokenizer, eos_token_ids, cache_dir)
    key = ("grammar", key, tuple(eos_token_ids), tokenizer.bos_token_id, len(tokenizer))
    return shared(key, lambda: GrammarCompiler(tokenizer, eos_token_ids, cache_dir))


def build_grammars(tokenizer, eos_token_ids: list[int], masks: GrammarMasks, vocab_limit: int, device: torch.device,
                   cache_dir: Path | None) -> GrammarCompiler:
    """The grammar compiler (a second of one core: the vocabulary's token trie, from the token table cached in
    `cache_dir`). Started on its own thread once warm-up is done (`Engine.warm_up`), whose steps it would stall; ready
    waits for it (engine/factory.py), so the first request after ready does not. The CPU mask kernel is warmed here too; a GPU's is warmed on the engine thread,
    which owns the device (`warm_up`)."""
    try:
        compiler = shared_compiler(tokenizer, eos_token_ids, cache_dir)
        if device.type == "cpu":
            masks.apply(torch.zeros(1, vocab_limit), [compiler.json_object().matcher()])
    except Exception as exc:  # a tokenizer llguidance cannot read (e.g. a stand-in): serve without it
        log.warning("structured output is unavailable for this tokenizer: %s", exc)
        raise
    return compiler
