"""LoRA adapters in the engine, without HTTP: adapters made here with PEFT on the embedded model (float32, unquantized)
give PEFT's merged model's logits and greedy text, alone and mixed in one step with other adapters and the base;
bad adapters are refused with the reason; the resident slots are LRU with reload from disk.

Tolerance: the engine's logits are held to PEFT's `merge_and_unload()` model's within 2e-3 absolute (logits of
magnitude ~10-30; the engine's own base logits match transformers' to ~1e-4, the adapter's unmerged update adds
float32 rounding of the same order)."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from lora_adapters import SPECS, greedy_choices, make_adapter, merged_model
from oai_gemma.chat import render_chat
from oai_gemma.engine.config import EngineConfig, LoRAConfig, LoraModule, ModelConfig, SchedulerConfig, parse_module
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.lora.adapter import AdapterError, module_shapes, read_adapter
from oai_gemma.engine.lora.registry import LoraRegistry
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.sequence import StepItem
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings, Settings

pytestmark = pytest.mark.slow

ATOL = 2e-3
TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    loaded = load(ModelSettings(dtype="float32"))
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: make_adapter(loaded.model, root / name, spec) for name, spec in SPECS.items()}
    modules = tuple(LoraModule(name, str(path)) for name, path in paths.items())
    engine = Engine(loaded, EngineConfig(
        model=ModelConfig(max_model_len=1024),
        scheduler=SchedulerConfig(max_num_seqs=4, max_prefill_tokens=256),
        lora=LoRAConfig(modules=modules, max_loras=3),
    ))
    loop = asyncio.new_event_loop()
    engine.start(loop)  # idle between requests: the first test drives the runner itself meanwhile
    engine.test_loop = loop
    yield loaded, engine, paths
    engine.shutdown()
    loop.close()


def prompt(engine: Engine, text: str) -> list[int]:
    return engine.encode(render_chat([{"role": "user", "content": text}]).prompt)


PROMPTS = ["Write about the ocean.", "List three colours.", "Tell me a joke.", "What is a cat?"]
POEM = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def references(setup):
    """PEFT's `merge_and_unload()` model of each adapter (None: the base model itself)."""
    loaded, _, paths = setup
    return {None: loaded.model, **{name: merged_model(loaded.model, path) for name, path in paths.items()}}


def test_each_adapter_gives_the_logits_of_pefts_merged_model_alone_and_mixed_in_one_step(setup, references):
    loaded, engine, paths = setup
    runner, adapters = engine.core.runner, engine.adapters
    ids = [prompt(engine, text) for text in PROMPTS]
    names = [None, *paths]  # the base, then each adapter: one per prompt
    slots = [adapters.acquire(adapters.lookup(name)) if name else 0 for name in names]
    try:
        last = runner.cache.num_blocks  # the pool's last blocks: the engine hands out its lowest first
        blocks = [list(range(last - 4 * (i + 1), last - 4 * i)) for i in range(len(ids))]
        assert all(len(i) <= 64 for i in ids)
        alone = [runner.forward([StepItem(b, i, 0, adapter=s)], [])[0] for b, i, s in zip(blocks, ids, slots)]
        mixed = runner.forward([StepItem(b, i, 0, adapter=s) for b, i, s in zip(blocks, ids, slots)], [])
        # a decode step of every row: one row at a time (groups), then all together through the resident adapters'
        # stack (what a step of several adapters' decode rows uses outside batch-invariant mode)
        decodes = [StepItem(b, [int(row.argmax())], len(i), adapter=s) for b, i, s, row in zip(blocks, ids, slots, alone)]
        decode_alone = torch.cat([runner.forward([], [item]) for item in decodes])
        invariance, runner.invariance = runner.invariance, None
        try:
            decode_stacked = runner.forward([], decodes)
        finally:
            runner.invariance = invariance
        assert (decode_stacked - decode_alone).abs().max() < 1e-3
    finally:
        for slot in slots:
            if slot:
                adapters.release(slot)
    for row, name in enumerate(names):
        with torch.inference_mode():
            expected = references[name](torch.tensor([ids[row]])).logits[0, -1]
        assert (alone[row] - expected).abs().max() < ATOL, name
        if runner.batch_invariant:  # float32 here: the linears' rows (the adapters' too) ignore the rows beside them
            assert torch.equal(mixed[row], alone[row]), f"{name}: its row differs when other adapters run beside it"
        assert (mixed[row] - alone[row]).abs().max() < 1e-4, name
    with torch.inference_mode():  # each adapter does change the logits (else the test could not fail)
        base = [runner.forward([StepItem(b, i, 0)], [])[0] for b, i in zip(blocks, ids)]
    assert all((alone[row] - base[row]).abs().max() > 0.1 for row in range(1, len(names)))


