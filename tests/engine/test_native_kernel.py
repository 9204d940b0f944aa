"""engine/ops/native's int8 kernel (woq_int8.c) through `NativeInt8Linear`: it computes x @ (w * scale)^T, a row's
result does not depend on the rows beside it (its tiles, the single-row path and threads aside), the prefill
path agrees, `auto` picks it only where the CPU computes in float32, and where it cannot be compiled the reason
is said and the setting falls back."""

import logging

import pytest
import torch
import torch.nn.functional as F

from oai_gemma.engine.config import ConfigError, Machine, _quantization
from oai_gemma.engine.factory import configure as resolve_config
from oai_gemma.engine.ops import native
from oai_gemma.engine.ops.native import sources
from oai_gemma.engine.ops.choice import linear_for
from oai_gemma.engine.ops.quantized import KERNEL_ROWS, NativeInt8Linear, NativeQ8Linear
from oai_gemma.settings import ModelSettings, Settings

from conftest import embedded_float32

pytestmark = pytest.mark.skipif(native.native_unavailable() is not None,
                                reason=f"the native kernel cannot run here: {native.native_unavailable()}")


def layer(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, NativeInt8Linear]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return weight, NativeInt8Linear(weight)


def activations(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Seeded inputs: the global generator's draws depend on which tests ran before (and a rare draw near a
    tolerance would fail one run in many, not every run)."""
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n, k", [(1024, 640), (640, 2048), (8, 16), (264, 640)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 31])
def test_the_kernel_multiplies_by_the_dequantized_weight(n, k, rows):
    weight, linear = layer(n, k)
    x = activations(rows, k)
    expected = F.linear(x, linear.dequantized())
    torch.testing.assert_close(linear(x), expected, rtol=1e-4, atol=1e-4)
    assert (linear.dequantized() - weight).abs().max() <= weight.abs().amax() / 127  # int8: one step at most


def test_a_rows_result_ignores_the_rows_beside_it():
    _, linear = layer(2048, 640)
    x = activations(KERNEL_ROWS - 1, 640)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 8, 17, 32, KERNEL_ROWS - 1):
        assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows together differ from each alone"


@pytest.mark.skipif(not native.cpu_has_avx512(), reason="no AVX512 here (or ATEN_CPU_CAPABILITY limits it)")
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_the_avx512_variant_agrees_with_the_avx2_one(rows):
    # one stored layout for both; the AVX512 loop sums even and odd input columns apart, then adds them
    _, linear = layer(264, 640)
    x = activations(rows, 640)
    out = {}
    for even_k in (False, True):
        out[even_k] = torch.empty(rows, 264)
        native.woq_int8_linear(even_k)(x.data_ptr(), rows, 640, linear.packed.data_ptr(), linear.scale.data_ptr(), 264,
                                       out[even_k].data_ptr(), 0, 0)
    assert native.woq_int8_linear(True) is not native.woq_int8_linear(False)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_bf16_activations_and_results_are_converted_in_the_kernel_as_torch_converts_them(rows):
    # a bf16 model's per-step layout hands the kernel bf16 and takes bf16 back: no conversion ops around the call
    _, linear = layer(264, 640)
    x = activations(rows, 640).bfloat16()
    wide = linear(x.float())
    assert torch.equal(linear(x), wide), "bf16 in: widened exactly"
    assert torch.equal(linear(x, torch.bfloat16), wide.bfloat16()), "bf16 out: rounded to nearest even, as torch does"


def test_threads_do_not_change_the_result():
    _, linear = layer(640, 2048)
    x = activations(6, 2048)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(2)
        assert torch.equal(linear(x), one)
    finally:
        torch.set_num_threads(before)


def test_a_prefill_chunk_goes_through_the_dequantized_weight():
    _, linear = layer(1024, 640)
    x = activations(KERNEL_ROWS, 640)
    torch.testing.assert_close(linear(x), F.linear(x, linear.dequantized()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear(x)[:8], linear(x[:8]), rtol=1e-4, atol=1e-4)


def test_it_stores_and_reads_back_as_the_same_layer():
    _, linear = layer(264, 640)
    again = NativeInt8Linear.from_tensors({name: t.clone() for name, t in linear.tensors().items()})
    x = activations(2, 640)
    assert torch.equal(again(x), linear(x))
    assert linear.packed_bytes == 264 * 640 + 4 * 264


def test_output_sizes_not_divisible_by_eight_are_refused():
    with pytest.raises(ValueError, match="divisible by 8"):
        NativeInt8Linear(torch.randn(12, 64))


def resolve(setting: str, dtype: torch.dtype, device: torch.device, int_dot_missing: str | None = None) -> str:
    """`model.quantization` as engine/config.py resolves it with what engine/factory.py's `probe` finds here."""
    missing = native.native_unavailable() if device.type == "cpu" else None
    return _quantization(setting, Machine(shape=None, device=device.type, dtype=str(dtype).removeprefix("torch."),
                                          native_missing=missing, int_dot_missing=int_dot_missing))


