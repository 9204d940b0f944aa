"""int_dot.c's compile-time variants (benchmarks/gemv_ab.py builds them for its in-process A/B): a schedule of the
tiles across threads (`SCHEDULE`, `CHUNKS`), the software prefetch distance (`PREFETCH`) and the timing build
(`TIMING`) each give every output the shipped build's bits, at one row and several, on two threads; the timing build
reports where a call's time went; the VNNI builds (sources.ISA_FLAGS, where this CPU has them) give the AVX2 build's
bits, int_dot.c's and the vision tower's vision_dot.c alike."""

import ctypes
import subprocess

import pytest
import torch

from oai_gemma.engine.ops import native
from oai_gemma.engine.ops.int_dot import DOT_TILES, Q4Linear, Q5Linear, Q8Linear
from oai_gemma.engine.ops.native import sources

pytestmark = pytest.mark.skipif(native.int_dot_unavailable() is not None or sources.compiler() is None,
                                reason="the integer dot-product kernels cannot be built here")

VARIANTS = ["-DCHUNKS=4 -DTIMING", "-DSCHEDULE=guided -DPREFETCH=0 -DPREFETCH_HINT=_MM_HINT_T1 -DQ4_DIRECT=0", "-DINTERLEAVE=1"]
"""Three builds (each compile is seconds): the variants' defines combined (`Q4_DIRECT=0`: a VNNI build's q4 through int16)."""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    directory = tmp_path_factory.mktemp("int_dot_builds")
    return {flag: compile_with(directory, f"variant{i}", [*sources.flags("int_dot"), *flag.split()])
            for i, flag in enumerate(VARIANTS)}


def compile_with(directory, name: str, flags, family: str = "int_dot") -> ctypes.CDLL:
    target = directory / f"{name}.so"
    subprocess.run([sources.compiler(), *flags, str(sources.FAMILIES[family][0]), "-o", str(target)], check=True)
    return ctypes.CDLL(str(target))


