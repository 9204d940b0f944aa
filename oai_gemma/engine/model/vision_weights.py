"""`VisionWeights`: Gemma-3's SigLIP vision tower and multimodal projector as the project holds them (issue 38.4).

Plain tensors and plain functions, the math and op order of transformers' `SiglipVisionModel` (no pooling head)
and `Gemma3MultiModalProjector` (the reference module tree: engine/model/lean_vision.py), so an image's features
are bitwise transformers' where the ops are the same (tests/engine/test_vision_weights.py):

    embed           patch conv (stride = patch) + learned position rows: [crops, 3, H, W] -> [crops, patches, width]
    each layer      x += out(attention(q, k, v of layer_norm1(x)));  x += fc2(gelu_tanh(fc1(layer_norm2(x))))
    finish          post_layernorm, average-pool to tokens_per_image, Gemma's RMSNorm (1 + w), @ projection

engine/model/vision_encode.py runs the layers a slice of rows at a time (`qkv`, `mix`); `image_features` is the
one-call encode. Filled from module names (`from_tensors`): lean_vision.py's tree or the checkpoint (`from_modules`,
`from_checkpoint`), transformers' model (`from_modules`), llama.cpp's mmproj GGUF (`from_mmproj`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ...cpu import MATMUL_SETTINGS
from ..shape import VisionShape

TOWER, PROJECTOR = "model.vision_tower.", "model.multi_modal_projector."
"""The module-name prefixes (transformers 5's) `from_tensors` reads."""
LAYER_NAMES = {
    "ln1_weight": "layer_norm1.weight", "ln1_bias": "layer_norm1.bias",
    "q_weight": "self_attn.q_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k_weight": "self_attn.k_proj.weight", "k_bias": "self_attn.k_proj.bias",
    "v_weight": "self_attn.v_proj.weight", "v_bias": "self_attn.v_proj.bias",
    "o_weight": "self_attn.out_proj.weight", "o_bias": "self_attn.out_proj.bias",
    "ln2_weight": "layer_norm2.weight", "ln2_bias": "layer_norm2.bias",
    "fc1_weight": "mlp.fc1.weight", "fc1_bias": "mlp.fc1.bias", "fc2_weight": "mlp.fc2.weight", "fc2_bias": "mlp.fc2.bias",
}
"""VisionLayer's fields -> the module names after `encoder.layers.N.`."""


@dataclass
class VisionLayer:
    """One SigLIP encoder layer: two LayerNorms, attention projections with biases, the MLP."""

    ln1_weight: torch.Tensor
    ln1_bias: torch.Tensor
    q_weight: torch.Tensor
    q_bias: torch.Tensor
    k_weight: torch.Tensor
    k_bias: torch.Tensor
    v_weight: torch.Tensor
    v_bias: torch.Tensor
    o_weight: torch.Tensor
    o_bias: torch.Tensor
    ln2_weight: torch.Tensor
    ln2_bias: torch.Tensor
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor


@dataclass
class VisionWeights:
    shape: VisionShape
    eps: float
    """The LayerNorms' and the projector's RMSNorm epsilon (the vision config's layer_norm_eps)."""
    patch_weight: torch.Tensor
    """[width, 3, patch, patch]: the patch embedding (a strided conv)."""
    patch_bias: torch.Tensor
    position: torch.Tensor
    """[patches, width]: the learned position rows."""
    layers: list[VisionLayer]
    post_weight: torch.Tensor
    post_bias: torch.Tensor
    soft_norm: torch.Tensor
    """The projector's RMSNorm weight as stored (applied as 1 + w in float32)."""
    projection: torch.Tensor
    """[width, text hidden]: mm_input_projection_weight."""
    attention_fp32_precision: str | None = None
    """oneDNN's float32 matmul precision for the attention (`torch.backends.mkldnn.matmul.fp32_precision`, set around
    the call only): `bf16` in the bf16 layout (vision_layout.py's `to_bf16`); None: the process's setting."""

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_weight.dtype

    @property
    def head_dim(self) -> int:
        return self.shape.hidden // self.shape.heads

    @classmethod
    def from_tensors(cls, shape: VisionShape, eps: float, tensor: Callable[[str], torch.Tensor]) -> VisionWeights:
        """From `tensor(name)`, which gives each tensor by its transformers 5 module name."""
        def layer(i: int) -> VisionLayer:
            return VisionLayer(**{f: tensor(f"{TOWER}encoder.layers.{i}.{n}") for f, n in LAYER_NAMES.items()})

        return cls(
            shape, eps, tensor(f"{TOWER}embeddings.patch_embedding.weight"), tensor(f"{TOWER}embeddings.patch_embedding.bias"),
            tensor(f"{TOWER}embeddings.position_embedding.weight"), [layer(i) for i in range(shape.layers)],
            tensor(f"{TOWER}post_layernorm.weight"), tensor(f"{TOWER}post_layernorm.bias"),
            tensor(f"{PROJECTOR}mm_soft_emb_norm.weight"), tensor(f"{PROJECTOR}mm_input_projection_weight"),
        )

    def tensors(self) -> list:
        """Every field's value: tensors, and a quantized layout's linears (vision_layout.py) with None for their biases."""
        top = (self.patch_weight, self.patch_bias, self.position, self.post_weight, self.post_bias, self.soft_norm, self.projection)
        return [*top, *(getattr(w, f.name) for w in self.layers for f in fields(w))]

    def nbytes(self) -> int:
        held = self.tensors()
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else getattr(t, "packed_bytes", 0) for t in held)


