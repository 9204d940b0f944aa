"""The vision tower in `q8a7`, `q8` and `bf16` (engine/model/vision_layout.py) on the tiny vision model: close to
float32, bitwise the same whether encoded unit by unit or in one call, padded intermediates exact, the 7-bit kernel
equal to its arithmetic written in torch, and what the server picks."""

import pytest
import torch
import torch.nn.functional as F

from oai_gemma.engine.config import ModelConfig
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.runner import load_weights
from oai_gemma.engine.model.vision_encode import VisionEncode
from oai_gemma.engine.model import vision_layout
from oai_gemma.engine.model.vision_layout import LINEARS, Bf16VisionLinear, VisionLinear, to_bf16, to_q8, tower_layout
from oai_gemma.engine.ops import native
from oai_gemma.engine.model.vision_weights import from_modules, image_features
from oai_gemma.settings import ModelSettings

pytestmark = pytest.mark.skipif(native.int_dot_unavailable() is not None, reason="the integer dot-product kernels cannot run here")


@pytest.fixture(scope="module")
def model(tiny_vision_dir):
    return load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"), lean=True).model


def pixels(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, 3, 896, 896, generator=torch.Generator().manual_seed(seed))


LAYOUTS = {"q8a7": lambda weights: to_q8(weights, 7), "q8": lambda weights: to_q8(weights, 8), "bf16": to_bf16}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layouts_features_stay_close_to_float32(model, layout):
    """Drift guard: the soft tokens of the int8 and bf16 towers against the float32 tower's (measured on this model:
    relative error 0.22% with 7-bit activations, 0.15% with 8-bit; cosine 0.99999); a wrong padding, scale, offset or
    bias would be far off."""
    x = pixels()
    expected = image_features(from_modules(model.model), x)
    got = image_features(LAYOUTS[layout](from_modules(model.model)), x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    cosine = F.cosine_similarity(got, expected, dim=-1)
    relative = (got - expected).norm() / expected.norm()
    assert cosine.min() > 0.9999, cosine.min()
    assert relative < 0.01, relative
    assert not torch.equal(got, expected)  # the layout really ran


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unit_by_unit_is_bitwise_its_one_call_encode(model, layout):
    x = pixels(seed=1)
    weights = LAYOUTS[layout](from_modules(model.model))
    expected = image_features(weights, x)
    job = VisionEncode(weights, x, rows=512)  # a budget that holds them: the `mix` units WIDE_ROWS wide
    assert job.run(3600.0) and job.units_done < job.total_units and "wide mix" in job.costs.seconds
    assert torch.equal(job.features, expected)


def test_the_7_bit_kernel_is_its_arithmetic():
    """vision_dot.c against the same steps in torch (float64 sums of the exact integer products): each block of 32
    activations scaled to -63..63 and rounded half away from zero, int8 weights per output channel, the bias."""
    torch.manual_seed(1)
    n, k, rows = 24, 96, 7
    weight, bias, x = torch.randn(n, k) * 0.05, torch.randn(n), torch.randn(rows, k) * 3
    x[2, 32:64] = 0  # a block of zeros: scale 0
    linear = VisionLinear(weight, bias)
    levels = linear.linear.packed.permute(0, 2, 1, 3).reshape(n, k).double()
    blocks = x.view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scaled = blocks * torch.where(amax > 0, 63.0 / amax, 0.0)
    q = torch.trunc(scaled + torch.where(scaled < 0, -0.5, 0.5)).double()
    expected = (q * (amax / 63).double()).view(rows, k) @ levels.T * linear.linear.scale.double() + bias.double()
    got = linear(x)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x[3:4]), got[3:4])  # a row alone: the same bits


