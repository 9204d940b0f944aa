"""The server builds Gemma-3's text modules itself (engine/model/lean.py) instead of importing transformers (issue 27's
start-up): the same tensors, the same math, the same tokens; checkpoints it does not understand still load."""

import json

import pytest
import torch

from lean_checks import assert_runs_without_transformers
from oai_gemma.engine.model import lean, lean_config
from oai_gemma.engine.model.loader import embedded_model_dir, load
from oai_gemma.settings import ModelSettings


pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def both():
    """(lean, transformers') loads of the embedded model in bfloat16: every tensor cast as the server casts it."""
    settings = ModelSettings(dtype="bfloat16")
    return load(settings, lean=True), load(settings)


def test_the_lean_tree_holds_transformers_tensors(both):
    ours, theirs = both
    assert type(ours.model).__module__ == "torch.nn.modules.module" and "Gemma3" in type(theirs.model).__name__
    mine, reference = dict(ours.model.named_parameters()), dict(theirs.model.named_parameters())
    assert mine.keys() == reference.keys() and len(mine) == 2 + 18 * 13  # embedding (lm_head tied), norm, 18 layers
    for name, tensor in mine.items():
        assert tensor.dtype == reference[name].dtype == torch.bfloat16 and torch.equal(tensor, reference[name]), name
    assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
    assert ours.tokenizer.encode("Hello") == theirs.tokenizer.encode("Hello") and ours.eos_token_ids == theirs.eos_token_ids
    for key in ("hidden_size", "head_dim", "layer_types", "sliding_window", "query_pre_attn_scalar", "rms_norm_eps", "vocab_size"):
        assert getattr(ours.text_config, key) == getattr(theirs.text_config, key), key


def test_the_lean_modules_compute_what_transformers_modules_do(both):
    ours, theirs = both
    mine, reference = ours.model.model, theirs.model.model
    ids = torch.tensor([2, 105, 4521, 262143, 0])
    assert torch.equal(mine.embed_tokens(ids), reference.embed_tokens(ids))  # scaled by sqrt(640), in bf16
    hidden = torch.randn(5, 640, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(mine.norm(hidden), reference.norm(hidden))
    positions = torch.tensor([[0, 1, 511, 512, 8000]])
    for kind in ("sliding_attention", "full_attention"):  # different rope_theta each
        for got, expected in zip(mine.rotary_emb(hidden, positions, kind), reference.rotary_emb(hidden, positions, kind)):
            assert torch.equal(got, expected), kind
    layer, theirs_layer = mine.layers[3], reference.layers[3]
    assert torch.equal(layer.self_attn.q_norm(hidden[:, :256]), theirs_layer.self_attn.q_norm(hidden[:, :256]))
    assert torch.equal(layer.mlp.up_proj(hidden), theirs_layer.mlp.up_proj(hidden))


def test_a_lean_load_does_not_import_transformers():
    """The point of the lean tree: transformers' import and its Gemma-3 modeling code are ~2 s of a 2-core start."""
    script = (
        "import sys\n"
        "from oai_gemma.engine.model.loader import load\n"
        "from oai_gemma.settings import ModelSettings\n"
        "loaded = load(ModelSettings(), lean=True)\n"
        "assert loaded.model.lm_head.weight.shape == (262144, 640)\n"
    )
    assert_runs_without_transformers(script)


def _config_variant(tmp_path, change, name="variant", source=None):
    """A copy of the embedded model's directory (or `source`; the weights linked, not copied) with config.json changed."""
    source, target = source or embedded_model_dir(), tmp_path / name
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    change(config)
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("change, why", [
    (lambda c: c.update(model_type="gemma3"), "model_type"),
    (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn", factor=8.0), "rope 'yarn'"),
    (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="linear"), "rope 'linear'"),  # no factor
    (lambda c: c.update(hidden_activation="silu"), "activation 'silu'"),
    (lambda c: c.pop("hidden_size"), "lacks hidden_size"),
    (lambda c: c.update(use_bidirectional_attention=True), "bidirectional"),
])
def test_a_config_the_lean_tree_does_not_implement_is_left_to_transformers(tmp_path, change, why):
    config, reason = lean.text_config(str(_config_variant(tmp_path, change)))
    assert config is None and why in reason


def test_a_multimodal_checkpoint_the_lean_tree_does_not_implement_loads_through_transformers(tmp_path, tiny_vision_dir):
    """(The tiny multimodal model itself is built lean: tests/engine/test_lean_vision.py.)"""
    def softcapped(config):
        config["text_config"]["attn_logit_softcapping"] = 50.0

    variant = _config_variant(tmp_path, softcapped, source=tiny_vision_dir)
    assert "soft-capping" in lean_config.model_config(str(variant))[1]
    loaded = load(ModelSettings(source=str(variant), dtype="float32"), lean=True)
    assert type(loaded.model).__name__ == "Gemma3ForConditionalGeneration" and type(loaded.processor).__name__ == "Gemma3Processor"


def test_a_config_without_layer_types_has_transformers_layer_pattern(tmp_path):
    config, _ = lean.text_config(str(_config_variant(tmp_path, lambda c: c.pop("layer_types"))))
    assert config.layer_types == json.loads((embedded_model_dir() / "config.json").read_text())["layer_types"]


def test_a_checkpoint_whose_tensors_do_not_match_its_config_is_refused_by_name(tmp_path):
    variant = _config_variant(tmp_path, lambda c: c.update(num_hidden_layers=17, layer_types=c["layer_types"][:17]))
    config, _ = lean.text_config(str(variant))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.17"):
        lean.build(config, str(variant), torch.float32)
    wider = _config_variant(tmp_path, lambda c: c.update(intermediate_size=4096), name="wider")
    config, _ = lean.text_config(str(wider))
    with pytest.raises(ValueError, match=r"mlp.(down|gate|up)_proj.weight has shape"):
        lean.build(config, str(wider), torch.float32)


def test_the_lean_config_is_the_projects_frozen_dataclass():
    """Issue 38: the loader reads config.json into the project's own type (transformers' names, nothing more)."""
    import dataclasses

    config, why = lean_config.model_config(str(embedded_model_dir()))
    assert isinstance(config, lean_config.TextConfig), why
    assert config._name_or_path == str(embedded_model_dir()) and config.num_hidden_layers == 18
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1
