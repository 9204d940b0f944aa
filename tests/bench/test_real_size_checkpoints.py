"""`oai-gemma bench checkpoint` (bench/checkpoint.py, issue 37): the random-weight 1B and 4B fixtures have the published
shapes and tensor names (checked on the meta device, nothing written), and the same code path at a shrunken size
writes checkpoints that transformers and our loader load, with the real tokenizer layout. The GGUF step needs a
llama.cpp source tree and is not run here."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from oai_gemma.bench import checkpoint  # noqa: E402
from oai_gemma.cli import build_parser  # noqa: E402

# shrunken text and vision towers: the same code path, a few MB (the vocabulary stays: the tokenizer fixes it)
SMALL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=16, num_attention_heads=4,
                  num_key_value_heads=1)
SMALL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_1b_config_is_the_published_one():
    config = checkpoint.published_config("1b")
    assert config.architectures == ["Gemma3ForCausalLM"] and config.model_type == "gemma3_text"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1152, 6912, 26)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.sliding_window == 512 and config.vocab_size == 262_144 and config.query_pre_attn_scalar == 256
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2
    assert config.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 1_000_000}
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000}
    assert config.dtype == torch.bfloat16 and config.tie_word_embeddings


def test_the_4b_config_is_the_published_one():
    config = checkpoint.published_config("4b")
    text, vision = config.text_config, config.vision_config
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (2560, 10240, 34)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 4, 256)
    assert text.sliding_window == 1024 and text.vocab_size == 262_208
    assert text.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4
    assert text.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert text.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert (vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers) == (1152, 4304, 27)
    assert (vision.num_attention_heads, vision.patch_size, vision.image_size) == (16, 14, 896)
    assert config.mm_tokens_per_image == 256
    assert (config.image_token_id, config.boi_token_index, config.eoi_token_index) == (262_144, 255_999, 256_000)


def _meta_state(config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = checkpoint.model_class(config)(config)
    return {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}


def test_the_embedding_is_small_enough_that_the_input_token_does_not_win_the_logits():
    # at std 0.02 the 4B's own-token logit stood 6.2 standard deviations above the others: it echoed every token
    for size, std in (("1b", 0.0095), ("4b", 0.0049)):
        assert checkpoint.embedding_std(checkpoint.published_config(size)) == pytest.approx(std, abs=2e-4), size


def test_the_1b_tensors_are_the_published_checkpoints():
    config = checkpoint.published_config("1b")
    plan = checkpoint.tensor_plan(config)
    # transformers' Gemma3ForCausalLM holds exactly these, plus the lm_head tied to the embedding
    assert plan == {k: v for k, v in _meta_state(config).items() if k != "lm_head.weight"}
    assert len(plan) == 2 + 26 * 13 and sum(map(math.prod, plan.values())) == 999_885_952  # gemma-3-1b's count
    assert plan["model.embed_tokens.weight"] == (262_144, 1152)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == (1024, 1152)
    assert plan["model.layers.25.self_attn.k_proj.weight"] == (256, 1152)
    assert plan["model.layers.5.mlp.down_proj.weight"] == (1152, 6912)
    assert plan["model.layers.0.self_attn.q_norm.weight"] == (256,)


def test_the_4b_tensors_are_the_published_checkpoints():
    config = checkpoint.published_config("4b")
    plan = checkpoint.tensor_plan(config)
    state = _meta_state(config)
    assert len(plan) == len(state) - 1 == 883 and "lm_head.weight" in state
    assert sum(map(math.prod, plan.values())) == 4_300_079_472  # gemma-3-4b-it's count
    # the published files' names (language_model.model.*, vision_tower.vision_model.*), the module tree's shapes
    for key, shape in state.items():
        name = checkpoint.checkpoint_name(key, multimodal=True)
        assert name is None and key == "lm_head.weight" or plan[name] == shape, key
    assert plan["language_model.model.embed_tokens.weight"] == (262_208, 2560)
    assert plan["language_model.model.layers.33.self_attn.k_proj.weight"] == (1024, 2560)
    assert plan["language_model.model.layers.0.mlp.gate_proj.weight"] == (10240, 2560)
    assert plan["vision_tower.vision_model.embeddings.patch_embedding.weight"] == (1152, 3, 14, 14)
    assert plan["vision_tower.vision_model.embeddings.position_embedding.weight"] == (4096, 1152)
    assert plan["vision_tower.vision_model.encoder.layers.26.mlp.fc1.weight"] == (4304, 1152)
    assert plan["multi_modal_projector.mm_input_projection_weight"] == (1152, 2560)
    assert checkpoint.shard(plan, 2, checkpoint.SHARD_BYTES).__len__() == 2  # two files, as published


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    """The 1b's code path at a shrunken width, in 8 MB shards (the 4B's index layout)."""
    config = checkpoint.published_config("1b", text=SMALL_TEXT)
    return checkpoint.build_checkpoint(config, tmp_path_factory.mktemp("ckpt") / "small-1b", shard_bytes=8 << 20)


@pytest.fixture(scope="module")
def small_multimodal(tmp_path_factory):
    config = checkpoint.published_config("4b", text=dict(SMALL_TEXT, num_key_value_heads=2), vision=SMALL_VISION)
    return checkpoint.build_checkpoint(config, tmp_path_factory.mktemp("ckpt") / "small-4b")


@pytest.mark.slow
def test_the_small_text_checkpoint_loads_in_transformers_with_every_tensor(small_text):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    index = json.loads((small_text / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((small_text / f).exists() for f in files)
    model, info = AutoModelForCausalLM.from_pretrained(small_text, output_loading_info=True)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.dtype == torch.bfloat16
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with safe_open(small_text / index["weight_map"]["model.layers.3.mlp.up_proj.weight"], "pt") as f:
        stored = f.get_tensor("model.layers.3.mlp.up_proj.weight")
    assert torch.equal(model.model.layers[3].mlp.up_proj.weight, stored)
    assert abs(stored.float().std().item() - checkpoint.INIT_STD) < 0.002
    assert torch.count_nonzero(model.model.layers[0].input_layernorm.weight) == 0  # Gemma's 1 + w
    embedding = model.model.embed_tokens.weight.float()
    assert abs(embedding.std().item() - checkpoint.embedding_std(model.config)) < 1e-3
    ids = torch.randint(0, 262_144, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert (logits[0].argmax(-1) == ids[0]).float().mean() < 0.2  # the output does not echo the input token
    assert json.loads((small_text / checkpoint.MARKER).read_text())["parameters"] == model.num_parameters()


@pytest.mark.slow
def test_the_small_text_checkpoint_loads_through_our_lean_loader(small_text):
    from oai_gemma.engine.model.loader import load
    from oai_gemma.settings import ModelSettings

    loaded = load(ModelSettings(source=str(small_text), dtype="bfloat16"), lean=True)
    assert type(loaded.model).__module__ == "torch.nn.modules.module"  # the lean tree, not transformers' classes
    assert loaded.eos_token_ids == (1, 106)
    assert loaded.tokenizer.encode("Hello") == [2, 9259] and loaded.tokenizer.chat_template
    assert loaded.model.model.embed_tokens.weight.shape == (262_144, 64)


@pytest.mark.slow
def test_the_weights_do_not_depend_on_the_file_layout(small_text, tmp_path):
    """A tensor's values come from (seed, name) alone: one file or shards, the same numbers."""
    from safetensors.torch import load_file

    config = checkpoint.published_config("1b", text=SMALL_TEXT)
    plan = checkpoint.tensor_plan(config)
    subset = {name: plan[name] for name in ("model.norm.weight", "model.layers.5.self_attn.o_proj.weight")}
    checkpoint.write_safetensors(tmp_path / "one.safetensors", subset, 0, torch.bfloat16)
    mine = load_file(tmp_path / "one.safetensors")
    index = json.loads((small_text / "model.safetensors.index.json").read_text())["weight_map"]
    for name in subset:
        assert torch.equal(mine[name], load_file(small_text / index[name])[name]), name


