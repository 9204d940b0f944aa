"""The engine's configuration: every setting it runs with, each `auto` decided, in one frozen object of frozen parts.

`resolve(settings, machine)` is the one place that turns the settings tree and what start-up found on this machine
and in the loaded model (`Machine`: device, dtype, the model's shape, whether the native kernel runs; filled by
engine/factory.py's `probe`, the one step that builds or measures anything) into an `EngineConfig`. As vLLM's
VllmConfig, it holds one frozen sub-config per reader: `model` (device, dtype, weight layout, decode path, context
length: engine/model/), `cache` (KV blocks, prefix caching), `scheduler` (batch rows, prefill chunk, waiting line),
`speculative` (drafting), `lora` (adapters) and `server` (a request's timeouts and backlog, enforced by the facade).
`Engine`, `EngineCore` and `ModelRunner` are built from the whole; a room that needs one part gets that part (the
speculator its `SpeculativeConfig`, `load_weights` the `ModelConfig`). It is logged once at start-up and served by
`/health` and `/v1/server_info` as one flat object (`as_dict`), so a user sees what `auto` became. New capabilities
add their fields to a sub-config here, not new arguments down three constructors. Settings this
machine cannot honour (an explicit `int8` without the native kernel, batch-invariant `on` off the CPU path, a KV
budget that cannot hold one sequence) raise `ConfigError` here, before the engine is built.

Pure: it imports nothing of the engine's rooms (ops/, cache/, lora/, model/; tests/deploy/test_lint.py), compiles and
measures nothing, and reads no file: the rooms import it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..settings import INT_DOT_QUANTIZATIONS, Settings

if TYPE_CHECKING:
    from .shape import TextShape

log = logging.getLogger("oai_gemma.engine")


class ConfigError(ValueError):
    """A setting this machine cannot honour: a start-up error (the server exits non-zero)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapter to serve: its name (a request's `model`), its PEFT directory, the base it was made for."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_module(spec: str) -> LoraModule:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError otherwise."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            value = json.loads(spec)
            module = LoraModule(str(value["name"]), str(value["path"]), value.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad --lora-modules entry {spec!r}: a JSON object needs \"name\" and \"path\" ({exc})") from None
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"bad --lora-modules entry {spec!r}: expected name=path or a JSON object")
        module = LoraModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"bad --lora-modules entry {spec!r}: the name and the path must not be empty")
    return module


@dataclass(frozen=True)
class Machine:
    """What start-up found on this machine and in the loaded model (engine/factory.py's `probe`, its one step that
    builds or measures anything), as plain facts for `resolve`."""

    shape: TextShape
    """The text model's dimensions: the KV budget's arithmetic."""
    device: str = "cpu"
    dtype: str = "float32"
    kv_bytes_per_token: int = 0
    """Every layer's K and V of one position in the KV cache's dtype (engine/cache/kv_cache.py)."""
    kv_block_size: int = 16
    image_tokens: int = 0
    """Tokens of one image (multimodal models), 0 for a text-only model."""
    native_missing: str | None = None
    """Why the native int8 kernel (engine/ops/native) cannot run here, built into `native_dir`; None: it runs."""
    native_dir: Path | None = None
    int_dot_missing: str | None = None
    """Why the integer dot-product kernels (`model.quantization` q8, q4, q4-mix) cannot run here; None: they run."""
    kernel_isa: str = "none"
    """The native kernels' instruction set (`avx512-vnni`, `avx512`, `avx2-vnni`, `avx2`, `none`)."""
    threads: int = 0
    """Torch compute threads of the engine thread."""
    weights_name: str = "model"
    """The checkpoint as a quantized-weights file names it (its path, its weight files' sizes and times: a checkpoint
    written again in place is quantized again)."""
    quantized_layouts: dict[str, str] = field(default_factory=dict)
    """Per `model.quantization` value, the stored layout's tag (torch's version, the format, the lm_head's kind):
    part of the file's name, so a layout that changed is quantized again."""


