"""What a second model's load and its idle unload do to the server's resident memory (issue 41's target: idle unload
frees the memory, RSS measured), on one `oai-gemma serve` with two models, over several load/unload cycles.

    PYTHONPATH=. python benchmarks/multi_model_memory.py [--second SOURCE] [--quantization auto] [--cycles 3]

`first` is the embedded 270M (loaded at start); `second` (default the 1B random checkpoint) has `keep_alive = 1`:
each cycle sends it one request (which loads it), waits for its idle unload, and prints the server's RSS (VmRSS)
before the load, once loaded, and after the unload, beside the engine's own count of the model's memory
(`oai_gemma:model_memory_bytes`: weights plus the KV cache allocated, most of it never touched). Counts, not
times: valid on a busy machine.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ServerProcess  # noqa: E402
from multi_model_load_itl import two_models  # noqa: E402

MB = 2**20


def rss(server: ServerProcess) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def status(server: ServerProcess, model: str) -> str:
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    return next(c["status"]["value"] for c in cards if c["id"] == model)


def footprint(server: ServerProcess, model: str) -> float:
    found = re.search(rf'^oai_gemma:model_memory_bytes{{model_name="{model}"}} (\S+)$', httpx.get(server.url + "/metrics").text, re.M)
    return float(found[1]) if found else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--second", default=str(Path.home() / ".cache/oai-gemma-bench/gemma-3-1b-random"))
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    body = {"model": "second", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
    server, log = two_models(args.second, args.quantization, "keep_alive = 1\n")
    with server:
        for cycle in range(args.cycles):
            before = rss(server)
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1800).raise_for_status()
            loaded, counted = rss(server), footprint(server, "second")
            deadline = time.monotonic() + 120
            while status(server, "second") != "unloaded" and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(1)
            after = rss(server)
            print(f"cycle {cycle}: RSS {before / MB:.0f} MB before, {loaded / MB:.0f} MB loaded (+{(loaded - before) / MB:.0f}; "
                  f"engine's count {counted / MB:.0f} MB), {after / MB:.0f} MB after the idle unload "
                  f"({(after - before) / MB:+.0f} MB against before)", flush=True)
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
