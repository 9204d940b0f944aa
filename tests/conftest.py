"""One real `oai-gemma serve` process with the real embedded model, shared by the whole session (`server`), and the
servers shared across test files by their settings (`shared_servers`: the fault server, the tiny multimodal
model's). The folder map, the shared servers and the `slow` marker: docs/testing.md."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import httpx
import openai
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
if os.environ.get("PYTEST_XDIST_WORKER"):  # set by pytest-xdist before it loads this file
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
"""Under `-n N`, OpenMP's threads sleep at a barrier instead of spinning, in the worker's torch (set before torch
loads) and in every server and subprocess it starts (`engine.cpu_wait`'s `passive`, as an operator's variable: kept):
two workers, their servers and clients share two cores, and a spinning thread burns its time slice while the thread
it waits for is off the CPU (loaded, a 32-token request to the default server: 12.9 -> 2.8 s of CPU). One process
(`python -m pytest`; CI and the README run `-n 2`) keeps OpenMP's default: quiet, api/test_completions.py took 54.7 / 50.8 s wall with it and
59.7 / 58.0 s passive (7% less CPU). What the tests check does not depend on it (the same kernels, the same bits);
the wait policy's own tests (engine/test_cpu.py) run their processes without it. docs/testing.md."""

MODEL = "gemma-3-270m"
MAX_MODEL_LEN = 2048
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
"""pytest-xdist's worker name (`gw0`, ...) under `-n N`, empty without: each worker is a session of its own, with its
own servers, so a path they write is named by it."""
LOG = Path(os.environ.get("OAI_GEMMA_TEST_LOG", "/tmp/oai-gemma-test-server.log"))
LOG = LOG.with_name(f"{LOG.stem}-{WORKER}{LOG.suffix}") if WORKER else LOG
FAULT_SERVER = (str(Path(__file__).with_name("fault_server.py")),)
"""`ServerProcess(..., launcher=FAULT_SERVER)`: a server with the faults of tests/fault_server.py."""
NO_TIMEOUTS = {"OAI_GEMMA_SERVER__IDLE_TIMEOUT": "0", "OAI_GEMMA_SERVER__REQUEST_TIMEOUT": "0"}
"""A shared, busy CPU can take minutes over a prefill: for tests that are not about request timeouts."""


SHARING = {"api/test_hash_collision.py": "fault", "api/test_store_crash.py": "fault",
           "chat/test_vision.py": "vision", "chat/test_tool_images.py": "vision", "browser/test_playground.py": "vision"}
"""Test files that share a `shared_servers` configuration across files: under `-n N` each group runs on one worker
(one server start); every other file is a group of its own (its module-scoped servers start once)."""
HEAVY = ("fault", "engine/test_speculative_engine.py", "engine/test_quantization.py", "engine/test_batch_invariance.py",
         "vision", "deploy/test_ray_serve.py", "deploy/test_readme.py", "engine/test_lora_server.py",
         "engine/test_prefix_cache.py", "api/test_soak.py", "deploy/test_wheel.py", "api/test_admission.py")
"""The longest groups (a quiet whole run's durations, docs/testing.md): under `-n N` they are handed out first,
so that no worker is left running one of them alone at the end while the others have nothing to do."""