def first_token_distribution(engine: Engine, ids: list[int], adapter: str | None) -> float:
    """The sum of the first generated token's 5 top logprobs under `adapter`."""
    async def main():
        request = GenerationRequest(f"first-{adapter}", ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), adapter=adapter)
        return [e async for e in engine.generate(request) if e.token_id is not None][0]

    return sum(logprob for _, logprob in engine.test_loop.run_until_complete(main()).top_logprobs)


def run(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    async def one(request):
        return [e.token_id async for e in engine.generate(request) if e.token_id is not None]

    async def main():
        return await asyncio.gather(*[one(r) for r in requests])

    return engine.test_loop.run_until_complete(main())


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_the_merged_models_greedy_text(setup, references):
    _, engine, paths = setup
    ids = prompt(engine, POEM)
    names = [None, *paths]

    def request(name, index):
        return GenerationRequest(f"r{index}-{name}", ids, SamplingParams(max_tokens=TOKENS, temperature=0.0), adapter=name)

    together = run(engine, [request(name, i) for i, name in enumerate(names)])
    alone = [run(engine, [request(name, 10 + i)])[0] for i, name in enumerate(names)]
    assert together == alone
    for name, tokens in zip(names, together):  # PEFT's merged model, greedy, gives the same text
        assert greedy_choices(references[name], ids, tokens) == tokens, name
    # every adapter changes what the model says (else rows mixed up between adapters would pass): its first token's
    # distribution differs from the others' (the 12 greedy tokens alone can coincide, one near-tie apart)
    first = [first_token_distribution(engine, ids, name) for name in names]
    assert all(abs(a - b) > 1e-3 for i, a in enumerate(first) for b in first[i + 1:]), first


KERNELS = ["native", "native AVX2", "torch"]


def use_kernel(monkeypatch, kernel: str) -> None:
    """Make the LoRA path `kernel` (KERNELS) the one this test's steps take: the native kernel where it runs here (its
    AVX2 variant forced), else torch's matmuls (as where no kernel can be compiled)."""
    from oai_gemma.engine.ops import native

    kernels = native.lora_kernels()
    if kernel != "torch" and kernels is None:
        pytest.skip(f"the native kernel cannot run here: {native.native_unavailable()}")
    forced = None if kernel == "torch" else (kernels[0], kernels[1] and kernel == "native")
    monkeypatch.setattr(native, "lora_kernels", lambda: forced)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["one row", "32 rows of 3 adapters and the base", "a prefill chunk and 5 decode rows",
                                    "a prefill chunk of 100"])
