"""`oai-gemma bench --lora N`: requests spread over N LoRA adapters (request i on adapter i mod N).

The adapters are given (`--lora-dir`: its first N PEFT subdirectories, by name) or made here: random rank
`--lora-rank` adapters on every projection of the base model, in PEFT's format, written without PEFT (the shapes
come from the model's config.json), kept under `bench-results/lora-adapters` for the next run. With `--compare`,
`ours-lora` is our server serving them (`--lora-modules`, `--max-loras N`), and `llama-server-lora` is llama.cpp's
server given the same adapters as GGUF LoRA (its converter, `convert_lora_to_gguf.py`, from the llama.cpp source
beside the binary, or `$OAI_GEMMA_LLAMA_CONVERT_LORA`) with a per-request `lora` list: it does not batch requests
of different adapters together. Against a running server (no `--compare`) the adapters are the first N its
`/v1/models` lists with a `parent`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ADAPTERS_DIR = Path("bench-results/lora-adapters")
CONVERT_ENV = "OAI_GEMMA_LLAMA_CONVERT_LORA"
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class LoraSet:
    """N adapters: their request names and PEFT directories."""

    names: list[str]
    paths: list[Path]
    spare: Path
    """One more adapter of the same rank, for timing a load at run time (`time_load`)."""

    def ours_flags(self) -> list[str]:
        """`oai-gemma serve` flags serving them all resident, and the load endpoint (timed: `time_load`)."""
        return ["--lora-modules", *(f"{n}={p}" for n, p in zip(self.names, self.paths)), "--max-loras",
                str(len(self.names) + 1), "--lora-runtime-loading"]

    def llama_flags(self, model_dir: str) -> list[str]:
        """llama-server flags loading them as GGUF LoRA, none applied unless a request's `lora` asks."""
        flags = []
        for path in self.paths:
            flags += ["--lora", str(gguf_of(path, model_dir))]
        return flags + ["--lora-init-without-apply"]


def _shapes(model_dir: str) -> tuple[int, dict[str, tuple[int, int]]]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return config["num_hidden_layers"], shapes


def make_adapter(directory: Path, model_dir: str, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (lora_B nonzero, small) of the model at `model_dir`, on every projection."""
    import torch
    from safetensors.torch import save_file

    layers, shapes = _shapes(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, block in MODULES.items():
            features_in, features_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) / features_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(MODULES), "base_model_name_or_path": model_dir, "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory


def prepare(count: int, rank: int, given: str | None, model_dir: str) -> LoraSet:
    """N adapters from `given` (a directory of PEFT adapter directories), else made here (once per rank)."""
    if given:
        found = sorted(p for p in Path(given).iterdir() if (p / "adapter_config.json").exists())
        if len(found) < count:
            raise ValueError(f"--lora {count}: {given} holds only {len(found)} PEFT adapter directories")
        paths, spare = found[:count], found[0]
    else:
        paths = []
        for index in range(count + 1):
            path = ADAPTERS_DIR / f"r{rank}-{index}"
            paths.append(path if (path / "adapter_model.safetensors").exists() else make_adapter(path, model_dir, rank, index))
        paths, spare = paths[:count], paths[count]
    return LoraSet([f"lora-{i}" for i in range(count)], [p.resolve() for p in paths], spare.resolve())


def converter() -> Path:
    """llama.cpp's `convert_lora_to_gguf.py`: `$OAI_GEMMA_LLAMA_CONVERT_LORA`, else beside the llama-server source."""
    from .compare import llama_server_binary

    if os.environ.get(CONVERT_ENV):
        return Path(os.environ[CONVERT_ENV])
    binary = llama_server_binary()
    for parent in Path(binary).resolve().parents if binary else ():
        if (parent / "convert_lora_to_gguf.py").exists():
            return parent / "convert_lora_to_gguf.py"
    raise FileNotFoundError(f"convert_lora_to_gguf.py not found beside llama-server: set {CONVERT_ENV}")


def gguf_of(path: Path, model_dir: str) -> Path:
    """The adapter as a GGUF LoRA (f32, converted once, kept beside it)."""
    out = path / "adapter-f32.gguf"
    if not out.exists():
        subprocess.run([sys.executable, str(converter()), "--base", model_dir, "--outtype", "f32", "--outfile", str(out), str(path)],
                       check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return out


def route(server: str, names: list[str]):
    """How request i names its adapter: ours by `model`, llama-server by its `lora` list (ids in `--lora` order)."""
    if server.startswith("llama-server"):
        return lambda index, body: {**body, "lora": [{"id": index % len(names), "scale": 1.0}]}
    return lambda index, body: {**body, "model": names[index % len(names)]}


def served_adapters(base_url: str, api_key: str | None) -> list[str]:
    """The adapters a running server lists in /v1/models (cards with a `parent`)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10, trust_env=False).json()["data"]
    return [card["id"] for card in data if card.get("parent")]


def time_load(base_url: str, path: Path, api_key: str | None) -> float | None:
    """Seconds one `POST /v1/load_lora_adapter` of `path` takes (then unloaded), None if the server refuses it."""
    import time

    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.perf_counter()
    loaded = httpx.post(root + "/v1/load_lora_adapter", json={"lora_name": "bench-load", "lora_path": str(path)},
                        headers=headers, timeout=60, trust_env=False)
    seconds = time.perf_counter() - started
    if loaded.status_code != 200:
        return None
    httpx.post(root + "/v1/unload_lora_adapter", json={"lora_name": "bench-load"}, headers=headers, timeout=60, trust_env=False)
    return seconds
