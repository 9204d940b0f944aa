"""Cost of applying grammar masks to a step's logits on a CPU: plain torch (`engine.grammar.apply_bitmask_torch`,
what a CPU install uses) vs xgrammar's C++ CPU kernel (when installed), at batch 8 and 32, float32 and bf16.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/mask_apply.py

The masks are real: llguidance's masks along a JSON document of a schema with the embedded model's 262,144-token
tokenizer (structural states allow a handful of tokens, string states nearly all). Each row of a batch takes
the next mask along the document. Prints the median and minimum of 25 runs per case, in ms.
"""

from __future__ import annotations

import statistics
import time

import llguidance.torch
import torch
from transformers import AutoTokenizer

from oai_gemma.engine.sampling.grammar import GrammarCompiler, apply_bitmask_torch
from oai_gemma.engine.model.loader import embedded_model_dir

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
DOCUMENT = '{"name":"Ada Lovelace of London","age":36,"tags":["math","poetry"]}'


def real_masks() -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    words = (compiler.vocab_size + 31) // 32
    masks = []
    for grammar in (compiler.json_schema(SCHEMA), compiler.json_object()):
        matcher = grammar.matcher()
        for token in tokenizer.encode(DOCUMENT, add_special_tokens=False):
            bitmask = torch.empty(1, words, dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            masks.append(bitmask[0].clone())
            matcher.consume_token(token)
    return torch.stack(masks)


def main() -> None:
    masks = real_masks()
    vocab = masks.shape[1] * 32
    ways = {"torch": apply_bitmask_torch}
    try:
        import xgrammar

        ways["xgrammar (C++ CPU kernel)"] = lambda logits, bitmask: xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    except ImportError:
        pass
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(masks)} masks, vocab {vocab}")
    print("| dtype | batch | way | median ms | min ms |\n| --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (8, 32):
            bitmask = masks[[j % len(masks) for j in range(batch)]].contiguous()
            for name, apply in ways.items():
                times = []
                for run in range(25):
                    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(run)).to(dtype)
                    start = time.perf_counter()
                    apply(logits, bitmask)
                    times.append((time.perf_counter() - start) * 1e3)
                print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {name} | {statistics.median(times):.2f} | {min(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