def test_the_fast_paths_update_is_each_rows_own_adapters_in_float32_to_its_dtypes_rounding(text_config, dtype, layout, kernel,
                                                                                           monkeypatch):
    """Outside batch-invariant mode (the native kernel for a part of few rows; else its own stacks, the resident
    stack with its mask, float32 for few rows of a bf16 model without the kernel, bf16 from FEW_ROWS): each row gets
    x A^T B^T of its own adapter as float32 computes it, to the rounding of the dtype (bf16: 2^-6 of the update's
    largest value, a few roundings of 2^-9; float32: 1e-5)."""
    from oai_gemma.engine.lora.adapter import AdapterWeights, pack
    from oai_gemma.engine.lora.apply import LoraStep, module_names
    from oai_gemma.engine.lora.registry import Registration

    use_kernel(monkeypatch, kernel)
    generator = torch.Generator().manual_seed(0)
    shapes = module_shapes(text_config)
    registry = LoraRegistry(text_config, dtype, torch.device("cpu"), max_loras=3, max_rank=16)
    weights, slots = {}, {}
    for rank, targets in [(4, ("q", "v", "down")), (8, tuple(shapes)), (16, ("k", "gate", "up", "o"))]:
        adapter = AdapterWeights(f"r{rank}", rank, [{} for _ in range(text_config.num_hidden_layers)])
        adapter.layers[0] = {m: (torch.randn(rank, shapes[m][0], generator=generator), torch.randn(shapes[m][1], rank, generator=generator) / 50)
                             for m in targets}
        registration = Registration(LoraModule(adapter.name, "-"), rank, ready=pack(adapter, dtype, torch.device("cpu")))
        registry.register(registration)
        slots[registry.acquire(registration)] = weights[adapter.name] = adapter
    ids = list(slots)
    prefills, decodes = {"one row": ([], [ids[0]]), "32 rows of 3 adapters and the base": ([], [(ids + [0])[i % 4] for i in range(32)]),
                         "a prefill chunk and 5 decode rows": ([(ids[1], 40)], [ids[2], 0, ids[0], ids[2], ids[2]]),
                         "a prefill chunk of 100": ([(ids[2], 100)], [])}[layout]

    def item(slot, count=1):
        return StepItem([], [0] * count, 0, adapter=slot)

    layers = [type("Layer", (), {m: object() for m in shapes})() for _ in range(text_config.num_hidden_layers)]
    step = LoraStep.of([item(s, n) for s, n in prefills], [item(s) for s in decodes], registry.resident, module_names(layers),
                       torch.device("cpu"), exact=False)
    row_slots = [s for s, n in prefills for _ in range(n)] + decodes
    for module, (features_in, features_out) in shapes.items():
        x = torch.randn(len(row_slots), features_in, generator=generator).to(dtype)
        got = step.around(lambda x, weight: torch.zeros(x.shape[0], features_out, dtype=dtype), 0)(x, getattr(layers[0], module)).float()
        expected = torch.zeros_like(got)
        for row, slot in enumerate(row_slots):
            pair = slots[slot].layers[0].get(module) if slot else None
            if pair is not None:
                expected[row] = x[row].float() @ pair[0].T @ pair[1].T
        tolerance = expected.abs().max() * (2**-6 if dtype == torch.bfloat16 else 1e-5)  # 0 where no row's adapter targets it
        assert (got - expected).abs().max() <= tolerance, module


@pytest.mark.parametrize("kernel", KERNELS[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_kernel_takes_any_width_rank_and_row_order(dtype, kernel, monkeypatch):
    """Widths that are no multiple of a vector (in 635, out 269, 40, 7), ranks 1, 5 and 16, rows of three adapters in
    any order beside base rows: each row gets its own adapter's update, added into the output as float32 computes
    it from the stack's weights (bf16: to a few roundings of 2^-9)."""
    from oai_gemma.engine.lora.apply import LoraStep, NativeRows
    from oai_gemma.engine.lora.stack import build_stack
    from oai_gemma.engine.ops import native

    use_kernel(monkeypatch, kernel)
    generator = torch.Generator().manual_seed(0)
    features_in, outs = 635, {"q": 269, "k": 40, "v": 7}
    adapters = {slot: (rank, [{m: (torch.randn(rank, features_in, generator=generator), torch.randn(n, rank, generator=generator) / 50)
                               for m, n in outs.items()}]) for slot, rank in ((1, 5), (2, 16), (3, 1))}
    stack = build_stack(adapters, 1, dtype)
    slots = [2, 0, 1, 2, 2, 3, 1, 2, 2, 2, 0, 3, 2]
    rows = NativeRows(slots, stack, dtype, torch.device("cpu"), native.lora_kernels()[1])
    step, group = LoraStep([], kernel=native.lora_kernels()[0]), stack.layers[0]["q"]
    x = torch.randn(len(slots), features_in, generator=generator).to(dtype)
    for first, (module, features_out) in enumerate(outs.items()):  # the group's first projection shrinks x
        out = torch.randn(len(slots), features_out, generator=generator).to(dtype)
        expected = out.float()
        for row, slot in enumerate(slots):
            if slot:
                a, b = (w.to(dtype).float() for w in adapters[slot][1][0][module])
                expected[row] += x[row].float() @ a.T @ b.T
        step.project_native(x, out, slice(0, len(slots)), True, rows, group.native[module][0], first == 0)
        assert (out.float() - expected).abs().max() <= expected.abs().max() * (2**-7 if dtype == torch.bfloat16 else 1e-6), module
    with pytest.raises(ValueError, match="contiguous"):
        step.project_native(x, torch.zeros(outs["v"], len(slots), dtype=dtype).T, slice(0, len(slots)), True, rows, group.native["v"][0], False)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="model's dtype"):  # the kernel would read the stack's bytes as the wrong type
        NativeRows(slots, stack, other, torch.device("cpu"), False)


# ---- bad adapters: each refused with its name and the reason ------------------------------------------------


@pytest.fixture(scope="module")
def text_config():
    """The embedded model's shapes (its config only: no weights needed to refuse an adapter)."""
    from transformers import AutoConfig

    from oai_gemma.engine.model.loader import embedded_model_dir

    config = AutoConfig.from_pretrained(embedded_model_dir())
    return getattr(config, "text_config", config)


def _write(directory, tensors: dict, config: dict | None = None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **(config or {})}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _pair(key: str, r: int, shape: tuple[int, int]) -> dict:
    return {f"{key}.lora_A.weight": torch.randn(r, shape[0]), f"{key}.lora_B.weight": torch.randn(shape[1], r)}


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, reason", [
    ("missing", "no adapter directory"),
    ("no-config", "has no adapter_config.json"),
    ("corrupt", "corrupt or unreadable"),
    ("rank", "rank 32 (layers.0.q_proj) is above the maximum, 16"),
    ("shape", "do not fit this base model"),
    ("layer", "but the base model has 18 layers"),
    ("embed", "targets the embeddings or the lm_head"),
    ("lm_head", "targets the embeddings or the lm_head"),
    ("vision", "targets the vision tower"),
    ("dora", "DoRA is not supported"),
    ("half", "not both lora_A and lora_B"),
])
def test_bad_adapters_are_refused_naming_the_adapter_and_the_reason(text_config, tmp_path, case, reason):
    config = text_config
    hidden, q = module_shapes(config)["q"]
    directory = tmp_path / case
    if case == "no-config":
        directory.mkdir()
    elif case == "corrupt":
        _write(directory, _pair(Q, 4, (hidden, q)))
        (directory / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    elif case in ("rank", "shape", "layer", "embed", "lm_head", "vision", "dora", "half"):
        tensors = {
            "rank": _pair(Q, 32, (hidden, q)), "shape": _pair(Q, 4, (hidden + 1, q)),
            "layer": _pair(Q.replace("layers.0", "layers.40"), 4, (hidden, q)),
            "embed": {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 10)},
            "lm_head": _pair("base_model.model.lm_head", 4, (hidden, 10)),
            "vision": _pair("base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj", 4, (hidden, q)),
            "dora": _pair(Q, 4, (hidden, q)), "half": {f"{Q}.lora_A.weight": torch.randn(4, hidden)},
        }[case]
        _write(directory, tensors, {"use_dora": True} if case == "dora" else None)
    with pytest.raises(AdapterError) as refused:
        read_adapter("bad-one", directory, config, max_rank=16)
    assert "LoRA adapter 'bad-one'" in str(refused.value) and reason in str(refused.value)


