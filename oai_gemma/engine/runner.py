"""The model runner: Gemma-3's forward pass over a mixed batch of prefill chunks and decode tokens.

It reuses the transformers modules' weights (projections, norms, MLP, rotary tables) but owns the
attention and the KV cache, so sequences of different lengths decode together in one batch, join and
leave between steps, and sliding-window layers keep only their window (a ring buffer).
Linear layers run once over all tokens of the step; attention runs per prefill chunk and batched for
all decode tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import FrozenLinear

SLIDING = "sliding_attention"


@dataclass
class StepItem:
    """One sequence's share of a step: `token_ids` written at positions `start`, `start + 1`, ..."""

    slot: int
    token_ids: list[int]
    start: int
    want_logits: bool = True
    image_spans: tuple[tuple[int, int], ...] = ()
    """[start, end) positions of image soft-token blocks: each attends to itself both ways (Gemma-3)."""
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows within this chunk, their embeddings): the vision tower's output replaces those tokens' embeddings."""
    keep_hidden: bool = False
    """Keep every position's last hidden state in `hidden` (prompt logprobs: see `ModelRunner.logits_of`)."""
    hidden: torch.Tensor | None = None


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


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... 64, then multiples of 64, up to the first one >= limit."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 64 else sizes[-1] + 64)
    return sizes


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds n (n itself past the largest: correct, just not pre-compiled)."""
    for size in sizes:
        if size >= n:
            return size
    return n


def _block_ids(positions: torch.Tensor, spans) -> torch.Tensor:
    """Index of the image block each position is in, -1 for text."""
    ids = torch.full_like(positions, -1)
    for index, (start, end) in enumerate(spans):
        ids[(positions >= start) & (positions < end)] = index
    return ids


def _text_parts(model):
    """(text decoder, lm_head) of a Gemma3ForCausalLM or Gemma3ForConditionalGeneration."""
    inner = model.model
    return getattr(inner, "language_model", inner), model.lm_head


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class ModelRunner:
    """`static_decode` (default: on a GPU) runs decode-only steps at static shapes, CUDA graphs where possible
    (engine/static_decode.py); `compile` (`auto` = with the static path) compiles its layer functions."""

    def __init__(
        self, model, num_slots: int, max_len: int, max_tokens_per_step: int,
        static_decode: bool | None = None, compile: str = "auto",
    ):
        self.model = model
        self.text_model, self.lm_head = _text_parts(model)
        config = self.text_model.config
        if getattr(config, "attention_bias", False):
            raise ValueError("attention projections with bias are not supported by this runner (Gemma-3 has none)")
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attention logit soft-capping (Gemma-2 style) is not supported by this runner")
        self.config = config
        self.device = self.lm_head.weight.device
        self.input_device = self.text_model.embed_tokens.weight.device
        self.layer_devices = [layer.self_attn.q_proj.weight.device for layer in self.text_model.layers]
        """Each layer's device: several GPUs when the model was loaded with device_map="auto"."""
        self.dtype = self.lm_head.weight.dtype
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.layer_types = list(config.layer_types)
        self.max_len = max_len
        static = self.device.type == "cuda" if static_decode is None else static_decode
        from .static_decode import StaticDecode, flash_kernel

        flash = flash_kernel(self.device, self.dtype, self.head_dim) if static else None
        self.cache = KVCache(
            config, num_slots, max_len, self.dtype, self.device, self.layer_devices,
            scratch_slot=static, positions_first=flash is not None,
        )
        self.linears = [
            tuple(
                FrozenLinear(module.weight)
                for module in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            )
            for a, m in ((layer.self_attn, layer.mlp) for layer in self.text_model.layers)
        ]
        self.lm_head_linear = FrozenLinear(self.lm_head.weight)
        self.row_buckets = buckets(num_slots)
        self.token_buckets = buckets(max_tokens_per_step)
        self.static = None
        if static:
            compiled = compile == "on" or (compile == "auto" and self.device.type == "cuda")
            self.static = StaticDecode(self, use_graphs=self.device.type == "cuda", compiled=compiled, flash=flash)

    def capture_decode_graphs(self) -> None:
        """Build (capture) every static decode bucket now: warm-up, before the server says it is ready."""
        if self.static is not None:
            self.static.capture_all()

    # ---- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, prefills: list[StepItem], decodes: list[StepItem]):
        """Run one step; returns logits [rows, vocab] (model dtype) for the items with `want_logits`, in order
        prefills then decodes."""
        if self.static is not None and decodes and not prefills:
            return self.static.run(decodes)
        items = prefills + decodes
        token_ids = [t for it in items for t in it.token_ids]
        positions = [it.start + i for it in items for i in range(len(it.token_ids))]
        padded = bucket(len(token_ids), self.token_buckets)
        pad = padded - len(token_ids)
        # the step runs at a bucketed token count: a few shapes only, each compiled (oneDNN) once at warm-up;
        # every distinct shape would otherwise keep its own kernels and buffers, and memory would creep up
        ids = torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=self.input_device)
        positions = torch.tensor(positions + [0] * pad, dtype=torch.long, device=self.input_device)
        hidden = self.text_model.embed_tokens(ids)
        offset = 0
        for it in prefills:
            if it.image_embeds is not None:
                rows, values = it.image_embeds
                hidden[offset + rows] = values.to(hidden.device, hidden.dtype)
            offset += len(it.token_ids)
        rope = {t: self.text_model.rotary_emb(hidden, positions[None], t) for t in set(self.layer_types)}
        rope = {t: (cos[0, :, None, :], sin[0, :, None, :]) for t, (cos, sin) in rope.items()}
        n_prefill = sum(len(it.token_ids) for it in prefills)
        dec_slots = torch.tensor([it.slot for it in decodes], dtype=torch.long, device=self.input_device)
        dec_pos = positions[n_prefill : len(token_ids)]
        dec_longest = max((it.start for it in decodes), default=0) + 1  # from the host: no device sync
        dec_contiguous = [it.slot for it in decodes] == list(range(len(decodes)))

        for li, layer in enumerate(self.text_model.layers):
            attn, (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) = layer.self_attn, self.linears[li]
            if hidden.device != self.layer_devices[li]:  # device_map="auto": the next layer is on another GPU
                device = self.layer_devices[li]
                hidden, dec_slots, dec_pos = hidden.to(device), dec_slots.to(device), dec_pos.to(device)
                rope = {t: (cos.to(device), sin.to(device)) for t, (cos, sin) in rope.items()}
            x = layer.input_layernorm(hidden)
            q = attn.q_norm(q_proj(x).view(-1, self.num_heads, self.head_dim))
            k = attn.k_norm(k_proj(x).view(-1, self.kv_heads, self.head_dim))
            v = v_proj(x).view(-1, self.kv_heads, self.head_dim)
            cos, sin = rope[self.layer_types[li]]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            outs = []
            offset = 0
            for it in prefills:
                n = len(it.token_ids)
                sl = slice(offset, offset + n)
                outs.append(self._prefill_attention(li, it, q[sl], k[sl], v[sl]))
                offset += n
            if decodes:
                end = offset + len(decodes)
                outs.append(
                    self._decode_attention(li, dec_slots, dec_pos, dec_longest, dec_contiguous, q[offset:end], k[offset:end], v[offset:end])
                )
            if pad:
                outs.append(q.new_zeros(pad, self.num_heads, self.head_dim))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden = hidden + layer.post_attention_layernorm(o_proj(out.reshape(out.shape[0], -1)))
            x = layer.pre_feedforward_layernorm(hidden)
            hidden = hidden + layer.post_feedforward_layernorm(down_proj(layer.mlp.act_fn(gate_proj(x)) * up_proj(x)))

        rows, offset = [], 0
        for it in items:
            if it.keep_hidden:
                it.hidden = hidden[offset : offset + len(it.token_ids)]
            offset += len(it.token_ids)
            if it.want_logits:
                rows.append(offset - 1)
        if not rows:
            return torch.empty(0, self.config.vocab_size)
        return self.logits_of(hidden[rows])

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of last-layer hidden states [rows, hidden] (at most the largest row bucket).
        The rows are padded to a row bucket: the lm_head runs only at the shapes warm-up compiled."""
        wanted = hidden.shape[0]
        padded = bucket(wanted, self.row_buckets)
        if padded > wanted:
            hidden = torch.cat((hidden, hidden[-1:].expand(padded - wanted, -1)))
        logits = self.lm_head_linear(self.text_model.norm(hidden.to(self.device)))[:wanted]
        if self.final_softcap:
            logits = torch.tanh(logits.float() / self.final_softcap) * self.final_softcap
        return logits

    # ---- attention ------------------------------------------------------------------------------

    def _prefill_attention(self, li: int, it: StepItem, q, k, v) -> torch.Tensor:
        """Attention of one chunk (positions start..start+n-1) over its cached past and itself."""
        kc, vc = self.cache.k[li], self.cache.v[li]
        n, start = q.shape[0], it.start
        qpos = torch.arange(start, start + n, device=q.device)
        if self.cache.sliding[li]:
            window = self.cache.capacity[li]
            past = torch.arange(max(0, start - window + 1), start, device=q.device)
            keys = torch.cat((kc[it.slot][:, past % window], k.transpose(0, 1)), dim=1)
            values = torch.cat((vc[it.slot][:, past % window], v.transpose(0, 1)), dim=1)
            kpos = torch.cat((past, qpos))
            mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
            keep = qpos[-window:]
            kc[it.slot][:, keep % window] = k[-window:].transpose(0, 1)
            vc[it.slot][:, keep % window] = v[-window:].transpose(0, 1)
        else:
            kc[it.slot, :, start : start + n] = k.transpose(0, 1)
            vc[it.slot, :, start : start + n] = v.transpose(0, 1)
            keys, values = kc[it.slot, :, : start + n], vc[it.slot, :, : start + n]
            kpos = torch.arange(start + n, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
        if it.image_spans:
            q_blocks = _block_ids(qpos, it.image_spans)[:, None]
            same_image = (q_blocks == _block_ids(kpos, it.image_spans)[None, :]) & (q_blocks >= 0)
            if self.cache.sliding[li]:
                mask |= same_image & (kpos[None, :] > qpos[:, None] - window)
            else:
                mask |= same_image
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=self.scaling, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    def _decode_attention(self, li: int, slots, pos, longest: int, contiguous: bool, q, k, v) -> torch.Tensor:
        """One new token for each of B sequences, batched: q [B, heads, D] over each row's own cache
        (`longest`: the longest row's length, known on the host)."""
        kc, vc = self.cache.k[li], self.cache.v[li]
        bsz = q.shape[0]
        if self.cache.sliding[li]:
            window = self.cache.capacity[li]
            kc[slots, :, pos % window] = k
            vc[slots, :, pos % window] = v
            span = min(window, longest)  # before the window fills, entries >= longest are still empty
        else:
            kc[slots, :, pos] = k
            vc[slots, :, pos] = v
            span = longest
        if contiguous:
            keys, values = kc[:bsz, :, :span], vc[:bsz, :, :span]
        else:
            keys, values = kc[slots, :, :span], vc[slots, :, :span]
        mask = torch.arange(span, device=q.device)[None, :] <= pos[:, None]  # [B, span]
        # group the query heads by their kv head: [B, kv_heads, group, D] attends [B, kv_heads, span, D]
        qg = q.view(bsz, self.kv_heads, self.num_heads // self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :], scale=self.scaling)
        return out.reshape(bsz, self.num_heads, self.head_dim)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower and projector: [crops, 3, H, W] -> [crops * tokens_per_crop, hidden]."""
        features = self.model.model.get_image_features(pixel_values.to(self.device, self.dtype))
        features = getattr(features, "pooler_output", features)
        return features.reshape(-1, features.shape[-1])
