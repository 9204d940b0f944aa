"""Build a small multimodal Gemma-3 test model offline: the embedded 270m text model plus a tiny random SigLIP.

The real multimodal Gemma-3 checkpoints (4b/12b/27b-it) are `Gemma3ForConditionalGeneration`s: a SigLIP vision
tower over 896x896 images in 14x14 patches (64x64 patches), a `Gemma3MultiModalProjector` that average-pools them
to 16x16 = 256 soft tokens and projects them to the text hidden size, and a text model whose vocabulary is
262208 rows (the tokenizer's 262144 plus `<image_soft_token>` at 262144 plus 63 unused rows). The model built
here keeps every piece of that layout that the serving code can see -- the processor (896x896, pan-and-scan,
256 `<image_soft_token>` per image between `<start_of_image>` 255999 and `<end_of_image>` 256000), the token
ids, the config fields, the checkpoint's key names -- but the vision tower is 2 layers of width 128, so it is a
few MB and runs on a CPU in well under a second. The text model is the embedded gemma-3-270m, copied exactly,
so on text-only prompts it gives the 270m model's logits.

    python -m oai_gemma.testing.tiny_vision DIR     # builds DIR (once) and prints it
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("oai_gemma.tiny_vision")

MARKER = ".tiny-multimodal-complete"
FORMAT_VERSION = 1

# what the real gemma-3-{4b,12b,27b}-it use (configs/hf/*/config.json, their tokenizer and processor)
VOCAB_SIZE = 262_208
IMAGE_TOKEN_ID = 262_144
BOI_TOKEN_ID = 255_999
EOI_TOKEN_ID = 256_000
IMAGE_TOKEN = "<image_soft_token>"
BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
MM_TOKENS_PER_IMAGE = 256
IMAGE_SIZE = 896
PATCH_SIZE = 14
EOS_TOKEN_IDS = [1, 106]  # <eos>, <end_of_turn>

# the tiny vision tower (the real one is 1152 wide, 27 layers, 16 heads, MLP 4304)
VISION_HIDDEN = 128
VISION_LAYERS = 2
VISION_HEADS = 4
VISION_INTERMEDIATE = 256
INIT_STD = 0.02
# the 64 rows the -it vocabulary adds (<image_soft_token> and 63 unused): tiny, so that their tied lm_head logits
# stay near 0 -- far below a real token's (the 270m's final hidden states are long: rows of std 0.02 give
# logits above 20) and greedy decoding on text never picks one
NEW_ROW_STD = 1e-3

EXTRA_SPECIAL_TOKENS = {"image_token": IMAGE_TOKEN, "boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN}

# the real checkpoints' preprocessor_config.json / processor_config.json (null = the processor's defaults:
# do_pan_and_scan False, min crop 256, max 4 crops, min ratio 1.2)
PREPROCESSOR_CONFIG = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": MM_TOKENS_PER_IMAGE,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 1 / 255,
    "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
}
PROCESSOR_CONFIG = {"image_seq_length": MM_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}


def is_built(target: Path, seed: int | None = None) -> bool:
    marker = Path(target) / MARKER
    if not marker.exists():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("format") == FORMAT_VERSION and (seed is None or info.get("seed") == seed)


def build_tiny_multimodal(target: Path, *, seed: int = 0, source: Path | None = None) -> Path:
    """Build (once) the tiny multimodal Gemma-3 in `target` and return it.

    `source` is a gemma-3-270m directory (config.json, model.safetensors, tokenizer); by default the embedded
    model, converted on first use. The result is deterministic for a given seed and source. It is built in a
    temporary sibling directory that is renamed into place after its marker file is written, under a file lock,
    so a half-built directory is never seen as complete and concurrent callers build once."""
    target = Path(target).expanduser().resolve()
    if is_built(target, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(target, seed):
            return target
        if source is None:
            from ..engine.model.loader import embedded_model_dir

            source = embedded_model_dir()
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
        try:
            _build_into(staging, Path(source), seed)
            (staging / MARKER).write_text(json.dumps({"format": FORMAT_VERSION, "seed": seed}) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_config(text_config_dict: dict):
    """The `Gemma3Config`: the 270m text config with the -it vocabulary, a tiny SigLIP, the real token ids."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = {k: v for k, v in text_config_dict.items() if k not in ("architectures", "_model_name_or_path", "dtype",
                                                                   "torch_dtype", "transformers_version")}
    text["vocab_size"] = VOCAB_SIZE
    text_config = Gemma3TextConfig(**text)
    vision_config = SiglipVisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=3,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
        attention_dropout=0.0,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=BOI_TOKEN_ID,
        eoi_token_index=EOI_TOKEN_ID,
        image_token_index=IMAGE_TOKEN_ID,
        initializer_range=INIT_STD,
        tie_word_embeddings=True,
        eos_token_id=list(EOS_TOKEN_IDS),
        bos_token_id=text_config.bos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.dtype = torch.float32
    return config


