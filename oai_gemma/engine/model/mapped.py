"""The token embedding read from the checkpoint file on demand, instead of a second copy in memory.

Gemma-3 ties its lm_head to the token embedding. On a CPU the runner keeps the lm_head re-laid out for oneDNN
(engine/ops/linear.py: 2.4x faster at batch 8 in float32), an opaque copy that cannot serve embedding lookups; the
plain matrix (671 MB in float32 for the 270m) would then stay in memory only to look up a few rows per step.
Mapped from the safetensors file, those rows are read from the page cache as they are needed.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from pathlib import Path

import torch

log = logging.getLogger("oai_gemma.engine")

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def map_embedding(text_model, lm_head, source_dir: str, any_dtype: bool = False) -> bool:
    """Point the embedding (and the lm_head tied to it) at the checkpoint file, where it is stored there in the
    model's dtype and shape; True if it was. The transformers modules keep working: the values are the same.
    `any_dtype`: also where the file stores another dtype (the caller casts the looked-up rows: a quantized
    model, whose lm_head no longer needs the matrix and whose embedding then needs no copy at all)."""
    weight = text_model.embed_tokens.weight
    if weight.device.type != "cpu" or lm_head.weight is not weight:
        return False
    found = _find(Path(source_dir), weight, any_dtype)
    if found is None:
        return False
    path, start, dtype = found
    parameter = torch.nn.Parameter(map_tensor(path, start, dtype, list(weight.shape)), requires_grad=False)
    text_model.embed_tokens.weight = parameter
    lm_head.weight = parameter
    log.info("token embedding mapped from %s (read on demand, not copied)", path.name)
    return True


def map_tensor(path: Path, start: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor at byte `start` of `path`, mapped (private, read on demand, rows looked up at random)."""
    with open(path, "rb") as file:
        memory = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes would never reach the file
    if hasattr(mmap, "MADV_RANDOM"):  # rows are looked up one token at a time: no readahead of 128 KiB per fault
        memory.madvise(mmap.MADV_RANDOM)
    count = 1
    for dim in shape:
        count *= dim
    return torch.frombuffer(memory, dtype=dtype, count=count, offset=start).view(shape)


def _find(source: Path, weight: torch.Tensor, any_dtype: bool = False) -> tuple[Path, int, torch.dtype] | None:
    """(file, byte offset, dtype) of the embedding in a safetensors checkpoint, if stored as `weight` is (in
    its shape; in its dtype too unless `any_dtype`)."""
    for path in checkpoint_files(source):
        if not path.exists():
            continue
        data_start, header = read_header(path)
        for key, entry in header.items():
            if key.endswith("embed_tokens.weight") and "vision" not in key:
                dtype = DTYPES.get(entry["dtype"])
                same = (dtype == weight.dtype or (any_dtype and dtype is not None)) and entry["shape"] == list(weight.shape)
                return (path, data_start + entry["data_offsets"][0], dtype) if same else None
    return None


def checkpoint_files(source: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: its index's shards, or model.safetensors."""
    index = source / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    return [source / name for name in names]


def read_header(path: Path) -> tuple[int, dict]:
    """(where the tensors' bytes start, the JSON header: name -> dtype, shape, data_offsets) of a safetensors file."""
    with open(path, "rb") as file:
        size = struct.unpack("<Q", file.read(8))[0]
        return 8 + size, json.loads(file.read(size))


def copy_out_of_checkpoint(model, keep: set[int]) -> int:
    """Copy every tensor of `model` that still lives in a memory-mapped checkpoint file (transformers maps
    safetensors without copying where the dtype matches) unless its id is in `keep`; returns the bytes copied.
    Once the runner holds its own (re-laid-out) projections, this lets the map close: the pages packing read
    would otherwise stay in this process's resident memory, a second copy of the weights."""
    ranges = _checkpoint_ranges()
    copied = 0
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(tensor) in keep or not tensor.numel() or tensor.device.type != "cpu":
                continue
            if any(lo <= tensor.data_ptr() < hi for lo, hi in ranges):
                tensor.data = tensor.data.clone()
                copied += tensor.numel() * tensor.element_size()
    return copied


def _checkpoint_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of *.safetensors files."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((lo, hi))
    except OSError:
        pass
    return ranges