@pytest.mark.slow
def test_the_small_multimodal_checkpoint_loads_with_its_processor(small_multimodal):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, info = AutoModelForImageTextToText.from_pretrained(small_multimodal, output_loading_info=True)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.count_nonzero(model.model.multi_modal_projector.mm_soft_emb_norm.weight) == 0
    processor = AutoProcessor.from_pretrained(small_multimodal)
    tokenizer = processor.tokenizer
    assert (tokenizer.image_token_id, tokenizer.boi_token, tokenizer.eoi_token) == (262_144, "<start_of_image>", "<end_of_image>")
    assert tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>"]) == [255_999, 256_000]
    assert len(tokenizer) == 262_145 and processor.image_seq_length == 256
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(small_multimodal / "tokenizer.json"))  # what our server tokenizes with
    for text in ("def f(x):\n    return x  # c", "a" + " " * 40 + "b", "\t\tx\n\n<end_of_turn>"):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    from PIL import Image

    batch = processor(text="<start_of_image> what is this?", images=Image.new("RGB", (64, 48), "red"), return_tensors="pt")
    assert batch["pixel_values"].shape == (1, 3, 896, 896)
    assert (batch["input_ids"] == 262_144).sum() == 256
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_the_tokenizer_model_is_the_vocabulary_llama_cpp_reads(small_text):
    """tokenizer.model, rebuilt from the embedded GGUF, splits text as tokenizer.json does (SentencePiece, which
    llama.cpp's converter reads it with, is no dependency of ours: skipped without it)."""
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer

    model = spm.SentencePieceProcessor(model_file=str(small_text / "tokenizer.model"))
    reference = Tokenizer.from_file(str(small_text / "tokenizer.json"))
    assert model.vocab_size() == 262_144 and model.is_unknown(3) and model.is_control(106) and model.is_byte(238)
    assert model.id_to_piece(140) == "▁▁▁▁" and model.id_to_piece(255_999) == "<start_of_image>"
    for text in ("Hello, world!", "  two spaces\n\n\ttab\t\t\tthree", "def f(x):\n    return x**2  # code",
                 "émojis 🤗, 中文字符, Zürich", "1234567 3.14159", "<table><caption>x</caption></table>"):
        assert model.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