def test_lora_modules_take_vllms_two_forms_and_refuse_others():
    assert parse_module("a=/x/y") == LoraModule("a", "/x/y")
    assert parse_module('{"name": "b", "path": "/p", "base_model_name": "gemma"}') == LoraModule("b", "/p", "gemma")
    for bad in ("no-equals", "=/p", "a=", '{"name": "x"}', "{not json"):
        with pytest.raises(ValueError):
            parse_module(bad)


def test_resident_slots_are_least_recently_used_and_reloaded_from_disk(setup):
    import queue

    loaded, engine, paths = setup
    reads = queue.SimpleQueue()  # the engine core's inbox, as far as the reader thread knows
    registry = LoraRegistry(loaded.text_config, torch.float32, torch.device("cpu"), max_loras=2, max_rank=64,
                            on_read=lambda *read: reads.put(read))

    def read_in_background(registration) -> int:
        """acquire: 0 while its files are read on the reader thread; then the read comes back and it is installed."""
        assert registry.acquire(registration) == 0 and registration.loading
        assert registry.read_done(*reads.get(timeout=60)) is None and not registration.loading
        return registry.acquire(registration)

    for name, path in paths.items():
        registry.register(registry.read(LoraModule(name, str(path))))
    a, b, c = (registry.lookup(name) for name in paths)
    slot_a, slot_b = registry.acquire(a), registry.acquire(b)
    assert {slot_a, slot_b} == {1, 2} and registry.loads == 0  # read at registration: no second read
    assert read_in_background(c) == 0 and c.ready is not None  # read, but both slots pinned by running sequences: c waits
    registry.release(slot_a)
    slot_c = registry.acquire(c)  # a was idle: dropped for c
    assert slot_c == slot_a and registry.loads == 1  # c, registered beyond max_loras, was not kept: read at first use
    registry.release(slot_b)
    assert read_in_background(a) == slot_b and registry.loads == 2  # a read again from disk, into b's idle slot
    assert [d["resident"] for d in registry.describe()] == [True, False, True]
    assert [d["slot"] for d in registry.describe()] == [slot_b, None, slot_c]
    registry.unregister(c.name)  # pinned: stays until its sequence ends
    assert registry.resident.slots[slot_c] is not None and registry.lookup(c.name) is None
    registry.release(slot_c)
    assert registry.resident.slots[slot_c] is None


