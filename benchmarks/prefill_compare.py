"""Prefill throughput side by side: two running servers given the same long completions prompt in turn (a new first
line each round, so neither side's prefix cache hits; llama-server also gets `cache_prompt: false`), `max_tokens` 1;
prompt tokens (each side's own `usage`) per second of wall time, and the median over the rounds.

    python benchmarks/prefill_compare.py --ours http://127.0.0.1:8000 --model gemma-3-4b-random \
        --other http://127.0.0.1:8091 [--other-is-ours] [--rounds 3] [--words 450]

Start the servers first, e.g. `oai-gemma serve --model DIR --speculative off` and llama-server `-m FILE.gguf -t 2
-c 8192 -np 1`; `--other-is-ours` when the other side is a second oai-gemma server (another commit), which takes the
model name and no `cache_prompt`. Run it on a quiet machine (`uptime`); the sides alternate, so load falls on both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request


def completion(base: str, body: dict) -> tuple[float, int]:
    """(seconds, prompt tokens) of one non-streamed completion."""
    started = time.perf_counter()
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        usage = json.load(response)["usage"]
    return time.perf_counter() - started, usage["prompt_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ours", required=True)
    parser.add_argument("--model", required=True, help="the model name our server serves")
    parser.add_argument("--other", required=True)
    parser.add_argument("--other-is-ours", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", type=int, default=450, help="~4 tokens a word with the Gemma tokenizer")
    args = parser.parse_args()
    sides = {"ours": (args.ours, True), "other": (args.other, args.other_is_ours)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for number in range(args.rounds):
        prompt = f"Round {number} against {args.other} begins. " + " ".join(f"item{(j * 7 + number) % 997}" for j in range(args.words))
        for name, (base, is_ours) in sides.items():
            body = {"model": args.model if is_ours else "default", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            if not is_ours:
                body["cache_prompt"] = False
            seconds, tokens = completion(base, body)
            rates[name].append(tokens / seconds)
            print(f"{name}: {tokens} prompt tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s", flush=True)
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.1f} prompt tok/s over {len(values)} rounds")


if __name__ == "__main__":
    main()