@dataclass(frozen=True)
class ModelConfig:
    """What runs the model and how: device, dtypes, weight layout, decode path (read by engine/model/)."""

    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "none"
    """`model.quantization` as resolved: `none`, `int8`, `int4`, `per-step`, `q8`, `q4` or `q4-mix` (never `auto`)."""
    quantized_weights: Path | None = None
    """The file quantized weights are kept in between starts (None: quantized at every start, or not at all)."""
    static_decode: bool = False
    """Decode-only steps at static shapes, CUDA graphs where possible (engine/model/static_decode.py)."""
    compile: bool = False
    """torch.compile the static decode's layer functions."""
    batch_invariant: str = "auto"
    """`engine.batch_invariant`: `off`, `on`, or `auto` (on where the start-up check on the weights finds it cheap:
    engine/model/invariance_check.py's `measure_invariance`, which engine/factory.py runs on the weights before the
    runner is built, leaving `on` or `off` here; an engine built by hand with `auto` has `ModelRunner.of` decide).
    Off the CPU path `resolve` makes it `off`."""
    max_model_len: int = 8192
    image_tokens: int = 0
    """Tokens of one image (multimodal models): a prefill chunk is never cut inside one, so it may be this long."""
    threads: int = 0
    """Torch compute threads of the engine thread (0: torch's default)."""
    cache_dir: Path | None = None
    """The model cache (`model.cache_dir`, default `$OAI_GEMMA_CACHE` or ~/.cache/oai-gemma)."""
    native_dir: Path | None = None
    """Where the native int8 kernel is compiled and kept (None: the default cache's `native`)."""


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache (engine/cache/): its size and whether full blocks are shared between requests."""

    kv_blocks: int = 0
    """KV cache blocks (16 tokens each); 0: room for max_num_seqs sequences of max_model_len."""
    prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """What a step may hold and how many may wait (engine/scheduler.py, engine/encoding.py, admission)."""

    max_num_seqs: int = 32
    """Batch rows: sequences decoded together, also the most choices (`n`) one request may ask for."""
    max_prefill_tokens: int = 512
    max_waiting: int = 256
    """Requests that may wait beyond the batch rows before admission refuses (the facade's capacity)."""
    vision_step_seconds: float = 0.0
    """An image encode's time budget per engine step (engine/encoding.py); 0: auto."""
    image_prefill_units: bool = False
    """An image's prefill chunk as units between steps, under the encode's budget (engine/prefilling.py)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Drafting (engine/speculative/planner.py)."""

    method: str = "ngram"
    """`engine.speculative` as resolved: `ngram` (drafts from prompt lookup and Predicted Outputs) or `off`
    (`auto` is `ngram` on the dynamic path, `off` with static decode: a drafted step runs dynamic)."""
    k: int = 32
    """Most draft tokens one sequence carries into a step."""
    budget: int = 32
    """Most decode tokens (each row's own and the drafts) a step carries while it adds drafts."""
    ngram_max: int = 4
    ngram_min: int = 2
    """Prompt lookup's longest n-gram and its minimum match (also the Predicted Output's realignment)."""

    @property
    def on(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters served (engine/lora/)."""

    modules: tuple[LoraModule, ...] = ()
    """The LoRA adapters served from the start (`lora.modules`, parsed), read and checked when the engine is built."""
    max_loras: int = 8
    """Adapters resident at once (engine/lora/registry.py)."""
    max_lora_rank: int = 64
    runtime_loading: bool = False
    """Adapters may be loaded and unloaded while serving (`lora.runtime_loading`)."""

    @property
    def enabled(self) -> bool:
        """Adapters are served: the engine keeps a registry (without it, no step pays anything for LoRA)."""
        return bool(self.modules) or self.runtime_loading


@dataclass(frozen=True)
class ServerConfig:
    """A request's limits as the facade enforces them (engine/engine.py, engine/submission.py)."""

    request_timeout: float = 0.0
    """Seconds from arrival to the last token; 0 means no limit."""
    idle_timeout: float = 0.0
    """Longest wait for a request's next event (queue included); 0 means no limit."""
    max_backlog: int = 0
    """Events a request's consumer may fall behind before the request is cancelled (Submission); 0: no limit."""


SERVED_NAMES = {
    ("lora", "modules"): "lora_modules", ("lora", "runtime_loading"): "lora_runtime_loading",
    ("speculative", "method"): "speculative", ("speculative", "k"): "speculative_k",
    ("speculative", "budget"): "speculative_budget", ("speculative", "ngram_max"): "speculative_ngram_max",
    ("speculative", "ngram_min"): "speculative_ngram_min",
}
"""The flat keys `/health` and `/v1/server_info` serve (README) where a sub-config's field name is not the key itself."""


@dataclass(frozen=True)
class EngineConfig:
    """The sub-configs, one per room that reads it (as vLLM's VllmConfig). Defaults suit an engine built by hand
    (tests, benchmarks) on a CPU; the server's comes from `resolve`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @property
    def max_logits_rows(self) -> int:
        """A step's most logits rows: one per sequence, and one per draft token (engine/speculative/planner.py)."""
        return max(self.scheduler.max_num_seqs, self.speculative.budget if self.speculative.on else 0)

    @property
    def max_tokens_per_step(self) -> int:
        """A step's most tokens: one prefill chunk (or one whole image) and every row's decode token and drafts."""
        return max(self.scheduler.max_prefill_tokens, self.model.image_tokens) + self.max_logits_rows

    def as_dict(self) -> dict[str, object]:
        """Plain flat data (paths as strings), as the start-up log and `/v1/server_info` show it: each sub-config's
        fields under their own names, or `SERVED_NAMES`'."""
        return {SERVED_NAMES.get((part.name, name), name): str(value) if isinstance(value, Path) else value
                for part in dataclasses.fields(self)
                for name, value in dataclasses.asdict(getattr(self, part.name)).items()}


def resolve(settings: Settings, machine: Machine) -> EngineConfig:
    """Settings + what start-up found (`Machine`) -> the engine's configuration, every `auto` decided; raises
    ConfigError for a setting this machine cannot honour."""
    model, engine = settings.model, settings.engine
    static = machine.device.startswith("cuda")
    cache_dir = model.cache_path
    quantization = _quantization(model.quantization, machine)
    return EngineConfig(
        model=ModelConfig(
            device=machine.device, dtype=machine.dtype, quantization=quantization,
            quantized_weights=None if quantization == "none" or model.load_format == "dummy" else (
                cache_dir / "quantized" / f"{machine.weights_name}-{quantization}-{machine.dtype}-{machine.quantized_layouts[quantization]}.safetensors"
            ),
            static_decode=static, compile=model.compile == "on" or (model.compile == "auto" and static),
            batch_invariant=_batch_invariant(engine.batch_invariant, machine.device),
            max_model_len=model.max_model_len, image_tokens=machine.image_tokens,
            threads=machine.threads, cache_dir=cache_dir, native_dir=machine.native_dir,
        ),
        cache=CacheConfig(kv_blocks=kv_blocks(machine, engine.max_num_seqs, model.max_model_len, engine.kv_cache_gib),
                          prefix_caching=engine.prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=engine.max_num_seqs, max_prefill_tokens=engine.max_prefill_tokens,
                                  max_waiting=engine.max_waiting, vision_step_seconds=engine.vision_step_ms / 1e3,
                                  image_prefill_units=engine.image_prefill_units),
        speculative=SpeculativeConfig(
            method="off" if engine.speculative == "off" or (engine.speculative == "auto" and static) else "ngram",
            k=engine.speculative_k, budget=engine.speculative_budget, ngram_max=engine.speculative_ngram_max,
            ngram_min=min(engine.speculative_ngram_min, engine.speculative_ngram_max),
        ),
        lora=_lora(settings, static),
        server=ServerConfig(request_timeout=settings.server.request_timeout, idle_timeout=settings.server.idle_timeout,
                            max_backlog=settings.server.max_stream_backlog),
    )


FOUR_BIT = "q4-mix"
"""What `auto` is on a CPU (float32 or bf16) for a model of hidden size FOUR_BIT_HIDDEN or more, where the integer
dot-product kernels run (docs/engine.md, "Quality at the 1B shape"; bf16 CPUs: docs/benchmarks.md, 2026-12-07, the
1B at 1.2 GB ready against per-step's 1.6 GB)."""
BF16_SMALL = "q8"
"""What `auto` is on a bf16 CPU below FOUR_BIT_HIDDEN where the integer dot-product kernels run: int8 weights times
int8 activations in blocks of 32 (VNNI), every row through the kernel (+0.91% perplexity against per-step's +0.52%).
Measured on the AVX512-bf16 EPYC, 270M, batch-invariant mode on (docs/benchmarks.md, 2026-12-07 13:43): the shared
prompt set 203 / 185 tok/s at 8 / 32 streams against per-step's 166 / 162 (per-step runs a long prompt's rows
through the dequantized matmul in that mode, every weight dequantized for a few uncached rows), the short set alike."""
FOUR_BIT_HIDDEN = 1152
"""gemma-3-1b's hidden size. The 270m (640) keeps int8: 4-bit projections cost it +21% perplexity."""


def _quantization(setting: str, machine: Machine) -> str:
    """`model.quantization` resolved. On a CPU float32's int8 and bf16's per-step run the native kernel; where it
    cannot (`machine.native_missing`), `auto` says why and what it costs, and `int8` in float32 or `per-step` is a
    start-up error (PyTorch's own int8 kernels are slower than float32 there: no point to it). `auto` where the
    kernel runs on a CPU: `FOUR_BIT` for models of hidden size FOUR_BIT_HIDDEN and more where the integer
    dot-product kernels run (`four_bit_by_size`), else in float32 `int8` (faster at 1, 8 and 32 streams, +0.5%
    perplexity; docs/engine.md) and in bf16 `BF16_SMALL` (`per-step`, one int8 copy with bf16 in and out, where the
    integer dot-product kernels cannot run); else none (a GPU has no quantized path)."""
    why, dtype = machine.native_missing if machine.device == "cpu" else None, machine.dtype
    dot_why = machine.int_dot_missing if machine.device == "cpu" and setting in INT_DOT_QUANTIZATIONS else None
    if dot_why:
        raise ConfigError(f"model.quantization = \"{setting}\" needs the native integer dot-product kernels, which "
                          f"cannot run here: {dot_why}. Use quantization auto, int8 or none, or fix the cause.")
    if why and (setting == "per-step" or (setting == "int8" and dtype == "float32")):
        raise ConfigError(
            f"model.quantization = \"{setting}\" needs the native int8 kernel, which cannot run here: {why}. "
            "Use quantization auto or none, or fix the cause."
        )
    if why and setting == "auto" and dtype == "bfloat16":
        log.warning("model.quantization = auto resolves to none: per-step needs the native int8 kernel, which cannot "
                    "run here (%s); one stream then reads bf16 weights, twice int8's bytes", why)
    elif why and setting == "auto" and dtype == "float32":
        log.warning(
            "model.quantization = auto resolves to none: the native int8 kernel cannot run here (%s). Decode then "
            "streams float32 weights, 4x the bytes: the projections of a one-row decode step took 17.8 ms instead "
            "of 3.1 (docs/engine.md, \"Weight-only quantized weights\")", why,
        )
    if setting != "auto":
        return setting
    if machine.device != "cpu" or machine.native_missing is not None:
        return "none"
    if dtype in ("float32", "bfloat16") and machine.int_dot_missing is None and four_bit_by_size(machine.shape):
        log.info("model.quantization = auto resolves to %s: a CPU with the integer dot-product kernels and a model of "
                 "hidden size %d >= %d (gemma-3-1b and larger; smaller ones take %s)", FOUR_BIT, machine.shape.hidden,
                 FOUR_BIT_HIDDEN, "int8" if dtype == "float32" else BF16_SMALL)
        return FOUR_BIT
    if dtype == "bfloat16" and machine.int_dot_missing is None:
        return BF16_SMALL
    return {"float32": "int8", "bfloat16": "per-step"}.get(dtype, "none")


def four_bit_by_size(shape: TextShape | None) -> bool:
    """Whether `auto` takes the 4-bit layout in float32: a text hidden size of at least FOUR_BIT_HIDDEN."""
    return shape is not None and shape.hidden >= FOUR_BIT_HIDDEN


def kv_blocks(machine: Machine, max_num_seqs: int, max_model_len: int, kv_cache_gib: float) -> int:
    """KV blocks in `kv_cache_gib` (0: what a ring-buffer cache of max_num_seqs sequences of max_model_len would
    take, where sliding layers keep only their window: the budget this engine had before it was paged). They
    must hold at least one sequence of max_model_len (the default budget is raised to that)."""
    per_token, size, shape = machine.kv_bytes_per_token, machine.kv_block_size, machine.shape
    least = -(-max_model_len // size)
    per_layer = per_token // shape.layers
    ring = sum(per_layer * (min(shape.sliding_window, max_model_len) if sliding else max_model_len) for sliding in shape.sliding)
    budget = kv_cache_gib * 2**30 or max(max_num_seqs * ring, least * size * per_token)
    blocks = int(budget // (per_token * size))
    if blocks < least:
        raise ConfigError(
            f"kv_cache_gib={kv_cache_gib} cannot hold one sequence of max_model_len={max_model_len} "
            f"({least * size * per_token / 2**30:.3f} GiB); raise it or lower max_model_len"
        )
    return blocks


def _lora(settings: Settings, static: bool) -> LoRAConfig:
    """The adapters' configuration: `lora.modules` parsed (a bad entry or a name given twice is a start-up error); adapters
    are implemented on the dynamic (CPU) path only."""
    lora = settings.lora
    try:
        modules = tuple(parse_module(spec) for spec in lora.modules)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    names = [m.name for m in modules]
    if len(set(names)) < len(names):
        raise ConfigError(f"--lora-modules names an adapter twice: {sorted({n for n in names if names.count(n) > 1})}")
    if settings.served_model_name in names:
        raise ConfigError(f"--lora-modules: the adapter name '{settings.served_model_name}' is the base model's")
    if static and (modules or lora.runtime_loading):
        raise ConfigError("LoRA adapters are implemented on the dynamic (CPU) path; the GPU's static decode does not apply "
                          "them yet: serve adapters on a CPU, or without --lora-modules / --lora-runtime-loading")
    return LoRAConfig(modules, lora.max_loras, lora.max_lora_rank, lora.runtime_loading)


def _batch_invariant(setting: str, device: str) -> str:
    """Batch-invariant mode is implemented for the CPU path only."""
    if device == "cpu" or setting == "off":
        return setting
    if setting == "on":
        raise ConfigError("engine.batch_invariant = \"on\" is implemented for the CPU path only; use auto or off")
    return "off"
