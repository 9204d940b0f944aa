"""One typed settings tree, read from a TOML file, then `OAI_GEMMA_*` env vars, then CLI flags.

Env vars name a field by its path with double underscores: `OAI_GEMMA_MODEL__SOURCE=/models/gemma-3-4b-it`,
`OAI_GEMMA_SERVER__PORT=9000`. Later sources win.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

EMBEDDED = "embedded"
INT_DOT_QUANTIZATIONS = ("q8", "q4", "q4-mix")
"""`model.quantization` values whose linears run the native integer dot-product kernels (engine/ops/int_dot.py): the
one list the configuration's checks, the layouts' choice (engine/ops/choice.py) and the vision tower's (engine/model/
vision_layout.py) read. Here, not in engine/ops/, because engine/config.py stays free of the engine's rooms."""
QUANTIZATIONS = ("none", "int8", "int4", "per-step", *INT_DOT_QUANTIZATIONS)
"""`model.quantization` as resolved (every value but `auto`)."""


class ModelSettings(msgspec.Struct, forbid_unknown_fields=True):
    source: str = EMBEDDED
    """`embedded` (gemma-3-270m from PyPI), a local directory, a Gemma-3 GGUF file (`model.gguf`, converted once into
    the model cache), or a hub id such as `google/gemma-3-4b-it`."""
    mmproj: str = ""
    """A GGUF `source`'s vision tower: llama.cpp's mmproj file (`mmproj-model-f16.gguf`) of the same model."""
    served_name: str = ""
    """The model id clients send and `/v1/models` lists; empty means derived from `source`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`auto`: bfloat16 on a GPU or a CPU with native bf16 matmul (AMX / AVX512-BF16), else float32; float32 on any CPU
    for gemma-3-1b and larger (text hidden size 1152+: their q4-mix kernels and the native float32 steps)."""
    device: str = "auto"
    """`auto`, `cpu`, `cuda`, `cuda:1`, ..."""
    device_map: str = ""
    """Set to `auto` to spread a model larger than one card over all GPUs (accelerate)."""
    load_format: Literal["auto", "dummy"] = "auto"
    """`dummy` builds the model from its config with random weights (speed tests without weights)."""
    attn_implementation: str = "sdpa"
    max_model_len: Annotated[int, msgspec.Meta(ge=16)] = 8192
    """Context window served: prompt plus completion tokens."""
    quantization: Literal[("auto", *QUANTIZATIONS)] = "auto"
    """Weight-only quantization of the linear layers and the lm_head at load (CPU only; engine/ops/quantized.py),
    quantized once into the model cache. `int8`: every one per output channel; `int4`: in bf16 the lm_head in int4
    groups of 32 and the rest int8 (all-int4 cost +41% perplexity), in float32 the lm_head through fbgemm's int8.
    `per-step`: bf16 only, each linear kept twice, int8 for steps of few rows (native kernel) and packed bf16 for
    the others, chosen per step by its row count. `auto`: where the project's native kernel compiles, if the CPU
    computes in float32 `q4-mix` for models of hidden size 1152 or more (gemma-3-1b and larger; where the integer
    kernels run) and `int8` below (+0.5% perplexity), and `per-step` if in bf16; else `none`. `q8`: every linear
    int8 x int8 (activations quantized per block of 32 in the kernel, integer dot products: faster from a few rows
    on); `q4`: the projections in 4-bit blocks of 32 (GGUF's Q4_1, fewer bytes per token) and the lm_head as `q8`;
    `q4-mix`: `q4` with v and down as `q8` in llama.cpp's Q4_K_M `use_more_bits` layers and the lm_head in 5-bit
    blocks (GGUF's Q5_1: 6 bits a weight, 226 MB a token at the 1B where q8 reads 303) (all three need the
    native kernels). docs/engine.md, "Weight-only quantized weights", "Integer dot products" and "Quality at the
    1B shape"."""
    compile: Literal["auto", "on", "off"] = "auto"
    """`auto`: compile the decode step on GPU only (on this CPU it did not pay, see docs/engine.md)."""
    cache_dir: str = ""
    """The model cache: the converted embedded model, quantized weights, the compiled native kernel; default
    `$OAI_GEMMA_CACHE`, else `~/.cache/oai-gemma`."""
    trust_remote_code: bool = False

    @property
    def cache_path(self) -> Path:
        """`cache_dir`, or its default: the one place the model cache's directory is decided."""
        return Path(self.cache_dir or os.environ.get("OAI_GEMMA_CACHE", "~/.cache/oai-gemma")).expanduser()


