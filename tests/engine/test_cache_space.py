"""Issue 39 items 1 and 6 on a real server with LoRA adapters and no API keys (so every request shares one cache
scope): no `cache_salt` a base-model request sends reaches an adapter's cached prefixes, and an adapter read again
from files changed on disk never reuses what its old weights computed. One server for the module."""

from __future__ import annotations

import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import MODEL, ServerProcess, user

pytestmark = pytest.mark.slow

ADAPTERS = ("a", "b")
SMALL = ("--max-num-seqs", "8", "--max-prefill-tokens", "512", "--batch-invariant", "off")  # a short warm-up
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Random PEFT-format adapters written directly (the benchmark's: no base model to load; test_lora.py reads them)."""
    from oai_gemma.bench.lora import make_adapter
    from oai_gemma.engine.model.loader import embedded_model_dir

    root = tmp_path_factory.mktemp("cache-space")
    paths = {name: make_adapter(root / name, str(embedded_model_dir()), rank=4, seed=seed) for seed, name in enumerate(ADAPTERS)}
    paths["changing"] = shutil.copytree(paths["a"], root / "changing")  # rewritten by the last test
    return paths


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    modules = [f"{name}={path}" for name, path in paths.items()]
    with ServerProcess("--lora-modules", *modules, "--max-loras", "2", *SMALL,
                       log=tmp_path_factory.mktemp("cache-space-log") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def new_prompt() -> str:
    """New to the server (its first block differs from any other's); about 40 tokens, two full blocks."""
    return f"[{uuid.uuid4().hex[:8]}] The keeper logged the tide, the wind and the lamp's oil every hour of the night."


def cached(client: openai.OpenAI, model: str, prompt: str, salt: str | None = None) -> int:
    reply = client.chat.completions.create(model=model, messages=user(prompt), max_tokens=1,
                                           extra_body={"cache_salt": salt} if salt else None)
    return reply.usage.prompt_tokens_details.cached_tokens


def forged_salts(paths) -> list[str]:
    """Every salt that imitates how an adapter's cache space is or was told apart: the old "\\0lora:<key>" suffix
    (keys were small integers counted from 1), the adapter's name in it and alone, the "scope/salt" join, and the
    content hash the space holds now, as hex and as raw characters."""
    from oai_gemma.engine.lora.adapter import _digest

    digests = [_digest(*((paths[name] / file).read_bytes() for file in FILES)) for name in ADAPTERS]
    keys = [*map(str, range(4)), *ADAPTERS]
    return [*(f"\x00lora:{key}" for key in keys), *ADAPTERS, "/\x00lora:1", "\x00lora:1/", "/",
            *(d.hex() for d in digests), *(d.decode("latin-1") for d in digests)]


def test_no_salt_a_base_request_sends_reaches_an_adapters_cached_prefixes(client, paths):
    prompt = new_prompt()
    assert cached(client, "a", prompt) == 0 and cached(client, "a", prompt) > 0  # the control: a poisoned space shows
    prompts = {salt: new_prompt() for salt in forged_salts(paths)}
    with ThreadPoolExecutor(8) as pool:  # concurrent: batched prefills, on a slow shared CPU
        assert not any(pool.map(lambda salt: cached(client, MODEL, prompts[salt], salt), prompts))  # KV written first
        runs = [(salt, name) for salt in prompts for name in ADAPTERS]
        reused = dict(zip(runs, pool.map(lambda run: cached(client, run[1], prompts[run[0]]), runs)))
    assert not {run: tokens for run, tokens in reused.items() if tokens}  # (salt, adapter): cached_tokens of base KV reused


def test_an_adapter_read_again_from_changed_files_never_reuses_its_old_prefix(client, server, paths):
    prompt = new_prompt()
    assert cached(client, "changing", prompt) == 0 and cached(client, "changing", prompt) > 0
    for name in ADAPTERS:  # two slots: `changing`, the least recently used, is dropped
        cached(client, name, new_prompt())
    for file in FILES:
        shutil.copyfile(paths["b"] / file, paths["changing"] / file)
    reads = server.log_path.read_text().count("LoRA adapter 'changing': reading it again")
    assert cached(client, "changing", prompt) == 0  # other weights now: the old prefix is not theirs
    assert server.log_path.read_text().count("LoRA adapter 'changing': reading it again") == reads + 1
    assert cached(client, "changing", prompt) > 0  # the new weights' own prefix is reused