def embed(w: VisionWeights, pixel_values: torch.Tensor) -> torch.Tensor:
    """SiglipVisionEmbeddings: [crops, 3, H, W] -> [crops, patches, width], each patch plus its position's row."""
    patches = F.conv2d(pixel_values.to(w.patch_weight.device, w.dtype), w.patch_weight, w.patch_bias, stride=w.shape.patch)
    return patches.flatten(2).transpose(1, 2) + w.position


def qkv(w: VisionWeights, layer: VisionLayer, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layer_norm1 of `rows` [..., width] and its q, k, v projections (each [..., width])."""
    normed = F.layer_norm(rows, layer.ln1_weight.shape, layer.ln1_weight, layer.ln1_bias, w.eps)
    return (project(normed, layer.q_weight, layer.q_bias), project(normed, layer.k_weight, layer.k_bias),
            project(normed, layer.v_weight, layer.v_bias))


def mix(w: VisionWeights, layer: VisionLayer, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`rows` [crops, n, width] after their attention over the crop's keys and their MLP: q [crops, heads, n,
    head_dim], k and v [crops, heads, patches, head_dim]."""
    with mkldnn_fp32_precision(w.attention_fp32_precision):
        out = F.scaled_dot_product_attention(q, k, v, scale=w.head_dim**-0.5)
    out = project(out.transpose(1, 2).reshape(*rows.shape[:-1], -1).contiguous(), layer.o_weight, layer.o_bias)
    mixed = rows + out
    normed = F.layer_norm(mixed, layer.ln2_weight.shape, layer.ln2_weight, layer.ln2_bias, w.eps)
    hidden = F.gelu(project(normed, layer.fc1_weight, layer.fc1_bias), approximate="tanh")
    return mixed + project(hidden, layer.fc2_weight, layer.fc2_bias)


@contextmanager
def mkldnn_fp32_precision(precision: str | None) -> Iterator[None]:
    """oneDNN's float32 matmul precision set to `precision` (None: as it is) for the block, then back. A process-wide
    setting: held under cpu.MATMUL_SETTINGS, which a load computing beside the steps holds too (`Turns.aside`), and
    otherwise only the engine thread in its turn computes. Measured on a 2-core AVX512-bf16 EPYC (torch 2.13, 16 heads
    x 4,096 x 72): float32 SDPA 0.43 s under the default, 0.24 s under `bf16`, the outputs 3.7e-7 apart (relative),
    each row's result still its own (256-row slices equal the one call bitwise)."""
    settings = torch.backends.mkldnn.matmul
    if precision is None:
        yield
        return
    with MATMUL_SETTINGS:
        before = settings.fp32_precision
        settings.fp32_precision = precision
        try:
            yield
        finally:
            settings.fp32_precision = before


def project(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer's projection: `F.linear` on a float weight, or a quantized layout's call (engine/model/vision_layout.py:
    its bias inside)."""
    return F.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else weight(x)


def heads(w: VisionWeights, x: torch.Tensor) -> torch.Tensor:
    """[crops, n, width] -> [crops, heads, n, head_dim] (a view)."""
    return x.view(*x.shape[:-1], w.shape.heads, w.head_dim).transpose(1, 2)


def encoder_layer(w: VisionWeights, layer: VisionLayer, x: torch.Tensor) -> torch.Tensor:
    """SiglipEncoderLayer on every row at once."""
    q, k, v = (heads(w, t) for t in qkv(w, layer, x))
    return mix(w, layer, x, q, k, v)


def finish(w: VisionWeights, hidden: torch.Tensor) -> torch.Tensor:
    """post_layernorm and the projector: [crops, patches, width] -> [crops, tokens_per_image, text hidden]."""
    hidden = F.layer_norm(hidden, w.post_weight.shape, w.post_weight, w.post_bias, w.eps)
    crops, _, width = hidden.shape
    side = w.shape.image_size // w.shape.patch
    kernel = side // round(w.shape.tokens_per_image**0.5)
    grid = hidden.transpose(1, 2).reshape(crops, width, side, side).contiguous()
    pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
    y = pooled.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + w.eps)
    normed = (y * (1.0 + w.soft_norm.float())).type_as(pooled)
    return torch.matmul(normed, w.projection).type_as(hidden)


@torch.inference_mode()
def image_features(w: VisionWeights, pixel_values: torch.Tensor) -> torch.Tensor:
    """The one-call encode: [crops, 3, H, W] -> [crops * tokens_per_image, text hidden]."""
    hidden = embed(w, pixel_values)
    for layer in w.layers:
        hidden = encoder_layer(w, layer, hidden)
    features = finish(w, hidden)
    return features.reshape(-1, features.shape[-1])


def from_modules(inner) -> VisionWeights | None:
    """The tensors of a multimodal model's inner `model` (its `vision_tower`, `multi_modal_projector`, `config`):
    lean_vision.py's tree or transformers' Gemma3Model, shared, not copied. None for a model without a tower."""
    if getattr(inner, "vision_tower", None) is None or getattr(inner, "multi_modal_projector", None) is None:
        return None
    tensors = {}
    for prefix, module in ((TOWER, inner.vision_tower), (PROJECTOR, inner.multi_modal_projector)):
        for name, tensor in module.named_parameters():  # transformers 4's SiglipVisionModel has a `vision_model` level
            tensors[prefix + name.removeprefix("vision_model.")] = tensor.detach()
    device = next(iter(tensors.values())).device  # a tower spread over GPUs (device_map) gathered on its first
    tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
    config = inner.config
    return VisionWeights.from_tensors(VisionShape.of(config), config.vision_config.layer_norm_eps, tensors.__getitem__)


def from_mmproj(path, shape: VisionShape, eps: float, dtype: torch.dtype) -> VisionWeights:
    """From llama.cpp's mmproj GGUF of Gemma-3 (tensor names as engine/model/gguf_convert.py maps them; the
    projector's norm stored as 1 + w, as the converter reads it back), each tensor in `dtype`."""
    from .gguf_convert import vision_name
    from .gguf_file import GGUFFile
    from .lean_vision import checkpoint_name

    gguf = GGUFFile(path)
    try:
        tensors = {}
        for tensor in gguf.tensors.values():
            name, shift = vision_name(tensor.name)
            rows = tensor.shape[0] if len(tensor.shape) > 1 else 1
            values = torch.from_numpy(gguf.rows(tensor, 0, rows).copy()) + shift
            tensors[checkpoint_name(name)] = values.reshape(tensor.shape).to(dtype)
    finally:
        gguf.close()
    return VisionWeights.from_tensors(shape, eps, tensors.__getitem__)