def test_padded_intermediate_is_exact_zero_columns():
    """An intermediate size that is not a multiple of 32 (SigLIP's 4304): fc1's padded outputs are exactly zero, and
    fc2 over them equals fc2 of the unpadded layer quantized alone."""
    torch.manual_seed(0)
    width, inner, pad = 64, 80, 16
    fc1_w, fc1_b = torch.randn(inner, width) * 0.05, torch.randn(inner) * 0.1
    fc2_w, fc2_b = torch.randn(width, inner) * 0.05, torch.randn(width) * 0.1
    x = torch.randn(5, 7, width)
    fc1, fc2 = VisionLinear(fc1_w, fc1_b, pad_outputs=pad), VisionLinear(fc2_w, fc2_b, pad_inputs=pad)
    hidden = F.gelu(fc1(x), approximate="tanh")
    assert hidden.shape == (5, 7, inner + pad) and torch.all(hidden[..., inner:] == 0)
    out = fc2(hidden)
    assert out.shape == (5, 7, width)
    expected = F.linear(F.gelu(F.linear(x, fc1_w, fc1_b), approximate="tanh"), fc2_w, fc2_b)
    assert F.cosine_similarity(out.reshape(-1, width), expected.reshape(-1, width), dim=-1).min() > 0.99


@pytest.mark.parametrize("fast_bf16, kind, share", [(False, VisionLinear, (0.7, 0.75)), (True, Bf16VisionLinear, (0.49, 0.501))])
def test_the_server_picks_its_layout_beside_the_integer_text_layouts_only(model, fast_bf16, kind, share):
    """q8a7 (int8 weights: a quarter of float32's, plus the scales) or, on a CPU with fast bf16 GEMMs, bf16 (half),
    each converted at the first encode."""
    for quantization, converted in (("q4-mix", True), ("q8", True), ("int8", False), ("none", False)):
        weights = tower_layout(from_modules(model.model), quantization, fast_bf16)
        assert isinstance(weights.layers[0].fc1_weight, kind) is converted, quantization
        assert isinstance(weights.layers[0].fc1_weight, torch.Tensor) is not converted, quantization
    floats = from_modules(model.model)
    linear_bytes = sum(getattr(layer, name).numel() * 4 for layer in floats.layers for name, _ in LINEARS)
    lazy = tower_layout(from_modules(model.model), "q4-mix", fast_bf16)
    assert lazy.nbytes() == floats.nbytes()  # the server's: converted at the first encode, float until then
    image_features(lazy, pixels())
    saved = floats.nbytes() - lazy.nbytes()
    assert share[0] * linear_bytes < saved < share[1] * linear_bytes


def test_the_runner_s_weights_take_q8a7_with_the_integer_text_layouts(tiny_vision_dir, model, monkeypatch):
    """engine/model/runner.py's `load_weights` (the server's path: the checkpoint streamed) gives `q8` text a q8a7
    tower whose features stay close to the float32 tower's (on a CPU without fast bf16 GEMMs: bf16 on one with)."""
    monkeypatch.setattr(vision_layout, "cpu_has_fast_bf16", lambda: False)
    loaded = load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"), lean=True, stream=True)
    weights = load_weights(loaded, ModelConfig(dtype="float32", quantization="q8"))
    assert all(isinstance(layer.q_weight, VisionLinear) and layer.q_weight.activations == 7 for layer in weights.vision.layers)
    assert weights.vision.layers[0].fc1_weight.source is not None  # quantized at the first encode, not at start-up
    x = pixels(seed=2)
    expected = image_features(from_modules(model.model), x)
    got = image_features(weights.vision, x)
    assert weights.vision.layers[-1].fc2_weight.source is None
    assert F.cosine_similarity(got, expected, dim=-1).min() > 0.9999
    assert torch.equal(image_features(weights.vision, x), got)  # the second encode: the same bits


def test_the_bf16_layout_runs_its_attention_under_onednn_bf16_precision_and_restores_it(model, monkeypatch):
    """The bf16 tower's attention runs with oneDNN's float32 matmuls at `bf16` precision (1.8x faster SDPA measured on
    an AVX512-bf16 EPYC), and the process-wide setting is back as it was after each call, so the text's float32
    matmuls (and batch-invariant mode's checks of them) never run under it."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.mkldnn.matmul.fp32_precision)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    before = torch.backends.mkldnn.matmul.fp32_precision
    image_features(to_bf16(from_modules(model.model)), pixels())
    assert seen and set(seen) == {"bf16"}
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    seen.clear()
    image_features(to_q8(from_modules(model.model)), pixels())
    assert set(seen) == {before}  # the other layouts leave it alone