def _checkpoint_name(module_key: str) -> str | None:
    """The key a real google/gemma-3-*-it safetensors file uses for a `Gemma3ForConditionalGeneration` key
    (transformers maps them back when loading); None for the tied lm_head, which checkpoints leave out."""
    if module_key == "lm_head.weight":
        return None
    for prefix, saved in (("model.language_model.", "language_model.model."),
                          # transformers 5's SiglipVisionModel dropped its `vision_model` level; checkpoints keep it
                          ("model.vision_tower.", "vision_tower.vision_model."),
                          ("model.multi_modal_projector.", "multi_modal_projector.")):
        if module_key.startswith(prefix):
            return saved + module_key[len(prefix):]
    raise ValueError(f"unexpected parameter {module_key}")


def _random_tensor(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Deterministic initial values for one vision-tower or projector tensor, by its name and shape."""
    if "mm_soft_emb_norm" in name:  # Gemma RMSNorm scales by (1 + weight)
        return torch.zeros(shape)
    if "mm_input_projection_weight" in name:
        # unit-RMS pooled features -> soft tokens about as large as the scaled text embeddings (RMS ~1)
        return torch.randn(shape, generator=generator) * shape[0] ** -0.5
    if "layer_norm" in name or "layernorm" in name:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=generator) * INIT_STD


def build_state_dict(config, text_weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model under the real checkpoints' key names: the text weights copied (embedding
    extended by seeded small random rows), the vision tower and projector seeded random."""
    from transformers import Gemma3ForConditionalGeneration

    with torch.device("meta"):
        skeleton = Gemma3ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, meta in skeleton.state_dict().items():  # a fixed order, so the random draws are reproducible
        name = _checkpoint_name(key)
        if name is None:
            continue
        if key.startswith("model.language_model."):
            source_key = "model." + key[len("model.language_model."):]
            tensor = text_weights[source_key].to(torch.float32)
            if source_key == "model.embed_tokens.weight":
                extra = meta.shape[0] - tensor.shape[0]
                rows = torch.randn(extra, meta.shape[1], generator=generator) * NEW_ROW_STD
                tensor = torch.cat([tensor, rows])
        else:
            tensor = _random_tensor(name, meta.shape, generator)
        if tensor.shape != meta.shape:
            raise ValueError(f"{key}: built {tuple(tensor.shape)}, the model wants {tuple(meta.shape)}")
        state[name] = tensor.contiguous()
    prefix = "model.language_model."
    used = {"model." + k[len(prefix):] for k in skeleton.state_dict() if k.startswith(prefix)}
    unused = set(text_weights) - used - {"lm_head.weight"}
    if unused:
        raise ValueError(f"text weights not used: {sorted(unused)[:5]}")
    return state


def tiny_tokenizer(source: Path):
    """The 270m tokenizer with `<image_soft_token>` added as special token 262144, and the boi/eoi/image token
    names the -it tokenizers carry (`tokenizer.boi_token`, `.image_token_id`...), and the chat template."""
    from transformers import AutoTokenizer

    from ..engine.model.loader import chat_template_text

    tokenizer = AutoTokenizer.from_pretrained(source, extra_special_tokens=dict(EXTRA_SPECIAL_TOKENS))
    ids = {
        IMAGE_TOKEN: tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        BOI_TOKEN: tokenizer.convert_tokens_to_ids(BOI_TOKEN),
        EOI_TOKEN: tokenizer.convert_tokens_to_ids(EOI_TOKEN),
    }
    expected = {IMAGE_TOKEN: IMAGE_TOKEN_ID, BOI_TOKEN: BOI_TOKEN_ID, EOI_TOKEN: EOI_TOKEN_ID}
    if ids != expected or len(tokenizer) != IMAGE_TOKEN_ID + 1:
        raise ValueError(f"unexpected image token ids {ids} (tokenizer of {len(tokenizer)})")
    tokenizer.chat_template = chat_template_text()
    return tokenizer


def _build_into(staging: Path, source: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    config = tiny_config(json.loads((source / "config.json").read_text()))
    text_weights = load_file(source / "model.safetensors")
    state = build_state_dict(config, text_weights, seed)
    del text_weights
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    del state
    config.save_pretrained(staging)
    text_config = config.get_text_config()
    GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        pad_token_id=text_config.pad_token_id,
        eos_token_id=list(EOS_TOKEN_IDS),
        cache_implementation="hybrid",
        do_sample=True,
        temperature=1.0,
        top_k=64,
        top_p=0.95,
    ).save_pretrained(staging)
    tokenizer = tiny_tokenizer(source)
    tokenizer.save_pretrained(staging)
    # the 270m's tokenizer_config carries load-time flags from its conversion; they are no property of the model
    tokenizer_config = json.loads((staging / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    # written by hand (not via save_pretrained) so they are the real checkpoints' files, not whichever image
    # backend (torchvision or PIL) this machine has
    (staging / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    (staging / "processor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oai_gemma.testing.tiny_vision",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to build the model (skipped if already built)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(build_tiny_multimodal(args.directory, seed=args.seed))


if __name__ == "__main__":
    main()
