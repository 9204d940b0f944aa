"""Decode steps at static shapes, for GPUs: one CUDA graph per (rows, span) bucket, captured once, replayed.

Why: a decode step of gemma-3-12b is ~1,300 small kernels. Launched one by one from Python, the launches and
not the weights' memory bandwidth bound the step at small batches. Captured into a CUDA graph, a step is one
replay. A graph replays fixed memory at fixed shapes, so everything a step varies lives in a static input
buffer (token ids, positions, block tables); the attention mask is computed on the device from the positions
(no host sync); padded rows write their K/V into the scratch block that no sequence owns.

Each row's blocks up to a bucketed span are gathered from the paged cache (engine/cache/kv_cache.py), so a short
context does not pay for `max_len`; attention over them is flash-attn's `flash_attn_with_kvcache` when it is
installed (up to `cache_seqlens`, sliding layers through `window_size`), else SDPA with a mask. The projections, norms and MLP of a layer are
two plain functions of tensors (engine/model/gemma3.py's `pre_attention`, `post_attention`): `torch.compile` compiles each once for
every layer (the weights are arguments, not constants), instead of one huge graph per shape.

On CPU, or with layers on several GPUs (a graph is captured on one device), the same static-shape
function runs eagerly: that is how the tests check it against the dynamic path.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F

from .buckets import bucket, span_buckets
from ..ops.invariance import round_up
from .gemma3 import LayerWeights, post_attention, pre_attention, signed_sin
from .weights import PROJECTIONS, Gemma3Weights

log = logging.getLogger("oai_gemma.static_decode")


def flash_kernel(device: torch.device, dtype: torch.dtype, head_dim: int):
    """flash-attn's `flash_attn_with_kvcache` where it is installed and fits the layout, else None (SDPA)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > 256 or head_dim % 8:
        return None
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def plain_layers(weights: Gemma3Weights) -> list[LayerWeights]:
    """Each layer's weights with its projections as plain tensors (each float linear's own, engine/model/layout.py's
    `float_tensors`), for the layer functions' `F.linear`: tensors, so dynamo guards on their shapes, never on which
    layer. Refuses a quantized linear (`model.quantization` other than `none` has no static path)."""
    return [w._replace(**{name: _plain(getattr(w, name)) for name in PROJECTIONS}) for w in weights.layers]


def _plain(linear) -> torch.Tensor:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"the static decode computes with float weights, not {type(linear).__name__}'s layout")
    return weight