def group_of(nodeid: str) -> str:
    """A test's group under pytest-xdist: its file (relative to tests/), or its `SHARING` group."""
    name = nodeid.split("::", 1)[0].removeprefix("tests/")
    return SHARING.get(name, name)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (`--dist load`, the default, or loadfile/loadgroup/loadscope): whole groups to a worker (`group_of`),
    in collection order: pytest-xdist's loadscope scheduler with this suite's groups. (Its own `loadgroup` reads
    `xdist_group` marks into test ids, which pytest 9 no longer lets it change.)"""
    if config.getvalue("dist") not in ("load", "loadfile", "loadgroup", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep the order below: HEAVY first, not the most tests first
    return FileGroups(config, log)


def pytest_collection_modifyitems(items):
    """In a pytest-xdist worker: the `HEAVY` groups first (every worker sorts the same collection the same way)."""
    if WORKER:
        rank = {name: index for index, name in enumerate(HEAVY)}
        items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(HEAVY)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker a core, at most 4 (each runs its own default server and in-process models: 3-4 GB), and
    none on one core (one worker only adds a process); PYTEST_XDIST_AUTO_NUM_WORKERS still decides where set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    cores = len(os.sched_getaffinity(0))
    return 0 if cores < 2 else min(cores, 4)


def wait_for(condition, timeout: float) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra: str, env: dict[str, str] | None = None, log: Path = LOG, launcher: tuple[str, ...] = ("-m", "oai_gemma.cli"),
                 program: str | None = None, cwd: Path | None = None):
        """`launcher`: what python runs with `serve ...` (tests/fault_server.py injects faults); `program`: an
        `oai-gemma` script to run instead (an installed wheel's), in `cwd`."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_seen: list[int] = []
        # unquantized float32: the batch-invariant mode is on there by default (README, Reproducibility), so tests
        # that compare two requests token for token hold whatever else the shared server runs (`extra` may override)
        cmd = [
            *((program,) if program else (sys.executable, *launcher)), "serve", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--quantization", "none", *extra,
        ]
        self.log_path = log
        self.log = open(log, "w")
        # each server its own store of Responses (`store: true`), unless the test names one
        store = {"OAI_GEMMA_RESPONSES__STORE_PATH": os.path.join(tempfile.mkdtemp(prefix="oai-gemma-store-"), "responses.sqlite3")}
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**store, **os.environ, **(env or {})}, cwd=cwd
        )

    def wait_ready(self, timeout: float = float(os.environ.get("OAI_GEMMA_TEST_READY_TIMEOUT", "600"))) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                self.health_seen.append(health.status_code)
                if health.status_code == 200:
                    return
                reason = _reason(health)
                if reason not in (None, "loading"):  # loading failed: no use waiting
                    raise RuntimeError(f"server not ready: {reason}; see {self.log_path}")
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s; see {self.log_path}")

    def __enter__(self) -> "ServerProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class SharedServers:
    """Server processes shared across test files: `get(*extra, env=..., launcher=...)` starts one on its first request
    and hands the same process to every later request with the same settings (the extra CLI arguments, the
    environment, the launcher), whichever test file asks. A test that breaks its server (kills it, stops its engine)
    must start its own `ServerProcess` instead. At most `KEEP` shared servers run at a time beside the session's
    default one (each holds a model: ~1.6 GB); the one asked for least recently is stopped first, and a later
    request starts it again. All stop at the end of the session."""

    KEEP = 1

    def __init__(self, logs: Path):
        self.logs = logs
        self.running: OrderedDict[tuple, ServerProcess] = OrderedDict()
        self.started: list[tuple] = []  # every start, in order (a restart after eviction shows as a repeat)

    def get(self, *extra: str, env: dict[str, str] | None = None, launcher: tuple[str, ...] = ("-m", "oai_gemma.cli"),
            name: str = "shared") -> ServerProcess:
        key = (extra, tuple(sorted((env or {}).items())), launcher)
        if key in self.running:
            self.running.move_to_end(key)
            return self.running[key]
        while len(self.running) >= self.KEEP:
            self.running.popitem(last=False)[1].stop()
        proc = ServerProcess(*extra, env=env, launcher=launcher, log=self.logs / f"{name}-{len(self.started)}.log")
        self.running[key] = proc.__enter__()
        self.started.append(key)
        return proc

    def close(self) -> None:
        while self.running:
            self.running.popitem()[1].stop()


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory):
    servers = SharedServers(tmp_path_factory.mktemp("shared-server-logs"))
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def server():
    with ServerProcess() as proc:
        yield proc


FAULT_SMALL = ("--max-num-seqs", "4", "--max-prefill-tokens", "64", "--max-model-len", "1024", "--batch-invariant", "off")
"""The shared fault server's settings: a short warm-up (the tests on it are about faults, not speed)."""


class FaultSwitches:
    """The shared fault server's switches (tests/fault_server.py): a fault is on while its file exists
    (`touch`, `clear`); the `fault_server` fixture clears every one before and after each test."""

    NAMES = {"hash_collide": "OAI_GEMMA_FAULT_HASH_COLLIDE", "store_full": "OAI_GEMMA_FAULT_STORE_FULL",
             "store_readonly": "OAI_GEMMA_FAULT_STORE_READONLY"}

    def __init__(self, root: Path):
        self.paths = {name: root / name for name in self.NAMES}

    @property
    def env(self) -> dict[str, str]:
        return {variable: str(self.paths[name]) for name, variable in self.NAMES.items()}

    def touch(self, name: str) -> None:
        self.paths[name].touch()

    def clear(self, name: str) -> None:
        self.paths[name].unlink(missing_ok=True)


@pytest.fixture(scope="session")
def fault_switches(tmp_path_factory) -> FaultSwitches:
    return FaultSwitches(tmp_path_factory.mktemp("fault-switches"))


