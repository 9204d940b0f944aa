"""Gemma-3's image preprocessing as the server uses it, without transformers: what chat/vision.py calls of
transformers' `Gemma3Processor` (`image_processor(images=[...], do_pan_and_scan=...)`, `replace_image_token`,
`tokenizer`), the same pixel values, crops and prompt text (tests/engine/test_lean_vision.py holds them equal).

Why not `AutoProcessor`: it imports transformers (modeling_utils and all: seconds of a 2-core start) and parses
the 33 MB tokenizer.json a second time, when the server has its own tokenizer (engine/model/tokenizer.py). The
steps are those of transformers 5's `Gemma3ImageProcessorPil`: convert to RGB (transparency over white), the
pan-and-scan crops of the original, each resized with Pillow (`resample` of preprocessor_config.json, bilinear
for Gemma-3), times `rescale_factor` in float64 then float32, minus `image_mean`, over `image_std`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

PAN_AND_SCAN = {"do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}
"""Gemma3Processor's defaults for what its checkpoints leave null."""
IMAGE_DEFAULTS = {"do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 2,
                  "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "size": {"height": 224, "width": 224}}
TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def can_preprocess(source: str) -> str:
    """"" when `source`'s preprocessor_config.json is Gemma-3's image processor with the steps above, else why not."""
    path = Path(source) / "preprocessor_config.json"
    if not path.is_file():
        return "no preprocessor_config.json"
    config = json.loads(path.read_text())
    kind = config.get("image_processor_type", "")
    if kind.removesuffix("Fast").removesuffix("Pil") != "Gemma3ImageProcessor":
        return f"image processor {kind!r}"
    size = config.get("size") or {}
    if set(size) != {"height", "width"} or config.get("do_center_crop") or config.get("do_pad"):
        return "an image size other than height and width, center crops or padding"
    return ""


class ImageProcessor:
    """`Gemma3ImageProcessorPil.__call__` for what chat/vision.py asks: one image at a time."""

    def __init__(self, config: dict):
        merged = {**IMAGE_DEFAULTS, **PAN_AND_SCAN, **{k: v for k, v in config.items() if v is not None}}
        for key in (*IMAGE_DEFAULTS, *PAN_AND_SCAN):
            setattr(self, key, merged[key])

    def __call__(self, images: list, do_pan_and_scan: bool | None = None, return_tensors: str = "pt", **overrides):
        options = {key: overrides.get(key, getattr(self, key)) for key in PAN_AND_SCAN}
        scan = self.do_pan_and_scan if do_pan_and_scan is None else do_pan_and_scan
        pixels, num_crops = [], []
        for image in images:
            array = np.array(to_rgb(image))
            crops = pan_and_scan(array, *(options[k] for k in list(PAN_AND_SCAN)[1:])) if scan else []
            pixels += [self.pixels(view) for view in [array, *crops]]
            num_crops.append(len(crops))
        return {"pixel_values": torch.from_numpy(np.stack(pixels)), "num_crops": torch.tensor(num_crops)}

    def pixels(self, array: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [3, height, width] float32, as the PIL backend's resize, rescale and normalize."""
        if self.do_resize:
            size = (self.size["width"], self.size["height"])
            array = np.array(Image.fromarray(array).resize(size, resample=self.resample))
        image = array.transpose(2, 0, 1)
        if self.do_rescale:
            image = (image.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            image = image.astype(np.float32) if not np.issubdtype(image.dtype, np.floating) else image
            mean, std = np.array(self.image_mean, dtype=image.dtype), np.array(self.image_std, dtype=image.dtype)
            image = ((image.T - mean) / std).T
        return np.ascontiguousarray(image, dtype=np.float32)


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: an RGB image as it is, any other over a white background."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def pan_and_scan(image: np.ndarray, min_crop: int, max_crops: int, min_ratio: float) -> list[np.ndarray]:
    """Gemma3ImageProcessor's pan-and-scan: a long image's side-by-side crops ([H, W, C] here), or none."""
    height, width = image.shape[:2]
    long, short = max(width, height), min(width, height)
    if long / short < min_ratio:
        return []
    count = min(int(math.floor(long / short + 0.5)), int(math.floor(long / min_crop)))
    count = min(max_crops, max(2, count))
    across, down = (count, 1) if width >= height else (1, count)
    crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
    if min(crop_w, crop_h) < min_crop:
        return []
    return [image[y : y + crop_h, x : x + crop_w] for y in range(0, crop_h * down, crop_h)
            for x in range(0, crop_w * across, crop_w)]


class Processor:
    """Gemma3Processor's face for chat/vision.py: the image processor, the tokenizer, an image's prompt text."""

    def __init__(self, source: str, tokenizer):
        directory = Path(source)
        self.image_processor = ImageProcessor(json.loads((directory / "preprocessor_config.json").read_text()))
        self.tokenizer = tokenizer
        settings = {}
        for name in ("processor_config.json", "tokenizer_config.json"):
            if (directory / name).is_file():
                settings = {**json.loads((directory / name).read_text()), **settings}
        tokens = {key: settings.get(key) or value for key, value in TOKENS.items()}
        length = settings.get("image_seq_length") or 256
        self.full_image_sequence = f"\n\n{tokens['boi_token']}{tokens['image_token'] * length}{tokens['eoi_token']}\n\n"

    def replace_image_token(self, image_inputs: dict, image_idx: int) -> str:
        num_crops = image_inputs["num_crops"][image_idx]
        if not num_crops:
            return self.full_image_sequence
        return (f"Here is the original image {self.full_image_sequence} and here are some crops to help you see better "
                + " ".join([self.full_image_sequence] * num_crops))
