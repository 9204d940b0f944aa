"""Rendered prompt + decoded images -> the token ids and pixel values a multimodal Gemma-3 prefills.

Each image goes through the model's own processor (896x896 SigLIP input, pan-and-scan crops when asked)
one at a time, so `detail` can differ per image; its `<start_of_image>` in the prompt is replaced by the
processor's own expansion (256 `<image_soft_token>` per crop between `<start_of_image>` and
`<end_of_image>`), and the whole text is tokenized at once, as the processor would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .render import IMAGE_TOKEN


# Gemma3Processor's own defaults for these: its checkpoints leave them null in preprocessor_config.json and
# the processor fills them in, so calling the image processor alone (per image, below) must too
PAN_AND_SCAN_DEFAULTS = {
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


@dataclass
class VisionPrompt:
    token_ids: list[int]
    pixel_values: torch.Tensor
    """[crops, 3, 896, 896]: each image's original view, then its pan-and-scan crops, in prompt order."""
    crop_keys: list[int]
    """One content hash per crop: the prefix cache tells two images apart by it, not by their token ids."""


def expand_images(processor, prompt: str, images: list, pan_and_scan: list[bool]) -> VisionPrompt:
    pieces = prompt.split(IMAGE_TOKEN)
    assert len(pieces) == len(images) + 1, "one <start_of_image> per image"
    text, pixel_values = [pieces[0]], []
    image_processor = processor.image_processor
    defaults = {k: v for k, v in PAN_AND_SCAN_DEFAULTS.items() if getattr(image_processor, k, None) is None}
    for image, scan, after in zip(images, pan_and_scan, pieces[1:]):
        inputs = image_processor(images=[image], do_pan_and_scan=scan, return_tensors="pt", **defaults)
        num_crops = [int(n) for n in torch.as_tensor(inputs["num_crops"]).flatten()]
        text += [processor.replace_image_token({"num_crops": num_crops}, 0), after]
        pixel_values.append(inputs["pixel_values"])
    pixels = torch.cat(pixel_values)
    token_ids = processor.tokenizer.encode("".join(text), add_special_tokens=False)
    keys = [int.from_bytes(hashlib.blake2b(crop.numpy().tobytes(), digest_size=8).digest(), "big") for crop in pixels]
    return VisionPrompt(token_ids, pixels, keys)
