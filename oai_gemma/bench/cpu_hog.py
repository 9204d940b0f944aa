"""`oai-gemma bench --cpu-hog`: throughput of a running server alone, then beside one `nice -n 10` busy loop.

A low-priority background process (a log shipper, a cron job) should cost the server about the share of the CPU
it takes, not most of its throughput (issue 18; `oai_gemma/cpu.py`). The run: c=8 short prompts quiet, then the
same with one niced busy loop, and the ratio of the two throughputs (target: at least 0.4 on 2 cores).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from .client import run_level
from .stats import summarize_level

CONCURRENCY = 8
TARGET = 0.4
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


async def cpu_hog(base_url: str, model: str, args: argparse.Namespace) -> dict:
    num = max(args.num_requests, CONCURRENCY)

    async def level() -> dict:
        run = await run_level(base_url, model, CONCURRENCY, num, args.max_tokens, args.request_timeout, args.api_key)
        return summarize_level(run)

    quiet = await level()
    hog = subprocess.Popen(["nice", "-n", "10", *BUSY_LOOP])
    try:
        hogged = await level()
    finally:
        hog.terminate()
        hog.wait(timeout=10)
    ratio = hogged["output_tok_s"] / quiet["output_tok_s"] if quiet["output_tok_s"] else 0.0
    return {"concurrency": CONCURRENCY, "quiet": quiet, "with_busy_loop": hogged, "ratio": ratio, "target": TARGET}


def report(result: dict) -> str:
    def line(name: str, level: dict) -> str:
        return (f"  {name:<15} {level['output_tok_s']:7.1f} tok/s   ITL p50 {level['itl_ms']['p50'] or 0:8.1f} ms   "
                f"errors {level['errors']}")

    verdict = "meets" if result["ratio"] >= result["target"] else "BELOW"
    return "\n".join([
        f"CPU hog (c={result['concurrency']}, one `nice -n 10` busy loop beside the server):",
        line("quiet", result["quiet"]),
        line("with busy loop", result["with_busy_loop"]),
        f"  ratio {result['ratio']:.2f} ({verdict} the target {result['target']})",
    ])
