"""The KV cache: one slot per running sequence, allocated once at start.

On a CPU the cache is one private anonymous memory map: allocating it is instant, and the OS backs a page with
memory only when a sequence first writes there (reading a page never written maps the shared zero page), so the
resident size follows the positions traffic actually wrote (never more than the whole cache, and a freed slot's
pages are reused, not added). A page never written reads as zeros, as `torch.zeros` would give. On a GPU it is
plain `torch.zeros`.
"""

from __future__ import annotations

import mmap

import torch

from .gemma3 import SLIDING


class KVCache:
    """Per layer K and V of shape [slots, kv_heads, capacity, head_dim].

    Full-attention layers hold `max_len` positions; sliding layers hold their window, position p at p % window.
    Each layer's tensors live on that layer's device (`layer_devices`, for a model spread over several GPUs).
    `scratch_slot` adds one slot past the served ones that no sequence owns: padded rows of a static-shape decode
    step write there. `positions_first` stores [slots, capacity, kv_heads, head_dim] (flash-attn's layout; `k`/`v`
    are then transposed views of `k_store`/`v_store`, so every other reader sees the same shape).
    """

    def __init__(
        self, text_config, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
        layer_devices: list[torch.device] | None = None, scratch_slot: bool = False, positions_first: bool = False,
    ):
        kv_heads, head_dim = text_config.num_key_value_heads, text_config.head_dim
        self.sliding = [t == SLIDING for t in text_config.layer_types]
        self.capacity = [min(text_config.sliding_window, max_len) if s else max_len for s in self.sliding]
        devices = layer_devices or [device] * len(self.capacity)
        allocated = num_slots + 1 if scratch_slot else num_slots
        shapes = [(allocated, c, kv_heads, head_dim) if positions_first else (allocated, kv_heads, c, head_dim) for c in self.capacity]
        tensors, self._memory, self._base = _zeros([*shapes, *shapes], dtype, [*devices, *devices])
        self.k_store, self.v_store = tensors[: len(shapes)], tensors[len(shapes) :]
        if positions_first:
            self.k = [k.transpose(1, 2) for k in self.k_store]
            self.v = [v.transpose(1, 2) for v in self.v_store]
        else:
            self.k, self.v = self.k_store, self.v_store
        self.num_slots = num_slots
        self.scratch = num_slots if scratch_slot else None
        """The slot padded rows write to, or None."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot `dst` the KV of slot `src` (a choice forked from a shared prompt)."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def resident_bytes(self) -> int:
        """Bytes of the cache backed by memory now (on a CPU: the pages written so far)."""
        if self._memory is None:
            return self.nbytes
        return _resident_bytes(self._base.data_ptr(), len(self._memory))

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self.k)

    @staticmethod
    def bytes_per_slot(text_config, max_len: int, dtype: torch.dtype) -> int:
        per_position = text_config.num_key_value_heads * text_config.head_dim * 2 * torch.finfo(dtype).bits // 8
        return sum(
            per_position * (min(text_config.sliding_window, max_len) if t == SLIDING else max_len)
            for t in text_config.layer_types
        )


def _zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype, devices: list[torch.device]):
    """(zero tensors of these shapes, the memory map behind the CPU ones and its byte view, or None). CPU tensors
    are views into one anonymous map (zero pages until written: no memory and no time spent at allocation)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [_round_up(itemsize * _numel(shape), mmap.PAGESIZE) for shape, d in zip(shapes, devices) if d.type == "cpu"]
    # private: a read of a position never written maps the shared zero page (a shared map would allocate it)
    memory = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if sizes else None
    if memory is not None and hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)  # a huge page would make one written position cost 2 MB
    base = torch.frombuffer(memory, dtype=torch.uint8) if memory is not None else None
    tensors, offset = [], 0
    for shape, device in zip(shapes, devices):
        if device.type != "cpu":
            tensors.append(torch.zeros(shape, dtype=dtype, device=device))
            continue
        nbytes = itemsize * _numel(shape)
        tensors.append(base[offset : offset + nbytes].view(dtype).view(shape))
        offset += _round_up(nbytes, mmap.PAGESIZE)
    return tensors, memory, base


def _resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address + length) this process holds in memory now: pages present and mapped by it
    alone (/proc/self/pagemap bits 63 and 56), so a never-written position that was read, which maps the
    kernel's shared zero page, does not count. Where pagemap cannot be read: the whole range."""
    first, pages = address // mmap.PAGESIZE, -(-length // mmap.PAGESIZE)
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = torch.frombuffer(bytearray(pagemap.read(pages * 8)), dtype=torch.int64)
    except (OSError, ValueError):
        return length
    present, exclusive = entries < 0, (entries >> 56) & 1 == 1  # bit 63 is the sign bit
    return int((present & exclusive).sum()) * mmap.PAGESIZE


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
