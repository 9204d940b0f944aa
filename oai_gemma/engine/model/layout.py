"""Each weight's final layout, made one tensor at a time, and the quantized-weights cache read and written per tensor.

`Layout` says what a projection or the lm_head becomes under the engine's configuration (`model.quantization`, the
model's dtype, the device): a packed float weight (engine/ops/linear.py's FrozenLinear) or a quantized linear
(engine/ops/quantized.py). Both fillers of `Gemma3Weights` (engine/model/weights.py: from a module tree; engine/model/
streamed.py: from safetensors) go through it, so both give the same layout, bit for bit. The int8 layouts are made from
row chunks (`rows(lo, hi)`: the weight's rows lo..hi in any float dtype): each output channel is quantized on its own,
so a chunk's float copy is all the float memory the quantizing takes, even for the 262k-row lm_head.

`LinearCache`: the quantized linears kept between starts (`EngineConfig.model.quantized_weights`): read back one linear at a
time into its own aligned tensors, written as one safetensors file streamed from the linears themselves (no second
copy of every weight, as `safetensors.torch.save_file`'s serialisation would make).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cpu import TURNS
from ..ops.linear import FrozenLinear
from ..ops.choice import linear_for
from ..ops.quantized import PerStepLinear
from .mapped import read_header

log = logging.getLogger("oai_gemma.engine")

Rows = Callable[[int, int], torch.Tensor]
"""rows(lo, hi) -> the weight's rows lo..hi ([hi - lo, in_features]), in the checkpoint's or the model's dtype."""

CHUNK_BYTES = 4 << 20
"""About this many bytes of float32 per chunk a weight is quantized in."""

STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64, "I8": torch.int8,
          "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
NAMES = {dtype: name for name, dtype in STORED.items()}


@dataclass(frozen=True)
class Layout:
    """What each linear weight becomes: `quantization` as resolved (engine/config.py; "none": packed float), in the
    model's `dtype`; `layers`: the model's layer count (`q4-mix` picks by layer); `float_tensors`: a float linear keeps
    its plain tensor beside a packed copy (the static decode computes with it: engine/model/static_decode.py)."""

    quantization: str
    dtype: torch.dtype
    layers: int = 0
    float_tensors: bool = False

    def kind(self, name: str):
        """The quantized class of weight `name` ("lm_head" or "projection.{i}"), or None: packed float."""
        return None if self.quantization == "none" else linear_for(self.quantization, name, self.dtype, self.layers)

    def make(self, name: str, rows: Rows, shape: tuple[int, int], stored: dict[str, torch.Tensor] | None = None):
        """The linear of weight `name` ([out, in] = `shape`), from its `stored` tensors (the cache) or its rows."""
        kind = self.kind(name)
        if kind is None:
            # a cast and a pack of the whole weight, one call each: a large weight's (the lm_head's, seconds) run beside
            # streaming models' steps rather than stall them for their length (cpu.Turns)
            large = shape[0] * shape[1] * self.dtype.itemsize > ASIDE_BYTES
            with TURNS.aside() if large else nullcontext():
                return FrozenLinear(rows(0, shape[0]).to(self.dtype), keep_weight=self.float_tensors)
        if stored is not None:
            linear = kind.from_tensors(stored)
        elif hasattr(kind, "from_rows"):
            linear = kind.from_rows(shape, lambda lo, hi: rows(lo, hi).to(self.dtype), chunk_rows(shape[1]))
        else:  # int4's torch layout: made from the whole weight
            linear = kind(rows(0, shape[0]).to(self.dtype))
        return self.wrap(name, linear)

    def wrap(self, name: str, linear):
        """`per-step`: the int8 linear in the model's dtype (its one layout; see PerStepLinear)."""
        if self.quantization == "per-step":
            return PerStepLinear(linear, cast=name != "lm_head")
        return linear


ASIDE_BYTES = 64 * 2**20
"""A float weight packed beside streaming models' steps from this size on (`Layout.make`)."""
READ_BYTES = 16 * 2**20
"""The most `read_rows` reads in one call (a few ms of copying)."""


