"""The engine's configuration: every setting it runs with, each `auto` decided, in one frozen object.

`resolve(settings, loaded)` is the one place that turns the settings tree (and the loaded model's facts: device,
dtype, shapes) into an `EngineConfig`; `Engine`, `EngineCore` and `ModelRunner` are built from that object and
each reads the fields it needs. It is logged once at start-up and served by `/health` and `/v1/server_info`, so a
user sees what `auto` became. New capabilities (speculative decoding, adapters) add their fields here, not new
arguments down three constructors. Settings this machine cannot honour (an explicit `int8` without the native
kernel, batch-invariant `on` off the CPU path) raise `ConfigError` here, before the engine is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..cpu import compute_thread_count
from ..settings import Settings
from .cache.memory import blocks_within_budget
from .lora.adapter import LoraModule, parse_module
from .ops import native
from .shape import TextShape
from .model.mapped import checkpoint_files
from .ops.quantized import FORMAT, NativeQ8Linear, linear_for, resolve as resolve_quantization

if TYPE_CHECKING:
    from .model.loader import LoadedModel

log = logging.getLogger("oai_gemma.engine")


class ConfigError(ValueError):
    """A setting this machine cannot honour: a start-up error (the server exits non-zero)."""


@dataclass(frozen=True)
class EngineConfig:
    """Defaults suit an engine built by hand (tests, benchmarks) on a CPU; the server's comes from `resolve`."""

    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "none"
    """`model.quantization` as resolved: `none`, `int8`, `int4`, `per-step`, `q8` or `q4` (never `auto`)."""
    quantized_weights: Path | None = None
    """The file quantized weights are kept in between starts (None: quantized at every start, or not at all)."""
    static_decode: bool = False
    """Decode-only steps at static shapes, CUDA graphs where possible (engine/model/static_decode.py)."""
    compile: bool = False
    """torch.compile the static decode's layer functions."""
    batch_invariant: str = "auto"
    """`engine.batch_invariant`: `off`, `on`, or `auto` (on where the runner's start-up check on its own weights
    finds it cheap; what it found is `ModelRunner.batch_invariant`). Off the CPU path `resolve` makes it `off`."""
    max_num_seqs: int = 32
    """Batch rows: sequences decoded together, also the most choices (`n`) one request may ask for."""
    max_model_len: int = 8192
    max_prefill_tokens: int = 512
    image_tokens: int = 0
    """Tokens of one image (multimodal models): a prefill chunk is never cut inside one, so it may be this long."""
    kv_blocks: int = 0
    """KV cache blocks (16 tokens each); 0: room for max_num_seqs sequences of max_model_len."""
    prefix_caching: bool = True
    max_waiting: int = 256
    request_timeout: float = 0.0
    """Seconds from arrival to the last token; 0 means no limit."""
    idle_timeout: float = 0.0
    """Longest wait for a request's next event (queue included); 0 means no limit."""
    max_backlog: int = 0
    """Events a request's consumer may fall behind before the request is cancelled (Submission); 0: no limit."""
    threads: int = 0
    """Torch compute threads of the engine thread (0: torch's default)."""
    cache_dir: Path | None = None
    """The model cache (`model.cache_dir`, default `$OAI_GEMMA_CACHE` or ~/.cache/oai-gemma)."""
    native_dir: Path | None = None
    """Where the native int8 kernel is compiled and kept (None: the default cache's `native`)."""
    lora_modules: tuple[LoraModule, ...] = ()
    """The LoRA adapters served from the start (`lora.modules`, parsed), read and checked when the engine is built."""
    max_loras: int = 8
    """Adapters resident at once (engine/lora/registry.py)."""
    max_lora_rank: int = 64
    lora_runtime_loading: bool = False
    """Adapters may be loaded and unloaded while serving (`lora.runtime_loading`)."""

    speculative: str = "ngram"
    """`engine.speculative` as resolved: `ngram` (drafts from prompt lookup and Predicted Outputs) or `off`
    (`auto` is `ngram` on the dynamic path, `off` with static decode: a drafted step runs dynamic)."""
    speculative_k: int = 32
    """Most draft tokens one sequence carries into a step."""
    speculative_budget: int = 32
    """Most decode tokens (each row's own and the drafts) a step carries while it adds drafts."""
    speculative_ngram_max: int = 4
    speculative_ngram_min: int = 2
    """Prompt lookup's longest n-gram and its minimum match (also the Predicted Output's realignment)."""

    @property
    def lora_enabled(self) -> bool:
        """Adapters are served: the engine keeps a registry (without it, no step pays anything for LoRA)."""
        return bool(self.lora_modules) or self.lora_runtime_loading

    @property
    def max_logits_rows(self) -> int:
        """A step's most logits rows: one per sequence, and one per draft token (engine/speculative/planner.py)."""
        return max(self.max_num_seqs, self.speculative_budget if self.speculative != "off" else 0)

    @property
    def max_tokens_per_step(self) -> int:
        """A step's most tokens: one prefill chunk (or one whole image) and every row's decode token and drafts."""
        return max(self.max_prefill_tokens, self.image_tokens) + self.max_logits_rows

    def as_dict(self) -> dict[str, object]:
        """Plain data (paths as strings), as the start-up log and `/v1/server_info` show it."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


def resolve(settings: Settings, loaded: LoadedModel) -> EngineConfig:
    """Settings + the loaded model's facts -> the engine's configuration, every `auto` decided; raises
    ConfigError for a setting this machine cannot honour."""
    model, engine = settings.model, settings.engine
    device, dtype = loaded.device, loaded.dtype
    static = device.type == "cuda"
    cache_dir = model.cache_path
    native_dir = cache_dir / "native"
    quantization = _quantization(model.quantization, dtype, device, native_dir)
    config = getattr(loaded.model, "config", None)
    return EngineConfig(
        device=str(device), dtype=str(dtype).removeprefix("torch."), quantization=quantization,
        quantized_weights=None if quantization == "none" or model.load_format == "dummy" else _quantized_file(
            cache_dir, loaded.source_dir, quantization, dtype
        ),
        static_decode=static, compile=model.compile == "on" or (model.compile == "auto" and static),
        batch_invariant=_batch_invariant(engine.batch_invariant, device),
        max_num_seqs=engine.max_num_seqs, max_model_len=model.max_model_len, max_prefill_tokens=engine.max_prefill_tokens,
        image_tokens=getattr(config, "mm_tokens_per_image", 0) or 0,
        kv_blocks=blocks_within_budget(TextShape.of(loaded.text_config), dtype, engine.max_num_seqs, model.max_model_len, engine.kv_cache_gib),
        prefix_caching=engine.prefix_caching, max_waiting=engine.max_waiting,
        request_timeout=settings.server.request_timeout, idle_timeout=settings.server.idle_timeout,
        max_backlog=settings.server.max_stream_backlog,
        threads=compute_thread_count(), cache_dir=cache_dir, native_dir=native_dir,
        **_lora(settings, static),
        speculative="off" if engine.speculative == "off" or (engine.speculative == "auto" and static) else "ngram",
        speculative_k=engine.speculative_k, speculative_budget=engine.speculative_budget,
        speculative_ngram_max=engine.speculative_ngram_max,
        speculative_ngram_min=min(engine.speculative_ngram_min, engine.speculative_ngram_max),
    )


def _quantization(setting: str, dtype: torch.dtype, device: torch.device, native_dir: Path) -> str:
    """`model.quantization` resolved. On a CPU the native kernel (engine/ops/native) is built here, into the
    configured cache: float32's int8 and bf16's per-step run it; where it cannot be, `auto` says why and what it
    costs, and `int8` in float32 or `per-step` is a start-up error (PyTorch's own int8 kernels are slower than
    float32 there: no point to it)."""
    why = native.build(native_dir) if device.type == "cpu" else None
    dot_why = (why or native.int_dot_unavailable()) if device.type == "cpu" and setting in ("q8", "q4") else None
    if dot_why:
        raise ConfigError(f"model.quantization = \"{setting}\" needs the native integer dot-product kernels, which "
                          f"cannot run here: {dot_why}. Use quantization auto, int8 or none, or fix the cause.")
    if why and (setting == "per-step" or (setting == "int8" and dtype == torch.float32)):
        raise ConfigError(
            f"model.quantization = \"{setting}\" needs the native int8 kernel, which cannot run here: {why}. "
            "Use quantization auto or none, or fix the cause."
        )
    if why and setting == "auto" and dtype == torch.bfloat16:
        log.warning("model.quantization = auto resolves to none: per-step needs the native int8 kernel, which cannot "
                    "run here (%s); one stream then reads bf16 weights, twice int8's bytes", why)
    elif why and setting == "auto" and dtype == torch.float32:
        log.warning(
            "model.quantization = auto resolves to none: the native int8 kernel cannot run here (%s). Decode then "
            "streams float32 weights, 4x the bytes: the projections of a one-row decode step took 17.8 ms instead "
            "of 3.1 (docs/engine.md, \"Weight-only quantized weights\")", why,
        )
    return resolve_quantization(setting, dtype, device)


def _lora(settings: Settings, static: bool) -> dict[str, object]:
    """The adapters' fields: `lora.modules` parsed (a bad entry or a name given twice is a start-up error); adapters
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
    return {"lora_modules": modules, "max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank,
            "lora_runtime_loading": lora.runtime_loading}


