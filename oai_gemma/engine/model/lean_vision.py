"""A multimodal Gemma-3 (4b/12b/27b-it) as plain modules from config.json and safetensors: no transformers.

The SigLIP vision tower and the multimodal projector of transformers' `Gemma3ForConditionalGeneration`, with its
module names and math, around engine/model/lean.py's text decoder:

    model.vision_tower          SiglipVisionModel: patch embedding (a strided conv), learned position embedding,
                                encoder layers (LayerNorm, attention with biases, gelu-tanh MLP), post_layernorm
    model.multi_modal_projector Gemma3MultiModalProjector: average-pool the patches to mm_tokens_per_image, Gemma's
                                RMSNorm (1 + w), times mm_input_projection_weight
    model.language_model        Gemma3TextModel (lean.py)
    lm_head                     tied to the token embedding

The loader builds this tree (the checkpoint's names mapped and every shape checked on the way in); the engine
computes from the tensors it holds, not from its modules: the text through engine/model/weights.py's Gemma3Weights,
the tower and projector through engine/model/vision_weights.py's VisionWeights (`from_modules`). The modules' own
forward is the reference: tests hold it to transformers' (tests/engine/test_lean_vision.py: same tensors, features,
tokens) and VisionWeights' functions to it (tests/engine/test_vision_weights.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .lean import Linear, RMSNorm, fill, read_checkpoint, text_model
from .lean_config import MultimodalConfig, VisionConfig

# a released checkpoint's names (google/gemma-3-*-it) -> transformers 5's module names; those pass unchanged
CHECKPOINT_NAMES = (
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^(model\.)?vision_tower\.vision_model\."), "model.vision_tower."),
    (re.compile(r"^multi_modal_projector\."), "model.multi_modal_projector."),
)

VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
"""The module names of the vision tower's and the projector's tensors."""


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class BiasedLinear(Linear):
    """nn.Linear with its bias (SigLIP's projections)."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(inputs, outputs)
        self.bias = _empty(outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    """nn.LayerNorm (weight and bias)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = _empty(dim), _empty(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    """SiglipVisionEmbeddings: [crops, 3, H, W] -> [crops, patches, hidden], each patch plus its position's row."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.patch = v.patch_size
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = _empty(v.hidden_size, v.num_channels, v.patch_size, v.patch_size)
        self.patch_embedding.bias = _empty(v.hidden_size)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = _empty((v.image_size // v.patch_size) ** 2, v.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        conv = self.patch_embedding
        patches = F.conv2d(pixel_values.to(conv.weight.dtype), conv.weight, conv.bias, stride=self.patch)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class Attention(nn.Module):
    """SiglipAttention (bidirectional, with biases), through torch's scaled_dot_product_attention as transformers'
    sdpa implementation calls it."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = v.num_attention_heads, v.hidden_size // v.num_attention_heads
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            setattr(self, name, BiasedLinear(v.hidden_size, v.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1).contiguous())


class EncoderLayer(nn.Module):
    """SiglipEncoderLayer: pre-norm attention and MLP, each added to the residual."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = LayerNorm(v.hidden_size, v.layer_norm_eps), LayerNorm(v.hidden_size, v.layer_norm_eps)
        self.self_attn = Attention(v)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = BiasedLinear(v.hidden_size, v.intermediate_size), BiasedLinear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """SiglipVisionModel without the pooling head (Gemma-3 has none): pixels -> last hidden states."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.config = v
        self.embeddings = Embeddings(v)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(v) for _ in range(v.num_hidden_layers))
        self.post_layernorm = LayerNorm(v.hidden_size, v.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class Projector(nn.Module):
    """Gemma3MultiModalProjector: [crops, patches, vision hidden] -> [crops, tokens per image, text hidden]."""

    def __init__(self, config: MultimodalConfig):
        super().__init__()
        v = config.vision_config
        self.mm_input_projection_weight = _empty(v.hidden_size, config.text_config.hidden_size)
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps)
        self.patches_per_side = v.image_size // v.patch_size
        self.kernel = self.patches_per_side // round(config.mm_tokens_per_image**0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        crops, _, width = hidden.shape
        grid = hidden.transpose(1, 2).reshape(crops, width, self.patches_per_side, self.patches_per_side).contiguous()
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(hidden)


class MultimodalModel(nn.Module):
    """Gemma3Model: `vision_tower`, `multi_modal_projector`, `language_model`, `get_image_features`."""

    def __init__(self, config: MultimodalConfig):
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config.vision_config)
        self.multi_modal_projector = Projector(config)
        self.language_model = text_model(config.text_config)

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[crops, 3, H, W] -> the soft tokens [crops, mm_tokens_per_image, text hidden] (transformers returns them
        as its output's `pooler_output`)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))


class ForConditionalGeneration(nn.Module):
    """Gemma3ForConditionalGeneration: `model` (above), `lm_head`, `config`."""

    def __init__(self, config: MultimodalConfig):
        super().__init__()
        self.config = config
        self.model = MultimodalModel(config)
        self.lm_head = Linear(config.text_config.hidden_size, config.text_config.vocab_size)

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model.get_image_features(pixel_values)


def build_multimodal(config: MultimodalConfig, source: str, dtype: torch.dtype) -> nn.Module:
    """`Gemma3ForConditionalGeneration`'s tree with the checkpoint's weights in `dtype`."""
    model = ForConditionalGeneration(config)
    tensors = {checkpoint_name(key): tensor for key, tensor in read_checkpoint(Path(source)).items()}
    fill(model, tensors, source, dtype, config.tie_word_embeddings)
    if model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    return model.eval()


def checkpoint_name(key: str) -> str:
    """The module name of a checkpoint's tensor (as transformers' conversion mapping renames it)."""
    for pattern, name in CHECKPOINT_NAMES:
        if pattern.match(key):
            return pattern.sub(name, key, count=1)
    return key
