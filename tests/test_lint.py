"""The package passes ruff (pyproject.toml's [tool.ruff]: pyflakes, syntax errors, and the complexity cap C901)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")  # installed with the test extra, in the running venv
    return [str(beside)] if beside.exists() else [shutil.which("ruff") or "ruff"]


def test_the_package_passes_ruff_with_the_complexity_check():
    run = subprocess.run([*_ruff(), "check", "--no-cache", "oai_gemma"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