def chunk_rows(in_features: int) -> int:
    """Rows per chunk: a multiple of 16 (every int8 layout's row group), about CHUNK_BYTES of float32."""
    return max(16, CHUNK_BYTES // (4 * in_features) // 16 * 16)


def read_rows(fd: int, offset: int, count: int) -> torch.Tensor:
    """`count` bytes of an open file from `offset` into a fresh (aligned) uint8 tensor: read, not mapped, so the file's
    pages never count in this process's resident memory. Read READ_BYTES at a time, each a unit of a load's work
    (`cpu.Turns`: streaming models may step between two; a q8 lm_head of 262k rows is 300 MB in one tensor)."""
    buffer = torch.empty(count, dtype=torch.uint8)
    view, done = memoryview(buffer.numpy()), 0
    while done < count:
        TURNS.offer()
        got = os.preadv(fd, [view[done : done + READ_BYTES]], offset + done)
        if got <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += got
    return buffer


class TensorFile:
    """One safetensors file's tensors, read on demand by rows (`rows`) into fresh tensors."""

    def __init__(self, path: Path):
        self.path = path
        self.start, header = read_header(path)
        self.entries = {key: entry for key, entry in header.items() if key != "__metadata__"}
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def dtype(self, key: str) -> torch.dtype:
        name = self.entries[key]["dtype"]
        if name not in STORED:
            raise ValueError(f"{self.path}: {key} is stored as {name}, not one of {sorted(STORED)}")
        return STORED[name]

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key]["shape"])

    def offset(self, key: str) -> int:
        return self.start + self.entries[key]["data_offsets"][0]

    def rows(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows lo..hi of tensor `key` (all of it by default) in its stored dtype."""
        shape, dtype = self.shape(key), self.dtype(key)
        if not shape:
            return read_rows(self.fd, self.offset(key), dtype.itemsize).view(dtype).view(())
        hi = shape[0] if hi is None else hi
        row = dtype.itemsize
        for dim in shape[1:]:
            row *= dim
        data = read_rows(self.fd, self.offset(key) + lo * row, (hi - lo) * row)
        return data.view(dtype).view(hi - lo, *shape[1:])


class LinearCache:
    """The quantized linears of `file` for `names` (those the layout quantizes): `stored(name)` reads one back where
    the file holds every one of them; `keep(name, linear)` collects new ones, `save()` writes them. `source` and
    `kind` (the checkpoint directory; quantization and dtype) go into the file's metadata, and saving removes the
    files this one supersedes (`prune`)."""

    def __init__(self, file: Path | None, names: list[str], source: Path | None = None, kind: str = ""):
        self.file, self.names, self.new = file, set(names), {}
        self.metadata = {"source": str(Path(source).resolve()), "kind": kind} if source is not None else {}
        self.source = None
        if file is not None and file.exists() and names:
            try:
                source = TensorFile(file)
            except (OSError, ValueError) as exc:
                log.warning("cannot read the quantized weights in %s (%s): quantizing again", file, exc)
                return
            if {key.rsplit(".", 1)[0] for key in source.entries} == self.names:
                self.source = source
            else:
                source.close()

    @property
    def complete(self) -> bool:
        return self.source is not None

    def stored(self, name: str) -> dict[str, torch.Tensor] | None:
        if self.source is None or name not in self.names:
            return None
        prefix = f"{name}."
        return {key[len(prefix):]: self.source.rows(key) for key in self.source.entries if key.startswith(prefix)}

    def keep(self, name: str, linear) -> None:
        if self.source is None and name in self.names:
            self.new[name] = getattr(linear, "few", linear)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def save(self) -> None:
        """Write the collected linears (atomically: a concurrent start reads a whole file or none)."""
        if self.file is None or not self.new:
            return
        tensors = {f"{name}.{part}": t for name, linear in self.new.items() for part, t in linear.tensors().items()}
        partial = self.file.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(partial, tensors, self.metadata)
            partial.replace(self.file)
        except OSError as exc:  # a read-only cache (a container's read-only root): every start quantizes
            log.warning("could not keep the quantized weights in %s (%s): each start quantizes them again", self.file, exc)
        else:
            if self.metadata:
                prune(self.file, self.metadata)
        self.new = {}


def path_name(source: Path | str) -> str:
    """A checkpoint directory's path as the start of its quantized weights' file names."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(Path(source).resolve()).strip("/"))


def prune(kept: Path, metadata: dict[str, str]) -> None:
    """Remove the quantized-weights files beside `kept` that no start will read again: those of the same checkpoint,
    quantization and dtype in another layout or of an older copy of the checkpoint (an upgrade's or a rewrite's:
    1-4 GB each at the real sizes), and those whose checkpoint directory is gone (a test's temporary model). Files
    written before the metadata existed are matched by name."""
    quantization, _, dtype = metadata["kind"].partition("-")
    for other in kept.parent.glob("*.safetensors"):
        if other == kept:
            continue
        try:
            found = read_header(other)[1].get("__metadata__") or {}
        except (OSError, ValueError):
            continue
        if found:
            stale = found.get("source") == metadata["source"] and found.get("kind") == metadata["kind"]
            stale = stale or not Path(found.get("source", "/")).exists()
        else:
            stale = re.match(rf"{re.escape(path_name(metadata['source']))}-([0-9a-f]{{12}}|unread)-{quantization}-{dtype}-", other.name)
        if stale:
            log.info("removing %s: superseded by %s, or its checkpoint is gone", other.name, kept.name)
            other.unlink(missing_ok=True)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory, READ_BYTES at a time, each a unit of
    a load's work (`cpu.Turns`: a first load beside streaming models writes the 4B's 2.5 GB of quantized weights)."""
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        for tensor in tensors.values():
            raw = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()) if tensor.numel() else b""
            for done in range(0, len(raw), READ_BYTES):
                TURNS.offer()
                file.write(raw[done : done + READ_BYTES])


def quantized_names(layout: Layout, count: int) -> list[str]:
    """The names of the linears `layout` quantizes among the projections 0..count-1 and the lm_head."""
    return [name for name in [*(f"projection.{i}" for i in range(count)), "lm_head"] if layout.kind(name) is not None]

