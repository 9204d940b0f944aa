"""The README's examples run as written (issue 30 item 1): every shell and Python block that talks to the default
server (`127.0.0.1:8000` / `localhost:8000`) runs against the session's server, its address put in place of
port 8000. That server is `oai-gemma serve` with the test flags of `conftest.ServerProcess` (`--max-model-len 2048
--dtype float32 --quantization none`): the embedded model, as a user's default server serves it. Every other block
is named below with why it does not run here, so a new block cannot slip through unrun."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
DEFAULT_SERVER = re.compile(r"(http://)?(127\.0\.0\.1|localhost):8000")
RUNNABLE = ("bash", "python", "console")

NOT_RUN = {  # the first line of a block that does not target the default server -> why
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e .": "installs (the quickstart)",
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url": "installs (the quickstart, CPU index)",
    "{ command -v chromium": "installs and runs this suite",
    'client.chat.completions.create(model="gemma-3-4b-it"': "images need a multimodal model (the text says so)",
    "oai-gemma serve --model /models/gemma-3-4b-it --served-model-name gemma-3-4b-it": "starts other models",
    "pip install torch            # the CUDA build from PyPI": "GPU install",
    "python3 benchmarks/gpu_check.py --out results/": "GPU benchmark",
    "docker build --build-arg GIT_COMMIT": "builds and runs the CPU image (no container daemon here; tests/test_docker.py)",
    "docker run --read-only --tmpfs /tmp": "runs the CPU image (no container daemon here)",
    "docker build -f Dockerfile.gpu": "builds a GPU image",
    "oai-gemma serve --port 8001 --lora-modules": "starts a server with LoRA adapters (tests/test_lora_server.py runs one)",
    "curl -s localhost:8001/v1/chat/completions": "needs that server's adapters (tests/test_lora_server.py sends the same)",
    "curl -s localhost:8001/v1/load_lora_adapter": "needs that server's adapters (tests/test_lora_server.py loads and unloads)",
    "from peft import LoraConfig, get_peft_model": "trains an adapter (tests/lora_adapters.py does, in a test fixture)",
    "oai-gemma bench --compare --servers ours,ours-lora": "a benchmark run (minutes; the lead's quiet window)",
}


def blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(README.read_text()) if lang in RUNNABLE]


def default_server_blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in blocks() if DEFAULT_SERVER.search(body)]


def test_every_block_either_runs_here_or_says_why_not():
    unrun = [body.splitlines()[0] for _, body in blocks() if not DEFAULT_SERVER.search(body)]
    unexplained = [line for line in unrun if not any(line.startswith(known) for known in NOT_RUN)]
    assert not unexplained, f"README blocks neither run by this test nor named in NOT_RUN: {unexplained}"
    assert len(default_server_blocks()) >= 6


def shell_command(lang: str, body: str) -> str:
    if lang == "console":  # `$ command` lines; the rest is sample output
        return "\n".join(line[2:] for line in body.splitlines() if line.startswith("$ "))
    return body


@pytest.mark.parametrize("lang, body", default_server_blocks(), ids=lambda v: v.splitlines()[0][:40] if "\n" in v else v)
def test_readme_block_runs_against_the_default_server(server, lang, body):
    code = DEFAULT_SERVER.sub(lambda m: (m.group(1) or "") + server.url.removeprefix("http://"), body)
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", shell_command(lang, code)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)  # a guard against a hang, not a speed goal
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), "the example printed nothing"
    if "curl -N" in code:
        assert "data: [DONE]" in done.stdout and re.search(r'"finish_reason": ?"(stop|length)"', done.stdout)
