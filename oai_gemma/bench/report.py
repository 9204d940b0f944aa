"""Turn the summaries into text: the console table, the JSON file, and the markdown report with ratios."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .floor import bandwidth_line, floor_table
from .prompts import PROMPT_SETS

NOTES = (
    "Output tokens are counted from the final `usage` chunk (`stream_options.include_usage`), or from the "
    "number of content chunks when a server sends no usage. tok/s is the level's total output tokens over "
    "its wall time (first request sent to last response done), so it is the aggregate throughput.",
    "TTFT is the arrival of the first chunk with non-empty content. ITL is the gap between consecutive content "
    "chunks as they reach the client: a server that sends several tokens per chunk (the tutorial's "
    "`TextIteratorStreamer` flushes per word, `transformers serve` may flush a backlog at once) shows fewer, "
    "longer gaps and some near-zero ones. TPOT = (E2E - TTFT) / (tokens - 1) is the per-token figure that is "
    "comparable across servers.",
    "`ignore_eos` is not an OpenAI field, so the prompts ask for long texts; a request may still stop early.",
    "Every server gets one untimed warm-up request first (lazy first-request work: CB init, kernel warm-up).",
    "Before each sweep the CPU is sampled for 1 s while the server idles: a high figure means other load "
    "shared the machine (or the server spins while idle) and skews that server's numbers.",
    "`transformers serve` without `--continuous-batching` runs all requests on one inference thread, one "
    "after the other; with it, requests join a paged-attention batch.",
    "The tutorial server starts one `model.generate` thread per request with a `TextIteratorStreamer`; "
    "concurrent requests run as concurrent generate calls that share the same cores, with no batching.",
    "Bare prefill: the decoder, then `lm_head` on the last position as a 2-D tensor. The stock forward with "
    "`logits_to_keep=1` (what `generate` does) hands `lm_head` a `[:, -1:]` slice; with the weights frozen by "
    "`requires_grad_(False)`, as `engine.loader.load` leaves them, torch 2.13 on CPU in bf16 runs that "
    "`F.linear` as a bmm that first copies the whole vocabulary matrix (~0.8 s here), while with trainable "
    "weights (a plain `from_pretrained`, as the tutorial server and `transformers serve` load) it does not. "
    "That stock figure is reported next to it.",
    "Speculative decoding (ours; issue 26): `accept` is the share of draft tokens the model accepted, `draft len` "
    "the mean draft's tokens, `tok/step` the output tokens per engine step (at concurrency 1, per forward of the "
    "model), read from `/health` before and after each level; `-` where a server does not report them. A chunk may "
    "then carry several tokens, so TPOT, not ITL, is the per-token figure.",
)
SHARED_NOTE = (
    "Shared prompt set: every request carries the same ~1,000-token system prompt (about 1,010 tokens with the "
    "chat template) and a distinct question led by its request number; the sweep numbers requests on across "
    "levels, so no request repeats an earlier one. `ours-no-prefix-cache` is ours with `--no-prefix-caching`; "
    "llama-server reuses the common prefix of a slot's previous prompt (`cache_prompt`, on by default). The "
    "bare-model reference is not run: it times the short prompts."
)
SHARED_BASELINES = ("ours-no-prefix-cache", "llama-server")
SHARED_TARGET = (8, 0.25, 1.5)
"""Issue 12's bar for the shared set: at c=8, ours' TTFT p50 at most 1/4 of ours-no-prefix-cache's, and its
aggregate tok/s at least 1.5x."""


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COLUMNS = (
    ("conc", lambda s: str(s["concurrency"])),
    ("reqs", lambda s: str(s["num_requests"])),
    ("err", lambda s: str(s["errors"])),
    ("tok/s", lambda s: _f(s["output_tok_s"])),
    ("req/s", lambda s: _f(s["requests_s"], 2)),
    ("TTFT p50", lambda s: _f(s["ttft_ms"]["p50"])),
    ("TTFT p90", lambda s: _f(s["ttft_ms"]["p90"])),
    ("TTFT p99", lambda s: _f(s["ttft_ms"]["p99"])),
    ("ITL p50", lambda s: _f(s["itl_ms"]["p50"])),
    ("ITL p99", lambda s: _f(s["itl_ms"]["p99"])),
    ("TPOT p50", lambda s: _f(s["tpot_ms"]["p50"])),
    ("E2E p50", lambda s: _f(s["e2e_ms"]["p50"])),
    ("E2E p99", lambda s: _f(s["e2e_ms"]["p99"])),
    ("accept", lambda s: _f(_spec(s, "acceptance"), 2)),
    ("draft len", lambda s: _f(_spec(s, "draft_len"))),
    ("tok/step", lambda s: _f(_spec(s, "tokens_per_step"), 2)),
)


def _spec(level: dict, key: str) -> float | None:
    """A speculative-decoding figure of a level (bench/floor.py `speculation`), None where not reported."""
    return (level.get("speculation") or {}).get(key)


def _grid(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)] if rows else [len(h) for h in header]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def level_table(levels: list[dict], markdown: bool = False) -> str:
    """One row per concurrency level; latencies in ms."""
    header = [name for name, _ in COLUMNS]
    return _grid(header, [[cell(s) for _, cell in COLUMNS] for s in levels], markdown)


def ratio_table(servers: dict[str, dict], ours: str = "ours", markdown: bool = False) -> str | None:
    """Our output tok/s divided by each baseline's, per concurrency level (>1: we are faster)."""
    if ours not in servers or not servers[ours].get("levels"):
        return None
    baselines = [name for name, s in servers.items() if name != ours and s.get("levels")]
    if not baselines:
        return None
    by_conc = {name: {lv["concurrency"]: lv["output_tok_s"] for lv in servers[name]["levels"]} for name in servers if servers[name].get("levels")}
    rows = []
    for conc, mine in by_conc[ours].items():
        row = [str(conc)]
        for name in baselines:
            theirs = by_conc[name].get(conc)
            row.append(f"{mine / theirs:.2f}x" if theirs else "-")
        rows.append(row)
    return _grid(["conc"] + [f"vs {name}" for name in baselines], rows, markdown)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return None if mine is None or not theirs else mine / theirs


