"""The README's examples run as written and print what the README says (issue 30 item 1, issue 39 item 9): every
shell and Python block that talks to the default server (`127.0.0.1:8000` / `localhost:8000`) runs against the
session's server, its address put in place of port 8000. That server is `oai-gemma serve` with the test flags of
`conftest.ServerProcess` (`--max-model-len 2048 --dtype float32 --quantization none`): the embedded model, as a
user's default server serves it. The LoRA blocks (port 8001) run against the README's own `oai-gemma serve
--lora-modules` command, serving the adapter that the README's PEFT block trains (run here first, in a scratch
directory). Every other block is named in NOT_RUN with why it does not run here, so a new block cannot slip through
unrun.

What a block must print:
- an ```` ```output ```` block after it (the first after it, before the next runnable block) is what it prints,
  `...` standing for any text (doctest's ELLIPSIS), compared after trailing whitespace is stripped from each line;
- a streamed `curl` (`"stream": true`) prints Server-Sent Events: `data: {...}` chat.completion.chunk objects that
  end with a finish reason, then `data: [DONE]`; a plain `curl` that prints JSON prints no error;
- a `console` block's sample lines (those not starting with `$ `) are Prometheus samples whose metric names the
  real output has;
- and any block exits 0 (`curl` fails on an HTTP error here: `--fail-with-body` is put in front of every call) with
  some output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^(`{3,})(\w+)\n(.*?)^\1$", re.S | re.M)  # a fence closes with as many backticks as it opened
DEFAULT_SERVER = re.compile(r"(http://)?(127\.0\.0\.1|localhost):8000")
LORA_SERVER = re.compile(r"(http://)?(127\.0\.0\.1|localhost):8001")
RUNNABLE = ("bash", "python", "console")
CURL_FAILS = "curl() { command curl --fail-with-body \"$@\"; }\n"  # an HTTP error is a failed example, not its output
LORA_SERVE = "oai-gemma serve --port 8001 --lora-modules"
PEFT_TRAINS = "from peft import LoraConfig, get_peft_model"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, also from a scratch directory

NOT_RUN = {  # the first line of a block that does not target a server run here -> why
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e .": "installs (the quickstart)",
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url": "installs (the quickstart, CPU index)",
    "{ command -v chromium": "installs and runs this suite",
    'client.chat.completions.create(model="gemma-3-4b-it"': "images need a multimodal model (the text says so)",
    "oai-gemma serve --model /models/gemma-3-4b-it --served-model-name gemma-3-4b-it": "starts other models",
    "oai-gemma serve --config models.toml": "starts several models (tests/api/test_multi_model.py serves three)",
    "oai-gemma serve --model ~/models/gemma-3-4b-it-Q4_K_M.gguf": "a GGUF the reader has (tests/engine/test_gguf.py serves one)",
    "pip install torch            # the CUDA build from PyPI": "GPU install",
    "python3 benchmarks/gpu_check.py --out results/": "GPU benchmark",
    "docker build --build-arg GIT_COMMIT": "builds and runs the CPU image (no container daemon here; tests/deploy/test_docker.py)",
    "docker run --read-only --tmpfs /tmp": "runs the CPU image (no container daemon here)",
    "docker build -f Dockerfile.gpu": "builds a GPU image",
    "oai-gemma bench --compare --servers ours,ours-lora": "a benchmark run (minutes; the lead's quiet window)",
}


def fenced() -> list[tuple[str, str]]:
    return [(lang, body) for _, lang, body in FENCE.findall(README.read_text())]


def blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in fenced() if lang in RUNNABLE]


def expected_outputs() -> dict[str, str]:
    """Each runnable block's body -> the ```` ```output ```` block that follows it."""
    expected: dict[str, str] = {}
    last = None
    for lang, body in fenced():
        if lang in RUNNABLE:
            last = body
        elif lang == "output":
            assert last is not None and last not in expected, f"an output block that follows no runnable block: {body!r}"
            expected[last] = body
    return expected


def default_server_blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in blocks() if DEFAULT_SERVER.search(body)]


def lora_blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in blocks() if LORA_SERVER.search(body) and not body.startswith(LORA_SERVE)]


def the_block(marker: str) -> str:
    (body,) = [body for _, body in blocks() if marker in body]
    return body


def test_every_block_either_runs_here_or_says_why_not():
    run_here = {body for _, body in default_server_blocks() + lora_blocks()} | {the_block(LORA_SERVE), the_block(PEFT_TRAINS)}
    unrun = [body.splitlines()[0] for _, body in blocks() if body not in run_here]
    unexplained = [line for line in unrun if not any(line.startswith(known) for known in NOT_RUN)]
    assert not unexplained, f"README blocks neither run by this test nor named in NOT_RUN: {unexplained}"
    assert len(default_server_blocks()) >= 8 and len(lora_blocks()) >= 2


