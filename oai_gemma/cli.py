"""`oai-gemma serve | prepare | bench`, and `oai-gemma --version`."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import msgspec
import msgspec.inspect

from .cpu import compute_thread, configure_cpu
from .logs import configure_logging
from .settings import SECTIONS, ModelSettings, ServerSettings, Settings, field_docs, load_settings, model_source_problem, served_models
from .version import version_line

# The settings operators change most, as flags of `serve` and `prepare`: (section, field, flag name when it is
# not the field's). Type, choices, default and help come from the settings tree, so a flag cannot drift from it.
SETTINGS_FLAGS: tuple[tuple[str, str, str | None], ...] = (
    ("model", "source", "model"),
    ("model", "mmproj", None),
    ("model", "served_name", "served-model-name"),
    ("model", "dtype", None),
    ("model", "device", None),
    ("model", "load_format", None),
    ("model", "quantization", None),
    ("model", "max_model_len", None),
    ("engine", "max_num_seqs", None),
    ("engine", "max_prefill_tokens", None),
    ("engine", "max_waiting", None),
    ("engine", "kv_cache_gib", None),
    ("engine", "prefix_caching", None),
    ("engine", "threads", None),
    ("engine", "cpu_wait", None),
    ("engine", "batch_invariant", None),
    ("lora", "modules", "lora-modules"),
    ("lora", "max_loras", None),
    ("lora", "max_lora_rank", None),
    ("lora", "runtime_loading", "lora-runtime-loading"),
    ("engine", "speculative", None),
    ("engine", "speculative_k", None),
    ("engine", "speculative_budget", None),
    ("engine", "speculative_ngram_max", None),
    ("engine", "speculative_ngram_min", None),
    ("router", "max_loaded", None),
    ("router", "memory_budget_gib", None),
    ("router", "keep_alive", None),
)
MULTI_VALUE_FLAGS = {"--lora-modules"}
"""List settings whose flag takes several values at once (vLLM's `--lora-modules a=/x b=/y`), repeatable too."""
# every server setting is a flag of `serve` (`api_keys` as the repeatable `--api-key`)
SERVE_ONLY_FLAGS = tuple(
    ("server", field, {"api_keys": "api-key", "admin_api_keys": "admin-api-key"}.get(field)) for field in ServerSettings.__struct_fields__
)


def flag_name(section: str, field: str, name: str | None) -> str:
    return "--" + (name or field.replace("_", "-"))


def _dest(section: str, field: str) -> str:
    return f"setting__{section}__{field}"


def _add_setting_flag(parser: argparse.ArgumentParser, section: str, field: str, name: str | None) -> None:
    info = next(f for f in msgspec.inspect.type_info(SECTIONS[section]).fields if f.name == field)
    kind = info.type
    kwargs: dict = {"dest": _dest(section, field), "default": None, "metavar": field.upper()}
    default = info.default
    if isinstance(kind, msgspec.inspect.LiteralType):
        kwargs["choices"] = list(kind.values)
        del kwargs["metavar"]
    elif isinstance(kind, msgspec.inspect.IntType):
        kwargs["type"] = int
    elif isinstance(kind, msgspec.inspect.FloatType):
        kwargs["type"] = float
    elif isinstance(kind, msgspec.inspect.BoolType):
        kwargs["action"] = argparse.BooleanOptionalAction
        del kwargs["metavar"]
    elif isinstance(kind, msgspec.inspect.VarTupleType):  # a list setting: the flag may be repeated
        kwargs["action"] = "append"
        kwargs["metavar"] = field.upper().removesuffix("S")
        default = "none; repeat the flag for several"
        if flag_name(section, field, name) in MULTI_VALUE_FLAGS:
            kwargs.update(action="extend", nargs="+")
    elif not isinstance(kind, msgspec.inspect.StrType):
        raise TypeError(f"no flag for {section}.{field} of type {kind}")
    doc = field_docs(section).get(field, "")
    if (section, field) == ("model", "source"):  # repeated as `--model ID=SOURCE`: several models (_overrides)
        kwargs["action"] = "append"
        doc += " Repeat as `--model ID=SOURCE` to serve several, each under its ID (`[models.<id>]` in a settings file)."
    shown = default if isinstance(default, str) and default.startswith("none;") else repr(default)
    kwargs["help"] = f"{doc} [{section}.{field}, default: {shown}]".strip().replace("%", "%%")
    parser.add_argument(flag_name(section, field, name), **kwargs)


def _overrides(args: argparse.Namespace) -> dict:
    tree: dict = {}
    for section, field, _ in SETTINGS_FLAGS + SERVE_ONLY_FLAGS:
        value = getattr(args, _dest(section, field), None)
        if value is not None and (section, field) == ("model", "source"):
            _model_sources(tree, value)
        elif value is not None:
            tree.setdefault(section, {})[field] = value
    return tree


def _model_sources(tree: dict, values: list[str]) -> None:
    """`--model SOURCE` (as ever) and `--model ID=SOURCE` (several models, each a `[models.<id>]` table; a plain one
    beside them is served too, under its own name). An existing path with `=` in it stays a plain source."""
    named = [v.partition("=") for v in values if "=" in v and not os.path.exists(v)]
    plain = [v for v in values if "=" not in v or os.path.exists(v)]
    if plain:
        tree.setdefault("model", {})["source"] = plain[-1]
    if named:
        models = tree.setdefault("models", {})
        if plain:  # the plain one first, under its own name: it stays the default model
            models[Settings(model=ModelSettings(source=plain[-1])).served_model_name] = {"source": plain[-1]}
        for name, _, source in named:
            models[name.strip()] = {"source": source.strip()}


def _add_settings_flags(parser: argparse.ArgumentParser, flags=SETTINGS_FLAGS) -> None:
    parser.add_argument("--config", help="a TOML settings file (see configs/); flags override it and OAI_GEMMA_* env vars")
    for section, field, name in flags:
        _add_setting_flag(parser, section, field, name)


def _settings(args: argparse.Namespace):
    try:
        return load_settings(args.config, _overrides(args))
    except (msgspec.ValidationError, OSError) as exc:
        sys.exit(f"oai-gemma: bad settings: {exc}")


def serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging(settings.server.log_level, settings.server.log_format)
    try:
        models = served_models(settings)
    except msgspec.ValidationError as exc:
        sys.exit(f"oai-gemma: bad settings: {exc}")
    for own, _ in models.values():
        problem = model_source_problem(own.model.source, own.model.mmproj)
        if problem:  # seconds, not a minute of loading, to say what is wrong
            return _failed_start(problem)
    replicas = bool(args.replicas or args.max_replicas)  # Ray Serve's proxy listens then, not this process
    try:
        listener = None if replicas else _listen(settings.server.host, settings.server.port)
    except OSError as exc:
        return _failed_start(f"cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror or exc}; "
                             "stop what holds that port or choose another (--port)")
    if listener is not None:  # uvicorn says nothing of a socket it is handed; "ready" comes once the model is warm
        host, port = listener.getsockname()[:2]
        logging.getLogger("oai_gemma.server").info("listening on %s:%d; /health answers 503 until the model is ready", host, port)
    # before anything imports torch: its OpenMP runtime reads the wait policy once, when it loads
    configure_cpu(settings.engine)
    if replicas:
        return _serve_replicas(settings, args)
    import uvicorn

    from .api.app import create_app
    from .api.graceful import GracefulServer
    from .api.connections import http_protocol

    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.server.host, port=settings.server.port, log_level=settings.server.log_level,
        access_log=False, timeout_graceful_shutdown=5,  # ours (oai_gemma.access) replaces uvicorn's
        http=http_protocol(settings.server.header_timeout, settings.server.send_buffer_bytes),
        timeout_keep_alive=settings.server.keep_alive_timeout,
        log_config=None,  # uvicorn's lines in the console's one format
    )
    server, state = GracefulServer(config, app.state.server.drain, settings.server.shutdown_grace), app.state.server
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[listener])
    return 1 if state.fatal else 0


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use ends the start at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener


