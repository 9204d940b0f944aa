"""`oai-gemma bench`: sweep concurrency levels against one running server, or start each compared server in turn."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .checkpoint import add_parser as add_checkpoint_parser
from .client import run_level, warm_up
from .compare import LORA_SERVERS, SERVER_NAMES, build_spec, default_servers, free_port, running
from .floor import engine_step_ms, health, read_bandwidth, speculation
from .memory import MB, PeakRss, high_water_mark, tree_rss
from .lora import prepare as prepare_lora, route as lora_route, served_adapters, time_load
from .prompts import EDITS, JSON_SUBJECTS, PROMPT_SETS, PROMPTS, QUESTIONS
from .report import console_report, markdown_report, write_json
from .stats import summarize_level

BUSY_WARNING = 0.15


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def _servers(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in SERVER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown server(s) {unknown}; choose from {', '.join(SERVER_NAMES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server to drive (without --compare)")
    parser.add_argument("--model", help="model name to request; default: the first id of GET /v1/models")
    parser.add_argument("--label", default="ours", help="the name the server gets in the report (without --compare)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--concurrency", type=_levels, default=[1, 8, 32], help="comma-separated levels, e.g. 1,8,32")
    parser.add_argument("--num-requests", type=int, default=8, help="requests per level (raised to the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", choices=PROMPT_SETS, default="short",
                        help="the prompt set of oai_gemma/bench/prompts.py: "
                             + "; ".join(f"{name}: {what}" for name, what in PROMPT_SETS.items()))
    parser.add_argument("--prediction", action="store_true",
                        help="with --prompts edit: send each original function as Predicted Outputs (`prediction`)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests before the sweep")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may wait for its next byte")
    parser.add_argument("--bare", action="store_true", help="also time the bare model, loaded as the server loads it (in a child process, before the sweep; short prompt set only)")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare-model reference in --compare mode")
    parser.add_argument("--compare", action="store_true", help="start each of --servers in turn and sweep each")
    parser.add_argument("--cpu-hog", action="store_true",
                        help="instead of the sweep: c=8 quiet, then beside one `nice -n 10` busy loop, and the throughput ratio (server at --base-url)")
    parser.add_argument("--servers", type=_servers,
                        help=f"with --compare: which, in order, of {','.join(SERVER_NAMES)} (default: all but ours-none and "
                             "ours-no-prefix-cache, or with --prompts shared ours,ours-no-prefix-cache,llama-server; "
                             "llama-server only where its binary is found)")
    parser.add_argument("--ours-args", default="", help="with --compare: extra flags for `oai-gemma serve` as one string, e.g. --ours-args='--max-num-seqs 16'")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    parser.add_argument("--log-dir", default="bench-results/logs", help="with --compare: where server logs go")
    parser.add_argument("--output-json", help="write all results (with raw timings) here")
    parser.add_argument("--plot", help="write a PNG of the latency distributions and throughput here")
    parser.add_argument("--markdown", help="write the markdown report (e.g. docs/benchmarks.md) here")
    parser.add_argument("--model-dir", help="with --compare: the checkpoint our server (--model) and the transformers baselines "
                        "serve (default: the embedded model), e.g. one `oai-gemma bench checkpoint` wrote")
    parser.add_argument("--gguf", help="with --compare: the GGUF llama-server serves (default: the embedded model's)")
    parser.add_argument("--mmproj", help="with --compare: llama-server's vision projector GGUF (its --mmproj), so "
                        "--prompts image runs on llama-server too (e.g. gguf/mmproj-*.gguf of `bench checkpoint --size 4b`)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send `ignore_eos` (ours and llama-server honour it): every request runs to --max-tokens, "
                        "as random-weight checkpoints need")
    parser.add_argument("--lora", type=int, default=0, metavar="N",
                        help="spread requests over N LoRA adapters (request i on adapter i mod N): with --compare the "
                             "ours-lora and llama-server-lora servers serve them; else the server's first N adapters")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the adapters --lora makes (without --lora-dir)")
    parser.add_argument("--lora-dir", help="a directory of PEFT adapter directories to use instead of random ones")
    add_checkpoint_parser(parser.add_subparsers(dest="bench_command", metavar="{checkpoint}",
                                                help="instead of a sweep: checkpoint writes the random-weight 1B/4B "
                                                     "fixtures (oai-gemma bench checkpoint --help)"))


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory = None
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": memory,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of all cores busy over `seconds` (from /proc/stat). Sampled while the server under test is idle,
    it shows other load sharing the machine, which skews every number; None where /proc/stat is missing."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("oai-gemma", "cli.py", "-m", "__main__.py"):
        argv[0] = "oai-gemma"
    return shlex.join(argv)


async def _sweep(base_url: str, model: str, args: argparse.Namespace, label: str, adapters: list[str] | None = None) -> dict:
    """`adapters`: the LoRA adapters requests are spread over (bench/lora.py), warmed up one request each."""
    server: dict = {"base_url": base_url, "model": model, "levels": []}
    if args.prompts == "image":  # one image, and a text stream during its encode (bench/image.py)
        from .image import report, run_image

        server["image"] = await run_image(base_url, model, args.max_tokens, args.request_timeout)
        print(report(label, server["image"]), file=sys.stderr, flush=True)
        return server
    route = lora_route(label, adapters) if adapters else None
    if args.ignore_eos:
        route = ignoring_eos(route)
    if adapters:
        server["lora_adapters"] = len(adapters)
    for _ in range(args.warmup):
        result = await warm_up(base_url, model, args.max_tokens, args.request_timeout, args.api_key, args.prompts,
                               route, len(adapters) if adapters else 1, prediction=args.prediction)
        if result.error:
            server["warmup_error"] = result.error
            print(f"[{label}] warm-up failed: {result.error}", file=sys.stderr)
    health_url = base_url.rstrip("/").removesuffix("/v1") + "/health"
    server["decode_bytes"] = health(health_url).get("decode_bytes")
    server["cpu_busy_idle"] = busy = cpu_busy()
    if busy is not None and busy > BUSY_WARNING:
        print(f"[{label}] warning: {busy:.0%} of the CPU is busy while the server idles: other load skews the "
              "numbers", file=sys.stderr)
    # the shared set numbers its requests on across the sweep: a level that repeated an earlier level's prompts
    # would hit the prefix cache beyond the system prompt (the short set restarts at prompt 0, as it always did)
    sent = args.warmup
    for concurrency in args.concurrency:
        num = max(args.num_requests, concurrency)
        first = sent if args.prompts == "shared" else 0
        before = health(health_url)
        run = await run_level(base_url, model, concurrency, num, args.max_tokens, args.request_timeout, args.api_key,
                              args.prompts, first, route=route, prediction=args.prediction)
        sent += num
        level = summarize_level(run)
        after = health(health_url)
        level["engine_step_ms"] = engine_step_ms(before, after)
        level["speculation"] = speculation(before, after, level["output_tokens"])
        server["levels"].append(level)
        print(f"[{label}] c={concurrency:<3} n={num:<3} {level['output_tok_s']:7.1f} tok/s  "
              f"TTFT p50 {level['ttft_ms']['p50'] or 0:8.1f} ms  ITL p50 {level['itl_ms']['p50'] or 0:7.1f} ms  "
              f"errors {level['errors']}", file=sys.stderr, flush=True)
    return server


def ignoring_eos(route: Callable[[int, dict], dict] | None) -> Callable[[int, dict], dict]:
    """`route`, then `ignore_eos` set on the body."""
    return lambda index, body: {**(route(index, body) if route else body), "ignore_eos": True}


def _discover_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10, trust_env=False).json()["data"]
        return data[0]["id"]
    except Exception:  # noqa: BLE001 - any failure: fall back to the embedded model's name
        return "gemma-3-270m"


def server_spec(name: str, args: argparse.Namespace, model_dir: str, dtype: str, device: str, lora=None):
    """`--compare`'s server `name` from the command line: ours with --ours-args (and --model-dir), llama-server on
    --gguf (with --mmproj), `-np` the highest --concurrency level."""
    ours_args = shlex.split(args.ours_args) + (["--model", model_dir] if args.model_dir else [])
    return build_spec(name, free_port(), model_dir, dtype, device, ours_args, max(args.concurrency), lora,
                      args.gguf, args.mmproj)


def run(args: argparse.Namespace) -> int:
    from ..engine.model.loader import pick_device, pick_dtype, resolve_source
    from ..settings import load_settings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.num_requests < 1 or args.max_tokens < 1:
        print("--num-requests and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.prediction and args.prompts != "edit":
        print("--prediction needs --prompts edit (the original functions are the predictions)", file=sys.stderr)
        return 2
    settings = load_settings().model
    device = pick_device(settings)
    model_dir = args.model_dir or (resolve_source(settings) if args.compare else "")
    dtype = str(pick_dtype(settings, device, model_dir or None)).removeprefix("torch.")
    lora = prepare_lora(args.lora, args.lora_rank, args.lora_dir, model_dir) if args.compare and args.lora else None
    payload: dict = {
        "meta": {
            "command": _command_line(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(),
            "model_dir": model_dir,
            "dtype": dtype,
            "device": str(device),
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "prompts": args.prompts,
            "prediction": args.prediction,
            "num_prompts": len({"shared": QUESTIONS, "edit": EDITS, "json": JSON_SUBJECTS}.get(args.prompts, PROMPTS)),
            "lora": {"adapters": args.lora, "rank": None if args.lora_dir else args.lora_rank, "dir": args.lora_dir} if args.lora else None,
        },
        "bare": None,
        "servers": {},
    }
    if not args.cpu_hog:
        payload["meta"]["read_bandwidth"] = read_bandwidth()  # the floor's denominator (bench/floor.py)
    if args.prompts == "short" and (args.bare or (args.compare and not args.no_bare)):
        from .bare import measure_bare

        if not args.compare:
            print("timing the bare model; the server at --base-url should be idle meanwhile", file=sys.stderr)
        busy = cpu_busy()
        payload["bare"] = measure_bare()
        payload["bare"]["cpu_busy_idle"] = busy
    if args.compare:
        for name in args.servers or default_servers(args.prompts):
            try:
                spec = server_spec(name, args, model_dir, dtype, str(device), lora)
                print(f"[{name}] starting: {shlex.join(spec.argv)}", file=sys.stderr, flush=True)
                started = time.monotonic()
                with running(spec, Path(args.log_dir), args.ready_timeout) as (model, pid):
                    ready_s = time.monotonic() - started  # process start to /health 200 (issue 27: at most 8 s warm)
                    ready_rss = tree_rss(pid)
                    adapters = lora.names if lora is not None and name in LORA_SERVERS else None
                    with PeakRss(pid) as peak:
                        server = asyncio.run(_sweep(spec.base_url, model, args, name, adapters))
                    server["ready_rss_mb"], server["peak_rss_mb"] = round((ready_rss or 0) / MB), round(peak.bytes / MB)
                    server["lifetime_peak_rss_mb"] = round((high_water_mark(pid) or 0) / MB)  # loading included
                    if name == "ours-lora":  # issue 28: a rank-16 adapter loads in under 1 s
                        server["lora_load_s"] = load_s = time_load(spec.base_url, lora.spare, args.api_key)
                        print(f"[{name}] loading one more adapter at run time: {load_s} s", file=sys.stderr)
                server["command"], server["ready_s"] = shlex.join(spec.argv), ready_s
                if name.startswith("llama-server"):  # it reads its GGUF's tensors once a token
                    server["decode_bytes"] = Path(spec.argv[spec.argv.index("-m") + 1]).stat().st_size
            except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
                print(f"[{name}] failed: {exc}", file=sys.stderr)
                server = {"error": str(exc), "levels": []}
            payload["servers"][name] = server
    elif args.cpu_hog:
        from .cpu_hog import cpu_hog, report

        model = args.model or _discover_model(args.base_url, args.api_key)
        asyncio.run(warm_up(args.base_url, model, args.max_tokens, args.request_timeout, args.api_key))
        payload["cpu_hog"] = result = asyncio.run(cpu_hog(args.base_url, model, args))
        print(report(result))
        if args.output_json:
            write_json(args.output_json, payload)
        return 0 if result["ratio"] >= result["target"] else 1
    else:
        model = args.model or _discover_model(args.base_url, args.api_key)
        payload["meta"]["model_dir"] = model
        adapters = served_adapters(args.base_url, args.api_key)[: args.lora] if args.lora else None
        if args.lora and len(adapters) < args.lora:
            print(f"--lora {args.lora}: the server lists {len(adapters)} adapters", file=sys.stderr)
            return 2
        payload["servers"][args.label] = asyncio.run(_sweep(args.base_url, model, args, args.label, adapters))

    print(console_report(payload))
    if args.output_json:
        write_json(args.output_json, payload)
    if args.plot:
        from .plot import plot

        plot(payload, args.plot)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown_report(payload))
    failed = any(s.get("error") or any(lv["errors"] for lv in s.get("levels", ())) for s in payload["servers"].values())
    return 1 if failed else 0
