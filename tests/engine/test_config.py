"""engine/config.py's sub-configs: `/health` and `/v1/server_info` serve them as the one flat object they always had
(README), and `resolve` puts each setting in the part that reads it."""

from oai_gemma.engine.config import (
    FOUR_BIT, CacheConfig, EngineConfig, LoRAConfig, LoraModule, Machine, ModelConfig, SchedulerConfig, ServerConfig,
    SpeculativeConfig, _quantization, resolve,
)
from oai_gemma.engine.shape import TextShape
from oai_gemma.settings import EngineSettings, LoraSettings, ModelSettings, ServerSettings, Settings

SERVED = [
    "device", "dtype", "quantization", "quantized_weights", "static_decode", "compile", "batch_invariant",
    "max_model_len", "image_tokens", "threads", "cache_dir", "native_dir", "kv_blocks", "prefix_caching",
    "max_num_seqs", "max_prefill_tokens", "max_waiting", "vision_step_seconds", "image_prefill_units", "speculative", "speculative_k",
    "speculative_budget", "speculative_ngram_max", "speculative_ngram_min", "lora_modules", "max_loras",
    "max_lora_rank", "lora_runtime_loading", "request_timeout", "idle_timeout", "max_backlog",
]


def test_the_served_configuration_keeps_its_flat_keys_and_values():
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16", max_model_len=2048), cache=CacheConfig(kv_blocks=77),
        scheduler=SchedulerConfig(max_num_seqs=5), speculative=SpeculativeConfig(method="off", k=7, ngram_min=3),
        lora=LoRAConfig(modules=(LoraModule("a", "/p"),), runtime_loading=True), server=ServerConfig(idle_timeout=9.0),
    )
    served = config.as_dict()
    assert sorted(served) == sorted(SERVED)
    assert (served["dtype"], served["max_model_len"], served["kv_blocks"], served["max_num_seqs"]) == ("bfloat16", 2048, 77, 5)
    assert (served["speculative"], served["speculative_k"], served["speculative_ngram_min"]) == ("off", 7, 3)
    assert served["lora_modules"] == ({"name": "a", "path": "/p", "base_model_name": None},)
    assert served["lora_runtime_loading"] is True and served["idle_timeout"] == 9.0


def test_resolve_puts_each_setting_in_the_part_that_reads_it():
    shape = TextShape(hidden=64, intermediate=128, heads=4, kv_heads=1, head_dim=16, vocab=1000, sliding_window=512,
                      sliding=(True, False), rms_eps=1e-6, query_pre_attn_scalar=16, rope=None, final_softcap=None)
    machine = Machine(shape=shape, kv_bytes_per_token=256, image_tokens=256, native_missing="no compiler here")
    settings = Settings(
        model=ModelSettings(max_model_len=1024),
        engine=EngineSettings(max_num_seqs=3, max_prefill_tokens=128, max_waiting=9, prefix_caching=False,
                              speculative_k=5, speculative_budget=12, speculative_ngram_max=3, speculative_ngram_min=4),
        server=ServerSettings(request_timeout=6, idle_timeout=7, max_stream_backlog=8), lora=LoraSettings(max_loras=2, runtime_loading=True),
    )
    config = resolve(settings, machine)
    assert (config.model.quantization, config.model.max_model_len, config.model.image_tokens) == ("none", 1024, 256)
    assert config.cache == CacheConfig(kv_blocks=config.cache.kv_blocks, prefix_caching=False) and config.cache.kv_blocks >= 64
    assert config.scheduler == SchedulerConfig(max_num_seqs=3, max_prefill_tokens=128, max_waiting=9)
    assert config.speculative == SpeculativeConfig(method="ngram", k=5, budget=12, ngram_max=3, ngram_min=3)
    assert config.lora == LoRAConfig(max_loras=2, runtime_loading=True) and config.lora.enabled
    assert config.server == ServerConfig(request_timeout=6, idle_timeout=7, max_backlog=8)
    assert (config.max_logits_rows, config.max_tokens_per_step) == (12, 256 + 12)


def test_auto_quantization_is_four_bit_from_the_1b_on_and_int8_or_per_step_below():
    def machine(hidden: int, dtype: str = "float32", **found) -> Machine:
        shape = TextShape(hidden=hidden, intermediate=4 * hidden, heads=4, kv_heads=1, head_dim=256, vocab=262144,
                          sliding_window=512, sliding=(True, False), rms_eps=1e-6, query_pre_attn_scalar=256, rope=None)
        return Machine(shape=shape, dtype=dtype, kv_bytes_per_token=1024, weights_name="m",
                       quantized_layouts={"int8": "a", "q4-mix": "b"}, **found)

    assert FOUR_BIT == "q4-mix"
    assert _quantization("auto", machine(1152)) == FOUR_BIT  # gemma-3-1b
    assert _quantization("auto", machine(2560)) == FOUR_BIT  # gemma-3-4b
    assert _quantization("auto", machine(640)) == "int8"  # the embedded 270m keeps int8 (4-bit: +21% perplexity)
    assert _quantization("auto", machine(1152, int_dot_missing="no AVX2")) == "int8"
    assert _quantization("auto", machine(1152, "bfloat16")) == FOUR_BIT  # bf16 CPUs too (one 4-bit copy)
    assert _quantization("auto", machine(640, "bfloat16")) == "q8"  # the 270m on a bf16 CPU: every row through VNNI
    assert _quantization("auto", machine(1152, "bfloat16", int_dot_missing="no AVX2")) == "per-step"
    assert _quantization("auto", machine(1152, native_missing="no compiler")) == "none"
    assert _quantization("int8", machine(1152)) == "int8" and _quantization("q4", machine(640)) == "q4"  # explicit stays
    # the model cache keeps the resolved layout under its own name (not int8's file, not q4's)
    file = resolve(Settings(), machine(1152)).model.quantized_weights
    assert file is not None and file.name == "m-q4-mix-float32-b.safetensors"


def test_auto_dtype_is_float32_on_a_cpu_from_the_1b_on_and_bf16_below_where_bf16_is_fast(tmp_path, monkeypatch):
    """gemma-3-1b and larger compute in float32 on a CPU even where bf16 is fast (their q4-mix kernels take float32
    rows as cheaply, and the float32-only native steps run: docs/benchmarks.md); smaller models follow the CPU."""
    import json

    import torch

    from oai_gemma.engine.model import loader

    def model(name: str, config: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    one_b = model("1b", {"hidden_size": 1152})
    four_b = model("4b", {"text_config": {"hidden_size": 2560}, "vision_config": {}})
    small = model("270m", {"hidden_size": 640})
    cpu, auto = torch.device("cpu"), ModelSettings()
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: True)
    assert [loader.pick_dtype(auto, cpu, s) for s in (one_b, four_b, small)] == [torch.float32, torch.float32, torch.bfloat16]
    assert loader.pick_dtype(auto, cpu, str(tmp_path / "missing")) == torch.bfloat16  # unread: the CPU decides
    assert loader.pick_dtype(ModelSettings(dtype="bfloat16"), cpu, one_b) == torch.bfloat16  # explicit stays
    assert loader.pick_dtype(auto, torch.device("cuda"), one_b) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: False)
    assert loader.pick_dtype(auto, cpu, small) == torch.float32