def run(library, linear, x: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    packed = linear.packed if packed is None else packed
    y = torch.empty(x.shape[0], linear.out_features, dtype=x.dtype)
    scale = linear.scale if linear.KIND == "q8" else packed
    tile_rows, tile_groups = DOT_TILES[linear.KIND][x.shape[0] > 1]
    bf16 = ctypes.c_int(x.dtype == torch.bfloat16)
    getattr(library, f"{linear.KIND}_dot_linear")(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
        ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(scale.data_ptr()), ctypes.c_int64(linear.out_features),
        ctypes.c_void_p(y.data_ptr()), bf16, bf16, ctypes.c_int(tile_rows), ctypes.c_int(tile_groups))
    return y


@pytest.mark.parametrize("cls", [Q8Linear, Q4Linear, Q5Linear])
@pytest.mark.parametrize("rows", [1, 5])
def test_every_variant_gives_the_shipped_kernels_bits(builds, cls, rows):
    generator = torch.Generator().manual_seed(3)
    linear = cls(torch.randn(8 * 53, 96, generator=generator) * 0.05)  # 53 groups: tiles of 4 leave one over
    x = torch.randn(rows, 96, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        shipped = linear.rowwise(x)
        for flag, library in builds.items():
            if flag != "-DINTERLEAVE=1":
                assert torch.equal(run(library, linear, x), shipped), flag
    finally:
        torch.set_num_threads(threads)


def test_the_timing_build_reports_a_calls_time(builds):
    library = builds["-DCHUNKS=4 -DTIMING"]
    linear = Q4Linear(torch.randn(8 * 64, 256, generator=torch.Generator().manual_seed(4)) * 0.05)
    timing = (ctypes.c_double * 3)()
    library.int_dot_timing(timing)  # zeroed
    run(library, linear, torch.randn(1, 256))
    library.int_dot_timing(timing)
    tile_cpu, tile_wall, call_wall = timing
    assert 0 < tile_wall and 0 < call_wall and 0 <= tile_cpu
    marks = (ctypes.c_double * 7)()
    library.int_dot_marks(marks)
    start, region, enter0, exit0, _, _, end = marks
    assert start <= region <= enter0 <= exit0 <= end


@pytest.mark.parametrize("cls", [Q4Linear, Q5Linear])
def test_the_interleaved_experiment_reads_its_own_layout_to_the_same_bits(builds, cls):
    """`-DINTERLEAVE=1`: a one-row tile's four groups block by block (benchmarks/gemv_ab.py lays them out)."""
    generator = torch.Generator().manual_seed(5)
    linear = cls(torch.randn(8 * 48, 96, generator=generator) * 0.05)
    x = torch.randn(1, 96, generator=generator)
    groups, blocks, nbytes = linear.packed.shape
    relaid = linear.packed.view(groups // 4, 4, blocks, nbytes).permute(0, 2, 1, 3).contiguous()
    assert torch.equal(run(builds["-DINTERLEAVE=1"], linear, x, relaid), linear.rowwise(x))


VNNI = [extra for needed, extra in sources.ISA_FLAGS["int_dot"] if needed <= sources.cpu_flags()]


@pytest.fixture(scope="module")
def isa_builds(tmp_path_factory):
    """The AVX2 build (the family's flags without sources.ISA_FLAGS) and each VNNI build this CPU can run."""
    directory, avx2 = tmp_path_factory.mktemp("int_dot_isa"), sources.flags("int_dot", isa=False)
    return compile_with(directory, "avx2", avx2), [compile_with(directory, f"vnni{i}", avx2 + extra) for i, extra in enumerate(VNNI)]


@pytest.mark.skipif(not VNNI, reason="this CPU has neither AVX-VNNI nor AVX512-VNNI with VL")
@pytest.mark.parametrize("cls", [Q8Linear, Q4Linear, Q5Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vnni_builds_give_the_avx2_builds_bits(isa_builds, cls, dtype):
    avx2, vnni = isa_builds
    generator = torch.Generator().manual_seed(6)
    linear = cls(torch.randn(8 * 53, 256, generator=generator) * 0.05)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 3, 8, 33, 130):
            x = torch.randn(rows, 256, generator=generator)
            x[:, 5] *= 40  # an outlier: its block's other values quantize small, the outlier's to 127
            x = x.to(dtype)
            expected = run(avx2, linear, x)
            for extra, library in zip(VNNI, vnni):
                assert torch.equal(run(library, linear, x), expected), (rows, extra)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not VNNI, reason="this CPU has neither AVX-VNNI nor AVX512-VNNI with VL")
def test_the_vision_towers_vnni_builds_give_the_avx2_builds_bits(tmp_path):
    # 53 groups of outputs: pairs in the 512-bit tiles and one left for the 256-bit tile; rows 1 (256-bit) to 130
    from oai_gemma.engine.model.vision_layout import TILE, VisionLinear

    avx2 = sources.flags("vision_dot", isa=False)
    builds = [compile_with(tmp_path, name, flags, "vision_dot")
              for name, flags in [("avx2", avx2), *((f"vnni{i}", avx2 + extra) for i, extra in enumerate(VNNI))]]
    generator = torch.Generator().manual_seed(7)
    linear = VisionLinear(torch.randn(8 * 53, 256, generator=generator) * 0.05, torch.randn(8 * 53, generator=generator))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 3, 8, 33, 130):
            x = torch.randn(rows, 256, generator=generator)
            x[:, 5] *= 40
            outputs = []
            for library in builds:
                y = torch.empty(rows, linear.linear.out_features)
                library.q7_dot_linear(*(ctypes.c_void_p(t.data_ptr()) if isinstance(t, torch.Tensor) else t for t in (
                    x, ctypes.c_int64(rows), ctypes.c_int64(256), linear.linear.packed, linear.block_sums, linear.linear.scale,
                    linear.bias, ctypes.c_int64(linear.linear.out_features), y, ctypes.c_int(TILE[0]), ctypes.c_int(TILE[1]))))
                outputs.append(y)
            assert all(torch.equal(y, outputs[0]) for y in outputs[1:]), rows
            assert torch.equal(outputs[0], linear(x)), "the shipped build"
    finally:
        torch.set_num_threads(threads)


def test_the_avx2_stand_in_builds_without_vnni(monkeypatch):
    """`ATEN_CPU_CAPABILITY=avx2` builds (and names) what an AVX2-only CPU has."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert sources.flags("int_dot") == sources.flags("int_dot", isa=False)
    avx2 = sources.library_name("int_dot")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert (sources.library_name("int_dot") != avx2) == bool(VNNI)
