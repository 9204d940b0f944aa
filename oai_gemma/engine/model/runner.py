"""The model runner: Gemma-3's forward pass over a mixed batch of prefill chunks and decode tokens.

It computes with the project's own container of the model's weights (engine/model/weights.py's Gemma3Weights, in
their final layout: packed or quantized) described by engine/shape.py's shape, and owns the attention and the KV
cache, so sequences of different lengths decode together in one batch, join and leave between steps, and
sliding-window layers keep only their window (a ring buffer).
A step is packed into tensors (`_pack`), run through the layers (`_layers`: engine/model/gemma3.py's layer around
our attention) and turned into logits for the rows that sample (`_logits`), as nano-vllm's runner does.
Linear layers run once over all tokens of the step; attention runs per prefill chunk and batched for
all decode tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .attention import DecodeKeys, decode_attention, decode_keys, prefill_attention
from .buckets import bucket, buckets
from .gemma3 import check_supported, post_attention, pre_attention, signed_sin
from .invariance_check import measure_invariance
from .layout import Layout
from .lean import Rotary
from .loader import LoadedModel
from .streamed import from_safetensors
from .vision_layout import tower_layout
from .vision_weights import image_features
from .weights import Gemma3Weights, from_modules, linear_bytes, text_parts
from ...cpu import TURNS
from ..ops.fused import fuse_layers
from ..ops.invariance import PROMPT_KERNEL_TOKENS, Invariance, RoleLinear, TiledLinear, tiled
from ..ops.linear import FrozenLinear, call_linear
from ..ops.quantized import KERNEL_ROWS
from ..cache.kv_cache import BLOCK_SIZE, KVCache
from ..shape import FULL, SLIDING, Gemma3Shape
from ..config import ConfigError, EngineConfig, ModelConfig
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
    decode: dict[bool, list[DecodeKeys]]
    """The decode rows' keys in full (False) and sliding (True) layers (in span groups: `decode_keys`)."""

    @property
    def items(self) -> list[StepItem]:
        return self.prefills + self.decodes


