"""Gemma-3's text decoder as plain modules, built straight from config.json and safetensors: no transformers.

The runner (engine/model/runner.py) owns the forward pass; from the model it takes only the module tree's weights,
the scaled token embedding, the final norm, the rotary tables and the config. Importing transformers, its Gemma-3
modeling code and running `from_pretrained` cost ~2.7 s of a warm start that must fit in 8 s (issue 27); this
costs a few hundred ms. The tree has transformers' names and math (`Gemma3ForCausalLM`: `model.layers[i].self_attn.
q_proj`, ...), so the runner, the mapped embedding and the quantized-weights cache treat both alike; tests hold it
to transformers' tree (same tensors, same logits through the engine).

Only a checkpoint these modules fully understand is built here (engine/model/lean_config.py says which: a Gemma-3's
config.json, text-only or multimodal (the vision tower: engine/model/lean_vision.py), default or linear rope,
safetensors on a local disk, for the CPU); anything else (other rope types, a hub id, a GPU, `device_map`, dummy
weights) loads through transformers as before.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .lean_config import MultimodalConfig, TextConfig, model_config
from .mapped import DTYPES, checkpoint_files, read_header



def text_config(source: str) -> tuple[TextConfig | None, str]:
    """(the config as attributes, "") when `source` is a text-only checkpoint this module builds, else (None, why
    not); engine/model/lean_config.py reads it (`model_config` also reads a multimodal one)."""
    return model_config(source, multimodal=False)


class Linear(nn.Module):
    """A projection without bias (nn.Linear's forward; its random initialisation skipped: the checkpoint fills it)."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: in float32, times (1 + weight), cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class ScaledEmbedding(nn.Module):
    """transformers' Gemma3TextScaledWordEmbedding: rows times sqrt(hidden_size), in the weight's dtype."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, device="meta"), requires_grad=False)
        self.embed_scale = nn.Buffer(torch.tensor(hidden**0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) * self.embed_scale.to(self.weight.dtype)


class Rotary(nn.Module):
    """transformers' Gemma3RotaryEmbedding for default and linear rope: cos and sin per layer type (`forward(x,
    positions, layer_type)`), from each type's rope_theta; linear scaling divides the frequencies by its factor
    (the 4B's global layers: 8). `rope_parameters`: per layer kind the model uses, {"rope_type", "rope_theta"[,
    "factor"]}."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, dict]):
        super().__init__()
        for kind, rope in rope_parameters.items():
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            if rope["rope_type"] == "linear":
                inv_freq = inv_freq / rope["factor"]
            setattr(self, f"{kind}_inv_freq", nn.Buffer(inv_freq, persistent=False))

    @classmethod
    def of_config(cls, config) -> Rotary:
        """The tables of a text config (lean_config.py's TextConfig or transformers'): its layers' kinds."""
        return cls(config.head_dim, {kind: config.rope_parameters[kind] for kind in set(config.layer_types)})

    @classmethod
    def of(cls, shape) -> Rotary:
        """The tables of an engine/shape.py TextShape (its `rope`: theta and linear factor per layer kind)."""
        return cls(shape.head_dim, {kind: {"rope_type": "linear" if factor != 1.0 else "default", "rope_theta": theta,
                                           "factor": factor} for kind, (theta, factor) in shape.rope.items()})

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _layer(c: TextConfig) -> nn.Module:
    attention, mlp, layer = nn.Module(), nn.Module(), nn.Module()
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention.q_proj, attention.k_proj = Linear(c.hidden_size, q), Linear(c.hidden_size, kv)
    attention.v_proj, attention.o_proj = Linear(c.hidden_size, kv), Linear(q, c.hidden_size)
    attention.q_norm, attention.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)
    mlp.gate_proj, mlp.up_proj = Linear(c.hidden_size, c.intermediate_size), Linear(c.hidden_size, c.intermediate_size)
    mlp.down_proj = Linear(c.intermediate_size, c.hidden_size)
    layer.self_attn, layer.mlp = attention, mlp
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        setattr(layer, name, RMSNorm(c.hidden_size, c.rms_norm_eps))
    return layer


def text_model(config: TextConfig) -> nn.Module:
    """`Gemma3TextModel`'s tree (`embed_tokens`, `layers`, `norm`, `rotary_emb`, `config`), weights on meta."""
    text = nn.Module()
    text.config = config
    text.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
    text.layers = nn.ModuleList(_layer(config) for _ in range(config.num_hidden_layers))
    text.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    text.rotary_emb = Rotary.of_config(config)
    return text


def build(config: TextConfig, source: str, dtype: torch.dtype) -> nn.Module:
    """The text-only model (`Gemma3ForCausalLM`'s tree: `.model`, `.lm_head`, `.config`) with the checkpoint's
    weights in `dtype` (a multimodal one: engine/model/lean_vision.py's `build_multimodal`). Tensors stored in
    `dtype` stay views into the file's private map, as transformers leaves them."""
    model = nn.Module()
    model.model, model.config = text_model(config), config
    model.lm_head = Linear(config.hidden_size, config.vocab_size)
    fill(model, read_checkpoint(Path(source)), source, dtype, config.tie_word_embeddings)
    if model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def shell(config: TextConfig | MultimodalConfig) -> nn.Module:
    """A model without its weights (`.config` only, text-only or multimodal): the loader's `stream` path, whose
    weights engine/model/streamed.py reads from the checkpoint straight into the project's containers."""
    model = nn.Module()
    model.config = config
    return model.eval()


def fill(model: nn.Module, tensors: dict[str, torch.Tensor], source: str, dtype: torch.dtype, tied: bool) -> None:
    """Put the checkpoint's `tensors` (under the model's parameter names) into `model`, cast to `dtype`: exactly
    the model's parameters (but a tied lm_head), each in its shape, or a ValueError naming what differs."""
    expected = {name for name, _ in model.named_parameters()}
    if tied:
        expected.discard("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    if set(tensors) != expected:
        raise ValueError(f"{source}: the checkpoint's tensors are not Gemma-3's: missing "
                         f"{sorted(expected - set(tensors))[:3]}, unexpected {sorted(set(tensors) - expected)[:3]}")
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if tensor.shape != module._parameters[leaf].shape:
            raise ValueError(f"{source}: {name} has shape {list(tensor.shape)}, config.json says {list(module._parameters[leaf].shape)}")
        module._parameters[leaf] = nn.Parameter(tensor.to(dtype), requires_grad=False)


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, as views into private maps of its files."""
    tensors = {}
    for path in checkpoint_files(directory):
        data_start, header = read_header(path)
        with open(path, "rb") as file:
            memory = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes never reach the file
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"{path}: {key} is stored as {entry['dtype']}, not one of {sorted(DTYPES)}")
            dtype, (start, end) = DTYPES[entry["dtype"]], entry["data_offsets"]
            count = (end - start) // dtype.itemsize
            tensors[key] = torch.frombuffer(memory, dtype=dtype, count=count, offset=data_start + start).view(entry["shape"])
    return tensors