def test_auto_quantizes_to_int8_where_the_cpu_computes_in_float32_and_q8_or_per_step_in_bf16():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve("auto", torch.float32, cpu) == "int8"
    assert resolve("auto", torch.bfloat16, cpu) == "q8"  # int8 x int8 in the integer dot-product kernels
    assert resolve("auto", torch.bfloat16, cpu, int_dot_missing="no AVX2") == "per-step"  # the int8 kernel, bf16 in and out
    assert resolve("auto", torch.float32, gpu) == "none"
    assert resolve("int4", torch.bfloat16, cpu) == "int4" and resolve("none", torch.float32, cpu) == "none"
    assert linear_for("int8", "q", torch.float32) is NativeInt8Linear
    # the lm_head: int8 x int8 with activations in blocks of 32 (its inputs are normed; the projections' are not)
    assert linear_for("int8", "lm_head", torch.float32) is NativeQ8Linear
    assert linear_for("per-step", "lm_head", torch.bfloat16) is NativeQ8Linear


@pytest.fixture
def native_elsewhere(monkeypatch):
    """A test that builds the kernels somewhere else or under another environment (CC, HOME): afterwards every
    library and verdict it cached is forgotten (`native.forget`), and the next caller looks again under the real
    environment (a kept "cannot compile" turned q8 and q4 off for the rest of the session)."""
    monkeypatch.setattr(native, "_directory", None)  # put back afterwards, with the kernel built there
    yield monkeypatch
    native.forget()


def test_without_a_compiler_the_reason_is_said_and_float32_keeps_pytorchs_kernels(native_elsewhere, tmp_path):
    native_elsewhere.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "cannot compile" in native.build(tmp_path / "native")
    assert resolve("auto", torch.float32, torch.device("cpu")) == "none"
    assert linear_for("int8", "q", torch.float32) is not NativeInt8Linear