class DecodeGraph:
    """One bucket: a static input buffer [rows, 2 + blocks] (token id, position, block table) and the step captured over it
    as a CUDA graph (`pool` shared by every bucket), or the same step run eagerly where there is no graph."""

    def __init__(self, step, inputs: torch.Tensor, use_graph: bool, pool=None):
        self.step = step
        self.inputs = inputs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        if use_graph:
            self._capture(pool)

    def _capture(self, pool) -> None:
        device = self.inputs.device
        with torch.cuda.device(device):
            self._capture_on(device, pool)

    def _capture_on(self, device: torch.device, pool) -> None:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisation (cuBLAS workspaces, torch.compile) must happen outside capture
                self.step(self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = self.step(self.inputs)

    def __call__(self, host_inputs: torch.Tensor) -> torch.Tensor:
        """Run the step on these inputs; a graph's output is its static buffer, so it is copied out."""
        self.inputs.copy_(host_inputs, non_blocking=True)
        if self.graph is None:
            return self.step(self.inputs)
        self.graph.replay()
        return self.output.clone()


class StaticDecode:
    """The decode-only step of a ModelRunner at bucketed static shapes (see the module docstring)."""

    def __init__(self, runner, *, use_graphs: bool, compiled: bool, flash=None):
        self.runner = runner
        self.weights = plain_layers(runner.gemma)
        self.eps = runner.eps
        self.shape = runner.shape
        self.flash = flash
        self.devices = sorted(set(runner.layer_devices) | {runner.input_device, runner.device}, key=str)
        self.rope = self._rope_tables()
        self.row_buckets = runner.row_buckets
        self.block_size = runner.cache.block_size
        self.span_buckets = [round_up(span, self.block_size) for span in span_buckets(runner.max_len)]
        self.table_width = self.span_buckets[-1] // self.block_size
        self.positions = {d: torch.arange(self.span_buckets[-1], device=d) for d in self.devices}
        self.use_graphs = use_graphs and len(self.devices) == 1 and self.devices[0].type == "cuda"
        self.pool = None
        if self.use_graphs:
            with torch.cuda.device(self.devices[0]):
                self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.pre, self.post = pre_attention, post_attention
        if compiled:
            self.pre = torch.compile(pre_attention, fullgraph=True)
            self.post = torch.compile(post_attention, fullgraph=True)

    def _rope_tables(self) -> dict:
        """cos/sin of every position, per layer type and device, from the runner's rotary tables: the step
        gathers its rows by position on the device (the same values the dynamic path computes)."""
        r = self.runner
        tables = {}
        for layer_type in set(r.layer_types):
            probe = torch.empty(1, dtype=r.dtype, device=r.input_device)
            cos, sin = r.rotary(probe, torch.arange(r.max_len, device=r.input_device)[None], layer_type)
            for device in self.devices:
                tables[layer_type, device] = (cos[0].to(device), signed_sin(sin[0]).to(device))
        return tables

    # ---- the step at one static shape ------------------------------------------------------------

    def step(self, inputs: torch.Tensor, span: int) -> torch.Tensor:
        """inputs [rows, 2 + blocks] (token id, position, block table) on the input device -> logits [rows, vocab]."""
        r = self.runner
        ids, pos, tables = inputs[:, 0], inputs[:, 1], inputs[:, 2 : 2 + span // self.block_size]
        hidden = r.gemma.embed(ids)
        per_device = {}
        for li, w in enumerate(self.weights):
            device = r.layer_devices[li]
            if device not in per_device:  # a model spread over several GPUs: positions and tables follow the layers
                p, s = pos.to(device), tables.to(device)
                rope = {t: (cos[p][:, None, :], sin[p][:, None, :]) for (t, d), (cos, sin) in self.rope.items() if d == device}
                per_device[device] = (p, s, rope)
            p, s, rope = per_device[device]
            hidden = hidden.to(device)
            cos, sin = rope[r.layer_types[li]]
            q, k, v = self.pre(hidden, w, cos, sin, self.eps, *self.shape)
            hidden = self.post(hidden, self._attend(li, q, k, v, p, s, span), w, self.eps)
        return r.logits_of(hidden)  # the rows are a bucket already: no padding

    def _attend(self, li: int, q, k, v, pos, tables, span: int) -> torch.Tensor:
        """Write this step's K/V at each row's position, then attend each row over its blocks up to `span`."""
        cache = self.runner.cache
        size = self.block_size
        cache.write(li, tables.gather(1, (pos // size)[:, None])[:, 0], pos % size, k, v)
        sliding = cache.sliding[li]
        keys, values = cache.blocks(li, tables)  # [rows, kv_heads, span, D]
        if self.flash is not None:  # its layout, [rows, span, kv_heads, D]: the gather's own, transposed back
            out = self.flash(
                q[:, None], keys.transpose(1, 2), values.transpose(1, 2), cache_seqlens=(pos + 1).to(torch.int32),
                softmax_scale=self.runner.scaling, window_size=(cache.window - 1, 0) if sliding else (-1, -1),
            )
            return out[:, 0]
        kpos = self.positions[q.device][:span][None, :]
        mask = kpos <= pos[:, None]
        if sliding:
            mask &= kpos > pos[:, None] - cache.window
        heads, kv_heads, head_dim = self.shape
        qg = q.view(q.shape[0], kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :], scale=self.runner.scaling)
        return out.reshape(q.shape[0], heads, head_dim)

    # ---- buckets ----------------------------------------------------------------------------------

    def host_inputs(self, decodes, rows: int) -> torch.Tensor:
        """[rows, 2 + blocks] on the host: real rows first, then padding (token 0 at position 0 of the scratch
        block); tables padded with the scratch block."""
        inputs = torch.full((rows, 2 + self.table_width), self.runner.cache.scratch, dtype=torch.long)
        inputs[:, :2] = 0
        for row, it in enumerate(decodes):
            blocks = it.blocks[: self.table_width]
            inputs[row, 0], inputs[row, 1] = it.token_ids[0], it.start
            inputs[row, 2 : 2 + len(blocks)] = torch.tensor(blocks)
        return inputs

    def shape_for(self, decodes) -> tuple[int, int]:
        """(rows, span) bucket of a decode step, chosen on the host from the items (no device read)."""
        rows = bucket(len(decodes), self.row_buckets)
        span = bucket(max(it.start for it in decodes) + 1, self.span_buckets)
        return rows, span

    def graph(self, rows: int, span: int) -> DecodeGraph:
        key = (rows, span)
        if key not in self.graphs:
            inputs = self.host_inputs([], rows).to(self.runner.input_device)
            self.graphs[key] = DecodeGraph(partial(self.step, span=span), inputs, self.use_graphs, self.pool)
        return self.graphs[key]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first (smaller graphs then reuse the shared pool's memory)."""
        for rows in sorted(self.row_buckets, reverse=True):
            for span in sorted(self.span_buckets, reverse=True):
                self.graph(rows, span)
        log.info(
            "static decode: %d buckets (%s), attention %s", len(self.graphs),
            "CUDA graphs" if self.use_graphs else "eager", "flash-attn" if self.flash is not None else "SDPA",
        )

    def run(self, decodes) -> torch.Tensor:
        """Logits [len(decodes), vocab] of one decode-only step."""
        rows, span = self.shape_for(decodes)
        return self.graph(rows, span)(self.host_inputs(decodes, rows))[: len(decodes)]