def _batch_invariant(setting: str, device: torch.device) -> str:
    """Batch-invariant mode is implemented for the CPU path only."""
    if device.type == "cpu" or setting == "off":
        return setting
    if setting == "on":
        raise ConfigError("engine.batch_invariant = \"on\" is implemented for the CPU path only; use auto or off")
    return "off"


def _quantized_file(cache_dir: Path, source_dir: str, quantization: str, dtype: torch.dtype) -> Path:
    """Quantized weights kept between starts, named by the model (its path, and its weight files' sizes and times: a
    checkpoint written again in place is quantized again), the setting, the dtype, torch's version (its int4 layout
    is torch's own) and the stored layout's version."""
    model = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(Path(source_dir).resolve()).strip("/"))
    model += f"-{_files_stamp(Path(source_dir))}"
    name = f"{model}-{quantization}-{str(dtype).removeprefix('torch.')}-torch{torch.__version__}-f{FORMAT}{'q8' if linear_for(quantization, 'lm_head', dtype) is NativeQ8Linear else ''}.safetensors"
    return cache_dir / "quantized" / name


def _files_stamp(source: Path) -> str:
    """A short digest of the checkpoint's weight files' sizes and modification times ("unread" where they cannot be)."""
    try:
        stats = [(path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in checkpoint_files(source)]
    except (OSError, ValueError):
        return "unread"
    return hashlib.sha256(repr(stats).encode()).hexdigest()[:12]