@pytest.fixture
def fault_server(shared_servers, fault_switches):
    """One fault-injecting server (tests/fault_server.py) for every test whose faults it survives (a colliding
    prefix-cache hash, a full or read-only Responses store): started once, every switch off before and after each
    test. (The engine-failure tests kill their engines: they start their own.)"""
    for name in fault_switches.paths:
        fault_switches.clear(name)
    proc = shared_servers.get(*FAULT_SMALL, env={**fault_switches.env, **NO_TIMEOUTS}, launcher=FAULT_SERVER, name="fault")
    yield proc
    for name in fault_switches.paths:
        fault_switches.clear(name)


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from oai_gemma.engine.model.loader import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@functools.cache
def embedded_float32():
    """`load(ModelSettings(dtype="float32"))`, once for the session: the engine tests' in-process engines and runners
    only read its module tree (one not told it owns the weights copies what it lays out anew), so every module
    shares one load (seconds) and one copy (~1 GB) instead of holding its own to the end of the session."""
    from oai_gemma.engine.model.loader import load
    from oai_gemma.settings import ModelSettings

    return load(ModelSettings(dtype="float32"))


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory):
    """The tiny multimodal Gemma-3 (270m text weights + a small random SigLIP): built once into the model cache
    (`tiny_vision_build`), then hard-linked into this session's own directory, so a session's servers quantize
    it afresh (their quantized-weights cache is named by the model's path) as they did when each session built it."""
    built = tiny_vision_build()
    target = tmp_path_factory.mktemp("tiny-vision") / "gemma-3-tiny-mm"

    def link(source, destination):
        try:
            os.link(source, destination)
        except OSError:  # another filesystem
            shutil.copy2(source, destination)

    shutil.copytree(built, target, copy_function=link)
    return target


def tiny_vision_build() -> Path:
    """The tiny multimodal model as `build_tiny_multimodal` writes it (deterministic: ~10 s and 1 GB written each
    session before), kept in the model cache under a digest of what determines it: the builder's source, the
    embedded model's files, transformers' and torch's versions. The tests only read it."""
    import torch
    import transformers

    from oai_gemma.engine.model.loader import embedded_model_dir
    from oai_gemma.settings import ModelSettings
    from oai_gemma.testing import tiny_vision

    source = embedded_model_dir()
    stamp = [Path(tiny_vision.__file__).read_bytes(), transformers.__version__.encode(), torch.__version__.encode()]
    stamp += [f"{f.name} {f.stat().st_size} {f.stat().st_mtime_ns}".encode() for f in sorted(source.iterdir()) if f.is_file()]
    digest = hashlib.sha256(b"\0".join(stamp)).hexdigest()[:16]
    return tiny_vision.build_tiny_multimodal(ModelSettings().cache_path / "tests" / f"gemma-3-tiny-mm-{digest}", source=source)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stream_count(client: openai.OpenAI, model: str, tokens: int, times: list[float], usage: list) -> None:
    """Stream `tokens` tokens of `model` (eos ignored), each content chunk's arrival (monotonic) into `times` and the
    usage's completion tokens into `usage`: what a stream beside a load or an eviction got (issue 41's tests)."""
    stream = client.chat.completions.create(
        model=model, messages=user("Count to a thousand."), max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
        if chunk.usage:
            usage.append(chunk.usage.completion_tokens)


def _reason(health: httpx.Response) -> str | None:
    """The `reason` of our /health's 503, None for another body (a proxy's, while its replicas start)."""
    try:
        return health.json().get("reason")
    except (ValueError, AttributeError):
        return None


VISION_MODEL, VISION_ADAPTER, VISION_API_KEY = "tiny-vision", "vision-lora", "vision-key"
VISION_MAX_IMAGES, VISION_MAX_PIXELS, VISION_MAX_DOWNLOAD = 4, 2_000_000, 1_000_000


@pytest.fixture(scope="session")
def vision_adapter(tiny_vision_dir, tmp_path_factory) -> Path:
    """A PEFT adapter on the seven projections of the tiny multimodal model's language model only (its vision tower
    has q/k/v_proj too), made from a copy of the model loaded here for it."""
    from lora_adapters import STRONG, make_adapter
    from oai_gemma.engine.model.loader import load
    from oai_gemma.settings import ModelSettings

    loaded = load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"))
    return make_adapter(loaded.model, tmp_path_factory.mktemp("vision-lora") / VISION_ADAPTER, STRONG["all8"], within="language_model")


@pytest.fixture
def vision_server(shared_servers, tiny_vision_dir, vision_adapter) -> ServerProcess:
    """The tiny multimodal model as `tiny-vision`, one server for chat/test_vision.py and the playground's image test:
    the adapter, image limits a test can reach, http images from loopback only, and an API key."""
    env = {
        "OAI_GEMMA_API_KEYS": VISION_API_KEY,
        "OAI_GEMMA_IMAGES__ALLOWED_HOSTS": '["127.0.0.1"]',
        "OAI_GEMMA_IMAGES__MAX_IMAGES": str(VISION_MAX_IMAGES),
        "OAI_GEMMA_IMAGES__MAX_PIXELS": str(VISION_MAX_PIXELS),
        "OAI_GEMMA_IMAGES__MAX_DOWNLOAD_BYTES": str(VISION_MAX_DOWNLOAD),
    }
    return shared_servers.get("--model", str(tiny_vision_dir), "--served-model-name", VISION_MODEL,
                              "--lora-modules", f"{VISION_ADAPTER}={vision_adapter}", env=env, name="vision")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's in-process model work: the tests share the machine with the servers (and one
    is fast enough for the small models they build)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
