"""`oai-gemma serve | prepare | bench`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

from .settings import load_settings

# flag -> (section, field)
SERVE_FLAGS = {
    "model": ("model", "source"),
    "served_model_name": ("model", "served_name"),
    "dtype": ("model", "dtype"),
    "device": ("model", "device"),
    "load_format": ("model", "load_format"),
    "max_model_len": ("model", "max_model_len"),
    "threads": ("model", "threads"),
    "max_num_seqs": ("engine", "max_num_seqs"),
    "max_prefill_tokens": ("engine", "max_prefill_tokens"),
    "kv_cache_gib": ("engine", "kv_cache_gib"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "log_level": ("server", "log_level"),
}


def _overrides(args: argparse.Namespace) -> dict:
    tree: dict = {}
    for flag, (section, field) in SERVE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            tree.setdefault(section, {})[field] = value
    return tree


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a TOML settings file (see configs/)")
    parser.add_argument("--model", help="`embedded` (default), a local model directory, or a hub id")
    parser.add_argument("--served-model-name", help="the model id clients send")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--load-format", choices=["auto", "dummy"])
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (0: one per core)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences decoded together in one batch")
    parser.add_argument("--max-prefill-tokens", type=int, help="prompt tokens prefilled per engine step")
    parser.add_argument("--kv-cache-gib", type=float, help="KV-cache budget in GiB (0: enough for max-num-seqs)")


def _settings(args: argparse.Namespace):
    try:
        return load_settings(args.config, _overrides(args))
    except (msgspec.ValidationError, OSError) as exc:
        sys.exit(f"oai-gemma: bad settings: {exc}")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api.app import create_app
    from .api.graceful import GracefulServer

    settings = _settings(args)
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log_access_as_json_lines()
    if args.replicas or args.max_replicas:
        return _serve_replicas(settings, args)
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.server.host, port=settings.server.port, log_level=settings.server.log_level,
        access_log=False, timeout_graceful_shutdown=5,  # ours (oai_gemma.access) replaces uvicorn's
    )
    GracefulServer(config, app.state.server.drain, settings.server.shutdown_grace).run()
    return 0


def _serve_replicas(settings, args: argparse.Namespace) -> int:
    """`--replicas N` / `--max-replicas M`: N engine replicas behind Ray Serve (pip install 'oai-gemma[ray]')."""
    try:
        from .deploy.ray_serve import ReplicaOptions, run
    except ImportError as exc:
        sys.exit(f"oai-gemma: --replicas needs Ray Serve: pip install 'oai-gemma[ray]' ({exc})")
    options = ReplicaOptions(
        replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=max(args.max_replicas or 1, args.min_replicas),
        target_ongoing_requests=args.target_ongoing_requests, cpus=args.replica_cpus, gpus=args.replica_gpus,
        routing=args.routing,
    )
    return run(settings, options, args.ray_address)


def _log_access_as_json_lines() -> None:
    """The access log's lines are JSON objects alone, so a log shipper can parse them as they are."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("oai_gemma.access")
    access.addHandler(handler)
    access.propagate = False


def prepare(args: argparse.Namespace) -> int:
    """Convert the embedded model once (what the first `serve` would do), e.g. in a Docker build or CI."""
    from .engine.loader import embedded_model_dir

    logging.basicConfig(level="INFO", format="%(message)s")
    print(embedded_model_dir(_settings(args).model))
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="oai-gemma", description="OpenAI-compatible server for Gemma-3")
    commands = parser.add_subparsers(dest="command", required=True)

    p_serve = commands.add_parser("serve", help="start the server")
    _add_settings_flags(p_serve)
    p_serve.add_argument("--host")
    p_serve.add_argument("--port", type=int)
    p_serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    ray = p_serve.add_argument_group("replicas (Ray Serve; pip install 'oai-gemma[ray]', see docs/scale-out.md)")
    ray.add_argument("--replicas", type=int, help="run this many engine replicas behind Ray Serve's proxy")
    ray.add_argument("--min-replicas", type=int, default=1, help="autoscaling: at least this many replicas")
    ray.add_argument("--max-replicas", type=int, help="autoscaling: at most this many replicas (instead of --replicas)")
    ray.add_argument("--target-ongoing-requests", type=float, default=0, help="autoscaling target per replica (0: max-num-seqs/2)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (fractions allowed)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    ray.add_argument("--routing", choices=["prefix", "least-ongoing"], default="prefix", help="replica choice (default: prefix affinity, then load)")
    ray.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    p_serve.set_defaults(func=serve)

    p_prepare = commands.add_parser("prepare", help="convert the embedded model into the local cache, then exit")
    _add_settings_flags(p_prepare)
    p_prepare.set_defaults(func=prepare)

    try:
        from .bench.command import add_arguments as add_bench_arguments
        from .bench.command import run as run_bench
    except ImportError:
        pass
    else:
        p_bench = commands.add_parser("bench", help="benchmark a running server (and the baselines)")
        add_bench_arguments(p_bench)
        p_bench.set_defaults(func=run_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
