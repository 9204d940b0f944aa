"""The KV cache: one slot per running sequence, allocated once at start (memory never grows with traffic)."""

from __future__ import annotations

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
        if positions_first:
            self.k_store = [
                torch.zeros(allocated, c, kv_heads, head_dim, dtype=dtype, device=d) for c, d in zip(self.capacity, devices)
            ]
            self.v_store = [torch.zeros_like(k) for k in self.k_store]
            self.k = [k.transpose(1, 2) for k in self.k_store]
            self.v = [v.transpose(1, 2) for v in self.v_store]
        else:
            self.k = [torch.zeros(allocated, kv_heads, c, head_dim, dtype=dtype, device=d) for c, d in zip(self.capacity, devices)]
            self.v = [torch.zeros_like(k) for k in self.k]
            self.k_store, self.v_store = self.k, self.v
        self.num_slots = num_slots
        self.scratch = num_slots if scratch_slot else None
        """The slot padded rows write to, or None."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot `dst` the KV of slot `src` (a choice forked from a shared prompt)."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

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