def versus(servers: dict[str, dict], baseline: str, ours: str = "ours") -> dict[int, tuple[dict, dict]]:
    """The concurrency levels both ran: our level and the baseline's."""
    if not servers.get(ours, {}).get("levels") or not servers.get(baseline, {}).get("levels"):
        return {}
    theirs = {lv["concurrency"]: lv for lv in servers[baseline]["levels"]}
    return {lv["concurrency"]: (lv, theirs[lv["concurrency"]]) for lv in servers[ours]["levels"] if lv["concurrency"] in theirs}


def ratios(mine: dict, theirs: dict) -> tuple[float | None, float | None]:
    """Our TTFT p50 / theirs (<1: we answer sooner) and our tok/s / theirs (>1: we are faster)."""
    return _ratio(mine["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]), _ratio(mine["output_tok_s"], theirs["output_tok_s"])


def versus_table(servers: dict[str, dict], baseline: str, markdown: bool = False) -> str | None:
    """Ours against one baseline per level: TTFT p50 and tok/s, each side and the ratio."""
    rows = []
    for conc, (mine, theirs) in versus(servers, baseline).items():
        ttft, tok_s = ratios(mine, theirs)
        rows.append([str(conc), _f(mine["ttft_ms"]["p50"]), _f(theirs["ttft_ms"]["p50"]), _times(ttft),
                     _f(mine["output_tok_s"]), _f(theirs["output_tok_s"]), _times(tok_s)])
    if not rows:
        return None
    header = ["conc", "TTFT p50 ours", f"TTFT p50 {baseline}", "TTFT ratio", "tok/s ours", f"tok/s {baseline}", "tok/s ratio"]
    return _grid(header, rows, markdown)


def shared_target_line(servers: dict[str, dict]) -> str | None:
    """Ours against ours-no-prefix-cache at SHARED_TARGET's level: met or missed."""
    conc, ttft_max, tok_s_min = SHARED_TARGET
    pair = versus(servers, "ours-no-prefix-cache").get(conc)
    if pair is None:
        return None
    ttft, tok_s = ratios(*pair)
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    return (f"target at c={conc}, ours vs ours-no-prefix-cache: TTFT p50 {_times(ttft)} (at most {ttft_max}x: "
            f"{verdict(ttft is not None and ttft <= ttft_max)}), tok/s {_times(tok_s)} (at least {tok_s_min}x: "
            f"{verdict(tok_s is not None and tok_s >= tok_s_min)})")


def _prompt_set(meta: dict) -> str:
    return meta.get("prompts", "short")  # results written before there were prompt sets: the short one


def prompt_set_line(meta: dict) -> str:
    predicted = ", each request with its Predicted Output (--prediction)" if meta.get("prediction") else ""
    return f"prompt set: {_prompt_set(meta)} ({PROMPT_SETS[_prompt_set(meta)]}){predicted}"


def bare_table(servers: dict[str, dict], bare: dict, markdown: bool = False) -> str | None:
    """Each server at concurrency 1 against the bare model: TTFT overhead and ITL/TPOT as multiples of a step."""
    if not bare:
        return None
    step, prefill = bare["decode_step_ms"], bare["prefill_ms"]
    rows = []
    for name, server in servers.items():
        level = next((lv for lv in server.get("levels", ()) if lv["concurrency"] == 1), None)
        if level is None:
            continue
        ttft, itl, tpot = level["ttft_ms"]["p50"], level["itl_ms"]["p50"], level["tpot_ms"]["p50"]
        rows.append([
            name,
            _f(ttft),
            _f(None if ttft is None else ttft - prefill),
            _f(itl),
            _f(None if itl is None else itl / step, 2),
            _f(None if tpot is None else tpot / step, 2),
        ])
    if not rows:
        return None
    header = ["server", "TTFT p50", "TTFT p50 - bare prefill", "ITL p50", "ITL p50 / bare step", "TPOT p50 / bare step"]
    return _grid(header, rows, markdown)


def _busy(value: float | None) -> str:
    return "" if value is None else f"; CPU {value:.0%} busy before"


def bare_line(bare: dict) -> str:
    return (
        f"bare model ({bare['dtype']}, {bare['device']}, {bare['threads']} threads): decode step {bare['decode_step_ms']:.1f} ms "
        f"(median of {bare['decode_steps']}, batch 1), prefill {bare['prefill_ms']:.1f} ms "
        f"(median over the prompts, {bare['prompt_tokens_median']:.0f} tokens median; stock forward with "
        f"logits_to_keep=1: {bare['prefill_stock_forward_ms']:.1f} ms{_busy(bare.get('cpu_busy_idle'))})"
    )


def console_report(payload: dict) -> str:
    parts = [prompt_set_line(payload["meta"])]
    shared = _prompt_set(payload["meta"]) == "shared"
    for name, server in payload["servers"].items():
        ready = f", ready in {server['ready_s']:.1f} s" if server.get("ready_s") is not None else ""
        ready += (f", RSS {server['ready_rss_mb']} MB ready, {server['peak_rss_mb']} MB peak in the sweep, "
                  f"{server.get('lifetime_peak_rss_mb')} MB since start" if server.get("peak_rss_mb") else "")
        parts.append(f"== {name}  ({server.get('base_url', '')}, model {server.get('model', '?')}{ready}"
                     f"{_busy(server.get('cpu_busy_idle'))})")
        if server.get("error"):
            parts.append(f"   FAILED: {server['error']}")
        if server.get("levels"):
            parts.append(level_table(server["levels"]))
            for level in server["levels"]:
                if level["error_samples"]:
                    parts.append(f"   c={level['concurrency']} errors: {'; '.join(level['error_samples'])}")
    if payload.get("bare"):
        parts += ["", bare_line(payload["bare"])]
        table = bare_table(payload["servers"], payload["bare"])
        if table:
            parts.append(table)
    ratios = ratio_table(payload["servers"])
    if ratios:
        parts += ["", "output tok/s, ours / baseline:", ratios]
    floor = floor_table(payload["servers"], payload["meta"].get("read_bandwidth"))
    if floor:
        parts += ["", bandwidth_line(payload["meta"].get("read_bandwidth")) + "; one stream against its floor:", floor]
    for baseline in SHARED_BASELINES if shared else ():
        table = versus_table(payload["servers"], baseline)
        if table:
            parts += ["", f"shared prompt, ours / {baseline} (latencies in ms):", table]
    target = shared_target_line(payload["servers"]) if shared else None
    if target:
        parts.append(target)
    return "\n".join(parts)


def write_json(path: str | os.PathLike, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


REPO_ROOT = Path(__file__).resolve().parents[2]


def portable(text: str) -> str:
    """A command or path as the report shows it, without the absolute paths of the machine it ran on: the
    venv's scripts by name, the checkout's files relative to it, the home directory as `~`."""
    for prefix, short in ((str(Path(sys.executable).parent) + "/", ""), (str(REPO_ROOT) + "/", ""), (str(Path.home()), "~")):
        text = text.replace(prefix, short)
    return text


def markdown_report(payload: dict) -> str:
    meta = payload["meta"]
    machine = meta["machine"]
    shared = _prompt_set(meta) == "shared"
    out = [
        "# Benchmark: oai-gemma against its baselines" + (", shared system prompt" if shared else ""),
        "",
        f"- Command: `{portable(meta['command'])}`",
        f"- Date: {meta['date']}",
        f"- Machine: {machine['cpu_model']}, nproc {machine['nproc']}, {machine['memory_gib']} GiB RAM; "
        f"torch {machine['torch']}, transformers {machine['transformers']}",
        f"- Model: `{portable(meta['model_dir'])}`, {meta['dtype']} on {meta['device']}",
        f"- Workload: per level, {meta['num_requests']} requests (at least the concurrency) of the "
        f"`{_prompt_set(meta)}` prompt set of `oai_gemma/bench/prompts.py` ({PROMPT_SETS[_prompt_set(meta)]}), "
        "streamed, temperature 0, "
        f"max_tokens {meta['max_tokens']}; concurrency levels {', '.join(map(str, meta['concurrency']))}",
        "",
    ]
    if payload.get("bare"):
        out += ["## The bare model", "", bare_line(payload["bare"]) + ".", ""]
        table = bare_table(payload["servers"], payload["bare"], markdown=True)
        if table:
            out += ["At concurrency 1 (ms):", "", table, ""]
    ratios = ratio_table(payload["servers"], markdown=True)
    if ratios:
        out += ["## Output tokens/s: ours ÷ baseline", "", ratios, ""]
    floor = floor_table(payload["servers"], meta.get("read_bandwidth"), markdown=True)
    if floor:
        out += ["## One stream against the physical floor", "", bandwidth_line(meta.get("read_bandwidth")) + ". The floor is "
                "the bytes one token reads over that bandwidth (bench/floor.py).", "", floor, ""]
    for baseline in SHARED_BASELINES if shared else ():
        table = versus_table(payload["servers"], baseline, markdown=True)
        if table:
            out += [f"## Shared system prompt: ours ÷ {baseline} (latencies in ms)", "", table, ""]
    target = shared_target_line(payload["servers"]) if shared else None
    if target:
        out += [target[0].upper() + target[1:] + ".", ""]
    out += ["## Per server (latencies in ms)", ""]
    for name, server in payload["servers"].items():
        out += [f"### {name}", "", f"`{portable(server.get('command') or server.get('base_url'))}`", ""]
        if server.get("ready_s") is not None:
            out += [f"Start to `/health` 200: {server['ready_s']:.1f} s.", ""]
        if server.get("peak_rss_mb"):
            out += [f"Resident memory (the server's process tree): {server['ready_rss_mb']} MB when ready, "
                    f"{server['peak_rss_mb']} MB at the sweep's peak; the server process's own peak since it started "
                    f"(loading included): {server.get('lifetime_peak_rss_mb')} MB.", ""]
        if server.get("cpu_busy_idle") is not None:
            out += [f"CPU busy while the server idled, before the sweep: {server['cpu_busy_idle']:.0%}.", ""]
        if server.get("error"):
            out += [f"Failed: {server['error']}", ""]
        if server.get("levels"):
            out += [level_table(server["levels"], markdown=True), ""]
    out += ["## Notes", ""] + [f"- {note}" for note in ((SHARED_NOTE,) if shared else ()) + NOTES] + [""]
    return "\n".join(out)
