"""`oai-gemma serve` flags are generated from the settings tree: each names a real field, with its type and choices."""

import subprocess
import sys

import msgspec
import msgspec.inspect
import pytest

from oai_gemma import cli
from oai_gemma.settings import SECTIONS, Settings, field_docs, load_settings

OPERATOR_FLAGS = {  # issue 18 item 7: the settings operators change most
    "--api-key": ("server", "api_keys"),
    "--max-waiting": ("engine", "max_waiting"),
    "--request-timeout": ("server", "request_timeout"),
    "--idle-timeout": ("server", "idle_timeout"),
    "--max-model-len": ("model", "max_model_len"),
    "--kv-cache-gib": ("engine", "kv_cache_gib"),
    "--dtype": ("model", "dtype"),
    "--threads": ("engine", "threads"),
}


def serve_actions() -> dict:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    serve = sub.choices["serve"]
    return {a.option_strings[0]: a for a in serve._actions if a.dest.startswith("setting__")}


def field_of(section: str, field: str) -> msgspec.inspect.Field:
    return next(f for f in msgspec.inspect.type_info(SECTIONS[section]).fields if f.name == field)


def test_operator_flags_exist_and_name_their_setting():
    actions = serve_actions()
    for flag, (section, field) in OPERATOR_FLAGS.items():
        assert flag in actions, f"serve has no {flag}"
        assert actions[flag].dest == f"setting__{section}__{field}"


def test_every_flag_matches_its_field_type_choices_and_doc():
    for flag, action in serve_actions().items():
        _, section, field = action.dest.split("__")
        assert section in Settings.__struct_fields__ and field in SECTIONS[section].__struct_fields__, flag
        kind = field_of(section, field).type
        if isinstance(kind, msgspec.inspect.LiteralType):
            assert sorted(action.choices) == sorted(kind.values), flag
        elif isinstance(kind, msgspec.inspect.IntType):
            assert action.type is int, flag
        elif isinstance(kind, msgspec.inspect.FloatType):
            assert action.type is float, flag
        elif isinstance(kind, msgspec.inspect.VarTupleType) and flag in cli.MULTI_VALUE_FLAGS:  # vLLM's `--lora-modules a=/x b=/y`
            assert action.nargs == "+" and type(action).__name__ == "_ExtendAction", flag
        elif isinstance(kind, msgspec.inspect.VarTupleType):
            assert action.nargs is None and type(action).__name__ == "_AppendAction", flag
        assert f"[{section}.{field}, default:" in action.help, flag
        doc = field_docs(section).get(field)
        assert doc and action.help.startswith(doc.replace("%", "%%")), f"{flag}: help is not the field's docstring"


def test_flags_reach_the_settings_and_win_over_env():
    args = cli.build_parser().parse_args([
        "serve", "--api-key", "k1", "--api-key", "k2", "--max-waiting", "3", "--request-timeout", "12.5",
        "--idle-timeout", "0", "--max-model-len", "2048", "--kv-cache-gib", "0.25", "--dtype", "float32",
        "--threads", "1", "--port", "9123",
    ])
    settings = load_settings(None, cli._overrides(args), environ={"OAI_GEMMA_ENGINE__MAX_WAITING": "99", "OAI_GEMMA_API_KEYS": "env"})
    assert settings.server.api_keys == ("k1", "k2")
    assert settings.engine.max_waiting == 3
    assert settings.server.request_timeout == 12.5 and settings.server.idle_timeout == 0
    assert settings.model.max_model_len == 2048 and settings.engine.kv_cache_gib == 0.25
    assert settings.model.dtype == "float32" and settings.engine.threads == 1 and settings.server.port == 9123


def test_lora_flags_take_vllms_syntax():
    args = cli.build_parser().parse_args([
        "serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-runtime-loading", "--admin-api-key", "root",
    ])
    settings = load_settings(None, cli._overrides(args), environ={})
    assert settings.lora.modules == ("a=/x", '{"name": "b", "path": "/y"}', "c=/z")
    assert settings.lora.max_loras == 2 and settings.lora.max_lora_rank == 16 and settings.lora.runtime_loading
    assert settings.server.admin_api_keys == ("root",)


def test_unset_flags_leave_config_and_env_alone():
    args = cli.build_parser().parse_args(["serve"])
    assert cli._overrides(args) == {}
    settings = load_settings(None, cli._overrides(args), environ={"OAI_GEMMA_ENGINE__MAX_WAITING": "7"})
    assert settings.engine.max_waiting == 7


@pytest.mark.parametrize("argv, message", [
    (["--max-waiting", "-1"], "bad settings"),  # below the setting's bound: the settings tree refuses it
    (["--dtype", "float8"], "invalid choice"),
    (["--request-timeout", "soon"], "invalid float value"),
])
def test_bad_flag_values_exit_with_a_clear_message_before_loading_anything(argv, message):
    code = f"import sys; from oai_gemma.cli import main; sys.exit(main({['serve', *argv]!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert message in done.stderr
