"""The native layer steps (engine/ops/native/layer.c, through engine/model/gemma3.py's `qk_norm_rope` and
`residual_norm`) give the torch ops' bits: q/k norms and rope, a residual branch and the next norm, at one row and
several, on a fused projection's columns as on tensors of their own."""

import pytest
import torch

from oai_gemma.engine.model import gemma3
from oai_gemma.engine.model.gemma3 import LayerWeights, qk_norm_rope, residual_norm, rms_norm, rope, signed_sin
from oai_gemma.engine.ops import native

pytestmark = pytest.mark.skipif(native.layer_kernels() is None, reason=f"the native kernels cannot run here: {native.native_unavailable()}")

HEADS, KV_HEADS, D, HIDDEN, EPS = 4, 1, 256, 1152, 1e-6


def _weights(generator) -> LayerWeights:
    scale = lambda n: 1.0 + 0.3 * torch.randn(n, generator=generator)  # noqa: E731
    return LayerWeights(*[None] * 4, scale(D), scale(D), *[None] * 7)


def _rope_tables(rows: int, generator):
    angles = torch.randn(rows, 1, D // 2, generator=generator) * 10
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().contiguous(), signed_sin(emb.sin())


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("fused", [True, False])
def test_qk_norm_rope_gives_the_torch_ops_bits(rows, fused):
    generator = torch.Generator().manual_seed(rows)
    w = _weights(generator)
    whole = torch.randn(rows, (HEADS + 2 * KV_HEADS) * D, generator=generator) * 5
    q, k = (whole[:, : HEADS * D], whole[:, HEADS * D : (HEADS + KV_HEADS) * D]) if fused else (
        whole[:, : HEADS * D].clone(), whole[:, HEADS * D : (HEADS + KV_HEADS) * D].clone())
    cos, sin = _rope_tables(rows, generator)
    got_q, got_k = qk_norm_rope(q, k, w, cos, sin, EPS, HEADS, KV_HEADS, D)
    want_q = rope(rms_norm(q.contiguous().view(-1, HEADS, D), w.q_norm, EPS), cos, sin)
    want_k = rope(rms_norm(k.contiguous().view(-1, KV_HEADS, D), w.k_norm, EPS), cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("rows", [1, 5])
def test_residual_norm_gives_the_torch_ops_bits(rows):
    generator = torch.Generator().manual_seed(10 + rows)
    hidden, delta = torch.randn(rows, HIDDEN, generator=generator) * 30, torch.randn(rows, HIDDEN, generator=generator)
    scale, next_scale = (1.0 + 0.3 * torch.randn(HIDDEN, generator=generator) for _ in range(2))
    out, normed = residual_norm(hidden, delta, scale, EPS, next_scale)
    want = hidden + rms_norm(delta, scale, EPS)
    assert torch.equal(out, want) and torch.equal(normed, rms_norm(want, next_scale, EPS))
    assert torch.equal(residual_norm(hidden, delta, scale, EPS), want)


def test_the_torch_ops_run_where_the_kernels_do_not_apply(monkeypatch):
    # bf16 (or any tensor the kernels do not take) keeps torch's ops: the same function, another path
    generator = torch.Generator().manual_seed(7)
    hidden, delta = (torch.randn(2, HIDDEN, generator=generator).bfloat16() for _ in range(2))
    scale = 1.0 + 0.3 * torch.randn(HIDDEN, generator=generator)
    assert torch.equal(residual_norm(hidden, delta, scale, EPS), hidden + rms_norm(delta, scale, EPS))
    monkeypatch.setattr(gemma3, "_layer_kernels", lambda x: None)
    w = _weights(generator)
    q, k = torch.randn(2, HEADS * D, generator=generator), torch.randn(2, KV_HEADS * D, generator=generator)
    cos, sin = _rope_tables(2, generator)
    got_q, _ = qk_norm_rope(q, k, w, cos, sin, EPS, HEADS, KV_HEADS, D)
    assert torch.equal(got_q, rope(rms_norm(q.view(-1, HEADS, D), w.q_norm, EPS), cos, sin))


def test_gelu_times_is_close_to_float64_and_each_value_its_own():
    """The native gelu(gate) * up: within 3e-5 (relative) of the float64 function (torch's float32 tanh form is
    off by up to 15% where gelu is small), and a row's bits the same alone and among many rows (the threaded size)."""
    generator = torch.Generator().manual_seed(0)
    gate = torch.cat((torch.linspace(-12, 12, 6912 * 2), torch.randn(6912 * 20, generator=generator) * 3)).view(-1, 6912)
    up = torch.randn(gate.shape, generator=generator)
    got = gemma3._gelu_times(gate, up)
    x = gate.double()  # the tanh form in float64, as x / (1 + e^(-2y)): float64's tanh form rounds to 0 from x ~ -7
    want = x / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))) * up.double()
    assert torch.allclose(got.double(), want, rtol=3e-5, atol=1e-30)  # float32 rounding of e^(-2y)'s argument, ~32 at x ~ -7
    x = gate.double()[:, ::97]
    assert torch.allclose(torch.nn.functional.gelu(x, approximate="tanh"), x / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))),
                          rtol=1e-12, atol=1e-15)  # the same function
    assert all(torch.equal(got[i], gemma3._gelu_times(gate[i : i + 1], up[i : i + 1])[0]) for i in (0, 1, 7, 21))
    fused = torch.cat((gate, up), dim=1)  # a fused gate/up projection's output: its columns, rows 2 x 6912 apart
    width = gate.shape[1]
    assert torch.equal(gemma3._gelu_times(fused[:, :width], fused[:, width:]), got)
    assert torch.equal(gemma3._gelu_times(fused[3:4, :width], fused[3:4, width:])[0], got[3])
