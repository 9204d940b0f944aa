"""The KV cache: a pool of fixed-size blocks that sequences' block tables point into (paged, as vLLM's).

Every layer's K and V is one tensor [blocks, block_size, kv_heads, head_dim]; a sequence's position p lives in
block `table[p // block_size]` at row `p % block_size` of every layer, sliding-window layers included (they read
only the last `window` positions, so a prefix shared by many requests gives each the exact attention a full
computation gives, whatever its length). Blocks are handed out and shared by engine/cache/block_pool.py.

On a CPU the pool is one private anonymous memory map: allocating it is instant, and the OS backs a page with
memory only when a block is first written (reading a page never written maps the shared zero page), so the
resident size follows the blocks traffic actually used. On a GPU it is plain `torch.zeros`.
"""

from __future__ import annotations

import mmap
import time

import torch

from ..shape import TextShape

BLOCK_SIZE = 16
"""Tokens per block: the granularity at which prompts share KV (vLLM's default)."""


class KVCache:
    """Per layer K and V of shape [num_blocks + 1, block_size, kv_heads, head_dim] (flash-attn's paged layout).

    The last block, `scratch`, belongs to no sequence: padded rows of a static-shape decode step write there.
    Each layer's tensors live on that layer's device (`layer_devices`, for a model spread over several GPUs).
    """

    def __init__(
        self, shape: TextShape, num_blocks: int, dtype: torch.dtype, device: torch.device,
        layer_devices: list[torch.device] | None = None, block_size: int = BLOCK_SIZE,
    ):
        kv_heads, head_dim = shape.kv_heads, shape.head_dim
        self.sliding = list(shape.sliding)
        self.window = shape.sliding_window
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch = num_blocks
        devices = layer_devices or [device] * len(self.sliding)
        shapes = [(num_blocks + 1, block_size, kv_heads, head_dim)] * len(self.sliding)
        tensors, self._memory, self._base = _zeros([*shapes, *shapes], dtype, [*devices, *devices])
        self.k, self.v = tensors[: len(shapes)], tensors[len(shapes) :]
        self._counted: tuple[float, int] | None = None
        """(when, resident bytes) of the last pagemap count (`resident_bytes`)."""

    def write(self, li: int, blocks: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens' K/V [tokens, kv_heads, D] at (block, row) each."""
        self.k[li][blocks, rows] = k
        self.v[li][blocks, rows] = v

    def positions(self, li: int, table: torch.Tensor, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys and values [kv_heads, end - first, D] at positions first..end-1."""
        pos = torch.arange(first, end, device=table.device)
        blocks, rows = table[pos // self.block_size], pos % self.block_size
        return self.k[li][blocks, rows].transpose(0, 1), self.v[li][blocks, rows].transpose(0, 1)

    def blocks(self, li: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, kv_heads, blocks * block_size, D] of each row's blocks `tables` [rows, blocks]."""
        rows, count = tables.shape
        # index_select copies whole blocks (3-5x faster on a CPU than `k[tables]`'s per-element gather; same values)
        flat = tables.reshape(-1)
        k, v = self.k[li].index_select(0, flat), self.v[li].index_select(0, flat)  # [rows * blocks, block_size, kv_heads, D]
        shape = (rows, count * self.block_size, *k.shape[-2:])
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def copy_block(self, src: int, dst: int) -> None:
        """Give block `dst` the KV of block `src` (a choice forked from a shared prompt's last, partial block)."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def resident_bytes(self, max_age: float = 0.0) -> int:
        """Bytes of the cache backed by memory now (on a CPU: the pages written so far); `max_age`: a count taken at
        most that many seconds ago will do (a read of /proc/self/pagemap is 8 bytes a page: ~9 MB and ~15 ms of one
        core for a 4.25 GiB cache, which /health polled every 20 ms took from the engine's cores)."""
        if self._memory is None:
            return self.nbytes
        now = time.monotonic()
        if self._counted is None or now - self._counted[0] >= max_age:
            self._counted = (now, _resident_bytes(self._base.data_ptr(), len(self._memory)))
        return self._counted[1]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self.k)

    @staticmethod
    def bytes_per_token(shape: TextShape, dtype: torch.dtype) -> int:
        """Every layer's K and V of one position."""
        return shape.kv_bytes_per_token(torch.finfo(dtype).bits // 8)


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
