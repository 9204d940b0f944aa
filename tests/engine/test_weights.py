"""Gemma3Weights (engine/model/weights.py, issue 38.4): read from safetensors one tensor at a time (streamed.py), the
same weights in the same layout, bit for bit, as from the module tree; the engine on them generates the same; the
loader never holds the model in float32 (issue 37: a subprocess's peak resident memory against the checkpoint's size)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oai_gemma.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.model.layout import Layout, LinearCache, TensorFile, path_name, write_safetensors
from oai_gemma.engine.model.loader import embedded_model_dir, load
from oai_gemma.engine.model.streamed import from_safetensors
from oai_gemma.engine.model.weights import PROJECTIONS, from_modules
from oai_gemma.engine.ops.linear import FrozenLinear
from oai_gemma.engine.shape import Gemma3Shape
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def same_linear(a, b, probe: torch.Tensor) -> bool:
    """The same layout holding the same bits (a packed float weight: the same products, oneDNN's layout is opaque)."""
    if type(a) is not type(b):
        return False
    a, b = getattr(a, "few", a), getattr(b, "few", b)
    if isinstance(a, FrozenLinear):
        return torch.equal(a(probe.to(a.packed.dtype if a.packed is not None else a.weight.dtype)),
                           b(probe.to(b.packed.dtype if b.packed is not None else b.weight.dtype)))
    ours, theirs = a.tensors(), b.tensors()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def assert_same_weights(streamed, tree) -> None:
    assert streamed.shape == tree.shape and streamed.dtype == tree.dtype and streamed.quantization == tree.quantization
    assert torch.equal(streamed.embedding, tree.embedding) and streamed.embedding.dtype == tree.embedding.dtype
    assert torch.equal(streamed.final_norm, tree.final_norm)
    generator = torch.Generator().manual_seed(0)
    for i, (ours, theirs) in enumerate(zip(streamed.layers, tree.layers, strict=True)):
        for field, a, b in zip(ours._fields, ours, theirs):
            if field in PROJECTIONS:
                probe = torch.randn(3, _in_features(tree, field), generator=generator)
                assert same_linear(a, b, probe), (i, field)
            else:
                assert torch.equal(a, b) and a.dtype == b.dtype == torch.float32, (i, field)
    probe = torch.randn(3, tree.shape.text.hidden, generator=generator)
    assert same_linear(streamed.lm_head, tree.lm_head, probe)


def _in_features(weights, field: str) -> int:
    text = weights.shape.text
    return {"o": text.heads * text.head_dim, "down": text.intermediate}.get(field, text.hidden)


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_the_embedded_models_weights_from_safetensors_equal_the_module_trees(quantization):
    loaded = load(ModelSettings(dtype="float32"), lean=True)
    layout = Layout(quantization, torch.float32)
    tree = from_modules(loaded.model, layout)
    streamed = from_safetensors(embedded_model_dir(), Gemma3Shape.of(loaded.model.config), layout)
    assert_same_weights(streamed, tree)
    assert streamed.mapped, "stored in float32, the model's dtype: the embedding is read from the file"


def test_the_tiny_vision_models_weights_from_safetensors_equal_the_module_trees(tiny_vision_dir):
    loaded = load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"), lean=True)
    streamed_load = load(ModelSettings(source=str(tiny_vision_dir), dtype="float32"), lean=True, stream=True)
    layout = Layout("int8", torch.float32)
    tree = from_modules(loaded.model, layout)
    streamed = from_safetensors(streamed_load.checkpoint, Gemma3Shape.of(streamed_load.model.config), layout)
    assert_same_weights(streamed, tree)
    assert not list(streamed_load.model.parameters()), "the stream path builds no module tree"
    ours, theirs = streamed.vision.tensors(), tree.vision.tensors()
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)), "the vision tower as the tree's"


def test_the_quantized_cache_is_read_back_per_tensor_into_the_same_layout(tmp_path):
    loaded = load(ModelSettings(dtype="float32"), lean=True)
    layout, file = Layout("int8", torch.float32), tmp_path / "int8.safetensors"
    shape = Gemma3Shape.of(loaded.model.config)
    first = from_safetensors(embedded_model_dir(), shape, layout, file)
    stored = TensorFile(file)
    assert {key.rsplit(".", 1)[0] for key in stored.entries} == {f"projection.{i}" for i in range(18 * 7)} | {"lm_head"}
    stored.close()
    again = from_safetensors(embedded_model_dir(), shape, layout, file)
    assert_same_weights(again, first)
    assert_same_weights(from_modules(loaded.model, layout, file), first)


