"""PEFT LoRA adapters: where they are (engine/config.py's `LoraModule`, vLLM's `--lora-modules` syntax), read and checked against the
base model (`read_adapter`), and made ready for the runner (`pack`).

A PEFT directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, rank/alpha patterns) and
`adapter_model.safetensors` (`...layers.N.self_attn.q_proj.lora_A.weight` [r, in] and `lora_B.weight` [out, r]).
Each targeted projection then computes base(x) + scale * (x @ A^T) @ B^T, scale = alpha / r (rsLoRA:
alpha / sqrt(r)); the scale is folded into B once here. Only the language model's seven projections are
supported: an adapter that touches anything else (embeddings, lm_head, the vision tower, DoRA, biases,
`modules_to_save`) is refused with the reason, never served half-applied. Each file is read once, and the
adapter's `digest` hashes those very bytes: the prefix cache's key for its KV (engine/cache/prefix_hash.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import LoraModule  # noqa: F401 (an entry of `--lora-modules`: plain configuration, parsed by config.py)
from ..ops.linear import FrozenLinear
from .stack import OWN, Stack, build_stack, compute_dtypes

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections an adapter may target, in engine/model/gemma3.py's LayerWeights names (`q` is `q_proj`)."""
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?P<path>.*\blayers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z]+)_proj)\.lora_(?P<ab>[AB])\.weight$")
_VISION = ("vision_tower", "multi_modal_projector", "vision_model")


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names it and says why."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"LoRA adapter '{name}': {reason}")
        self.name, self.reason = name, reason


@dataclass
class AdapterWeights:
    """An adapter read and checked: per layer, per module, (A [r, in], B [out, r] already times its scale)."""

    name: str
    rank: int
    """The highest rank of its modules."""
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    digest: bytes = b""
    """The content hash of the files it was read from (`_digest`)."""


@dataclass
class AdapterLinears:
    """An adapter made ready for the runner: per layer, per module, (A, B) as the runner's linears in its dtype
    (engine/ops/linear.py: batch-invariant mode calls them as the base's), and stacked on their own per compute dtype
    (`stacks`: the other modes' path, engine/lora/apply.py and stack.py), of which `tensors` (each projection's A
    and B) builds the resident adapters' stack."""

    name: str
    rank: int
    layers: list[dict[str, tuple[FrozenLinear, FrozenLinear]]]
    tensors: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    stacks: dict[torch.dtype, Stack]
    digest: bytes = b""
    """The content hash of the files it was read from: its sequences' prefix-cache key."""

    @property
    def nbytes(self) -> int:
        linears = sum(_bytes(a) + _bytes(b) for layer in self.layers for a, b in layer.values())
        stacks = sum(stack.nbytes for stack in self.stacks.values())
        return linears + stacks + sum(a.nbytes + b.nbytes for layer in self.tensors for a, b in layer.values())


def _bytes(linear) -> int:
    weight = getattr(linear, "weight", None)
    return weight.numel() * weight.element_size() if weight is not None else linear.packed_bytes


