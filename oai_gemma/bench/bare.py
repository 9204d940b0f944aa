"""The bare-model reference: the HF model's own prefill and batch-1 decode step, timed in-process.

Loaded exactly as the server loads it (`engine.loader.load` with the same settings), in a child process so
the benchmark client never holds the model while a server runs (a server and this would share the cores).
"""

from __future__ import annotations

import inspect
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor


def _measure(prefill_reps: int, decode_steps: int, warmup_steps: int) -> dict:
    import torch
    from transformers import DynamicCache

    from ..chat import render_chat
    from ..engine.model.loader import load
    from ..settings import load_settings
    from .prompts import PROMPTS, messages_for

    loaded = load(load_settings().model)
    model, tokenizer = loaded.model, loaded.tokenizer
    # transformers 5.24 renamed `past_key_values` to `cache`; older 5.x only knows the first
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prompt_ids(index: int) -> torch.Tensor:
        text = render_chat(messages_for(index)).prompt  # what the server renders (it starts with <bos>)
        return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=loaded.device)

    def prefill(ids: torch.Tensor, stock: bool = False):
        """Fill a fresh cache with the prompt and pick the first token.

        stock: the model's own forward with `logits_to_keep=1`, as `generate` calls it. Else the decoder then
        `lm_head` on the last row as a 2-D tensor: the stock path hands `lm_head` a `[:, -1:]` slice, and with
        frozen weights (`requires_grad_(False)`, as `load` leaves them) torch 2.13 on CPU in bf16 runs that
        `F.linear` as a bmm that first copies the whole vocabulary matrix.
        """
        cache = DynamicCache(config=model.config)
        started = time.perf_counter()
        if stock:
            logits = model(input_ids=ids, **{cache_kw: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        else:
            hidden = model.model(input_ids=ids, **{cache_kw: cache}, use_cache=True).last_hidden_state
            logits = model.lm_head(hidden[:, -1].reshape(ids.shape[0], -1))
        token = logits.argmax(-1, keepdim=True)
        return time.perf_counter() - started, cache, token

    with torch.inference_mode():
        prefill(prompt_ids(0))  # first calls: allocator and kernel warm-up
        prefill(prompt_ids(0), stock=True)
        per_prompt, per_prompt_stock, lengths = [], [], []
        for index in range(len(PROMPTS)):
            ids = prompt_ids(index)
            lengths.append(ids.shape[-1])
            per_prompt.append(statistics.median(prefill(ids)[0] for _ in range(prefill_reps)))
            per_prompt_stock.append(prefill(ids, stock=True)[0])
        _, cache, token = prefill(prompt_ids(0))
        steps = []
        for step in range(warmup_steps + decode_steps):
            started = time.perf_counter()
            out = model(input_ids=token, **{cache_kw: cache}, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            if step >= warmup_steps:
                steps.append(time.perf_counter() - started)
    return {
        "source": loaded.source_dir,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens_median": statistics.median(lengths),
        "prefill_ms": statistics.median(per_prompt) * 1000,
        "prefill_ms_by_prompt": [t * 1000 for t in per_prompt],
        "prefill_stock_forward_ms": statistics.median(per_prompt_stock) * 1000,
        "decode_step_ms": statistics.median(steps) * 1000,
        "decode_steps": len(steps),
    }


def measure_bare(prefill_reps: int = 3, decode_steps: int = 20, warmup_steps: int = 3) -> dict:
    """Median prefill over the prompt set and median batch-1 greedy decode step (DynamicCache), in ms."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure, prefill_reps, decode_steps, warmup_steps).result()