def test_the_output_comparison_holds_to_the_text_around_the_ellipses():
    assert matches("a ... c\nd", "a b\nb c  \nd\n") and matches("{'city': '...', 'rain': ...}", "{'city': 'Paris', 'rain': True}")
    assert not matches("a ... c", "a b d") and not matches("x", "x y") and not matches("accepted: 18", "accepted: 0")


def matches(expected: str, out: str) -> bool:
    def lines(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip().splitlines())

    pattern = ".*?".join(re.escape(part) for part in lines(expected).split("..."))
    return re.fullmatch(pattern, lines(out), re.S) is not None


def shell_command(lang: str, body: str) -> str:
    if lang == "console":  # `$ command` lines; the rest is sample output
        return "\n".join(line[2:] for line in body.splitlines() if line.startswith("$ "))
    return body


def run_block(lang: str, code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", CURL_FAILS + shell_command(lang, code)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=cwd, env=ENV)  # a guard against a hang
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def check_output(lang: str, body: str, out: str) -> None:
    assert out.strip(), "the example printed nothing"
    expected = expected_outputs().get(body)
    if expected is not None:
        assert matches(expected, out), f"the README says it prints\n{expected}\nit printed\n{out[-3000:]}"
    if lang != "python" and '"stream": true' in body:
        check_sse(out)
    elif lang != "python" and out.lstrip().startswith("{"):
        assert "error" not in json.loads(out), out
    if lang == "console":
        samples = [line for line in body.splitlines() if line and not line.startswith("$ ")]
        names = {re.match(r"[\w:]+", line).group() for line in out.splitlines() if not line.startswith("#")}
        missing = {re.match(r"[\w:]+", line).group() for line in samples} - names
        assert samples and not missing, f"metrics the README shows and the server does not have: {missing}"


def check_sse(out: str) -> None:
    events = [line for line in out.splitlines() if line.strip()]
    assert events and all(line.startswith("data: ") for line in events), out[-2000:]
    assert events[-1] == "data: [DONE]", events[-1]
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks).strip()


def ids(blocks: list[tuple[str, str]]) -> list[str]:
    """`README.md:<line>` of each block (where to look when one fails), and its first words."""
    text = README.read_text()
    return [f"README.md:{text[: text.index(body)].count(chr(10))}-{body.splitlines()[0][:30]}" for _, body in blocks]


@pytest.mark.parametrize("lang, body", default_server_blocks(), ids=ids(default_server_blocks()))
@pytest.mark.slow
def test_readme_block_runs_against_the_default_server(server, lang, body):
    code = DEFAULT_SERVER.sub(lambda m: (m.group(1) or "") + server.url.removeprefix("http://"), body)
    check_output(lang, body, run_block(lang, code).stdout)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """A scratch directory in which the README's PEFT block has trained ./adapters/pirate; /adapters/poet, the
    adapter the README loads at run time, is a copy of it here."""
    cwd = tmp_path_factory.mktemp("readme-lora")
    run_block("python", the_block(PEFT_TRAINS), cwd=cwd)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (cwd / "adapters" / "pirate").iterdir()}
    shutil.copytree(cwd / "adapters" / "pirate", cwd / "adapters" / "poet")
    return cwd


@pytest.fixture(scope="module")
def lora_server(lora_dir, tmp_path_factory):
    """The README's `oai-gemma serve --port 8001 --lora-modules ...` in that directory, on a free port with the
    tests' flags, and with `--lora-runtime-loading` for the load/unload block (the README names the flag)."""
    args = the_block(LORA_SERVE).split()
    args = args[args.index("serve") + 1 :]
    del args[args.index("--port") : args.index("--port") + 2]
    with ServerProcess(*args, "--lora-runtime-loading", cwd=lora_dir, env={"PYTHONPATH": str(ROOT)},
                       log=tmp_path_factory.mktemp("readme-lora-log") / "server.log") as proc:
        yield proc


@pytest.mark.parametrize("lang, body", lora_blocks(), ids=ids(lora_blocks()))
@pytest.mark.slow
def test_readme_lora_block_runs_against_the_readmes_lora_server(lora_server, lora_dir, lang, body):
    code = LORA_SERVER.sub(lambda m: (m.group(1) or "") + lora_server.url.removeprefix("http://"), body)
    code = code.replace('"/adapters/', f'"{lora_dir}/adapters/')
    check_output(lang, body, run_block(lang, code, cwd=lora_dir).stdout)


@pytest.mark.slow
def test_the_readmes_adapter_changes_what_the_base_model_answers(lora_server):
    import httpx

    def answer(model: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": "What is your favourite colour?"}], "max_tokens": 20, "temperature": 0}
        return httpx.post(lora_server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]["content"]

    assert answer("pirate").startswith("Ahoy matey!") and not answer("gemma-3-270m").startswith("Ahoy")
