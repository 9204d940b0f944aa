"""The benchmark's percentile and per-level aggregation, on hand-made timings."""

import sys
from pathlib import Path

import pytest

from oai_gemma.bench.client import LevelRun, RequestResult
from oai_gemma.bench.report import REPO_ROOT, portable, ratio_table
from oai_gemma.bench.stats import percentile, summarize_level


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def _request(start, chunks, end, usage=None, error=None):
    return RequestResult(start=start, end=end, chunk_times=list(chunks), usage_tokens=usage, error=error)


def test_summarize_level():
    run = LevelRun(
        concurrency=2,
        wall_s=2.0,
        results=[
            # TTFT 0.1, gaps 0.1 and 0.2, usage says 4 tokens (one chunk carried two)
            _request(0.0, [0.1, 0.2, 0.4], 0.5, usage=4),
            # TTFT 0.3, gap 0.3, no usage: 2 tokens from the chunk count
            _request(0.5, [0.8, 1.1], 1.2),
            # failed: excluded from latencies and tokens, counted as an error
            _request(1.0, [1.5], 1.6, usage=9, error="HTTP 500: boom"),
            # no content at all: not ok either
            _request(1.0, [], 1.1),
        ],
    )
    s = summarize_level(run)
    assert (s["num_requests"], s["completed"], s["errors"]) == (4, 2, 2)
    assert "HTTP 500: boom" in s["error_samples"]
    assert s["output_tokens"] == 6
    assert s["output_tok_s"] == pytest.approx(3.0)
    assert s["requests_s"] == pytest.approx(1.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100.0 + 200.0 * 0.99)
    assert sorted(s["raw"]["itl_ms"]) == pytest.approx([100.0, 200.0, 300.0])
    assert s["itl_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["p99"] == pytest.approx(298.0)
    # TPOT: (0.5 - 0.1) / 3 and (1.2 - 0.8) / 1
    assert sorted(s["raw"]["e2e_ms"]) == pytest.approx([500.0, 700.0])
    assert s["tpot_ms"]["p50"] == pytest.approx((400.0 / 3 + 400.0) / 2)
    assert s["e2e_ms"]["mean"] == pytest.approx(600.0)


def test_empty_level_has_no_percentiles():
    s = summarize_level(LevelRun(concurrency=1, wall_s=1.0, results=[_request(0.0, [], 1.0, error="refused")]))
    assert s["completed"] == 0 and s["errors"] == 1 and s["output_tok_s"] == 0.0
    assert s["ttft_ms"]["p50"] is None and s["itl_ms"]["mean"] is None


def test_ratio_table_divides_our_throughput_by_each_baseline():
    servers = {
        "ours": {"levels": [{"concurrency": 1, "output_tok_s": 30.0}, {"concurrency": 8, "output_tok_s": 120.0}]},
        "tutorial": {"levels": [{"concurrency": 1, "output_tok_s": 20.0}, {"concurrency": 8, "output_tok_s": 15.0}]},
        "broken": {"error": "did not start", "levels": []},
    }
    table = ratio_table(servers)
    assert "vs tutorial" in table and "broken" not in table
    assert "1.50x" in table and "8.00x" in table


def test_report_commands_carry_no_absolute_paths_of_the_machine_they_ran_on():
    home = Path.home()
    command = (
        f"{sys.executable} {REPO_ROOT}/benchmarks/tutorial_server.py --model-dir {home}/.cache/oai-gemma/gemma-3-270m"
    )
    assert portable(command) == (
        f"{Path(sys.executable).name} benchmarks/tutorial_server.py --model-dir ~/.cache/oai-gemma/gemma-3-270m"
    )
    assert portable(f"{Path(sys.executable).parent}/transformers serve x") == "transformers serve x"


def test_one_stream_is_reported_beside_the_floor_its_bytes_imply_and_the_engine_step():
    from oai_gemma.bench.floor import engine_step_ms, floor_table, read_bandwidth

    step = engine_step_ms({"steps": 10, "step_seconds": 1.0}, {"steps": 74, "step_seconds": 1.576})
    assert step == pytest.approx(9.0)
    assert engine_step_ms({}, {"status": "ok"}) is None and engine_step_ms({"steps": 3, "step_seconds": 0.1},
                                                                           {"steps": 3, "step_seconds": 0.1}) is None
    servers = {
        "ours": {"decode_bytes": 100 * 2**20, "levels": [{"concurrency": 1, "itl_ms": {"p50": 10.0}, "engine_step_ms": step}]},
        "llama-server": {"decode_bytes": 200 * 2**20, "levels": [{"concurrency": 1, "itl_ms": {"p50": 12.0}}]},
        "no-bytes": {"decode_bytes": None, "levels": [{"concurrency": 1, "itl_ms": {"p50": 9.0}}]},
        "failed": {"error": "x", "levels": []},
    }
    table = floor_table(servers, 20e9, markdown=True)
    assert "| ours | 100 | 5.2 | 10.0 | 1.91x | 9.0 | 1.0 |" in table  # 104.9 MB / 20 GB/s = 5.24 ms
    assert "| llama-server | 200 | 10.5 | 12.0 | 1.14x | - | - |" in table
    assert "no-bytes" not in table and "failed" not in table
    assert "ours" in floor_table(servers, None) and "llama-server" not in floor_table(servers, None)
    assert read_bandwidth(repeats=2, size=1 << 24) > 1e8  # a streaming read: far above 100 MB/s anywhere


def test_the_peak_rss_of_a_server_counts_its_whole_process_tree():
    """A parent that starts a child holding ~200 MB: the tree's peak includes the child's memory. The child holds
    it until the parent is gone (its stdin, a pipe the parent holds, ends), not for a fixed time that a loaded
    machine's slow start could use up before the sampler saw it."""
    import subprocess
    import sys

    from conftest import wait_for
    from oai_gemma.bench.memory import MB, PeakRss, tree_rss

    code = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', "
            "'import sys; b = bytearray(200 * 2**20); b[::4096] = b\"x\" * len(b[::4096]); sys.stdin.read()'], "
            "stdin=subprocess.PIPE); child.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        with PeakRss(parent.pid, every=0.05) as peak:
            wait_for(lambda: peak.bytes > 200 * MB, 120)
        assert peak.bytes > 200 * MB
    finally:
        parent.kill()
        parent.wait()
    assert tree_rss(parent.pid) is None  # gone


def test_a_process_high_water_mark_counts_memory_it_has_freed_since():
    """The process says when it has freed its 300 MB and then waits on its stdin: no sleep that a loaded machine
    could outrun (it exited, or had not freed yet, when a fixed-time check read it)."""
    import subprocess
    import sys

    from oai_gemma.bench.memory import MB, high_water_mark, tree_rss

    code = ("import sys; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; "
            "print('freed', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "freed\n"
        assert high_water_mark(proc.pid) > 300 * MB and tree_rss(proc.pid) < 200 * MB
    finally:
        proc.kill()
        proc.wait()


def test_ignore_eos_is_added_to_every_request_after_its_route():
    from oai_gemma.bench.command import ignoring_eos

    assert ignoring_eos(None)(0, {"model": "m"}) == {"model": "m", "ignore_eos": True}
    routed = ignoring_eos(lambda index, body: {**body, "model": f"adapter-{index}"})
    assert routed(3, {"model": "m"}) == {"model": "adapter-3", "ignore_eos": True}


def test_llama_server_serves_the_gguf_it_is_given(monkeypatch):
    from oai_gemma.bench import compare

    monkeypatch.setenv(compare.LLAMA_SERVER_ENV, "/usr/local/bin/llama-server")
    argv = compare.llama_server_argv(9000, 8, "/models/gemma-3-1b-q4_k_m.gguf")
    assert argv[argv.index("-m") + 1] == "/models/gemma-3-1b-q4_k_m.gguf"


def test_compare_forwards_mmproj_to_llama_server_only(monkeypatch):
    import argparse

    from oai_gemma.bench import compare
    from oai_gemma.bench.command import add_arguments, server_spec

    monkeypatch.setenv(compare.LLAMA_SERVER_ENV, "/usr/local/bin/llama-server")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--compare", "--prompts", "image", "--concurrency", "1,8", "--model-dir", "/ckpt",
                              "--gguf", "/ckpt/gguf/m-q4_k_m.gguf", "--mmproj", "/ckpt/gguf/mmproj-m-f16.gguf"])
    argv = server_spec("llama-server", args, "/ckpt", "float32", "cpu").argv
    assert argv[argv.index("-m") + 1] == "/ckpt/gguf/m-q4_k_m.gguf"
    assert argv[argv.index("--mmproj") + 1] == "/ckpt/gguf/mmproj-m-f16.gguf"
    assert argv[argv.index("-np") + 1] == "8"
    assert "--mmproj" not in server_spec("ours", args, "/ckpt", "float32", "cpu").argv
    without = parser.parse_args(["--compare", "--gguf", "/ckpt/gguf/m-q4_k_m.gguf"])
    assert "--mmproj" not in server_spec("llama-server", without, "/ckpt", "float32", "cpu").argv
