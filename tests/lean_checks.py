"""The lean module tree's point, checked in a fresh interpreter: a start that never imports transformers."""

from __future__ import annotations

import subprocess
import sys

NO_TRANSFORMERS = (
    "import sys\n"
    "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if m.startswith('transformers'))[:5]\n"
)


def assert_runs_without_transformers(script: str) -> None:
    """Run `script` in a new Python, then check that nothing it did imported transformers."""
    done = subprocess.run([sys.executable, "-c", script + NO_TRANSFORMERS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