class ModelRunner:
    """Built from the model's weights (engine/model/weights.py's Gemma3Weights: `load_weights` fills them from a
    loaded checkpoint or a module tree), the batch-invariant mode measured on them (`measure_invariance`) and the
    engine's configuration (engine/config.py): `static_decode` runs decode-only steps at static shapes, CUDA graphs
    where possible (engine/model/static_decode.py, from the same weights), `compile` compiles its layer functions.
    `model`: the module tree or the loader's shell the weights came from (its tensors the weights share are counted
    once in `weight_bytes`), or None."""

    def __init__(self, weights: Gemma3Weights, config: EngineConfig, model=None, invariance: Invariance | None = None):
        self.gemma = weights
        self.model = model
        text = self.text_shape = weights.shape.text
        self.device = weights.device
        self.input_device = weights.embedding.device
        self.layer_devices = [w.input_norm.device for w in weights.layers]
        """Each layer's device: several GPUs when the model was loaded with device_map="auto"."""
        self.dtype = weights.dtype
        self.num_heads, self.kv_heads, self.head_dim = text.heads, text.kv_heads, text.head_dim
        self.shape = (self.num_heads, self.kv_heads, self.head_dim)
        self.eps = text.rms_eps
        self.scaling = text.query_pre_attn_scalar**-0.5
        self.final_softcap = text.final_softcap
        self.layer_types = [SLIDING if sliding else FULL for sliding in text.sliding]
        self.rotary = Rotary.of(text)
        self.max_len = max_len = config.model.max_model_len
        num_slots, static = config.scheduler.max_num_seqs, config.model.static_decode
        flash = flash_kernel(self.device, self.dtype, self.head_dim) if static else None
        started = time.monotonic()
        num_blocks = config.cache.kv_blocks or num_slots * -(-max_len // BLOCK_SIZE)  # 0: room for num_slots of max_len
        self.cache = KVCache(text, num_blocks, self.dtype, self.device, self.layer_devices)
        self.weights = weights.layers
        """Each layer's weights, its projections packed for oneDNN on a CPU (engine/ops/linear.py) or quantized."""
        self.lm_head_linear = weights.lm_head
        self.mapped_embedding = weights.mapped
        """The token embedding is read from the checkpoint file on demand (engine/model/mapped.py), not held in memory."""
        self.quantization = weights.quantization
        self.timings = {"KV cache": time.monotonic() - started}
        """Seconds of the start-up phases this constructor (and `of`) runs (logged by engine/factory.py)."""
        self.num_slots = num_slots
        """Most rows a step samples (the scheduler's batch size)."""
        self.row_buckets = buckets(num_slots)
        self.logits_buckets = buckets(config.max_logits_rows)
        """Logits rows of a step: the rows' and their drafts' (speculative decoding)."""
        self.token_buckets = buckets(config.max_tokens_per_step)
        self.invariance = invariance
        """Batch-invariant mode (engine/ops/invariance.py): tiled linears, grid-aligned padded attention; None: off.
        Decided before the runner is built (`measure_invariance`, by engine/factory.py or `of`)."""
        self.batch_invariant = invariance is not None
        self.invariance_cost: float | None = None
        """What the mode costs (on) or would cost (off) a prefill chunk's linears, as start-up measured it
        (`measure_invariance`); None: not measured."""
        self.lora = None
        """The resident LoRA adapters (engine/lora/registry.py `ResidentAdapters`, a read-only view the engine core
        hands over once at its start) when adapters are served: each slot's weights."""
        self.lora_names = module_names(self.weights)
        self.static = None
        if static:
            self.static = StaticDecode(self, use_graphs=self.device.type == "cuda", compiled=config.model.compile, flash=flash)

    @classmethod
    def of(cls, source, config: EngineConfig, own_weights: bool = False) -> ModelRunner:
        """The runner of a LoadedModel or a module tree (`load_weights`), batch-invariant mode measured on its weights
        first (`measure_invariance`): what engine/factory.py does step by step for the server."""
        started = time.monotonic()
        weights = load_weights(source, config.model, own_weights)
        measured = time.monotonic()
        invariance, cost = measure_invariance(weights, config)
        runner = cls(weights, config, source.model if isinstance(source, LoadedModel) else source, invariance)
        runner.invariance_cost = cost
        runner.timings = {"weights": measured - started, **runner.timings, "invariance check": time.monotonic() - measured}
        return runner

    def sequence_blocks(self, index: int, length: int | None = None) -> list[int]:
        """Block table of the index-th of fixed runs of blocks, each long enough for `length` positions (default
        max_len; the default pool holds `num_slots` of those): for callers that drive the runner without a
        scheduler (quality checks, tests, benchmarks)."""
        per_sequence = -(-(length or self.max_len) // self.cache.block_size)
        if (index + 1) * per_sequence > self.cache.num_blocks:
            raise ValueError(f"the KV pool has {self.cache.num_blocks} blocks: no room for run {index} of {per_sequence}")
        return list(range(index * per_sequence, (index + 1) * per_sequence))

    def weight_bytes(self) -> int:
        """Bytes of every weight the runner holds in memory (Gemma3Weights' and the module tree's, counted once)."""
        counted = {self.gemma.embedding.data_ptr()}
        tree = [] if self.model is None else list(self.model.parameters())
        vision = [] if self.gemma.vision is None else self.gemma.vision.tensors()  # the streamed path's tower: no tree
        held = 0
        for t in tree + vision:
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in counted:
                counted.add(t.data_ptr())
                held += t.numel() * t.element_size()
            elif t is not None and not isinstance(t, torch.Tensor):  # the tower's quantized linears (vision_layout.py)
                held += t.packed_bytes
        return self.gemma.nbytes() + held

    def decode_bytes(self) -> int:
        """Bytes of the linears' weights one decode step of one row reads: the most of what one stream's token must
        stream from memory (bench/floor.py)."""
        return sum(linear_bytes(linear) for linear in self.gemma.linears())

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
        elif self.kernel_prompts_below:  # a short prompt's rows go with the decode rows, through the row-exact kernel
            batch = self._pack([it for it in prefills if not it.kernel] + [it for it in prefills if it.kernel], decodes)
        else:
            batch = self._pack(prefills, decodes)
        return self._logits(batch, self._layers(batch, layers), prefills + decodes)

    @property
    def kernel_prompts_below(self) -> int:
        """Prompts of fewer tokens run their rows through the row-exact kernel (StepItem `kernel`, decided by the
        scheduler once per request): batch-invariant mode by role; 0: none (a prompt's rows are any step's)."""
        return PROMPT_KERNEL_TOKENS if self.invariance is not None and self.invariance.by_role else 0

    @property
    def warm_layers(self) -> list[int]:
        """One layer of each kind (sliding and full attention): what warm-up runs, since oneDNN makes a shape's
        kernels once for all layers alike (measured: a bucket's first full step after it is as fast as its second)."""
        return sorted({self.layer_types.index(kind) for kind in self.layer_types})

    @property
    def warm_token_buckets(self) -> list[int]:
        """The token buckets warm-up runs: every one where a step's shape builds kernels (oneDNN's packed weights, or
        its bf16 matmuls, which make a shape's kernels on its first call; a GPU), else the first and the first of
        the prefill path (KERNEL_ROWS): in float32 the native layouts (int8, q8, q4 and their lm_heads) and the
        dequantized prefill's sgemm build nothing per shape, so a bucket's first call is as fast as its next
        (measured on the 1B, docs/benchmarks.md), and the other buckets only cost start-up time (most of the 1B's
        5.5 s warm-up)."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or self.static is not None or any(
                isinstance(linear, FrozenLinear) and linear.packed is not None for linear in self.gemma.linears()):
            return self.token_buckets
        return sorted({self.token_buckets[0], bucket(KERNEL_ROWS, self.token_buckets)})

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
            step, small = (self.invariance.span_step, self.invariance.small_spans) if self.invariance else (0, ())
            # a decode item with drafts is one row per position, each over its own past (engine/speculative/)
            tables = [it.blocks for it in decodes for _ in it.token_ids]
            starts = [it.start + i for it in decodes for i in range(len(it.token_ids))]
            for sliding in set(self.cache.sliding):
                keys = decode_keys(tables, starts, self.cache.window if sliding else None, self.cache, step, small)
                decode[sliding] = [group.to(self.input_device) for group in keys]
        tables = [torch.tensor(it.blocks, dtype=torch.long, device=self.input_device) for it in prefills]
        writes = tuple(t.to(self.input_device) for t in writes)
        return Batch(prefills, decodes, ids, tensor_positions, pad, writes, tables, decode)

    def _embed(self, batch: Batch) -> torch.Tensor:
        """Token embeddings, with the vision tower's output in place of each image soft token."""
        hidden = self.gemma.embed(batch.ids).to(self.dtype)  # a mapped embedding may be stored in another dtype
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
        rope = {t: self.rotary(hidden, batch.positions[None], t) for t in set(self.layer_types)}
        rope = {t: (cos[0, :, None, :], signed_sin(sin[0, :, None, :])) for t, (cos, sin) in rope.items()}
        decode, writes = batch.decode, batch.writes
        linear = step_linear = self._step_linear(batch)
        lora = None if self.lora is None else LoraStep.of(
            batch.prefills, batch.decodes, self.lora, self.lora_names, hidden.device, exact=self.invariance is not None,
        )
        for li in range(len(self.weights)) if layers is None else layers:
            TURNS.offer()  # a layer is a unit of a load's warm-up (cpu.Turns; a no-op on an engine's thread)
            w = self.weights[li]
            device = self.layer_devices[li]
            if hidden.device != device:  # device_map="auto": the next layer is on another GPU
                hidden = hidden.to(device)
                decode = {kind: [group.to(device) for group in keys] for kind, keys in decode.items()}
                writes = tuple(t.to(device) for t in writes)
                rope = {t: (cos.to(device), sin.to(device)) for t, (cos, sin) in rope.items()}
            cos, sin = rope[self.layer_types[li]]
            if lora is not None:  # each row's adapter update beside the base projections (engine/lora/apply.py)
                linear = lora.around(step_linear, li)
            q, k, v = pre_attention(hidden, w, cos, sin, self.eps, *self.shape, linear=linear)
            out = self._attention(li, batch, writes, decode, q, k, v)
            hidden = post_attention(hidden, out, w, self.eps, linear=linear)
        return hidden

    def _step_linear(self, batch: Batch):
        """The projections' call for this step: plain; or in batch-invariant mode each row by its role (a prompt row
        through the prefill path, a decode row through the row-exact kernel) where the layouts allow, else tiled."""
        if self.invariance is None:
            return call_linear
        if not self.invariance.by_role:
            return TiledLinear(self.invariance.tile)
        rows = batch.ids.shape[0]
        prompt_rows = sum(len(it.token_ids) for it in batch.prefills if not it.kernel)  # the kernel's prompts come after
        return RoleLinear(self.invariance.tile, prompt_rows, rows - batch.pad, rows)

    def _attention(self, li: int, batch: Batch, writes, decode: dict[bool, list[DecodeKeys]], q, k, v) -> torch.Tensor:
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
            outs.append(decode_attention(self.cache, li, decode[self.cache.sliding[li]], q[sl], self.scaling, self.batch_invariant))
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
            return torch.empty(0, self.text_shape.vocab)
        most = self.logits_buckets[-1]
        parts = [self.logits_of(hidden[rows[lo : lo + most]]) for lo in range(0, len(rows), most)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of last-layer hidden states [rows, hidden] (at most the largest row bucket).
        The rows are padded to a row bucket: the lm_head runs only at the shapes warm-up compiled."""
        TURNS.offer()  # the lm_head is a unit of a load's warm-up too
        wanted = hidden.shape[0]
        padded = bucket(wanted, self.logits_buckets)
        if padded > wanted:
            hidden = torch.cat((hidden, hidden[-1:].expand(padded - wanted, -1)))
        normed = self.gemma.norm(hidden.to(self.device))
        logits = (tiled(self.lm_head_linear, normed, self.invariance.tile) if self.invariance else self.lm_head_linear(normed))[:wanted]
        if self.final_softcap:
            logits = torch.tanh(logits.float() / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower and projector: [crops, 3, H, W] -> [crops * tokens_per_crop, hidden]."""
        return image_features(self.gemma.vision, pixel_values.to(self.device, self.dtype))


def load_weights(source, config: ModelConfig, own_weights: bool = False) -> Gemma3Weights:
    """The weights of a LoadedModel (engine/model/loader.py) in their final layout, read from its checkpoint one tensor
    at a time where the loader left the text weights there (`checkpoint`), else from its module tree; or of a module
    tree. `own_weights`: they may take the tree's projections (weights.py's `from_modules`)."""
    loaded = source if isinstance(source, LoadedModel) else None
    model = loaded.model if loaded is not None else source
    streamed = loaded is not None and loaded.checkpoint is not None
    text_config = (getattr(model.config, "text_config", None) or model.config) if streamed else text_parts(model)[0].config
    check_supported(text_config)
    if streamed:
        device, dtype = loaded.device, loaded.dtype
    else:
        device, dtype = text_parts(model)[1].weight.device, text_parts(model)[1].weight.dtype
    if config.quantization != "none" and (config.static_decode or device.type != "cpu"):
        raise ConfigError(
            f"model.quantization = {config.quantization!r} is implemented for the CPU path only; on a GPU use \"none\""
        )
    layout = Layout(config.quantization, dtype, text_config.num_hidden_layers, float_tensors=config.static_decode)
    if streamed:
        weights = from_safetensors(loaded.checkpoint, Gemma3Shape.of(model.config), layout, config.quantized_weights,
                                   getattr(text_config, "tie_word_embeddings", True))
    else:
        weights = from_modules(model, layout, config.quantized_weights, own_weights and not config.static_decode)
    fuse_layers(weights.layers)  # q/k/v and gate/up one kernel call each where their layout allows (same bits)
    weights.vision = tower_layout(weights.vision, config.quantization)  # q8 beside the integer text layouts
    return weights
