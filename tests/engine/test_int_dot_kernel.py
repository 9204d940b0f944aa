"""engine/ops/native/int_dot.c through `Q8Linear` (int8 weights per channel) and `Q4Linear` (4-bit blocks, GGUF's
Q4_1), both times int8 activations quantized per row and block of 32 (`model.quantization` q8 / q4): they compute
what an exact emulation of their arithmetic does, close to the float product, a row's result is the same bit for
bit alone or among 7 or 31 others (batch invariance, issue 40), bad shapes and dtypes are refused, the stored form
reads back, and `linear_for` picks them."""

import pytest
import torch
import torch.nn.functional as F

from oai_gemma.engine.ops import native
from oai_gemma.engine.ops.choice import linear_for, more_bits
from oai_gemma.engine.ops.int_dot import Q4Linear, Q5Linear, Q8Linear, q4_blocks
from oai_gemma.engine.ops.quantized import KERNEL_ROWS

pytestmark = pytest.mark.skipif(native.int_dot_unavailable() is not None,
                                reason=f"the integer dot-product kernels cannot run here: {native.int_dot_unavailable()}")

CLASSES = [Q8Linear, Q4Linear, Q5Linear]


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def rows_of(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40  # an outlier column, as Gemma's activations have: its block's scale is its own
    return x


def emulated(linear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: each row's blocks of 32 quantized as int8.c does (scale amax / 127,
    round half away from zero), exact integer block sums, scaled per block and summed."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(dim=2)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    r = blocks * inverse[..., None]
    q = torch.trunc(torch.where(r < 0, r - 0.5, r + 0.5)).double()
    x_scale = (amax / 127.0).double()
    w = linear.dequantized().double()
    if isinstance(linear, Q8Linear):
        levels = torch.round(w / linear.scale.double()[:, None]).view(-1, k // 32, 32)
        sums = torch.einsum("mbi,nbi->mnb", q, levels)
        return ((sums * x_scale[:, None, :]).sum(2) * linear.scale.double()).float()
    w_scale, w_min = linear.per_output(linear.scale).double(), linear.per_output(linear.min).double()
    sums = torch.einsum("mbi,nbi->mnb", q, linear.levels().double())
    x_sums = q.sum(2)  # a block's activation sum: the min multiplies it
    return (sums * x_scale[:, None, :] * w_scale[None] + w_min[None] * (x_scale * x_sums)[:, None, :]).sum(2).float()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("n, k, m", [(64, 96, 1), (64, 96, 5), (256, 1152, 3), (24, 64, 9)])
def test_the_kernel_computes_its_arithmetic(cls, n, k, m):
    linear = cls(weights(n, k))
    x = rows_of(m, k)
    expected = emulated(linear, x)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("cls", CLASSES)
def test_close_to_the_float_product(cls):
    # against the dequantized weight the only error is 8-bit activations per block of 32: within 2% of the output's
    # largest value; against the float weight q8 adds int8's one step a weight, q4 Q4_1's sixteen levels
    weight, x = weights(512, 1152), rows_of(8, 1152)
    linear = cls(weight)
    y = linear(x)
    dequantized = F.linear(x, linear.dequantized())
    assert (y - dequantized).abs().max() <= 0.02 * dequantized.abs().max()
    exact = F.linear(x, weight)
    assert (y - exact).abs().max() <= (0.03 if cls is Q8Linear else 0.15) * exact.abs().max()


def test_q4_levels_scales_and_mins():
    weight = weights(16, 64)
    levels, scales, mins = q4_blocks(weight)
    assert levels.dtype == torch.uint8 and int(levels.max()) <= 15 and scales.dtype == mins.dtype == torch.float16
    dequantized = levels.float() * scales.float()[..., None] + mins.float()[..., None]
    # the least-squares scale and min: well under the plain symmetric Q4_0 rounding's error (scale = the largest / -8)
    blocks = weight.view(16, 2, 32)
    plain_scale = (blocks.gather(2, blocks.abs().argmax(2, keepdim=True)) / -8).half().float()
    plain = (torch.clamp(torch.round(blocks / plain_scale), -8, 7)) * plain_scale
    assert ((dequantized - blocks) ** 2).sum() <= 0.8 * ((plain - blocks) ** 2).sum()
    assert torch.equal(Q4Linear(weight).dequantized(), dequantized.view(16, 64))


def reference_q4_search(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's least squared error over q4_blocks' candidates (inverse scales (15 + step / 10) / spread, the
    least-squares (scale, min) rounded to float16, levels rounded against them), written plainly in float64."""
    b = blocks.double()
    lo, spread = b.amin(-1).clamp(max=0), (b.amax(-1) - b.amin(-1).clamp(max=0)).clamp(min=1e-12)
    best = torch.full(b.shape[:-1], float("inf"), dtype=torch.float64)
    for step in range(-10, 11):
        q = torch.clamp(torch.round((b - lo[..., None]) * ((15 + 0.1 * step) / spread)[..., None]), 0, 15)
        sl, sll, slx, sx = q.sum(-1), (q * q).sum(-1), (q * b).sum(-1), b.sum(-1)
        det = 32 * sll - sl * sl
        d = torch.where(det > 0, (32 * slx - sl * sx) / det.clamp(min=1e-30), spread / 15).half().double()
        m = torch.where(det > 0, (sx - d * sl) / 32, lo).half().double()
        q = torch.clamp(torch.round((b - m[..., None]) / torch.where(d != 0, d, 1)[..., None]), 0, 15)
        best = torch.minimum(best, ((b - (d[..., None] * q + m[..., None])) ** 2).sum(-1))
    return best


def test_the_native_q4_search_finds_each_blocks_least_error_candidate():
    weight = weights(64, 256, seed=3)
    weight[:, 7] *= 8  # an outlier in each row's first block
    levels, scales, mins = q4_blocks(weight)
    ours = ((levels.double() * scales.double()[..., None] + mins.double()[..., None] - weight.view(64, 8, 32).double()) ** 2).sum(-1)
    reference = reference_q4_search(weight.view(64, 8, 32))
    # float32 sums in the kernel against float64 here pick another candidate in a few blocks (either way, a few
    # percent), so the whole weight's error is compared: the plain min/max rounding alone is 1.24x the search's
    assert ours.sum() <= 1.005 * reference.sum()
    assert (ours <= 1.25 * reference).all()
    assert torch.equal(q4_blocks(weight)[0], levels), "the same bits every time"


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_a_rows_result_ignores_the_rows_beside_it(cls, x_dtype, out_dtype):
    linear = cls(weights(264, 1152))
    x = rows_of(32, 1152).to(x_dtype)
    every = linear(x, out_dtype)
    assert every.dtype == out_dtype
    for row in (0, 6, 31):
        alone = linear(x[row : row + 1], out_dtype)
        among_8 = linear(x[row // 8 * 8 : row // 8 * 8 + 8], out_dtype)[row % 8]
        assert torch.equal(alone[0], every[row]), f"row {row}: alone vs among 31 others"
        assert torch.equal(alone[0], among_8), f"row {row}: alone vs among 7 others"
    for rows in (2, 3, 4, 5, 7, 13):  # every tile shape's remainder
        assert torch.equal(linear(x[:rows], out_dtype), every[:rows])


@pytest.mark.parametrize("cls", CLASSES)
def test_shapes_and_dtypes_the_kernel_cannot_take_are_refused(cls):
    with pytest.raises(ValueError, match="K % 32"):
        cls(weights(64, 48))  # K not a multiple of 32
    with pytest.raises(ValueError, match="N % 8"):
        cls(weights(12, 64))
    linear = cls(weights(64, 64))
    for dtype in (torch.float16, torch.float64, torch.int8):
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            linear(torch.ones(2, 64, dtype=dtype))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        linear(torch.ones(2, 64), torch.float16)
    with pytest.raises(ValueError, match="rows of 64"):
        linear(torch.ones(2, 32))


@pytest.mark.parametrize("cls", CLASSES)
def test_the_stored_form_reads_back_and_the_prefill_path_agrees(cls):
    linear = cls(weights(128, 256))
    again = cls.from_tensors({name: t.clone() for name, t in linear.tensors().items()})
    x = rows_of(KERNEL_ROWS, 256)
    assert torch.equal(again(x[:9]), linear(x[:9]))
    bits = {Q8Linear: 8, Q4Linear: 4, Q5Linear: 5}[cls]
    assert linear.packed_bytes == 128 * 256 * bits // 8 + (128 * 4 if cls is Q8Linear else 128 * 256 // 32 * 4)
    # from KERNEL_ROWS rows: the dequantized weight times float activations, within the activations' 8 bits
    prefill = linear(x)
    kernel = torch.cat([linear(part) for part in x.split(KERNEL_ROWS - 1)])
    assert (prefill - kernel).abs().max() <= 0.02 * prefill.abs().max()


def test_linear_for_picks_them():
    for dtype in (torch.float32, torch.bfloat16):
        assert linear_for("q8", "lm_head", dtype) is Q8Linear
        assert linear_for("q8", "projection.0", dtype) is Q8Linear
        assert linear_for("q4", "lm_head", dtype) is Q8Linear
        assert linear_for("q4", "projection.3", dtype) is Q4Linear


def test_q4_mix_keeps_v_and_down_in_q8_in_the_layers_llamas_q4_k_m_gives_more_bits():
    # the layers whose attn_v / ffn_down llama.cpp's Q4_K_M files of the 1B (26 layers) and 4B (34) hold at 6-8 bits
    assert [i for i in range(26) if more_bits(i, 26)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 22, 23, 24, 25]
    assert [i for i in range(34) if more_bits(i, 34)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29, 30, 31, 32, 33]
    pick = {i: linear_for("q4-mix", f"projection.{i}", torch.float32, 26) for i in range(26 * 7)}
    assert pick[2] is Q8Linear and pick[6] is Q8Linear  # layer 0's v and down
    assert pick[3 * 7 + 2] is Q4Linear and pick[3 * 7 + 6] is Q4Linear  # layer 3: not one of them
    assert pick[5 * 7 + 6] is Q8Linear and pick[25 * 7 + 2] is Q8Linear
    assert sum(cls is Q8Linear for cls in pick.values()) == 2 * 13  # the rest 4-bit: q, k, o, gate, up everywhere
    assert linear_for("q4-mix", "lm_head", torch.float32, 26) is Q5Linear  # GGUF's Q5_1: 226 MB a token, not 303
    assert linear_for("q4", "lm_head", torch.float32, 26) is Q8Linear  # q4 keeps the q8 lm_head


def test_the_q4_layout_version_names_its_cache_file():
    # the q4 blocks' stored layout changed (VERSION 2: scales inside each block; 3: Q4_1's mins too): an older file must
    # never be read back as the new one, so the version is part of the model cache's name for q4 only
    from oai_gemma.engine.factory import _layout

    assert f"q4v{Q4Linear.VERSION}" in _layout("q4", torch.float32)
    assert "q4v" not in _layout("q8", torch.float32) and "q4v" not in _layout("int8", torch.float32)
    assert Q4Linear(weights(16, 64)).packed.shape == (2, 2, 160)


def test_the_q5_lm_head_names_q4_mixs_cache_file():
    # q4-mix's files from before its q5 lm_head hold a q8 one under the same tensor names: never read back as q5
    from oai_gemma.engine.factory import _layout

    assert f"q5v{Q5Linear.VERSION}" in _layout("q4-mix", torch.float32)
    assert "q5v" not in _layout("q4", torch.float32) and "q5v" not in _layout("q8", torch.float32)
    assert Q5Linear(weights(16, 64)).packed.shape == (2, 2, 192)


def test_q5_levels_take_all_five_bits_and_halve_q4s_error():
    weight = weights(64, 256, seed=4)
    levels, scales, mins = q4_blocks(weight, bits=5)
    assert int(levels.max()) == 31 and int(levels.min()) == 0
    linear = Q5Linear(weight)
    dequantized = levels.float() * scales.float()[..., None] + mins.float()[..., None]
    assert torch.equal(linear.dequantized(), dequantized.view(64, 256)), "the fifth bits read back"
    q4_error = ((Q4Linear(weight).dequantized() - weight) ** 2).sum()
    assert ((dequantized.view(64, 256) - weight) ** 2).sum() <= 0.3 * q4_error  # ~1/4: half the step


@pytest.mark.parametrize("cls", CLASSES)
def test_made_from_row_chunks_the_layout_is_the_whole_weights(cls):
    # the loader makes the lm_head from chunks of rows (the 4B's whole in float32 would be 2.7 GB): the same bits
    weight = weights(1000, 256)
    whole, chunked = cls(weight), cls.from_rows(tuple(weight.shape), lambda lo, hi: weight[lo:hi], 48)
    assert whole.tensors().keys() == chunked.tensors().keys()
    assert all(torch.equal(whole.tensors()[name], chunked.tensors()[name]) for name in whole.tensors())