@pytest.mark.slow
def test_the_tokenizer_config_lists_the_token_types_llama_cpp_takes(small_text, small_multimodal):
    """Added tokens: special ones become CONTROL in llama.cpp's conversion, the others USER_DEFINED, as in the
    embedded (real) GGUF; that includes the runs of spaces, which tokenizer.json keeps in its BPE vocabulary."""
    decoder = json.loads((small_text / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert decoder["106"]["content"] == "<end_of_turn>" and decoder["106"]["special"]
    assert decoder["140"] == {"content": "▁▁▁▁", "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": False}
    assert decoder["255999"]["content"] == "<start_of_image>" and not decoder["255999"]["special"]
    assert "262144" not in decoder
    config = json.loads((small_multimodal / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["262144"] == {"content": "<image_soft_token>", "lstrip": False,
                                                        "normalized": False, "rstrip": False, "single_word": False,
                                                        "special": True}
    assert (config["boi_token"], config["eoi_token"], config["image_token"]) == ("<start_of_image>", "<end_of_image>",
                                                                               "<image_soft_token>")


def test_the_gguf_metadata_reader_reads_what_gguf_py_writes(tmp_path):
    import gguf

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_token_list(["<pad>", "▁a", "  "])
    writer.add_token_scores([0.0, -1.5, -1000.0])
    writer.add_token_types([3, 1, 4])
    writer.add_uint32("test.count", 7)
    writer.add_bool("test.flag", True)
    writer.add_float64("test.ratio", 0.25)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    metadata = checkpoint.gguf_metadata(path)
    assert metadata["general.architecture"] == b"gemma3"
    assert metadata["tokenizer.ggml.tokens"] == ["<pad>".encode(), "▁a".encode(), b"  "]
    assert metadata["tokenizer.ggml.scores"] == [0.0, -1.5, -1000.0] and metadata["tokenizer.ggml.token_type"] == [3, 1, 4]
    assert (metadata["test.count"], metadata["test.flag"], metadata["test.ratio"]) == (7, True, 0.25)
    assert metadata["test.nested"] == [[1, 2], [3]]


def test_the_sentencepiece_writer_encodes_protobuf_fields():
    assert checkpoint._varint(300) == b"\xac\x02"
    assert checkpoint._field(1, "ab") == b"\x0a\x02ab"
    assert checkpoint._field(2, 1.0) == b"\x15" + struct.pack("<f", 1.0)
    assert checkpoint._field(43, 0) == b"\xd8\x02\x00"


def test_the_command_is_a_bench_subcommand_and_bench_still_parses():
    args = build_parser().parse_args(["bench", "checkpoint", "--size", "4b", "--gguf", "q4_k_m,Q8_0"])
    assert args.func is checkpoint.run and args.size == "4b" and args.gguf == ["q4_k_m", "q8_0"]
    assert build_parser().parse_args(["bench", "checkpoint", "--size", "1b", "--gguf", "none"]).gguf == []
    args = build_parser().parse_args(["bench", "--compare", "--concurrency", "1,8"])
    assert args.func.__module__ == "oai_gemma.bench.command" and args.concurrency == [1, 8]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "checkpoint", "--size", "2b"])


def test_without_llama_cpp_the_gguf_step_says_where_to_point_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OAI_GEMMA_LLAMA_SERVER", str(tmp_path / "bin" / "llama-server"))
    monkeypatch.delenv(checkpoint.LLAMA_CPP_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="--llama-cpp"):
        checkpoint.find_llama_cpp()
    tree = tmp_path / "llama.cpp"
    (tree / "build" / "bin").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("")
    found = checkpoint.find_llama_cpp(str(tree))
    assert found.source == tree and found.quantize is None
    (tree / "build" / "bin" / "llama-quantize").write_text("")
    assert checkpoint.find_llama_cpp(str(tree)).quantize == tree / "build" / "bin" / "llama-quantize"


def test_a_gguf_step_leaves_its_file_only_once_complete(tmp_path):
    import subprocess

    source, output = tmp_path / "in.gguf", tmp_path / "out.gguf"
    source.write_bytes(b"GGUF")
    with pytest.raises(subprocess.CalledProcessError):
        checkpoint._run(["sh", "-c", 'cp "$0" "$1"; exit 1', str(source), str(output)], output)
    assert not output.exists() and not list(tmp_path.glob("*.partial"))
    checkpoint._run(["cp", str(source), str(output)], output)
    assert output.read_bytes() == b"GGUF" and not list(tmp_path.glob("*.partial"))


def _fake_llama_cpp(tmp_path):
    """A llama.cpp stand-in whose converter and quantize copy a marker into their output and log each call."""
    import stat
    import sys

    tree, log = tmp_path / "llama.cpp", tmp_path / "calls.log"
    tree.mkdir()
    (tree / "convert_hf_to_gguf.py").write_text(
        "import sys\nout = sys.argv[sys.argv.index('--outfile') + 1]\n"
        f"open({str(log)!r}, 'a').write(('mmproj' if '--mmproj' in sys.argv else 'convert') + '\\n')\n"
        "open(out, 'w').write('GGUF')\n")
    quantize = tmp_path / "llama-quantize"
    quantize.write_text(f"#!{sys.executable}\nimport sys, shutil\nopen({str(log)!r}, 'a').write(sys.argv[3] + '\\n')\n"
                        "shutil.copy(sys.argv[1], sys.argv[2])\n")
    quantize.chmod(quantize.stat().st_mode | stat.S_IEXEC)
    return checkpoint.LlamaCpp(tree, quantize), log


def test_a_rerun_of_the_gguf_step_makes_only_what_is_missing(tmp_path):
    llama, log = _fake_llama_cpp(tmp_path)
    directory = tmp_path / "gemma-3-4b-random"
    directory.mkdir()
    (directory / "preprocessor_config.json").write_text("{}")
    made = checkpoint.write_gguf(directory, ["q4_k_m", "q8_0"], llama)
    assert [path.name for path in made] == ["gemma-3-4b-random-q4_k_m.gguf", "gemma-3-4b-random-q8_0.gguf",
                                            "mmproj-gemma-3-4b-random-f16.gguf"]
    assert log.read_text().split() == ["convert", "Q4_K_M", "Q8_0", "mmproj"]
    assert not checkpoint.gguf_path(directory, "bf16").exists()  # removed once both are quantized
    log.write_text("")
    assert checkpoint.write_gguf(directory, ["q4_k_m", "q8_0"], llama) == made
    assert log.read_text() == ""  # all there: nothing runs again
    checkpoint.gguf_path(directory, "q8_0").unlink()
    killed = directory / "gguf" / "mmproj-gemma-3-4b-random-f16.gguf.partial"  # what a SIGKILLed step leaves
    killed.write_text("half")  # (beside a finished mmproj, which nothing rebuilds)
    checkpoint.write_gguf(directory, ["q4_k_m", "q8_0"], llama)
    assert log.read_text().split() == ["convert", "Q8_0"] and not killed.exists()