def module_shapes(text_config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of the base model."""
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    q, kv = text_config.num_attention_heads * text_config.head_dim, text_config.num_key_value_heads * text_config.head_dim
    return {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden), "gate": (hidden, inter),
            "up": (hidden, inter), "down": (inter, hidden)}


def _digest(*files: bytes) -> bytes:
    """The content hash of an adapter's files (length-prefixed: no two pairs of files hash alike by construction)."""
    digest = hashlib.sha256()
    for data in files:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


def _config(name: str, directory: Path) -> tuple[dict, bytes]:
    """The parsed config and the bytes it was parsed from."""
    if not directory.is_dir():
        raise AdapterError(name, f"no adapter directory at {directory}")
    try:
        data = (directory / CONFIG).read_bytes()
        config = json.loads(data)
    except FileNotFoundError:
        raise AdapterError(name, f"{directory} has no {CONFIG} (a PEFT adapter directory has one)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(name, f"{CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(name, f"{CONFIG} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(name, f"peft_type {config.get('peft_type')!r} is not supported (LoRA only)")
    refused = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save (full copies of "
               f"{config.get('modules_to_save')})", "layer_replication": "layer_replication"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(name, f"{what} is not supported: only the low-rank update of the projections")
    for key in ("lora_alpha", "r"):
        if key in config and not isinstance(config[key], (int, float)):
            raise AdapterError(name, f"{CONFIG}: {key} must be a number")
    return config, data


def _tensors(name: str, directory: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors and the bytes they were read from."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = directory / WEIGHTS
    if not path.exists():
        bin_file = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" if (directory / "adapter_model.bin").exists() else ""
        raise AdapterError(name, f"{directory} has no {WEIGHTS}{bin_file}")
    try:
        data = path.read_bytes()
        return load(data), data
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(name, f"{WEIGHTS} is corrupt or unreadable: {exc}") from None


def _pattern(patterns: dict, path: str, default):
    """PEFT's rank/alpha patterns: the first key that matches the end of the module's path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", path):
            return value
    return default


def _refusal(key: str) -> str:
    if any(part in key for part in _VISION):
        return f"it targets the vision tower ({key}): adapters apply to the language model only"
    if "embed" in key or "lm_head" in key:
        return f"it targets the embeddings or the lm_head ({key}): only the attention and MLP projections are supported"
    return f"unsupported tensor {key}: only q/k/v/o/gate/up/down projections' lora_A and lora_B are supported"


def read_adapter(name: str, path: str | Path, text_config, max_rank: int) -> AdapterWeights:
    """The adapter at `path`, checked against the base model's shapes and `max_rank`; AdapterError otherwise."""
    directory = Path(path).expanduser()
    config, config_data = _config(name, directory)
    tensors, tensor_data = _tensors(name, directory)
    shapes, num_layers = module_shapes(text_config), text_config.num_hidden_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or any(part in key for part in _VISION) or match["module"] not in MODULES:
            raise AdapterError(name, _refusal(key))
        layer = int(match["layer"])
        if layer >= num_layers:
            raise AdapterError(name, f"{key}: layer {layer}, but the base model has {num_layers} layers (another base model?)")
        pairs.setdefault((layer, match["module"]), {})[match["ab"]] = tensor
        paths[(layer, match["module"])] = match["path"]
    if not pairs:
        raise AdapterError(name, f"{WEIGHTS} holds no lora_A/lora_B weights")
    weights = AdapterWeights(name, 0, [{} for _ in range(num_layers)], _digest(config_data, tensor_data))
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}_proj"
        if set(ab) != {"A", "B"}:
            raise AdapterError(name, f"{where} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        features_in, features_out = shapes[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != features_in or b.shape != (features_out, rank):
            raise AdapterError(name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this base model's "
                               f"[r, {features_in}] and [{features_out}, r] (an adapter of another base model?)")
        if rank > max_rank:
            raise AdapterError(name, f"rank {rank} ({where}) is above the maximum, {max_rank} (--max-lora-rank)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(name, f"{where} holds NaN or infinite values")
        alpha = _pattern(config.get("alpha_pattern"), paths[(layer, module)], config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights.layers[layer][module] = (a.contiguous(), (b * scale).contiguous())
        weights.rank = max(weights.rank, rank)
    return weights


def pack(weights: AdapterWeights, dtype: torch.dtype, device: torch.device) -> AdapterLinears:
    """The adapter on the runner's device, as linears like the base's in its dtype (oneDNN-packed on a CPU) and
    stacked in each dtype it computes in (engine/lora/stack.py `compute_dtypes`): never quantized, whatever the base
    is."""
    tensors = [{module: (a.to(device), b.to(device)) for module, (a, b) in layer.items()} for layer in weights.layers]
    return AdapterLinears(weights.name, weights.rank, [
        {module: (FrozenLinear(a.to(dtype)), FrozenLinear(b.to(dtype))) for module, (a, b) in layer.items()} for layer in tensors
    ], tensors, {each: build_stack({OWN: (weights.rank, tensors)}, len(tensors), each) for each in compute_dtypes(dtype, device)},
        weights.digest)
