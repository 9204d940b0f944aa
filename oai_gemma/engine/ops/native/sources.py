"""The native kernels' sources (one library per family), flags and how they are compiled, with nothing imported but the standard library:
the wheel's build (setup.py) compiles them with this module, loaded by path before torch or the package exist,
and the run-time build (`ops/native/__init__.py`) compiles them the same way where the wheel carries no library."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
FAMILIES = {
    "woq_int8": (HERE / "woq_int8.c", HERE / "avx2_common.h"),  # the int8 linears (woq_int8_linear, q8_linear) and rms_norm_rows
    "lora": (HERE / "lora.c", HERE / "lora_tiles.h"),  # lora_project
    "int_dot": (HERE / "int_dot.c", HERE / "avx2_common.h"),  # int8 x int8 dot products: q8_dot_linear, q4_dot_linear (quantization q8, q4)
    "layer": (HERE / "layer.c",),  # a decoder layer's small steps: qk_norm_rope, residual_norm
    "attention": (HERE / "attention.c",),  # decode_attention: a step's decode rows over their own KV blocks, in place
    "q4_quantize": (HERE / "q4_quantize.c",),  # q4_1_blocks: quantization q4's least-squares search
    "vision_dot": (HERE / "vision_dot.c", HERE / "avx2_common.h"),  # q7_dot_linear: the vision tower's int8 x 7-bit linears
}
"""One library per kernel family, so a family that fails to compile turns off only its own kernels. The files
after the first are headers the first includes: they name the library too."""
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-lm")
FAMILY_FLAGS = {"layer": ("-ffp-contract=off",), "int_dot": ("-fschedule-insns", "-fsched-pressure")}
"""A family's flags beside FLAGS: `layer` must give torch's elementwise bits, so no multiply and add fuse into an FMA;
`int_dot`'s one-row tiles spilled a quarter of their products to the stack in GCC's default order, and scheduling
before register allocation, mindful of the sixteen registers, keeps them (q4: 1.2x the one-row throughput, measured
in instructions and CPU time; the same bits: an order of instructions, not of float operations)."""
VNNI_FLAGS = (({"avx512_vnni", "avx512vl", "avx512bw"}, ("-mavx512vnni", "-mavx512vl", "-mavx512bw")),
              ({"avx_vnni"}, ("-mavxvnni",)))
ISA_FLAGS = {"int_dot": VNNI_FLAGS, "vision_dot": VNNI_FLAGS}
"""A family's flags for what this CPU has beyond AVX2: the first entry whose CPU flags it has all of (int_dot.c's and
vision_dot.c's vpdpbusd: the same bits, fewer instructions; with AVX512BW their 512-bit tiles of several rows), none where `ATEN_CPU_CAPABILITY=avx2` (the AVX2 stand-in) or `default`
is set. Part of the library's name, so a build for other flags is never reused, and a wheel's library built on a
VNNI CPU is compiled again on one without."""
PREBUILT = HERE / "prebuilt"
"""Where a wheel keeps the libraries its build compiled (absent in a checkout and in a wheel built without a compiler)."""


class CompileFailed(RuntimeError):
    """Why the kernels could not be compiled here (no compiler, a failed compile, an unwritable directory)."""


def library_name(family: str) -> str:
    """The family's library file name, named by its sources' and flags' digest: a changed source is never a stale
    library."""
    files = FAMILIES[family]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in files) + " ".join(flags(family)).encode())
    return f"{family}-{digest.hexdigest()[:16]}.so"


def flags(family: str, isa: bool = True) -> tuple[str, ...]:
    """The family's compiler flags (`isa=False`: without ISA_FLAGS, the AVX2 build)."""
    return FLAGS + FAMILY_FLAGS.get(family, ()) + (isa_flags(family) if isa else ())


def isa_flags(family: str) -> tuple[str, ...]:
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        return ()
    here = cpu_flags()
    return next((extra for needed, extra in ISA_FLAGS.get(family, ()) if needed <= here), ())


@functools.cache
def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags (empty where there is none): oai_gemma.cpu.cpu_flags's reading, which this module, loaded
    by path without the package, cannot import."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((frozenset(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), frozenset())
    except OSError:
        return frozenset()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_into(directory: Path, family: str) -> Path:
    """Compile the family's library into `directory` (atomically: a concurrent build loads a whole library or makes
    its own) and return its path; raises CompileFailed with the reason."""
    source = FAMILIES[family][0]
    target = directory / library_name(family)
    cc = compiler()
    if cc is None:
        raise CompileFailed("no C compiler (cc, gcc) on PATH; install gcc (Debian: build-essential)")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([cc, *flags(family), str(source), "-o", str(partial)], capture_output=True, text=True)
    except OSError as error:
        raise CompileFailed(f"cannot compile {source.name} into {directory}: {error}") from error
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise CompileFailed(f"{cc} failed on {source.name}: {done.stderr.strip()[-500:]}")
    partial.replace(target)
    return target
