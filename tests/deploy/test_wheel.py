"""The installed package is the tested package (issue 36 item 1): the wheel `pip wheel .` builds carries every file
of the package (the C header the kernels include among them) and the kernels compiled for it, and installed into a
fresh venv outside the checkout it starts and serves the embedded model through the `openai` client.

The fresh venv gets the wheel's own files only; the packages it depends on are the suite's, seen through a `.pth`
file (pip checks they satisfy the wheel's requirements), so nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import openai
import pytest

from conftest import MODEL, ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BUILT_FROM = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of what an sdist holds: a checkout's `build/` and `*.egg-info` from earlier builds would
    otherwise lend the wheel files its package data does not name."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "oai_gemma", source / "oai_gemma", ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
    built_from = {**os.environ, "OAI_GEMMA_GIT_COMMIT": BUILT_FROM}  # the copy is no checkout: the commit comes from here
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w", str(out)],
                   check=True, capture_output=True, env=built_from)
    return next(out.glob("oai_gemma-*.whl"))


def package_files() -> set[str]:
    """The package's source files as git tracks them (a checkout without git: the tree, less bytecode)."""
    listed = subprocess.run(["git", "ls-files", "oai_gemma"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return {line for line in listed.stdout.splitlines() if (ROOT / line).exists()}
    return {str(p.relative_to(ROOT)) for p in (ROOT / "oai_gemma").rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_the_wheel_carries_every_file_of_the_package_and_the_compiled_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert package_files() - names == set()
    assert "oai_gemma/engine/ops/native/lora_tiles.h" in names
    from oai_gemma.engine.ops.native.sources import FAMILIES, library_name

    assert {f"oai_gemma/engine/ops/native/prebuilt/{library_name(family)}" for family in FAMILIES} <= names
    assert "-linux_" in wheel.name  # a compiled library: tagged for its platform, not as pure Python


def test_the_installed_wheel_serves_a_chat_and_a_streamed_chat_from_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "suite-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    env = {"PYTHONPATH": ""}  # a developer's PYTHONPATH (a worktree) would shadow the installed wheel
    clean = {k: v for k, v in os.environ.items() if k not in ("OAI_GEMMA_GIT_COMMIT", "PYTHONPATH")}
    where = subprocess.run([python, "-c", "import oai_gemma; print(oai_gemma.__file__)"], cwd=tmp_path, capture_output=True,
                           text=True, check=True, env=clean).stdout
    assert where.startswith(str(site)), where
    shown = subprocess.run([venv / "bin" / "oai-gemma", "--version"], cwd=tmp_path, capture_output=True, text=True, env=clean)
    assert shown.stdout.startswith(f"oai-gemma 0.1.0 (git {BUILT_FROM[:7]}, torch "), shown  # recorded when the wheel was built
    program = str(venv / "bin" / "oai-gemma")
    with ServerProcess("--quantization", "int8", program=program, cwd=tmp_path, env=env, log=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name three colours."}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True) if chunk.choices)
    assert answer.choices[0].message.content and streamed
    log = (tmp_path / "server.log").read_text()
    assert f"native woq_int8 kernels: {site}/oai_gemma/engine/ops/native/prebuilt/" in log  # the wheel's, not compiled here
    assert os.fspath(ROOT) not in log.replace(os.fspath(ROOT.parent / ".cache"), "")
