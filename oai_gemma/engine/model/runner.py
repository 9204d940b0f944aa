"""The model runner: Gemma-3's forward pass over a mixed batch of prefill chunks and decode tokens.

It reuses the transformers modules' weights (projections, norms, embeddings, rotary tables) but owns the
attention and the KV cache, so sequences of different lengths decode together in one batch, join and
leave between steps, and sliding-window layers keep only their window (a ring buffer).
A step is packed into tensors (`_pack`), run through the layers (`_layers`: engine/gemma3.py's layer around
our attention) and turned into logits for the rows that sample (`_logits`), as nano-vllm's runner does.
Linear layers run once over all tokens of the step; attention runs per prefill chunk and batched for
all decode tokens.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import DecodeKeys, decode_attention, decode_keys, prefill_attention
from .buckets import bucket, buckets
from .gemma3 import LayerWeights, check_supported, post_attention, pre_attention, signed_sin
from ..ops.invariance import Invariance, TiledLinear, span_step, tile_rows, tiled
from ..cache.kv_cache import BLOCK_SIZE, KVCache
from ..shape import TextShape
from ..config import ConfigError, EngineConfig
from ..ops.linear import FrozenLinear, call_linear
from .mapped import copy_out_of_checkpoint, map_embedding
from ..ops.quantized import PerStepLinear, quantize_all
from .static_decode import StaticDecode, flash_kernel
from ..lora.apply import LoraStep, module_names
from ..sequence import StepItem

log = logging.getLogger("oai_gemma.engine")


@dataclass
class Batch:
    """One step packed into tensors, at a bucketed token count (`pad` padding tokens at the end)."""

    prefills: list[StepItem]
    decodes: list[StepItem]
    ids: torch.Tensor
    positions: torch.Tensor
    pad: int
    writes: tuple[torch.Tensor, torch.Tensor]
    """(block, row in it) where each real token's K/V goes."""
    tables: list[torch.Tensor]
    """Each prefill's block table."""
    decode: dict[bool, DecodeKeys]
    """The decode rows' keys in full (False) and sliding (True) layers."""

    @property
    def items(self) -> list[StepItem]:
        return self.prefills + self.decodes


def _text_parts(model):
    """(text decoder, lm_head) of a Gemma3ForCausalLM or Gemma3ForConditionalGeneration."""
    inner = model.model
    return getattr(inner, "language_model", inner), model.lm_head


