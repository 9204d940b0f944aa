"""What runs: the package's version, the git commit it came from and torch's build, for `oai-gemma --version`, the
start-up log and `/v1/server_info`, so that a bug report or a benchmark says what it ran on."""

from __future__ import annotations

import functools
import os
from importlib import metadata
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
"""The directory above the package: a git checkout's root when running from one (an editable install, `python -m`)."""
BUILD_COMMIT = Path(__file__).with_name("BUILD_COMMIT")
"""The commit a wheel was built from, written into it by setup.py where the build ran in a checkout."""


def version() -> str:
    try:
        return metadata.version("oai-gemma")
    except metadata.PackageNotFoundError:  # the source tree on sys.path, never installed
        return "unknown"


def torch_version() -> str:
    """torch's version from its metadata (`2.13.0+cpu`): `--version` answers without importing torch (2 s)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_commit(root: Path = CHECKOUT) -> str | None:
    """The checkout's HEAD commit when the package runs from one, read from `.git` without spawning git (which a
    slim image lacks); else `OAI_GEMMA_GIT_COMMIT` (the image build sets it), else the commit the wheel was built
    from (`BUILD_COMMIT`), else None."""
    try:
        git = root / ".git"
        if git.is_file():  # a worktree or a submodule: `gitdir: <path>`
            git = (root / git.read_text().partition(":")[2].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head  # a detached HEAD
        ref = head.removeprefix("ref: ")
        common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").is_file() else git
        for base in (git, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
        packed = [line.split()[0] for line in (common / "packed-refs").read_text().splitlines() if line.endswith(" " + ref)]
        return packed[0] if packed else None
    except OSError:
        return os.environ.get("OAI_GEMMA_GIT_COMMIT") or (BUILD_COMMIT.read_text().strip() if BUILD_COMMIT.is_file() else None)


def version_line() -> str:
    """`oai-gemma 0.1.0 (git 7a59612, torch 2.13.0+cpu)`: `--version`, and the start-up log's first line."""
    commit = git_commit()
    return f"oai-gemma {version()} ({f'git {commit[:7]}, ' if commit else ''}torch {torch_version()})"


@functools.cache
def provenance() -> dict[str, object]:
    """`/v1/server_info`'s version fields, once (`kernel_isa`, the native kernels', comes from the engine)."""
    import torch

    return {"version": version(), "git_commit": git_commit(), "torch_version": str(torch.__version__),  # a str subclass msgspec refuses
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