def _failed_start(reason: str) -> int:
    logging.getLogger("oai_gemma.server").error("oai-gemma: %s; exiting", reason)
    return 1


def _serve_replicas(settings, args: argparse.Namespace) -> int:
    """`--replicas N` / `--max-replicas M`: engine replicas behind Ray Serve (pip install 'oai-gemma[ray]')."""
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


def _add_replica_flags(parser: argparse.ArgumentParser) -> None:
    """How `serve` runs as Ray Serve replicas: deployment options, not settings of one server."""
    ray = parser.add_argument_group("replicas (Ray Serve; pip install 'oai-gemma[ray]', see docs/scale-out.md)")
    ray.add_argument("--replicas", type=int, help="run this many engine replicas behind Ray Serve's proxy")
    ray.add_argument("--min-replicas", type=int, default=1, help="autoscaling: at least this many replicas")
    ray.add_argument("--max-replicas", type=int, help="autoscaling: at most this many replicas (instead of --replicas)")
    ray.add_argument("--target-ongoing-requests", type=float, default=0, help="autoscaling target per replica (0: max-num-seqs/2)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (fractions allowed); also its torch threads")
    ray.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    ray.add_argument("--routing", choices=["prefix", "least-ongoing"], default="prefix", help="replica choice (default: prefix affinity, then load)")
    ray.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")


def prepare(args: argparse.Namespace) -> int:
    """Write what the first `serve` would write into the model cache, then exit (a Docker build, a CI cache): the
    embedded model converted, the native kernels compiled, the quantized weights for this machine's dtype and the
    grammar engine's token table. It loads and warms up the engine to do so: the same code as `serve`, seconds more."""
    settings = _settings(args)
    configure_logging(settings.server.log_level, settings.server.log_format)
    configure_cpu(settings.engine)
    from .engine.factory import load_engine
    from .engine.sampling.grammar import StructuredOutputUnavailable

    # on a compute thread, as `serve` loads: the invariance check's verdict is kept under the thread count that
    # serving runs with (this thread computes with one), so the first `serve` finds it
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(load_engine(settings))
        except BaseException as exc:  # raised again below, on this thread
            outcome.append(exc)

    thread = compute_thread(run, "oai-gemma-prepare")
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    engine = outcome[0]
    try:
        engine.grammars  # built in the background after warm-up: wait for it (and its token table)
    except StructuredOutputUnavailable as exc:
        logging.getLogger("oai_gemma.engine").warning("%s", exc)
    engine.shutdown()
    print(settings.model.cache_path)
    return 0


class _Version(argparse.Action):
    """`--version`, computed only when asked (argparse's own takes the string up front)."""

    def __call__(self, parser, *_) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oai-gemma", description="OpenAI-compatible server for Gemma-3")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version, git commit and torch's version, then exit")
    commands = parser.add_subparsers(dest="command", required=True)

    p_serve = commands.add_parser("serve", help="start the server")
    _add_settings_flags(p_serve, SETTINGS_FLAGS + SERVE_ONLY_FLAGS)
    _add_replica_flags(p_serve)
    p_serve.set_defaults(func=serve)

    p_prepare = commands.add_parser("prepare", help="fill the model cache as the first start would (model converted, kernels compiled), then exit")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