class EngineSettings(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 32
    """Sequences decoded together in one batch (batch slots)."""
    kv_cache_gib: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """KV-cache budget in GiB: blocks of 16 tokens shared by running sequences and cached prefixes (it must hold one
    max_model_len sequence; a request is admitted once the blocks its prompt and max_tokens may need are free).
    0: the memory max_num_seqs sequences of max_model_len took before the cache was paged."""
    prefix_caching: bool = True
    """A prompt starts from the longest prefix any earlier or running request computed (automatic prefix caching,
    in 16-token blocks); off for A/B runs (`--no-prefix-caching`)."""
    prefix_cache_scope: Literal["auto", "global", "key"] = "auto"
    """Who shares cached prefixes: `key`: requests under one API key share, different keys never do (a fast first
    token would tell one tenant what another sent); `global`: every request; `auto`: `key` when API keys are
    configured, else `global`. A request's `cache_salt` narrows it further."""
    max_prefill_tokens: Annotated[int, msgspec.Meta(ge=16)] = 512
    """Prompt tokens prefilled per engine step, so a long prompt never stalls running streams for long."""
    vision_step_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """How long each engine step runs an image's vision tower (encoded a slice at a time between steps, so running
    streams keep streaming). 0: the shorter of the running sequences' last step and the median of their last 8
    (their inter-token time at most about doubles while an image encodes), 250 ms when nothing else runs."""
    image_prefill_units: bool = False
    """An image's prefill chunk (its block is never split: its tokens attend to each other both ways) runs as units
    between steps under the same budget as its encode, so running streams keep streaming (engine/prefilling.py);
    false (the default until it is measured at 4B: docs/benchmarks.md): in one step (~10 s at 4B on 2 cores, every
    stream waiting)."""
    default_max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024
    """Completion cap when a request sets neither max_tokens nor max_completion_tokens."""
    max_waiting: Annotated[int, msgspec.Meta(ge=0)] = 256
    """Requests allowed to wait for a batch slot; beyond that a 429 with Retry-After, not an unbounded queue."""
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Torch compute threads on a CPU; 0 means one per CPU this process may run on (its affinity mask)."""
    cpu_wait: Literal["auto", "passive", "active"] = "auto"
    """How idle compute threads wait for work on a CPU: `auto` keeps the OpenMP runtime's default (spin briefly,
    then sleep; measured the best alone and 0.80 of it beside a busy process); `passive` sleeps at once
    (OMP_WAIT_POLICY=PASSIVE, KMP_BLOCKTIME=0: ~28% slower alone, for hosts crowded with other work); `active`
    spins without end."""
    batch_invariant: Literal["auto", "on", "off"] = "auto"
    """Greedy and seeded outputs identical whatever runs beside a request, however its prompt was chunked
    (engine/ops/invariance.py; CPU only). `auto`: on where this CPU's kernels pass the start-up check; `on`: a start-up
    error where they do not; `off`: the shapes' own kernels (a prefix-cache hit then also reuses generated tokens)."""
    speculative: Literal["auto", "off", "ngram"] = "auto"
    """Speculative decoding: draft tokens from prompt lookup (the output copying the prompt) and from a request's
    Predicted Output, checked several at a time in one step; outputs stay exactly what they would be without it.
    `auto`: on (`ngram`) on the CPU's dynamic path, off with the GPU's static decode; `off`: never."""
    speculative_k: Annotated[int, msgspec.Meta(ge=1, le=64)] = 32
    """Most draft tokens one sequence carries into a step (its own acceptance history decides how many it does)."""
    speculative_budget: Annotated[int, msgspec.Meta(ge=1)] = 32
    """Most decode tokens a step holds while it adds drafts (every row's own token first): a batch of this many
    sequences carries none, where speculation would cost throughput (keep it at most max_num_seqs for that)."""
    speculative_ngram_max: Annotated[int, msgspec.Meta(ge=1, le=32)] = 4
    """Prompt lookup's longest n-gram: the sequence's last tokens looked up in its prompt and output."""
    speculative_ngram_min: Annotated[int, msgspec.Meta(ge=1, le=32)] = 2
    """Prompt lookup's shortest n-gram (minimum match) before a draft is proposed."""


class ImageSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where images may come from and how big they may be (`image_url` parts; multimodal models only)."""

    allow_private_networks: bool = False
    """Private, loopback, link-local and similar addresses are refused unless True (cloud metadata always is)."""
    allowed_hosts: tuple[str, ...] = ()
    """Exact hostnames or `*.example.com` (subdomains only), allowed whatever they resolve to."""
    file_root: str | None = None
    """`file://` URLs only when set, and only inside this directory."""
    max_download_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    """Decompression-bomb limit (width x height), checked before decoding."""
    max_images: int = 16
    """Per request."""
    connect_timeout: float = 5.0
    total_timeout: float = 20.0
    max_redirects: int = 3
    pan_and_scan: bool = False
    """Pan-and-scan (up to 4 extra 256-token crops) for `detail: "auto"` images; `"high"` always, `"low"` never."""


class ServerSettings(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    """Address to listen on (`0.0.0.0` for every interface)."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    """TCP port to listen on."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Server log level (the access log is always on)."""
    log_format: Literal["text", "json"] = "text"
    """Console lines: `text` for a person (time, level, logger, message), `json` (one object per line) for log shippers."""
    log_probes: bool = False
    """Access-log lines for `/health` and `/metrics` too (off: load balancers and Prometheus would bury the rest)."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys clients must send (also `OAI_GEMMA_API_KEYS=k1,k2`); none means open."""
    admin_api_keys: tuple[str, ...] = ()
    """Bearer keys that may also call the admin endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`); they
    are API keys too. Once any key is configured, those endpoints take admin keys only."""
    health_requires_key: bool = False
    """`/health` is open by default so load balancers can probe it."""
    metrics_requires_key: bool = False
    """`/metrics` is open by default so Prometheus can scrape it."""
    metrics_vllm_names: bool = True
    """`/metrics` also carries vLLM's names (`vllm:num_requests_waiting`, ...) for gateways and autoscalers made for vLLM."""
    log_request_text: bool = False
    """Debugging only: access-log lines then carry the request body and the output text."""
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 32 * 1024 * 1024
    """Larger request bodies get a 413."""
    request_timeout: Annotated[float, msgspec.Meta(ge=0)] = 600.0
    """Seconds from a request's arrival to its last token; past it the request ends (504, or a stream's
    error event then `[DONE]`). 0 means no limit."""
    idle_timeout: Annotated[float, msgspec.Meta(ge=0)] = 120.0
    """Longest wait for a request's next token, time in the queue included (a stream that goes quiet
    this long ends the same way); the encode of a request's images is progress (counted from its last slice).
    0 means no limit."""
    max_stream_backlog: Annotated[int, msgspec.Meta(ge=0)] = 1024
    """Events (tokens) a stream may have waiting for a client that reads slower than they come; past it the request
    is cancelled and its KV freed (`oai_gemma:stream_backlog_cancels_total`), so a client that stops reading holds
    bounded memory. 0 means no limit."""
    send_buffer_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The kernel send buffer of each connection (SO_SNDBUF); 0 leaves the OS's autotuning (Linux: up to 4 MB per
    connection). A small one makes a client that stops reading show sooner in `max_stream_backlog`."""
    keep_alive_timeout: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Seconds an idle kept-alive connection stays open (uvicorn's `timeout_keep_alive`, same default)."""
    header_timeout: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    """Seconds a new or kept-alive connection has to send its request's headers in full; past it the connection is
    closed (slowloris). uvicorn has no such limit. 0 means none."""
    body_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    """Longest wait for the next part of a request body; past it a 408 and the connection closes (a body that stops
    half way holds no worker; nothing reaches the engine). uvicorn has no such limit. 0 means none."""
    body_min_rate: Annotated[float, msgspec.Meta(ge=0)] = 500.0
    """Bytes a second a request body must average after its first `body_timeout` seconds: the whole body is due
    `body_timeout` s plus 1 s per `body_min_rate` bytes after the headers (Apache's mod_reqtimeout default MinRate),
    so a body trickled a byte at a time cannot hold a connection for ever. 0 means no rate, only `body_timeout`."""
    exit_on_engine_failure: bool = True
    """When loading the model fails, or the engine thread dies (an error outside any one request, e.g. out of memory):
    end every open stream with an error event, log one ERROR line saying why, then exit non-zero so Kubernetes, Ray or
    systemd restart or report it. Off: keep answering 503 with the reason (`/health`), e.g. to inspect a failed load."""
    shutdown_grace: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    """On SIGTERM/SIGINT: seconds running requests get to finish while new ones get 503; the rest are then
    ended (503, or an error event then `[DONE]`) and the process exits 0."""
    playground: bool = True
    """Serve the web playground at `/` and `/playground` (the page is open; its API calls need a key when keys are set)."""


