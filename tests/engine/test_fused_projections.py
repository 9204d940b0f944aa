"""engine/ops/fused.py: q/k/v and gate/up of the native quantized layouts in one kernel call give every output the
bits its own projection's call gives (at decode's few rows, in the batch-invariant mode's tiles and by role, and on
a prefill chunk), the parts keep their own tensors as views of the whole (no weight twice), and a step's `linear` that is not
a plain call (LoRA's per-projection wrapper) still gets one call per projection."""

from types import SimpleNamespace

import pytest
import torch

from oai_gemma.engine.ops import native
from oai_gemma.engine.ops.fused import Fused, fuse_layers, projections
from oai_gemma.engine.ops.int_dot import Q4Linear, Q8Linear
from oai_gemma.engine.ops.invariance import RoleLinear, TiledLinear
from oai_gemma.engine.ops.linear import FrozenLinear, call_linear
from oai_gemma.engine.ops.quantized import KERNEL_ROWS, NativeInt8Linear

pytestmark = pytest.mark.skipif(native.int_dot_unavailable() is not None,
                                reason=f"the native kernels cannot run here: {native.int_dot_unavailable()}")


def layer(cls, hidden: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": 64, "k": 32, "v": 32, "gate": 96, "up": 96}
    return SimpleNamespace(**{name: cls(torch.randn(n, hidden, generator=g) * 0.05) for name, n in shapes.items()})


def rows(m: int, k: int = 128) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 3] *= 30
    return x


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear, NativeInt8Linear])
@pytest.mark.parametrize("m", [1, 3, 8, KERNEL_ROWS + 2])
def test_one_call_gives_each_projection_its_own_bits(cls, m):
    w = layer(cls)
    x = rows(m)
    alone = {name: getattr(w, name)(x) for name in ("q", "k", "v", "gate", "up")}
    tiled_alone = {name: TiledLinear(8)(x, getattr(w, name)) for name in alone}
    by_role = RoleLinear(8, prefill_rows=m // 2, real_rows=m, rows=m)  # the first half prompt rows, then decode rows
    by_role_alone = {name: by_role(x, getattr(w, name)) for name in alone}
    bytes_before = sum(getattr(w, name).packed_bytes for name in alone)
    assert fuse_layers([w]) == 2
    assert sum(getattr(w, name).packed_bytes for name in alone) == bytes_before
    for names in (("q", "k", "v"), ("gate", "up")):
        parts = [getattr(w, name) for name in names]
        fused = parts[0].fused
        assert isinstance(fused, Fused) and all(p.fused is fused for p in parts)
        whole = fused.whole.packed
        for p in parts:  # a view of the whole's memory, not a copy
            assert whole.data_ptr() <= p.packed.data_ptr() < whole.data_ptr() + whole.numel() * whole.element_size()
        for name, out in zip(names, projections(call_linear, x, parts)):
            assert torch.equal(out, alone[name]), name
            assert torch.equal(getattr(w, name)(x), alone[name]), f"{name} called alone after fusing"
        for name, out in zip(names, projections(TiledLinear(8), x, parts)):
            assert torch.equal(out, tiled_alone[name]), f"{name} in the invariant mode's call"
        for name, out in zip(names, projections(by_role, x, parts)):
            assert torch.equal(out, by_role_alone[name]), f"{name} in the invariant mode's call by role"


def test_a_wrapping_linear_gets_one_call_per_projection():
    w = layer(Q4Linear)
    fuse_layers([w])
    seen = []

    def per_projection(x, linear):  # as LoRA's wrapper: it must see each projection to add its own update
        seen.append(linear)
        return linear(x)

    x = rows(2)
    outs = projections(per_projection, x, (w.q, w.k, w.v))
    assert seen == [w.q, w.k, w.v]
    assert [o.shape[1] for o in outs] == [64, 32, 32]


def test_other_layouts_and_mixed_layers_are_left_alone():
    g = torch.Generator().manual_seed(0)
    frozen = SimpleNamespace(**{name: FrozenLinear(torch.randn(32, 64, generator=g)) for name in ("q", "k", "v", "gate", "up")})
    assert fuse_layers([frozen]) == 0 and not hasattr(frozen.q, "fused")
    mixed = layer(Q8Linear)
    mixed.q = Q4Linear(torch.randn(64, 128, generator=g))
    assert fuse_layers([mixed]) == 1 and not hasattr(mixed.q, "fused") and hasattr(mixed.gate, "fused")


@pytest.mark.parametrize("m", [1, 5])
def test_q_and_k_fuse_alone_where_v_is_another_layout(m):
    # q4-mix's use_more_bits layers: 4-bit q and k, v in q8; one call for q and k, one for v, each part's own bits
    w = layer(Q4Linear)
    w.v = Q8Linear(torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 0.05)
    x = rows(m)
    alone = [part(x) for part in (w.q, w.k, w.v)]
    assert fuse_layers([w]) == 2 and w.q.fused is w.k.fused and not hasattr(w.v, "fused")
    calls = []

    def plain(x, linear):
        calls.append(linear)
        return linear(x)

    plain.fuses = True
    outs = projections(plain, x, (w.q, w.k, w.v))
    assert calls == [w.q.fused, w.v]
    assert all(torch.equal(out, expected) for out, expected in zip(outs, alone))
    for linear in (TiledLinear(8), RoleLinear(8, prefill_rows=m // 2, real_rows=m, rows=m)):
        assert all(torch.equal(out, expected) for out, expected in zip(projections(linear, x, (w.q, w.k, w.v)), alone))