class ModelRunner:
    """Built from the engine's configuration (engine/config.py): `static_decode` runs decode-only steps at static
    shapes, CUDA graphs where possible (engine/static_decode.py), `compile` compiles its layer functions.
    `own_weights`: the runner may take the model's layer projections: once re-laid out for oneDNN (a copy), the
    module's originals are freed, so one copy stays in memory; the transformers model can then no longer run its
    own forward (the server's case; tests that hold the engine against transformers keep it whole)."""

    def __init__(self, model, config: EngineConfig, own_weights: bool = False, lora=None):
        self.model = model
        self.text_model, self.lm_head = _text_parts(model)
        text_config = self.text_model.config
        check_supported(text_config)
        self.config = text_config
        self.device = self.lm_head.weight.device
        self.input_device = self.text_model.embed_tokens.weight.device
        self.layer_devices = [layer.self_attn.q_proj.weight.device for layer in self.text_model.layers]
        """Each layer's device: several GPUs when the model was loaded with device_map="auto"."""
        self.dtype = self.lm_head.weight.dtype
        self.num_heads = text_config.num_attention_heads
        self.kv_heads = text_config.num_key_value_heads
        self.head_dim = text_config.head_dim
        self.shape = (self.num_heads, self.kv_heads, self.head_dim)
        self.eps = text_config.rms_norm_eps
        self.scaling = text_config.query_pre_attn_scalar**-0.5
        self.final_softcap = getattr(text_config, "final_logit_softcapping", None)
        self.layer_types = list(text_config.layer_types)
        self.max_len = max_len = config.max_model_len
        num_slots, static, quantization = config.max_num_seqs, config.static_decode, config.quantization
        flash = flash_kernel(self.device, self.dtype, self.head_dim) if static else None
        started = time.monotonic()
        num_blocks = config.kv_blocks or num_slots * -(-max_len // BLOCK_SIZE)  # 0: room for num_slots of max_len
        self.cache = KVCache(TextShape.of(text_config), num_blocks, self.dtype, self.device, self.layer_devices)
        allocated = time.monotonic()
        self.mapped_embedding = False
        """The token embedding is read from the checkpoint file on demand (engine/mapped.py), not held in memory."""
        if own_weights and not static:  # all but what is re-laid out below: then the checkpoint's map can close
            copy_out_of_checkpoint(model, {id(t) for t in self._projections()} | {id(self.lm_head.weight)})
        make = self._quantized(quantization, config.quantized_weights, static) if quantization != "none" else FrozenLinear
        self.weights = [LayerWeights.of(layer, make) for layer in self.text_model.layers]
        """Each layer's weights, its projections pre-packed for oneDNN on a CPU (engine/linear.py), or quantized
        (engine/quantized.py)."""
        self.lm_head_linear = make(self.lm_head.weight)
        self.quantization = quantization
        if own_weights and not static:  # the static path reads the module weights (F.linear)
            self._release_packed()
            if self.lm_head_linear.packed is not None:
                self.mapped_embedding = map_embedding(
                    self.text_model, self.lm_head, getattr(model.config, "_name_or_path", ""), any_dtype=quantization != "none",
                )
            gc.collect()
        self.timings = {"relayout": time.monotonic() - allocated, "KV cache": allocated - started}
        """Seconds of the start-up phases this constructor runs (logged by engine/factory.py)."""
        self.num_slots = num_slots
        """Most rows a step samples (the scheduler's batch size)."""
        self.row_buckets = buckets(num_slots)
        self.logits_buckets = buckets(config.max_logits_rows)
        """Logits rows of a step: the rows' and their drafts' (speculative decoding)."""
        self.token_buckets = buckets(config.max_tokens_per_step)
        if config.batch_invariant == "on" and config.quantization == "per-step":  # one layout whatever a step's rows
            for linear in [self.lm_head_linear, *(p for w in self.weights for p in w)]:
                if isinstance(linear, PerStepLinear):
                    linear.pin()
        measured = time.monotonic()
        self.invariance = self._measure_invariance(config.batch_invariant, static, config.max_tokens_per_step, num_slots)
        """Batch-invariant mode (engine/invariance.py): tiled linears, grid-aligned padded attention; None: off."""
        self.batch_invariant = self.invariance is not None
        self.timings["invariance check"] = time.monotonic() - measured
        self.lora = lora
        """The resident LoRA adapters (engine/lora/registry.py `ResidentAdapters`: read only here) when adapters are
        served: each slot's weights."""
        self.lora_names = module_names(self.weights)
        self.static = None
        if static:
            self.static = StaticDecode(self, use_graphs=self.device.type == "cuda", compiled=config.compile, flash=flash)

    def _measure_invariance(self, setting: str, static: bool, most_tokens: int, most_rows: int) -> Invariance | None:
        """`on`: on, or a start-up error where this CPU's kernels cannot be made invariant; `auto`: on where that
        is cheap, i.e. where the linears need no tiling (float32 here; bf16 tiles make prefill 1.5x slower)."""
        if setting == "off":
            return None
        if static or self.device.type != "cpu":
            if setting == "on":
                raise ConfigError("engine.batch_invariant = \"on\" is implemented for the CPU path only; use auto or off")
            return None
        w, hidden, most_tokens = self.weights[0], self.config.hidden_size, bucket(most_tokens, self.token_buckets)
        tile = tile_rows({
            "q_proj": (w.q, hidden, most_tokens), "o_proj": (w.o, self.num_heads * self.head_dim, most_tokens),
            "gate_proj": (w.gate, hidden, most_tokens), "down_proj": (w.down, self.config.intermediate_size, most_tokens),
            "lm_head": (self.lm_head_linear, hidden, bucket(most_rows, self.row_buckets)),
        }, self.dtype, whole_only=setting == "auto")
        if tile is None and setting == "auto":
            log.info("batch-invariant mode off (auto): this CPU's linears need row tiles, which slow prefill; "
                     "on with --batch-invariant on")
            return None
        step = span_step(*self.shape, self.dtype)
        if tile is None or step is None:
            if setting == "on":
                raise ConfigError("engine.batch_invariant = \"on\", but this CPU's kernels are not batch-invariant")
            log.warning("batch-invariant mode off: this CPU's kernels are not batch-invariant (linears: %s, attention: %s)",
                        "ok" if tile else "differ", "ok" if step else "differ")
            return None
        log.info("batch-invariant mode: linears in calls of at most %d rows, decode spans padded to %d", tile, step)
        return Invariance(tile, step)

    def _quantized(self, quantization: str, cache_file: Path | None, static: bool):
        """weight -> its quantized linear (`model.quantization`; CPU only), all quantized at once, or read back
        from `cache_file`."""
        if static or self.device.type != "cpu":
            raise ConfigError(
                f"model.quantization = {quantization!r} is implemented for the CPU path only; on a GPU use \"none\""
            )
        weights = dict(zip((f"projection.{i}" for i in range(len(self._projections()))), self._projections()))
        weights["lm_head"] = self.lm_head.weight
        linears = quantize_all({name: w.detach() for name, w in weights.items()}, quantization, cache_file)
        by_tensor = {id(weights[name]): linear for name, linear in linears.items()}
        if quantization == "per-step":  # both layouts: the int8 copy beside the packed weight
            lm_head = id(self.lm_head.weight)
            return lambda weight: PerStepLinear(by_tensor[id(weight)], FrozenLinear(weight), cast=id(weight) != lm_head)
        return lambda weight: by_tensor[id(weight)] if id(weight) in by_tensor else FrozenLinear(weight)

    def _projections(self) -> list[torch.Tensor]:
        return [
            module.weight for layer in self.text_model.layers for module in (
                layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj,
            )
        ]

    def _release_packed(self) -> None:
        """Free the module weight of every projection that has a packed copy (see `own_weights`)."""
        for layer, w in zip(self.text_model.layers, self.weights):
            a, m = layer.self_attn, layer.mlp
            modules = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            for module, linear in zip(modules, (w.q, w.k, w.v, w.o, w.gate, w.up, w.down)):
                if linear.packed is not None:
                    module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)

    def sequence_blocks(self, index: int, length: int | None = None) -> list[int]:
        """Block table of the index-th of fixed runs of blocks, each long enough for `length` positions (default
        max_len; the default pool holds `num_slots` of those): for callers that drive the runner without a
        scheduler (quality checks, tests, benchmarks)."""
        per_sequence = -(-(length or self.max_len) // self.cache.block_size)
        if (index + 1) * per_sequence > self.cache.num_blocks:
            raise ValueError(f"the KV pool has {self.cache.num_blocks} blocks: no room for run {index} of {per_sequence}")
        return list(range(index * per_sequence, (index + 1) * per_sequence))

    def weight_bytes(self) -> int:
        """Bytes of every weight the runner and the model hold in memory (packed copies included)."""
        mapped = self.text_model.embed_tokens.weight if self.mapped_embedding else None
        return sum(t.numel() * t.element_size() for t in self.model.parameters() if t is not mapped) + sum(
            linear.packed_bytes for w in [*self.weights, [self.lm_head_linear]] for linear in w if hasattr(linear, "packed_bytes")
        )

    def decode_bytes(self) -> int:
        """Bytes of the linears' weights one decode step of one row reads (the layout `per-step` uses there): the
        most of what one stream's token must stream from memory (bench/floor.py)."""
        def read(linear) -> int:
            if isinstance(linear, PerStepLinear):
                linear = linear.few if linear.rows > 1 else linear.many
            weight = getattr(linear, "weight", None)
            return linear.packed_bytes or (weight.numel() * weight.element_size() if weight is not None else 0)

        return sum(read(linear) for w in [*self.weights, [self.lm_head_linear]] for linear in w if hasattr(linear, "packed_bytes"))

    def capture_decode_graphs(self) -> None:
        """Build (capture) every static decode bucket now: warm-up, before the server says it is ready."""
        if self.static is not None:
            self.static.capture_all()

    # ---- the step: pack, layers, logits -----------------------------------------------------------

    @torch.inference_mode()
    def forward(self, prefills: list[StepItem], decodes: list[StepItem], layers: list[int] | None = None):
        """Run one step; returns logits [rows, vocab] (model dtype) for the items with `want_logits`, in order
        prefills then decodes. `layers`: only these layers (warm-up: a shape's kernels are made once for every
        layer of a kind, see `warm_layers`)."""
        if self.static is not None and decodes and not prefills and all(len(it.token_ids) == 1 for it in decodes):
            return self.static.run(decodes)
        # a decode item with drafts (engine/speculative/) runs as a short prefill chunk, its past gathered once;
        # in batch-invariant mode as one decode row per position, computed exactly as plain decode steps are
        drafted = [] if self.batch_invariant else [it for it in decodes if len(it.token_ids) > 1]
        if drafted:
            batch = self._pack(prefills + drafted, [it for it in decodes if len(it.token_ids) == 1])
        else:
            batch = self._pack(prefills, decodes)
        return self._logits(batch, self._layers(batch, layers), prefills + decodes)

    @property
    def warm_layers(self) -> list[int]:
        """One layer of each kind (sliding and full attention): what warm-up runs, since oneDNN makes a shape's
        kernels once for all layers alike (measured: a bucket's first full step after it is as fast as its second)."""
        return sorted({self.layer_types.index(kind) for kind in self.layer_types})

    def _pack(self, prefills: list[StepItem], decodes: list[StepItem]) -> Batch:
        """The step's token ids and positions as tensors, padded to a token bucket: a few shapes only, each
        compiled (oneDNN) once at warm-up; every distinct shape would otherwise keep its own kernels and buffers,
        and memory would creep up."""
        items = prefills + decodes
        token_ids = [t for it in items for t in it.token_ids]
        positions = [it.start + i for it in items for i in range(len(it.token_ids))]
        size = self.cache.block_size
        blocks = [it.blocks[p // size] for it in items for p in range(it.start, it.start + len(it.token_ids))]
        writes = (torch.tensor(blocks, dtype=torch.long), torch.tensor(positions, dtype=torch.long) % size)
        pad = bucket(len(token_ids), self.token_buckets) - len(token_ids)
        ids = torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=self.input_device)
        tensor_positions = torch.tensor(positions + [0] * pad, dtype=torch.long, device=self.input_device)
        decode = {}
        if decodes:
            step = self.invariance.span_step if self.invariance else 0
            # a decode item with drafts is one row per position, each over its own past (engine/speculative/)
            tables = [it.blocks for it in decodes for _ in it.token_ids]
            starts = [it.start + i for it in decodes for i in range(len(it.token_ids))]
            for sliding in set(self.cache.sliding):
                keys = decode_keys(tables, starts, self.cache.window if sliding else None, self.cache, step)
                decode[sliding] = keys.to(self.input_device)
        tables = [torch.tensor(it.blocks, dtype=torch.long, device=self.input_device) for it in prefills]
        writes = tuple(t.to(self.input_device) for t in writes)
        return Batch(prefills, decodes, ids, tensor_positions, pad, writes, tables, decode)

    def _embed(self, batch: Batch) -> torch.Tensor:
        """Token embeddings, with the vision tower's output in place of each image soft token."""
        hidden = self.text_model.embed_tokens(batch.ids).to(self.dtype)  # a mapped embedding may be stored wider
        offset = 0
        for it in batch.prefills:
            if it.image_embeds is not None:
                rows, values = it.image_embeds
                hidden[offset + rows] = values.to(hidden.device, hidden.dtype)
            offset += len(it.token_ids)
        return hidden

    def _layers(self, batch: Batch, layers: list[int] | None = None) -> torch.Tensor:
        """The decoder layers (those listed in `layers`, else all) over the packed step: last-layer hidden states
        [padded tokens, hidden]."""
        hidden = self._embed(batch)
        rope = {t: self.text_model.rotary_emb(hidden, batch.positions[None], t) for t in set(self.layer_types)}
        rope = {t: (cos[0, :, None, :], signed_sin(sin[0, :, None, :])) for t, (cos, sin) in rope.items()}
        decode, writes = batch.decode, batch.writes
        linear = step_linear = TiledLinear(self.invariance.tile) if self.invariance else call_linear
        lora = None if self.lora is None else LoraStep.of(
            batch.prefills, batch.decodes, self.lora, self.lora_names, hidden.device, exact=self.invariance is not None,
        )
        for li in range(len(self.weights)) if layers is None else layers:
            w = self.weights[li]
            device = self.layer_devices[li]
            if hidden.device != device:  # device_map="auto": the next layer is on another GPU
                hidden = hidden.to(device)
                decode = {kind: keys.to(device) for kind, keys in decode.items()}
                writes = tuple(t.to(device) for t in writes)
                rope = {t: (cos.to(device), sin.to(device)) for t, (cos, sin) in rope.items()}
            cos, sin = rope[self.layer_types[li]]
            if lora is not None:  # each row's adapter update beside the base projections (engine/lora/apply.py)
                linear = lora.around(step_linear, li)
            q, k, v = pre_attention(hidden, w, cos, sin, self.eps, *self.shape, linear=linear)
            out = self._attention(li, batch, writes, decode, q, k, v)
            hidden = post_attention(hidden, out, w, self.eps, linear=linear)
        return hidden

    def _attention(self, li: int, batch: Batch, writes, decode: dict[bool, DecodeKeys], q, k, v) -> torch.Tensor:
        """Write the step's K/V, then each prefill chunk over its past and itself and every decode token batched;
        zeros for the padding."""
        real = k.shape[0] - batch.pad
        self.cache.write(li, *writes, k[:real], v[:real])
        outs, offset = [], 0
        for it, table in zip(batch.prefills, batch.tables):
            sl = slice(offset, offset + len(it.token_ids))
            outs.append(prefill_attention(
                self.cache, li, table.to(q.device), it.start, it.image_spans, q[sl], self.scaling, self.batch_invariant,
            ))
            offset += len(it.token_ids)
        if batch.decodes:
            sl = slice(offset, k.shape[0] - batch.pad)
            outs.append(decode_attention(self.cache, li, decode[self.cache.sliding[li]], q[sl], self.scaling))
        if batch.pad:
            outs.append(q.new_zeros(batch.pad, self.num_heads, self.head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _logits(self, batch: Batch, hidden: torch.Tensor, order: list[StepItem]) -> torch.Tensor:
        """Logits of each item's last `num_logits` positions when it wants them, items in `order`; keeps the hidden
        states asked for."""
        ends, offset = {}, 0
        for it in batch.items:
            if it.keep_hidden:
                it.hidden = hidden[offset : offset + len(it.token_ids)]
            offset += len(it.token_ids)
            ends[id(it)] = offset
        rows = [row for it in order if it.want_logits for row in range(ends[id(it)] - it.num_logits, ends[id(it)])]
        if not rows:
            return torch.empty(0, self.config.vocab_size)
        most = self.logits_buckets[-1]
        parts = [self.logits_of(hidden[rows[lo : lo + most]]) for lo in range(0, len(rows), most)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of last-layer hidden states [rows, hidden] (at most the largest row bucket).
        The rows are padded to a row bucket: the lm_head runs only at the shapes warm-up compiled."""
        wanted = hidden.shape[0]
        padded = bucket(wanted, self.logits_buckets)
        if padded > wanted:
            hidden = torch.cat((hidden, hidden[-1:].expand(padded - wanted, -1)))
        normed = self.text_model.norm(hidden.to(self.device))
        logits = (tiled(self.lm_head_linear, normed, self.invariance.tile) if self.invariance else self.lm_head_linear(normed))[:wanted]
        if self.final_softcap:
            logits = torch.tanh(logits.float() / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower and projector: [crops, 3, H, W] -> [crops * tokens_per_crop, hidden]."""
        features = self.model.model.get_image_features(pixel_values.to(self.device, self.dtype))
        features = getattr(features, "pooler_output", features)
        return features.reshape(-1, features.shape[-1])