@pytest.mark.slow  # fast subset (issue 36.4): the same subsystem is covered by its lighter tests
def test_an_engine_on_streamed_weights_generates_what_one_on_the_module_tree_does():
    config = EngineConfig(
        model=ModelConfig(max_model_len=512, quantization="int8"),
        scheduler=SchedulerConfig(max_num_seqs=2, max_prefill_tokens=128),
    )
    engines = [Engine(load(ModelSettings(dtype="float32"), lean=True, stream=stream), config) for stream in (True, False)]
    assert engines[0].core.runner.mapped_embedding
    loop = asyncio.new_event_loop()

    async def collect(engine):
        ids = engine.encode("The capital of France is")
        request = GenerationRequest("w", ids, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2))
        return [(e.token_id, e.logprob) async for e in engine.generate(request) if e.token_id is not None]

    try:
        for engine in engines:
            engine.start(loop)
        streamed, tree = (loop.run_until_complete(collect(engine)) for engine in engines)
        assert len(streamed) == 8 and streamed == tree
    finally:
        for engine in engines:
            engine.shutdown()
        loop.close()


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from oai_gemma.engine.model.layout import Layout
    from oai_gemma.engine.model.streamed import from_safetensors
    from oai_gemma.engine.shape import Gemma3Shape, TextShape

    def status(key):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    text = TextShape(**json.loads(sys.argv[2]))
    torch.zeros(1) + 1
    before = status("VmRSS")
    weights = from_safetensors(Path(sys.argv[1]), Gemma3Shape(text), Layout("int8", torch.float32))
    print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "held": weights.nbytes()}))
""")


@pytest.mark.slow  # fast subset (issue 36.4): the same subsystem is covered by its lighter tests
def test_loading_holds_the_final_weights_and_about_one_chunk_of_float(tmp_path):
    """A 254 MB bf16 checkpoint (508 MB in float32) loads into int8 weights (~130 MB held, the embedding mapped) with
    a peak of those and less than 0.4x the checkpoint's size above what the process held before: never the model in
    float32, nor its file's pages resident."""
    from oai_gemma.engine.model.layout import write_safetensors

    text = dict(hidden=1024, intermediate=4096, heads=4, kv_heads=1, head_dim=256, vocab=65536, sliding_window=512,
                sliding=(True, False, True, True), rms_eps=1e-6, query_pre_attn_scalar=256.0,
                rope={"sliding_attention": (10000.0, 1.0), "full_attention": (1e6, 1.0)})
    from oai_gemma.engine.model.streamed import expected_shapes
    from oai_gemma.engine.shape import TextShape

    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)
               for name, shape in expected_shapes(TextShape(**text), "model.", tied=True).items()}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    write_safetensors(tmp_path / "model.safetensors", tensors)
    del tensors
    argv = json.dumps({**text, "sliding": list(text["sliding"])})
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    grown = memory["peak"] - memory["before"]
    print(f"checkpoint {size / 2**20:.0f} MB bf16, held {memory['held'] / 2**20:.0f} MB, peak {grown / 2**20:.0f} MB above the start")
    assert memory["held"] < 0.6 * size, "int8 weights and the mapped embedding"
    # the final weights, a chunk of float and the allocator's slack (0.41x of the size on a quiet run); float32 whole: 2x
    assert grown < memory["held"] + 0.6 * size, "the final weights and a chunk of float (the model in float32: 2x the size)"


class _Stored:
    """A quantized linear as the cache sees it: its tensors."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": torch.arange(4, dtype=torch.int8)}


def test_saving_quantized_weights_removes_the_files_no_start_will_read_again(tmp_path):
    source, gone, cache = tmp_path / "model", tmp_path / "deleted-model", tmp_path / "quantized"
    source.mkdir(), cache.mkdir()
    stem = path_name(source)

    def write(name: str, metadata: dict | None) -> Path:
        write_safetensors(cache / name, {"x": torch.zeros(2)}, metadata)
        return cache / name

    mine = {"source": str(source.resolve()), "kind": "int8-float32"}
    older_layout = write(f"{stem}-0123456789ab-int8-float32-torch2.0-f1.safetensors", mine)
    other_kind = write(f"{stem}-0123456789ab-q4-float32-torch2.0-f2q4v3.safetensors", {**mine, "kind": "q4-float32"})
    source_gone = write("tmp_deleted-model-0123456789ab-int8-float32-f2.safetensors", {"source": str(gone), "kind": "int8-float32"})
    unlabelled_same = write(f"{stem}-unread-int8-float32-torch1.0-f1.safetensors", None)
    unlabelled_other_model = write(f"{stem}-2-0123456789ab-int8-float32-f1.safetensors", None)
    kept = cache / f"{stem}-fedcba987654-int8-float32-torch2.1-f2.safetensors"
    linear_cache = LinearCache(kept, ["lm_head"], source, "int8-float32")
    linear_cache.keep("lm_head", _Stored())
    linear_cache.save()
    assert kept.exists() and TensorFile(kept).entries.keys() == {"lm_head.packed"}
    assert not older_layout.exists() and not source_gone.exists() and not unlabelled_same.exists()
    assert other_kind.exists(), "another quantization of the same checkpoint is still read by its own starts"
    assert unlabelled_other_model.exists(), "a checkpoint whose path merely starts the same is another model"
