"""A start that fails, exits (issue 36 item 2): one ERROR line saying what and what to do, then a non-zero exit
status, never a server that answers 503 for ever. Each case is a real `oai-gemma serve` process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port

HANG = 180
"""Seconds after which a start that has not exited counts as hanging (the failures here take seconds)."""


def start(*flags: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "oai_gemma.cli", "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, **(env or {})}, cwd=cwd,
    )


def failed_start(*flags: str, env: dict[str, str] | None = None) -> str:
    """The log of a start that must fail: it exits 1 by itself, with one ERROR line and no traceback."""
    proc = start("--port", str(free_port()), *flags, env=env)
    try:
        log, _ = proc.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server did not exit within {HANG} s: {proc.communicate()[0][-3000:]}")
    assert proc.returncode == 1, log[-3000:]
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def embedded_dir():
    from oai_gemma.engine.model.loader import embedded_model_dir

    return embedded_model_dir()


def test_a_model_path_that_is_not_there_is_one_line_and_exit_1(tmp_path):
    missing = tmp_path / "nonexistent"
    line = failed_start("--model", str(missing))
    assert f"no model directory at {missing}" in line


def test_a_directory_without_config_json_is_named(tmp_path):
    assert "has no config.json" in failed_start("--model", str(tmp_path))


def test_a_port_in_use_ends_the_start_before_loading_anything():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = start("--port", str(port))
        log, _ = proc.communicate(timeout=HANG)
    assert proc.returncode == 1, log
    assert f"cannot listen on 127.0.0.1:{port}" in log and "choose another (--port)" in log
    assert "start-up:" not in log  # nothing was loaded


@pytest.mark.slow
def test_a_checkpoint_with_a_broken_config_exits_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text"')
    line = failed_start("--model", str(tmp_path))
    assert f"cannot load the model from {tmp_path}" in line and "config.json" in line


@pytest.mark.slow
def test_a_checkpoint_missing_its_weights_exits(tmp_path, embedded_dir):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (embedded_dir / name).exists():
            shutil.copy(embedded_dir / name, tmp_path / name)
    line = failed_start("--model", str(tmp_path))
    assert str(tmp_path) in line


@pytest.mark.slow
def test_truncated_safetensors_exit_as_a_bad_checkpoint(tmp_path, embedded_dir):
    for path in embedded_dir.iterdir():
        if path.is_file():
            shutil.copy(path, tmp_path / path.name)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])
    assert f"cannot load the model from {tmp_path}" in failed_start("--model", str(tmp_path))


@pytest.mark.slow
def test_running_out_of_memory_while_loading_says_what_to_lower():
    line = failed_start("--kv-cache-gib", "5000")  # more KV cache than any machine here has
    assert "out of memory while loading the model" in line and "--kv-cache-gib" in line


@pytest.mark.slow
def test_a_kernel_that_cannot_be_built_for_a_setting_that_needs_it_exits(tmp_path, embedded_dir):
    env = {"CC": "/bin/false", "OAI_GEMMA_MODEL__CACHE_DIR": str(tmp_path)}  # an empty cache: the kernel is compiled
    line = failed_start("--model", str(embedded_dir), "--dtype", "float32", "--quantization", "int8", env=env)
    assert "bad settings" in line and "native int8 kernel" in line


@pytest.mark.slow
def test_with_exit_on_engine_failure_off_a_failed_load_keeps_answering_503_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    port = free_port()
    proc = start("--port", str(port), "--model", str(tmp_path), "--no-exit-on-engine-failure")
    try:
        deadline, reason = time.monotonic() + HANG, None
        while time.monotonic() < deadline and reason is None:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                reason = health.json().get("reason") if health.status_code == 503 and "cannot load" in health.text else None
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert reason and str(tmp_path) in reason
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- GGUF files (issue 37 item 5) ------------------------------------------------------------------------------

def _gguf(path, arch: str = "gemma3", hidden: int = 64, projection: int | None = None):
    """A small GGUF of `arch`: a few of the converter's metadata keys and one tensor (an mmproj with `projection`)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    if projection is None:
        writer.add_embedding_length(hidden)
        writer.add_block_count(1)
        writer.add_tensor("token_embd.weight", np.zeros((256, hidden), np.float32))
    else:
        writer.add_clip_projector_type("gemma3")
        writer.add_vision_projection_dim(projection)
        writer.add_tensor("v.post_ln.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_that_is_not_a_gguf_is_named_before_anything_loads(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    assert f"{fake} is not a GGUF file" in failed_start("--model", str(fake))


def test_a_gguf_of_another_architecture_is_named(tmp_path):
    llama = _gguf(tmp_path / "llama.gguf", arch="llama")
    line = failed_start("--model", str(llama))
    assert "architecture 'llama'" in line and "Gemma-3 GGUF" in line


def test_a_truncated_gguf_exits_saying_so(tmp_path):
    path = _gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-20_000])
    line = failed_start("--model", str(path), env={"OAI_GEMMA_MODEL__CACHE_DIR": str(tmp_path / "cache")})
    assert f"cannot convert {path}" in line and "cut short" in line


def test_an_mmproj_for_another_models_width_is_named_before_anything_loads(tmp_path):
    model = _gguf(tmp_path / "text.gguf", hidden=64)
    mmproj = _gguf(tmp_path / "mmproj.gguf", arch="clip", projection=2560)
    line = failed_start("--model", str(model), "--mmproj", str(mmproj))  # told by the files' first bytes
    assert "projects images to width 2560" in line and "hidden size is 64" in line


def test_an_mmproj_given_with_a_checkpoint_directory_is_refused(tmp_path, embedded_dir):
    mmproj = _gguf(tmp_path / "mmproj.gguf", arch="clip", projection=640)
    assert "--mmproj goes with a GGUF --model" in failed_start("--model", str(embedded_dir), "--mmproj", str(mmproj))
