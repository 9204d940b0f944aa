"""Every shipped profile in configs/ parses into Settings; a typo or a bad value in one is refused, not ignored."""

import json
from pathlib import Path

import msgspec
import pytest

from oai_gemma.settings import EMBEDDED, load_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROFILES = sorted(CONFIGS.glob("*.toml"))
HF_CONFIGS = sorted(CONFIGS.glob("hf/*/config.json"))


def load(path):
    return load_settings(path, environ={})  # the test runner's own OAI_GEMMA_* must not leak in


def test_the_expected_profiles_ship():
    names = {p.name for p in PROFILES}
    assert {"embedded-cpu.toml", "gemma-3-4b-it.toml", "gemma-3-12b-it.toml", "gemma-3-27b-it.toml"} <= names


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_profile_parses(path):
    settings = load(path)
    assert settings.served_model_name
    assert settings.model.max_model_len >= 16


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_profile_starts_with_a_comment_saying_how_to_run_it(path):
    text = path.read_text()
    assert text.startswith("#")
    assert f"oai-gemma serve --config configs/{path.name}" in text


def test_embedded_profile_is_the_cpu_default():
    settings = load(CONFIGS / "embedded-cpu.toml")
    assert settings.model.source == EMBEDDED
    assert settings.served_model_name == "gemma-3-270m"
    assert settings.model.dtype == "auto"
    assert settings.server.port == 8000


@pytest.mark.parametrize("size", ["4b", "12b", "27b"])
def test_gpu_profiles_serve_the_hub_model_in_bf16_on_cuda(size):
    settings = load(CONFIGS / f"gemma-3-{size}-it.toml")
    assert settings.model.source == f"google/gemma-3-{size}-it"
    assert settings.model.dtype == "bfloat16"
    assert settings.model.device == "cuda"
    assert settings.model.compile == "on"
    assert settings.model.device_map == ("auto" if size == "27b" else "")


def test_env_overrides_a_profile():
    settings = load_settings(CONFIGS / "gemma-3-12b-it.toml", environ={"OAI_GEMMA_MODEL__SOURCE": "/models/gemma-3-12b-it"})
    assert settings.model.source == "/models/gemma-3-12b-it"


def test_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nsource = "embedded"\nmax_seq_len = 4096\n')
    with pytest.raises(msgspec.ValidationError, match="max_seq_len"):
        load(bad)


def test_unknown_section_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[sever]\nport = 8000\n")
    with pytest.raises(msgspec.ValidationError, match="sever"):
        load(bad)


@pytest.mark.parametrize(
    "body",
    [
        '[model]\ndtype = "fp8"\n',
        "[model]\nmax_model_len = 8\n",
        "[engine]\nmax_num_seqs = 0\n",
        "[server]\nport = 70000\n",
        '[model]\ncompile = "yes"\n',
    ],
    ids=["dtype", "max_model_len", "max_num_seqs", "port", "compile"],
)
def test_bad_value_is_refused(tmp_path, body):
    bad = tmp_path / "bad.toml"
    bad.write_text(body)
    with pytest.raises(msgspec.ValidationError):
        load(bad)


@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.parent.name)
def test_vendored_hf_config_is_a_multimodal_gemma3(path):
    config = json.loads(path.read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "gemma3_text"
    assert config["vision_config"]["model_type"] == "siglip_vision_model"


def test_served_name_is_derived_from_the_source_unless_set(tmp_path):
    assert load_settings(None, environ={}).served_model_name == "gemma-3-270m"
    assert load_settings(None, {"model": {"source": "google/gemma-3-4b-it"}}, environ={}).served_model_name == "google/gemma-3-4b-it"
    local = tmp_path / "my-gemma"
    local.mkdir()
    assert load_settings(None, {"model": {"source": str(local)}}, environ={}).served_model_name == "my-gemma"
    named = {"model": {"source": str(local), "served_name": "prod"}}
    assert load_settings(None, named, environ={}).served_model_name == "prod"


def test_cli_flags_win_over_env_and_file(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 7000\n")
    env = {"OAI_GEMMA_SERVER__PORT": "7100"}
    assert load_settings(config, environ=env).server.port == 7100
    assert load_settings(config, {"server": {"port": 7200}}, environ=env).server.port == 7200
