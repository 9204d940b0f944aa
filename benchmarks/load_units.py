"""The units of a load's work as `cpu.Turns` sees them: every stretch between two of the load's turn offers (a
stretch the steps of streaming models wait through, once they wait) and every stretch it runs aside (beside their
steps), with where each began and ended, longest first (issue 41: a load beside a stream may stall a step for at
most about `LOAD_SHARE` of a step plus the unit in progress).

    PYTHONPATH=. python benchmarks/load_units.py --model ~/.cache/oai-gemma-bench/gemma-3-4b-random [--quantization auto] [--whole]

It loads `--first` (default the embedded 270M, as the server's first model: the process's one-time costs paid) and
then the model as api/model_router.py loads one beside loaded models (a thread of one torch thread, in a turn,
the grammar compiler left for later) beside a stand-in stream: a thread taking empty steps in turns throughout (so
a step always waits, as beside a real stream, and each offer hands over for no time): each stretch is one unit's
length on one core, in the process's CPU seconds (`time.process_time`: what a shared machine's other work
does not stretch; the loader's and its helper threads', such as the tokenizer's build, as nothing else computes; a
quiet machine's wall time is about that, plus any wait for the disk).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from oai_gemma.cpu import TURNS, configure_cpu
from oai_gemma.settings import load_settings, served_models

ROOT = str(Path(__file__).resolve().parents[1])


def site(depth: int = 2) -> str:
    """The first frames of ours above the caller of `offer`/`aside`: 'file:line fn < file:line fn'."""
    frame, out = sys._getframe(depth), []
    while frame is not None and len(out) < 3:
        name = frame.f_code.co_filename
        if name.startswith(ROOT) and "contextlib" not in name:
            out.append(f"{os.path.relpath(name, ROOT)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


class Recorder(logging.Handler):
    """Marks: (the loader's CPU seconds, kind, site): kind 'offer', 'aside+' / 'aside-', 'log'."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.marks: list[tuple[float, str, str]] = []
        self.loader: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if threading.get_ident() == self.loader:
            self.marks.append((time.process_time(), "log", record.getMessage()[:90]))

    def install(self) -> None:
        offer, aside = TURNS.offer, TURNS.aside

        def traced_offer() -> None:
            if threading.get_ident() == self.loader:
                self.marks.append((time.process_time(), "offer", site()))
            offer()

        @contextmanager
        def traced_aside():
            mine = threading.get_ident() == self.loader and TURNS._loader == self.loader
            if mine:
                self.marks.append((time.process_time(), "aside+", site(3)))
            with aside():
                yield
            if mine:
                self.marks.append((time.process_time(), "aside-", site(3)))

        TURNS.offer, TURNS.aside = traced_offer, traced_aside
        logging.getLogger("oai_gemma").addHandler(self)


def stretches(marks: list[tuple[float, str, str]], start: float, end: float) -> tuple[list, list]:
    """(in-turn stretches, aside stretches): (seconds, from site, to site), each from one mark to the next."""
    turn, aside, depth, last, last_site = [], [], 0, start, "load start"
    for at, kind, where in [*marks, (end, "end", "load end")]:
        if kind == "log":
            continue
        (aside if depth else turn).append((at - last, last_site, where))
        depth += {"aside+": 1, "aside-": -1}.get(kind, 0)
        last, last_site = at, where
    return turn, aside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path.home() / ".cache/oai-gemma-bench/gemma-3-1b-random"))
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--first", default="embedded", help="loaded before, untraced ('none': nothing)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--over", type=float, default=0.05, help="count the stretches over this many seconds")
    parser.add_argument("--whole", action="store_true", help="each native quantized call one unit (as before `in_units`)")
    args = parser.parse_args()
    config = Path(tempfile.mkdtemp()) / "models.toml"
    first = f'[models.first]\nsource = "{args.first}"\n\n' if args.first != "none" else ""
    config.write_text(first + f'[models.second]\nsource = "{args.model}"\nquantization = "{args.quantization}"\n'
                      'speculative = "off"\nmax_num_seqs = 4\n')
    models = served_models(load_settings(config, {}, environ={}))
    settings = models["second"][0]
    configure_cpu(settings.engine)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    from oai_gemma.engine.factory import load_engine
    from oai_gemma.engine.ops import quantized

    if args.whole:
        quantized.UNIT_MACS = 1 << 62

    kept = load_engine(models["first"][0]) if "first" in models else None  # noqa: F841  (loaded beside, as in the server)
    recorder = Recorder()
    recorder.install()
    times = {}

    def load() -> None:
        torch.set_num_threads(1)  # as api/model_router.py loads beside loaded models
        recorder.loader = threading.get_ident()
        times["start"], times["wall"] = time.process_time(), time.perf_counter()
        with TURNS.load():
            load_engine(settings, grammars=False)
        times["end"], times["wall"] = time.process_time(), time.perf_counter() - times["wall"]

    def steps() -> None:  # empty steps in turns: a step always waits for the load's next offer
        while loader.is_alive():
            with TURNS.step():
                pass

    loader = threading.Thread(target=load)
    loader.start()
    stepper = threading.Thread(target=steps)
    stepper.start()
    loader.join()
    stepper.join()
    start, end = times["start"], times["end"]
    turn, aside = stretches(recorder.marks, start, end)
    offers = sum(1 for _, kind, _ in recorder.marks if kind == "offer")
    print(f"\nload {times['wall']:.2f} s, {end - start:.2f} s of CPU: in turn {sum(s for s, _, _ in turn):.2f} s in {len(turn)} stretches ({offers} offers), "
          f"aside {sum(s for s, _, _ in aside):.2f} s in {len(aside)}; in-turn stretches over {args.over * 1e3:.0f} ms: "
          f"{sum(1 for s, _, _ in turn if s > args.over)} ({sum(s for s, _, _ in turn if s > args.over):.2f} s)")
    print(f"uptime: {os.getloadavg()}")
    for title, found in (("in turn", turn), ("aside", aside)):
        print(f"\nlongest {title}:")
        for seconds, lo, hi in sorted(found, reverse=True)[: args.top]:
            print(f"  {seconds * 1e3:8.1f} ms  {lo}\n             -> {hi}")
    print("\nphases (the loader's log lines at its CPU seconds from the start):")
    for at, kind, text in recorder.marks:
        if kind == "log":
            print(f"  {at - start:7.2f}  {text}")


if __name__ == "__main__":
    main()
