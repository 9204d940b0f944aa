"""The native decode attention (engine/ops/native/attention.c, through engine/model/attention.py's `_decode`): close
to torch's gather and scaled_dot_product_attention, and each row's bits its own (alone or beside other rows, with
a table shared by several rows, over a span padded with blocks it does not attend)."""

from types import SimpleNamespace

import pytest
import torch

from oai_gemma.engine.model import attention
from oai_gemma.engine.model.attention import DecodeKeys, _decode
from oai_gemma.engine.ops import native

pytestmark = pytest.mark.skipif(native.decode_attention() is None, reason=f"the native kernels cannot run here: {native.native_unavailable()}")

BLOCK, BLOCKS, HEADS, D = 16, 12, 4, 256


def _cache(kv_heads: int, generator) -> SimpleNamespace:
    """A stand-in for KVCache with one layer: what `_decode` reads (k, v, block_size, blocks)."""
    shape = (BLOCKS + 1, BLOCK, kv_heads, D)
    k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)

    def blocks(li, tables):
        return [t.index_select(0, tables.reshape(-1)).view(tables.shape[0], -1, kv_heads, D).transpose(1, 2) for t in (k, v)]

    return SimpleNamespace(k=[k], v=[v], block_size=BLOCK, blocks=blocks)


def _keys(tables: list[list[int]], positions: list[int], window: int | None = None) -> DecodeKeys:
    count = len(tables[0])
    kpos = torch.arange(count * BLOCK)[None, :]
    pos = torch.tensor(positions)[:, None]
    mask = kpos <= pos
    if window:
        mask &= kpos > pos - window
    return DecodeKeys(torch.tensor(tables), mask)


def _torch_decode(cache, keys, q, scaling, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(attention, "_native_decode", lambda *args: None)
        return _decode(cache, 0, keys, q, scaling)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_matches_torch(kv_heads, window, monkeypatch):
    generator = torch.Generator().manual_seed(kv_heads)
    cache = _cache(kv_heads, generator)
    keys = _keys([[3, 7, 1, 5], [0, 2, 4, 6], [8, 9, 10, 11]], [5, 40, 63], window)
    q = torch.randn(3, HEADS, D, generator=generator)
    got = _decode(cache, 0, keys, q, 0.0625)
    want = _torch_decode(cache, keys, q, 0.0625, monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_decode_rows_are_their_own():
    """A row's bits alone, beside others, over a longer (padded, unattended) span and through a shared table."""
    generator = torch.Generator().manual_seed(3)
    cache = _cache(1, generator)
    q = torch.randn(3, HEADS, D, generator=generator)
    both = _decode(cache, 0, _keys([[3, 7, 1], [0, 2, 4], [8, 9, 10]], [20, 40, 33]), q, 0.0625)
    alone = _decode(cache, 0, _keys([[0, 2, 4]], [40]), q[1:2], 0.0625)
    padded = _decode(cache, 0, _keys([[0, 2, 4, 12, 12]], [40]), q[1:2], 0.0625)
    shared = _decode(cache, 0, DecodeKeys(torch.tensor([[0, 2, 4]]), _keys([[0, 2, 4]] * 3, [40, 40, 40]).mask), q, 0.0625)
    assert torch.equal(both[1:2], alone) and torch.equal(alone, padded)
    assert all(torch.equal(shared[i], _decode(cache, 0, _keys([[0, 2, 4]], [40]), q[i : i + 1], 0.0625)[0]) for i in range(3))
    every = list(range(BLOCKS))  # three rows over every block: enough work for the kernel's threads; one row alone: none
    threaded = _decode(cache, 0, _keys([every] * 3, [150, 191, 100]), q, 0.0625)
    assert all(torch.equal(threaded[i], _decode(cache, 0, _keys([every], [p]), q[i : i + 1], 0.0625)[0])
               for i, p in enumerate([150, 191, 100]))
