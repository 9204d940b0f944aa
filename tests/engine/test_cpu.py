"""CPU threads and their wait policy (`engine.threads`, `engine.cpu_wait`), and `oai-gemma bench --cpu-hog`."""

import argparse
import asyncio
import json
import os
import subprocess
import sys

import pytest

from conftest import MODEL

SCRIPT = """
import json, os, sys
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # as `taskset -c N` or a container's cpuset would
from oai_gemma.cpu import configure_cpu
from oai_gemma.settings import load_settings
settings = load_settings(None, json.loads(sys.argv[1]), environ={})
threads = configure_cpu(settings.engine)
import threading
import torch
from oai_gemma.cpu import compute_thread
seen = {}
compute = compute_thread(lambda: seen.update(compute=torch.get_num_threads()), "test")
compute.start(); compute.join()
plain = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads()))  # started after the compute thread
plain.start(); plain.join()
print(json.dumps({"threads": threads, "torch": torch.get_num_threads(), **seen, "omp": os.environ.get("OMP_WAIT_POLICY"),
                  "kmp": os.environ.get("KMP_BLOCKTIME")}))
"""


def configured(overrides: dict, env: dict | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(overrides)], capture_output=True, text=True,
                          timeout=300, env={**environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_threads_default_to_the_cpus_the_process_may_use_and_the_runtimes_wait_policy():
    one = {"threads": 1, "torch": 1, "compute": 1, "later": 1}
    assert configured({}) == {**one, "omp": None, "kmp": None}
    assert configured({"engine": {"cpu_wait": "passive"}}) == {**one, "omp": "PASSIVE", "kmp": "0"}


def test_only_compute_threads_compute_with_the_configured_threads():
    # a second OpenMP pool (any other thread computing with 2+ threads) makes the engine's workers sleep between
    # a step's parallel regions: measured 38.6 vs 22.6 ms a decode step (engine/cpu.py)
    assert configured({"engine": {"threads": 3, "cpu_wait": "active"}}) == {
        "threads": 3, "torch": 1, "compute": 3, "later": 1, "omp": "ACTIVE", "kmp": None,
    }


def test_an_operators_wait_policy_is_kept():
    assert configured({}, env={"OMP_WAIT_POLICY": "ACTIVE"})["omp"] == "ACTIVE"


def busy_loops() -> list[str]:
    out = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout.split()
    return [pid for pid in out if pid != str(os.getpid())]


SERVE_ORDER = """
import json, os, sys
import oai_gemma.cli as cli

def configure_cpu(settings):  # records what `serve` has loaded by the time it sets the wait policy, then stops
    print(json.dumps({"torch_loaded": "torch" in sys.modules}))
    raise SystemExit(0)

cli.configure_cpu = configure_cpu
cli.main(["serve", "--port", "1"])
"""


def test_serve_sets_the_wait_policy_before_torch_loads():
    # libgomp reads OMP_WAIT_POLICY when it loads, with torch: set later, the policy would be silently ignored
    done = subprocess.run([sys.executable, "-c", SERVE_ORDER], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch_loaded": False}


OMP_IN_THREADS = """
import ctypes, json, threading
import torch
from oai_gemma.cpu import compute_thread
torch.set_num_threads(3)
gomp = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
omp_max_threads = ctypes.CDLL(gomp).omp_get_max_threads
seen = {}
plain = threading.Thread(target=lambda: seen.update(plain=omp_max_threads()))
compute = compute_thread(lambda: seen.update(compute=omp_max_threads()), "test")
for t in (plain, compute):
    t.start(); t.join()
print(json.dumps(seen))
"""


def test_the_engine_thread_computes_with_the_configured_threads_whatever_omp_num_threads_says():
    # Ray starts its workers with OMP_NUM_THREADS=1: a plain thread then computes on one core, whatever the
    # process configured; the engine's thread must not
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", OMP_IN_THREADS], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"plain": 1, "compute": 3}


@pytest.mark.slow
def test_cpu_hog_run_reports_both_levels_and_stops_its_busy_loop(server):
    from oai_gemma.bench.cpu_hog import cpu_hog, report

    before = set(busy_loops())
    args = argparse.Namespace(num_requests=8, max_tokens=4, request_timeout=120, api_key=None)
    result = asyncio.run(cpu_hog(server.url + "/v1", MODEL, args))
    assert result["quiet"]["errors"] == 0 and result["with_busy_loop"]["errors"] == 0
    assert result["quiet"]["output_tok_s"] > 0 and result["with_busy_loop"]["output_tok_s"] > 0
    assert result["ratio"] == pytest.approx(result["with_busy_loop"]["output_tok_s"] / result["quiet"]["output_tok_s"])
    assert "ratio" in report(result)
    assert set(busy_loops()) <= before  # its busy loop is gone
