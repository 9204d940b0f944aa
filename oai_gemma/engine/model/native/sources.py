"""The native kernels' sources, flags and how they are compiled, with nothing imported but the standard library:
the wheel's build (setup.py) compiles them with this module, loaded by path before torch or the package exist,
and the run-time build (`native/__init__.py`) compiles them the same way where the wheel carries no library."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "woq_int8.c", HERE / "lora.c")
HEADERS = (HERE / "lora_tiles.h",)
SOURCE_NAMES = " and ".join(source.name for source in SOURCES)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-lm")
PREBUILT = HERE / "prebuilt"
"""Where a wheel keeps the library its build compiled (absent in a checkout and in a wheel built without a compiler)."""


class CompileFailed(RuntimeError):
    """Why the kernels could not be compiled here (no compiler, a failed compile, an unwritable directory)."""


def library_name() -> str:
    """The library's file name, named by the sources' and flags' digest: a changed source is never a stale library."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode())
    return f"woq_int8-{digest.hexdigest()[:16]}.so"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_into(directory: Path) -> Path:
    """Compile the library into `directory` (atomically: a concurrent build loads a whole library or makes its own)
    and return its path; raises CompileFailed with the reason."""
    target = directory / library_name()
    cc = compiler()
    if cc is None:
        raise CompileFailed("no C compiler (cc, gcc) on PATH; install gcc (Debian: build-essential)")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(partial)], capture_output=True, text=True)
    except OSError as error:
        raise CompileFailed(f"cannot compile {SOURCE_NAMES} into {directory}: {error}") from error
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise CompileFailed(f"{cc} failed on {SOURCE_NAMES}: {done.stderr.strip()[-500:]}")
    partial.replace(target)
    return target
