"""A GGUF file's metadata and tensor table, read with `struct` over a memory map, and its tensors as arrays.

Why not `gguf.GGUFReader`: it makes a numpy view per part of every metadata value, and Gemma-3's 262,144-token
vocabulary is three such arrays: opening the embedded 270m took 46 s on the busy 2-core machine, this 1 s. The
layout read is GGUF v2/v3 (github.com/ggml-org/ggml, docs/gguf.md); the tensors' block formats are `gguf.quants`'.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
F32, F16, BF16 = 0, 1, 30
"""The ggml types stored as plain values (the others are blocks that `gguf.quants.dequantize` expands)."""


class GGUFError(ValueError):
    """A file that is not a Gemma-3 GGUF this server can convert; the message says which and why."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    """In PyTorch's order (rows first): GGUF lists the dimensions the other way round."""
    kind: int
    """Its ggml type (`gguf.GGMLQuantizationType`)."""
    start: int
    """Byte offset in the file."""
    nbytes: int


class GGUFFile:
    """`metadata` (key -> value; string arrays as lists, numeric ones as numpy arrays) and `tensors` (name ->
    Tensor) of one file; `rows(tensor, first, last)` reads rows of a tensor as float32 (or its raw values)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, position, tensor_count = _read_metadata(self._map, None)
            self.tensors = _read_tensors(self._map, position, tensor_count, self.metadata)
        except (OSError, ValueError, struct.error, UnicodeDecodeError, KeyError, IndexError, OverflowError) as exc:
            if isinstance(exc, GGUFError):
                raise
            raise GGUFError(f"{self.path} is not a readable GGUF file (damaged or cut short?): {exc}") from None

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def raw(self, tensor: Tensor) -> np.ndarray:
        """The tensor's bytes, a row per index of its first dimension (a 1-D tensor: one row): (rows, bytes)."""
        rows = tensor.shape[0] if len(tensor.shape) > 1 else 1
        return np.frombuffer(self._map, np.uint8, tensor.nbytes, tensor.start).reshape(rows, -1)

    def rows(self, tensor: Tensor, first: int, last: int) -> np.ndarray:
        """Rows `first:last` of the tensor (as `raw` cuts it) as float32, each row flat."""
        from gguf.quants import dequantize

        chunk = self.raw(tensor)[first:last]
        if tensor.kind == F32:
            return chunk.view("<f4")
        if tensor.kind == F16:
            return chunk.view("<f2").astype(np.float32)
        return dequantize(chunk, tensor.kind).reshape(len(chunk), -1)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # an array of its tensors still alive: the map closes when that goes
            pass


def peek(path: str | Path, keys: int = 48) -> dict | None:
    """The metadata values in the file's first 64 KB (`general.architecture`, the sizes: the converter writes them
    before the vocabulary), at most `keys` of them, or None where the file does not start as a GGUF does.
    Milliseconds: it stops there."""
    try:
        with open(path, "rb") as file:
            head = file.read(1 << 16)
    except OSError:
        return None
    found: dict = {}
    try:
        _read_metadata(head, keys, found)
    except GGUFError:
        if not found:
            return None
    except (ValueError, struct.error, UnicodeDecodeError, IndexError, OverflowError):
        pass  # a value past the first 64 KB: what came before it is found
    return found


def source_problem(path: str, role: str, model: str = "") -> str | None:
    """Why the file at `path` cannot be the model (`role` "model") or its vision tower ("mmproj", of the GGUF
    `model`), where its first bytes show it; None otherwise."""
    head = peek(path)
    if head is None:
        return f"{path} is not a GGUF file (it does not start as one)"
    arch, want = head.get("general.architecture"), "gemma3" if role == "model" else "clip"
    if arch != want:
        what = "a Gemma-3 GGUF (architecture gemma3)" if role == "model" else \
            "a Gemma-3 mmproj GGUF (architecture clip: llama.cpp's `convert_hf_to_gguf.py --mmproj` output)"
        return f"{path} is a GGUF of architecture {arch!r}: --{role} takes {what}"
    hidden = (peek(model) or {}).get("gemma3.embedding_length") if model else None
    width = head.get("clip.vision.projection_dim")
    if hidden is not None and width is not None and hidden != width:
        return (f"{path} projects images to width {width}, {Path(model).name}'s hidden size is {hidden}: it is "
                "another model's vision tower (gemma-3-270m and 1b have none; 4b, 12b and 27b do)")
    return None


def _read_metadata(data, limit: int | None, metadata: dict | None = None) -> tuple[dict, int, int]:
    """(metadata, where the tensor table starts, tensor count); only the first `limit` values if given, into
    `metadata` as they are read."""
    if bytes(data[:4]) != MAGIC:
        raise GGUFError("it does not start with the GGUF magic bytes")
    version, tensor_count, count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} (this reads versions 2 and 3)")
    position, metadata = 24, {} if metadata is None else metadata
    for _ in range(count if limit is None else min(count, limit)):
        key, position = _string(data, position)
        kind = struct.unpack_from("<I", data, position)[0]
        metadata[key], position = _value(data, position + 4, kind)
    return metadata, position, tensor_count


def _string(data, position: int) -> tuple[str, int]:
    size = struct.unpack_from("<Q", data, position)[0]
    end = position + 8 + size
    if end > len(data):
        raise GGUFError("a string runs past the end of the file")
    return bytes(data[position + 8:end]).decode("utf-8", errors="replace"), end


def _value(data, position: int, kind: int):
    if kind in SCALARS:
        return struct.unpack_from(SCALARS[kind], data, position)[0], position + struct.calcsize(SCALARS[kind])
    if kind == STRING:
        return _string(data, position)
    if kind != ARRAY:
        raise GGUFError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", data, position)
    position += 12
    if item in NUMPY:
        values = np.frombuffer(data, NUMPY[item], count, position)  # copied: no view keeps the map open
        return (values.astype(bool) if item == 7 else values.copy()), position + values.nbytes
    items = []
    for _ in range(count):
        value, position = _value(data, position, item)
        items.append(value)
    return items, position


def _read_tensors(data, position: int, count: int, metadata: dict) -> dict[str, Tensor]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    table = []
    for _ in range(count):
        name, position = _string(data, position)
        dims = struct.unpack_from("<I", data, position)[0]
        shape = struct.unpack_from(f"<{dims}Q", data, position + 4)
        kind, offset = struct.unpack_from("<IQ", data, position + 4 + 8 * dims)
        position += 4 + 8 * dims + 12
        table.append((name, tuple(reversed(shape)), kind, offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-position // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in table:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name} has ggml type {kind}, which gguf {_gguf_version()} cannot read") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
        if start + offset + nbytes > len(data):
            raise GGUFError(f"the file is cut short: tensor {name} runs past its end ({len(data)} bytes)")
        tensors[name] = Tensor(name, shape, kind, start + offset, nbytes)
    return tensors


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
