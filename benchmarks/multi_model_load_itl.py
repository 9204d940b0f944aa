"""A loaded model's inter-token latency while another model loads beside it (issue 41's target: ITL p99 during the
load at most 2x the ITL alone), on one `oai-gemma serve` with two models.

    PYTHONPATH=. python benchmarks/multi_model_load_itl.py [--second SOURCE] [--tokens 400] [--streams 2]

It starts a server with `first` (the embedded 270M, loaded at start) and `second` (default: the embedded 270M again,
int8; `--second /path/to/gemma-3-1b-it` for a real checkpoint). Each run unloads `second`, loads it once alone
(timed), unloads it, streams `--tokens` tokens from `first` alone (speculative decoding off: one token per step),
then streams again while `POST /models/load` loads `second`, and prints the load's seconds alone and beside the
stream, ITL p50/p99/max alone and during the load, their ratio, and the wall-clock times of gaps over 0.5 s (to
compare with the server log's start-up phases). `--streams 2`: a third model, `other` (the embedded 270M, int8), is
loaded too and streams beside `first` (alone and during the load alike): issue 41's "a third model's first request
served while the others stream"; each stream's figures are printed. Run it in a quiet window: figures taken under
other load are void.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import ServerProcess  # noqa: E402


def stream_times(url: str, tokens: int, times: list[float] | None = None, model: str = "first") -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    times = [] if times is None else times
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                times.append(time.time())
    return times


def summary(times: list[float], start: float = 0.0, end: float = float("inf")) -> dict[str, float]:
    """Gaps between tokens that overlap [start, end]."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b >= start and a <= end)
    if not gaps:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": statistics.median(gaps), "p99": gaps[int(0.99 * (len(gaps) - 1))], "max": gaps[-1], "n": len(gaps)}


def two_models(second: str, quantization: str, more: str = "") -> tuple[ServerProcess, Path]:
    """A server (started; `with` it to wait until ready) of `first` (the embedded 270M, loaded at start) and `second`
    (its `more` settings added to its table), and its log's path."""
    config = Path(tempfile.mkdtemp()) / "models.toml"
    config.write_text(f'[models.first]\nsource = "embedded"\n\n[models.second]\nsource = "{second}"\n'
                      f'quantization = "{quantization}"\n{more}\n[models.other]\nsource = "embedded"\nquantization = "int8"\n')
    log = Path(tempfile.mkdtemp()) / "server.log"
    return ServerProcess("--config", str(config), "--max-num-seqs", "4", "--speculative", "off", log=log), log


def together(url: str, tokens: int, models: list[str], load=None):
    """Each model's token times, streamed at once; with `load`, it is called once every stream has a token, and
    (its start, its end, the times) come back."""
    timed = [[] for _ in models]
    threads = [threading.Thread(target=stream_times, args=(url, tokens, times, model)) for model, times in zip(models, timed)]
    for thread in threads:
        thread.start()
    started = ended = 0.0
    if load is not None:
        while not all(timed):
            time.sleep(0.05)
        started = time.time()
        load()
        ended = time.time()
    for thread in threads:
        thread.join()
    return timed if load is None else (started, ended, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--second", default="embedded")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--streams", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()
    streams = ["first", "other"][: args.streams]
    server, log = two_models(args.second, args.quantization)
    with server:
        httpx.post(server.url + "/models/load", json={"model": "second"}, timeout=600)  # quantized once into the cache
        if args.streams == 2:
            httpx.post(server.url + "/models/unload", json={"model": "second"}, timeout=600)
            httpx.post(server.url + "/models/load", json={"model": "other"}, timeout=600).raise_for_status()
        for run in range(args.runs):
            httpx.post(server.url + "/models/unload", json={"model": "second"}, timeout=600)
            started = time.time()
            httpx.post(server.url + "/models/load", json={"model": "second"}, timeout=600).raise_for_status()
            load_alone = time.time() - started  # nothing streams: the load's turns never wait (cpu.Turns)
            httpx.post(server.url + "/models/unload", json={"model": "second"}, timeout=600)
            alone = [summary(times) for times in together(server.url, args.tokens, streams)]
            started, ended, timed = together(server.url, args.tokens, streams, lambda: httpx.post(
                server.url + "/models/load", json={"model": "second"}, timeout=600).raise_for_status())
            for model, quiet, times in zip(streams, alone, timed):
                during = summary(times, started, ended)
                print(f"run {run} {model}: {len(times)} tokens, the last {times[-1] - ended:+.1f} s after the load ended")
                print(f"run {run} {model}: load {ended - started:.1f} s beside {len(streams)} stream(s), {load_alone:.1f} s alone; ITL alone p50 "
                      f"{quiet['p50'] * 1e3:.1f} ms p99 {quiet['p99'] * 1e3:.1f} ms; during the load ({during['n']} gaps) p50 "
                      f"{during['p50'] * 1e3:.1f} ms p99 {during['p99'] * 1e3:.1f} ms max {during['max'] * 1e3:.0f} ms; p99 ratio "
                      f"{during['p99'] / quiet['p99']:.2f} (target <= 2)")
                for a, b in zip(times, times[1:]):
                    if b - a > 0.5 and b >= started and a <= ended:
                        print(f"  gap {b - a:.2f} s ending {datetime.fromtimestamp(b).strftime('%H:%M:%S.%f')[:-3]}")
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
