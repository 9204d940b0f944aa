"""What runs, said everywhere (issue 36 item 5): `oai-gemma --version`, `/v1/server_info` (and `/health`) and the
start-up log carry the version, the git commit (read from `.git`: every layout git writes), torch's version and
the kernels' instruction sets."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from oai_gemma.engine.ops import native
from oai_gemma.version import CHECKOUT, git_commit, version, version_line

SHA = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def test_version_prints_the_version_the_commit_and_torch():
    done = subprocess.run([sys.executable, "-m", "oai_gemma.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    commit = git_commit()
    assert done.stdout == f"oai-gemma {version()} ({f'git {commit[:7]}, ' if commit else ''}torch {torch.__version__})\n"


@pytest.mark.skipif(not (CHECKOUT / ".git").exists() or not shutil.which("git"), reason="not running from a git checkout")
def test_the_commit_read_from_dot_git_is_the_one_git_names():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit() == head


def _layout(root: Path, kind: str) -> Path:
    """A checkout at `root/repo` whose HEAD is SHA, in one of the layouts git writes."""
    repo, git = root / "repo", root / "repo" / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    if kind == "loose ref":
        (git / "refs" / "heads").mkdir(parents=True)
        (git / "refs" / "heads" / "main").write_text(SHA + "\n")
    elif kind == "packed ref":
        (git / "packed-refs").write_text(f"# pack-refs with: peeled fully-peeled sorted\n{OTHER} refs/heads/other\n{SHA} refs/heads/main\n")
    elif kind == "detached HEAD":
        (git / "HEAD").write_text(SHA + "\n")
    elif kind == "worktree":  # `git worktree add ../wt`: .git is a file; the branch's ref is in the main .git
        (git / "refs" / "heads").mkdir(parents=True)
        (git / "refs" / "heads" / "wt").write_text(SHA + "\n")
        private = git / "worktrees" / "wt"
        private.mkdir(parents=True)
        (private / "HEAD").write_text("ref: refs/heads/wt\n")
        (private / "commondir").write_text("../..\n")
        repo = root / "wt"
        repo.mkdir()
        (repo / ".git").write_text("gitdir: ../repo/.git/worktrees/wt\n")
    return repo


@pytest.mark.parametrize("kind", ["loose ref", "packed ref", "detached HEAD", "worktree"])
def test_the_commit_is_read_from_every_git_layout(kind, tmp_path):
    assert git_commit(_layout(tmp_path, kind)) == SHA


def test_outside_a_checkout_the_commit_is_the_image_builds_or_none(tmp_path, monkeypatch):
    monkeypatch.delenv("OAI_GEMMA_GIT_COMMIT", raising=False)
    assert git_commit(tmp_path) is None  # installed from a wheel
    monkeypatch.setenv("OAI_GEMMA_GIT_COMMIT", SHA)  # the Dockerfile's GIT_COMMIT build argument
    assert git_commit(tmp_path) == SHA


def test_server_info_and_the_start_up_log_say_what_runs(server):
    info = httpx.get(server.url + "/v1/server_info").json()
    capability, isa = torch.backends.cpu.get_cpu_capability(), native.kernel_isa()
    assert info["version"] == version() and info["git_commit"] == git_commit() and info["torch_version"] == torch.__version__
    assert info["cpu_capability"] == capability and info["kernel_isa"] == isa
    health = httpx.get(server.url + "/health").json()
    assert {key: health[key] for key in ("version", "git_commit", "kernel_isa")} == {key: info[key] for key in ("version", "git_commit", "kernel_isa")}
    log = server.log_path.read_text()
    assert version_line() in log and f"CPU kernels: torch {capability}, native {isa}" in log
