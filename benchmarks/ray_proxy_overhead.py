"""What Ray Serve's proxy costs: TTFT and inter-token latency at one concurrency, direct server vs one replica
behind Ray Serve (the same engine, the same settings), measured one after the other on the same machine.

    python benchmarks/ray_proxy_overhead.py --concurrency 8 --num-requests 64 --max-tokens 64 --rounds 3

Target (issue 16): the proxy adds at most 2 ms to p50 TTFT and nothing to p50 ITL at c=8. Needs the `ray` extra.
Run it on a quiet machine: other load moves both numbers by more than the difference measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import httpx

from oai_gemma.bench.client import run_level, warm_up
from oai_gemma.bench.compare import free_port
from oai_gemma.bench.stats import summarize_level

TARGET_TTFT_MS = 2.0


def start(extra: list[str], port: int, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "oai_gemma.cli", "serve", "--port", str(port), *extra]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not ready; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def measure(base_url: str, args) -> dict:
    model = "gemma-3-270m" if not args.model else args.model
    for _ in range(2):
        await warm_up(base_url, model, args.max_tokens, 600, None)
    levels = []
    for _ in range(args.rounds):
        run = await run_level(base_url, model, args.concurrency, args.num_requests, args.max_tokens)
        levels.append(summarize_level(run))
    return {
        "ttft_p50_ms": statistics.median(level["ttft_ms"]["p50"] for level in levels),
        "itl_p50_ms": statistics.median(level["itl_ms"]["p50"] for level in levels),
        "tok_s": statistics.median(level["output_tok_s"] for level in levels),
        "errors": sum(level["errors"] for level in levels),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="repeats per server; the median of their p50s is reported")
    parser.add_argument("--model", help="served model name (default gemma-3-270m)")
    parser.add_argument("--serve-args", default="--dtype float32", help="flags for both servers, as one string")
    parser.add_argument("--replica-cpus", default=str(os.cpu_count()), help="Ray CPUs (and torch threads) of the replica; default all cores, as the direct server uses")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    common = shlex.split(args.serve_args)
    results = {}
    for name, extra in (
        ("direct", common),
        ("ray-serve", [*common, "--replicas", "1", "--replica-cpus", args.replica_cpus, "--routing", "least-ongoing"]),
    ):
        port = free_port()
        proc = start(extra, port, f"/tmp/ray-proxy-overhead-{name}.log")
        try:
            results[name] = asyncio.run(measure(f"http://127.0.0.1:{port}/v1", args))
        finally:
            stop(proc)
        print(f"{name:10} {json.dumps(results[name])}", file=sys.stderr)
    ttft = results["ray-serve"]["ttft_p50_ms"] - results["direct"]["ttft_p50_ms"]
    itl = results["ray-serve"]["itl_p50_ms"] - results["direct"]["itl_p50_ms"]
    verdict = "PASS" if ttft <= TARGET_TTFT_MS and itl <= 0.5 else "MISS"
    print(f"c={args.concurrency}: Ray Serve adds {ttft:+.2f} ms p50 TTFT (target <= {TARGET_TTFT_MS}), {itl:+.2f} ms p50 ITL "
          f"(target ~0): {verdict}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ttft_delta_ms": ttft, "itl_delta_ms": itl}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