def test_the_benchs_adapters_are_valid_peft_adapters_routed_per_request(text_config, tmp_path):
    from oai_gemma.bench import compare
    from oai_gemma.bench.lora import LoraSet, make_adapter, route
    from oai_gemma.engine.model.loader import embedded_model_dir

    path = make_adapter(tmp_path / "a", str(embedded_model_dir()), rank=4, seed=0)
    assert read_adapter("bench", path, text_config, max_rank=4).rank == 4
    names = ["lora-0", "lora-1", "lora-2"]
    assert route("ours-lora", names)(4, {"model": "gemma-3-270m"})["model"] == "lora-1"
    assert route("llama-server-lora", names)(5, {"model": "m"}) == {"model": "m", "lora": [{"id": 2, "scale": 1.0}]}
    lora = LoraSet(names, [path] * 3, path)
    argv = compare.build_spec("ours-lora", 9000, "", "bfloat16", "cpu", [], 8, lora).argv
    assert argv[argv.index("--lora-modules") + 1] == f"lora-0={path}" and argv[argv.index("--max-loras") + 1] == "4"
    with pytest.raises(ValueError):
        compare.build_spec("ours-lora", 9000, "", "bfloat16", "cpu", [], 8)


def test_bad_lora_settings_are_start_up_errors(setup):
    from oai_gemma.engine.config import ConfigError, _lora
    from oai_gemma.settings import load_settings

    def settings(*modules):
        return load_settings(overrides={"lora": {"modules": list(modules)}}, environ={})

    assert _lora(settings("a=/x", '{"name": "b", "path": "/y"}'), static=False).modules[1] == LoraModule("b", "/y")
    for modules, why in [(("a=/x", "a=/y"), "names an adapter twice"), (("gemma-3-270m=/x",), "is the base model's"),
                         (("nonsense",), "expected name=path")]:
        with pytest.raises(ConfigError, match=why):
            _lora(settings(*modules), static=False)
    with pytest.raises(ConfigError, match="static decode"):
        _lora(settings("a=/x"), static=True)
    loaded, _, paths = setup
    with pytest.raises(ConfigError, match="LoRA adapter 'gone': no adapter directory"):
        Engine(loaded, EngineConfig(
            model=ModelConfig(max_model_len=64),
            scheduler=SchedulerConfig(max_num_seqs=1),
            lora=LoRAConfig(modules=(LoraModule("gone", "/nonexistent"),)),
        ))


def test_an_adapter_on_a_quantized_bf16_base_moves_the_logits_as_pefts(setup, references):
    """bf16 with int8 projections (its quantized weights from the model cache when a server made them): the adapter,
    kept unquantized, moves the logits as PEFT's merged float32 model moves them from the base (to bf16's and int8's
    rounding: cosine > 0.9 of the two moves)."""
    from oai_gemma.engine.factory import configure

    loaded, engine32, paths = setup
    quantized = load(ModelSettings(dtype="bfloat16"))
    stored = configure(Settings(model=ModelSettings(dtype="bfloat16", quantization="int8")), quantized).model.quantized_weights
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16", quantization="int8", max_model_len=256, batch_invariant="off",
                          quantized_weights=stored),
        scheduler=SchedulerConfig(max_num_seqs=2),
        lora=LoRAConfig(modules=(LoraModule("all8", str(paths["all8"])),)),
    )
    engine = Engine(quantized, config, own_weights=True)
    runner, registry = engine.core.runner, engine.adapters
    ids = prompt(engine32, PROMPTS[1])
    blocks = runner.sequence_blocks(0, 64)
    slot = registry.acquire(registry.lookup("all8"))
    base = runner.forward([StepItem(blocks, ids, 0)], [])[0].float()
    adapted = runner.forward([StepItem(blocks, ids, 0, adapter=slot)], [])[0].float()
    with torch.inference_mode():
        reference = [references[name](torch.tensor([ids])).logits[0, -1] for name in (None, "all8")]
    moved, expected = adapted - base, reference[1] - reference[0]
    assert torch.nn.functional.cosine_similarity(moved, expected, dim=0) > 0.9
    engine.shutdown()