class LoraSettings(msgspec.Struct, forbid_unknown_fields=True):
    """LoRA adapters served beside the base model (README, "LoRA adapters"; engine/lora/)."""

    modules: tuple[str, ...] = ()
    """Adapters to serve, vLLM's syntax: `name=path` or a JSON object `{"name": ..., "path": ..., "base_model_name": ...}`
    (`--lora-modules a=/adapters/a b=/adapters/b`); each a PEFT directory (adapter_config.json +
    adapter_model.safetensors). A request picks one by its `model` field."""
    max_loras: Annotated[int, msgspec.Meta(ge=1)] = 8
    """Adapters resident at once (the most a step mixes); the least recently used idle one is dropped for another
    and read again from disk when asked for."""
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Highest adapter rank accepted (nothing is reserved per rank: it bounds what one adapter may cost)."""
    runtime_loading: bool = False
    """`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); with
    API keys configured they need an admin key (`--admin-api-key`)."""


class ResponsesSettings(msgspec.Struct, forbid_unknown_fields=True):
    """The store behind `/v1/responses` (`store: true`, `previous_response_id`): one SQLite file."""

    store_path: str = ""
    """The SQLite file; empty means `~/.cache/oai-gemma/responses.sqlite3`."""
    max_stored: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    """Responses kept (all API keys together); beyond it the oldest are deleted. 0 keeps none."""
    max_age: Annotated[float, msgspec.Meta(ge=0)] = 30 * 24 * 3600.0
    """Seconds a stored response is kept (OpenAI keeps 30 days); 0 means no age limit."""

    @property
    def path(self) -> Path:
        return Path(self.store_path).expanduser() if self.store_path else Path.home() / ".cache" / "oai-gemma" / "responses.sqlite3"


class RouterSettings(msgspec.Struct, forbid_unknown_fields=True):
    """Several models behind one base URL (`[models.<id>]` tables, `--model ID=SOURCE`): when they load and unload."""

    max_loaded: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Models loaded at once; a load past it first unloads the least recently used idle one. 0: no limit."""
    memory_budget_gib: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Bytes the loaded models may hold (each model's weights plus its KV cache, as its engine counts them); a load
    past it first unloads the least recently used idle ones. 0: `memory_fraction` of the memory available at start."""
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    """The default budget's share of the memory available (MemAvailable) when the server starts."""
    keep_alive: float = -1.0
    """Seconds an idle model stays loaded after its last request (Ollama's `keep_alive`; a `[models.<id>]` table and a
    request's `keep_alive` field override it). Negative: for ever; 0: unloaded as soon as it is idle."""
    load_wait: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    """Seconds a load waits for a model to unload when every loaded one has requests in flight; then a 503 with
    Retry-After."""


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    images: ImageSettings = msgspec.field(default_factory=ImageSettings)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    responses: ResponsesSettings = msgspec.field(default_factory=ResponsesSettings)
    router: RouterSettings = msgspec.field(default_factory=RouterSettings)
    models: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    """`[models.<id>]` tables: each a model served as `<id>`, with `source` and any `model`, `engine` or
    `keep_alive` setting of its own over the global ones (`served_models`)."""

    @property
    def served_model_name(self) -> str:
        if self.model.served_name:
            return self.model.served_name
        if self.model.source == EMBEDDED:
            return "gemma-3-270m"
        if self.model.source.endswith(".gguf"):
            return Path(self.model.source).stem
        return Path(self.model.source.rstrip("/")).name if os.path.isdir(self.model.source) else self.model.source


def served_models(settings: Settings) -> dict[str, tuple[Settings, float]]:
    """Each model served, by id, in order (the first is the default): its own settings (its table's `model` and
    `engine` fields over the global ones) and its keep_alive. No `[models.*]` table: the one `model` section, as ever.
    Raises `msgspec.ValidationError` naming a table's bad field."""
    if not settings.models:
        return {settings.served_model_name: (settings, settings.router.keep_alive)}
    out = {}
    model_fields, engine_fields = set(ModelSettings.__struct_fields__), set(EngineSettings.__struct_fields__)
    for name, table in settings.models.items():
        unknown = set(table) - model_fields - engine_fields - {"keep_alive"}
        if unknown:
            raise msgspec.ValidationError(f"unknown field(s) {sorted(unknown)} in `models.{name}`")
        try:
            model = msgspec.convert({**msgspec.to_builtins(settings.model), "served_name": name,
                                     **{k: v for k, v in table.items() if k in model_fields}}, ModelSettings, strict=False)
            engine = msgspec.convert({**msgspec.to_builtins(settings.engine),
                                      **{k: v for k, v in table.items() if k in engine_fields}}, EngineSettings, strict=False)
            keep_alive = msgspec.convert(table.get("keep_alive", settings.router.keep_alive), float, strict=False)
        except msgspec.ValidationError as exc:
            raise msgspec.ValidationError(f"{exc} in `models.{name}`") from None
        out[name] = (msgspec.structs.replace(settings, model=model, engine=engine, models={}), keep_alive)
    return out


def model_source_problem(source: str, mmproj: str = "") -> str | None:
    """Why `model.source` (and `model.mmproj`) cannot be loaded, where that shows without loading it: a source
    written as a path (not a Hugging Face id, `org/name`) that is not there, a directory with no config.json, a
    file that is no Gemma-3 GGUF by its first bytes, an mmproj without a GGUF model. None otherwise."""
    if mmproj and not source.endswith(".gguf"):
        return (f"--mmproj goes with a GGUF --model (llama.cpp's model file and its mmproj); {source} carries its "
                "vision tower, if it has one, in its own checkpoint")
    for path, role in ((source, "model"), (mmproj, "mmproj")):
        problem = _file_problem(path, role, source) if path and path != EMBEDDED else None
        if problem:
            return problem
    return None


def _file_problem(source: str, role: str, model: str) -> str | None:
    path = Path(source).expanduser()
    if not path.exists():
        looks_like_a_path = source.startswith(("/", "./", "../", "~")) or source.endswith((".gguf", ".safetensors"))
        kind = "file" if source.endswith((".gguf", ".safetensors")) else "directory"
        return f"no {role} {kind} at {source}" if looks_like_a_path else None
    if path.is_dir() and not (path / "config.json").exists():
        return f"{source} has no config.json: --model takes a Gemma-3 checkpoint directory (config.json, *.safetensors, tokenizer.json)"
    if path.is_file() and (source.endswith(".gguf") or role == "mmproj"):
        from .engine.model.gguf_file import source_problem

        return source_problem(str(path), role, model if role == "mmproj" else "")
    return None


ENV_PREFIX = "OAI_GEMMA_"

SECTIONS: dict[str, type[msgspec.Struct]] = {
    "model": ModelSettings, "engine": EngineSettings, "server": ServerSettings, "images": ImageSettings,
    "lora": LoraSettings, "router": RouterSettings,
}


@functools.cache
def field_docs(section: str) -> dict[str, str]:
    """The docstrings written under a section's fields (read from this file), for `--help` and docs."""
    tree = ast.parse(inspect.getsource(SECTIONS[section]))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        section, _, field = key[len(ENV_PREFIX) :].lower().partition("__")
        # lists and tables come as JSON: OAI_GEMMA_IMAGES__ALLOWED_HOSTS='["images.example.com"]'
        tree.setdefault(section, {})[field] = json.loads(value) if value[:1] in "[{" else value
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def load_settings(
    config_file: str | os.PathLike | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Config file < env vars < overrides (CLI flags). Raises `msgspec.ValidationError` on a bad value."""
    tree: dict[str, Any] = {}
    if config_file:
        with open(config_file, "rb") as f:
            tree = tomllib.load(f)
    env = dict(os.environ if environ is None else environ)
    tree = _merge(tree, _env_overrides(env))
    if env.get("OAI_GEMMA_API_KEYS"):
        tree = _merge(tree, {"server": {"api_keys": [k.strip() for k in env["OAI_GEMMA_API_KEYS"].split(",") if k.strip()]}})
    tree = _merge(tree, overrides or {})
    # env values are strings: strict=False lets msgspec turn "9000" into 9000 and "true" into True
    return msgspec.convert(tree, Settings, strict=False)
