"""Every GIL hold over `--threshold` ms while a second model loads beside a loaded one, in this process (issue 41:
a hold stalls every other model's stream for its length, their engine threads and the event loop alike).

    PYTHONPATH=. python benchmarks/load_gil_holds.py [--second SOURCE] [--quantization int8] [--threshold 20]

It loads `first` (the embedded 270M) as the server would, then `second` on a thread of one torch thread (as
api/model_router.py does beside a loaded model) while a sampling thread sleeps 5 ms at a time and measures how late
it wakes: a wake-up later than the threshold is a hold, printed with its length and where the loader was when the
GIL came back (the call just after the one that held it). Loads and holds are also timed by the load's phases (the
engine's log). Holds under other load on the machine are still holds; their lengths are then longer.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from oai_gemma.settings import load_settings, served_models


def sample(stop: threading.Event, loader: threading.Thread, threshold: float, holds: list) -> None:
    period = 0.005
    while not stop.is_set():
        before = time.perf_counter()
        time.sleep(period)
        late = time.perf_counter() - before - period
        if late > threshold:
            frame = sys._current_frames().get(loader.ident)
            where = traceback.format_stack(frame)[-3:] if frame is not None else ["(the loader had ended)\n"]
            holds.append((late, time.perf_counter(), where))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--second", default="embedded")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--threshold", type=float, default=20.0, help="ms")
    parser.add_argument("--loads", type=int, default=2, help="loads of the second model (the first fills its caches)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    config = Path(tempfile.mkdtemp()) / "models.toml"
    config.write_text(f'[models.first]\nsource = "embedded"\n\n[models.second]\nsource = "{args.second}"\n'
                      f'quantization = "{args.quantization}"\nspeculative = "off"\n')
    models = served_models(load_settings(config, {}, environ={}))
    from oai_gemma.engine.factory import load_engine

    first = load_engine(models["first"][0])  # noqa: F841  (kept loaded, as the server keeps it)
    for run in range(args.loads):
        holds: list = []
        import torch

        loader = threading.Thread(target=lambda: (torch.set_num_threads(1), load_engine(models["second"][0])))
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(stop, loader, args.threshold / 1e3, holds))
        started = time.perf_counter()
        loader.start()
        sampler.start()
        loader.join()
        stop.set()
        sampler.join()
        print(f"\nload {run}: {time.perf_counter() - started:.1f} s, {len(holds)} holds over {args.threshold:.0f} ms, "
              f"{sum(h[0] for h in holds):.2f} s in all")
        for late, at, where in holds:
            print(f"  {late * 1e3:7.0f} ms at +{at - started:6.2f} s, the loader then at:\n" + "".join("      " + line for line in where))


if __name__ == "__main__":
    main()