def test_a_compiler_error_is_said(native_elsewhere, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'error: the compiler refused' >&2\nexit 1\n")
    fake.chmod(0o755)
    native_elsewhere.setenv("CC", str(fake))
    assert "the compiler refused" in native.build(tmp_path / "native")


def test_a_family_that_fails_to_compile_turns_off_only_its_own_kernels(native_elsewhere, tmp_path):
    broken = tmp_path / "lora.c"
    broken.write_text("this is not C\n")
    native_elsewhere.setitem(sources.FAMILIES, "lora", (broken,))
    assert native.build(tmp_path / "native") is None  # the int8 family compiles on its own
    assert native.lora_kernels() is None and native.rms_norm_rows() is not None


# ---- where start-up builds it, and what it says when it cannot (issue 25, item 5) ----------------------------

def float32_model():
    return embedded_float32()  # conftest: one load for the session


def test_the_configured_cache_dir_gets_the_kernel_where_the_default_cache_cannot_be_written(native_elsewhere, tmp_path):
    loaded = float32_model()
    blocker = tmp_path / "a-file"  # no directory can be made under a file, not even by root
    blocker.write_text("")
    native_elsewhere.setenv("HOME", str(blocker))
    native_elsewhere.setenv("OAI_GEMMA_CACHE", str(blocker / "cache"))
    config = resolve_config(Settings(model=ModelSettings(cache_dir=str(tmp_path / "mine"))), loaded)
    assert config.model.native_dir == tmp_path / "mine" / "native"
    assert config.model.quantization == "int8"  # auto, in float32, with the kernel built in the configured cache
    assert list(config.model.native_dir.glob("woq_int8-*.so"))


def test_without_the_kernel_auto_warns_with_the_reason_and_the_cost_and_int8_is_a_start_up_error(native_elsewhere, tmp_path, caplog):
    loaded = float32_model()
    native_elsewhere.setenv("CC", str(tmp_path / "no-such-cc"))
    settings = Settings(model=ModelSettings(cache_dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="oai_gemma.engine"):
        assert resolve_config(settings, loaded).model.quantization == "none"
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING and "native int8 kernel" in r.message)
    assert "cannot compile" in warning.message and "17.8 ms instead of 3.1" in warning.message
    settings.model.quantization = "int8"
    with pytest.raises(ConfigError, match="quantization = \"int8\".*cannot compile"):
        resolve_config(settings, loaded)


def q8_reference(x: torch.Tensor, linear: NativeQ8Linear) -> torch.Tensor:
    """What woq_int8.c's q8_linear computes, in torch: x rounded to int8 per block of 32 columns (one scale a block,
    half away from zero), exact integer sums per block, scaled and summed over blocks in order, times the weight's
    scale."""
    rows, k = x.shape
    w = linear.packed.permute(0, 2, 1, 3).reshape(-1, k).to(torch.int32)
    blocks = x.float().view(rows, k // 32, 32)
    scale = blocks.abs().amax(dim=2) / 127
    inverse = torch.where(scale > 0, 127 / blocks.abs().amax(dim=2), torch.zeros_like(scale))
    r = blocks * inverse[..., None]
    q = torch.where(r < 0, r - 0.5, r + 0.5).trunc().to(torch.int32)
    out = torch.zeros(rows, w.shape[0])
    for b in range(k // 32):
        sums = (q[:, b, None, :] * w[None, :, b * 32 : (b + 1) * 32]).sum(-1).float()
        out = out + sums * scale[:, b, None]
    return out * linear.scale


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
def test_the_q8_kernel_computes_int8_activations_times_int8_weights(rows):
    weight = torch.randn(272, 640, generator=torch.Generator().manual_seed(1)) * 0.05
    linear = NativeQ8Linear(weight)
    x = activations(rows, 640, seed=rows)
    x[:, 5] *= 40  # an outlier costs only its own block's precision
    torch.testing.assert_close(linear(x), q8_reference(x, linear), rtol=1e-5, atol=1e-4)
    wide = F.linear(x, linear.dequantized())  # float32 activations: 8-bit blocks cost about a percent
    assert (linear(x) - wide).norm() <= 0.02 * wide.norm()
    assert torch.equal(linear(x.bfloat16(), torch.bfloat16), linear(x.bfloat16()).bfloat16()), "bf16 out rounded as torch does"


def test_a_rows_q8_result_ignores_the_rows_beside_it_and_both_instruction_sets_agree():
    linear = NativeQ8Linear(torch.randn(528, 640, generator=torch.Generator().manual_seed(2)) * 0.05)
    x = activations(KERNEL_ROWS - 1, 640)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 8, 17, KERNEL_ROWS - 1):
        assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows together differ from each alone"
    if native.cpu_has_vnni():  # integer sums are exact and the float steps run in one order: the same bits
        out = {}
        for vnni in (True, False):
            out[vnni] = torch.empty(5, 528)
            native.q8_linear()(x.data_ptr(), 5, 640, linear.packed.data_ptr(), linear.scale.data_ptr(), 528,
                               out[vnni].data_ptr(), 0, 0, vnni)
        assert torch.equal(out[True], out[False])


def test_q8_sizes_it_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0"):
        NativeQ8Linear(torch.randn(24, 640))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0"):
        NativeQ8Linear(torch.randn(32, 48))


@pytest.mark.parametrize("vnni, avx512, int_dot_flags, isa", [
    (True, True, ("-mavx512vnni", "-mavx512vl"), "avx512-vnni"),
    (False, True, (), "avx512"),
    (False, False, ("-mavxvnni",), "avx2-vnni"),  # an AVX-VNNI CPU without AVX512: int_dot.c's 256-bit vpdpbusd
    (False, False, (), "avx2"),
])
def test_the_kernel_isa_names_what_the_kernels_are_built_for(monkeypatch, vnni, avx512, int_dot_flags, isa):
    monkeypatch.setattr(native, "native_unavailable", lambda: None)
    monkeypatch.setattr(native, "cpu_has_vnni", lambda: vnni)
    monkeypatch.setattr(native, "cpu_has_avx512", lambda: avx512)
    monkeypatch.setattr(native, "isa_flags", lambda family: int_dot_flags if family == "int_dot" else ())
    assert native.kernel_isa() == isa
