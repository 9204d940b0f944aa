"""The vision tower alone, from a multimodal checkpoint: its layouts timed at the resumable encode's grain.

    python -m oai_gemma.bench.vision ~/.cache/oai-gemma-bench/gemma-3-4b-random [--layers 1] [--full]

Loads only `vision_tower` and `multi_modal_projector` (no text model: a 4B's float32 text weights and a second
copy do not fit a 24 GB machine), then for each layout of the tower's linears times `--layers` encoder layers of one
896x896 crop one-call (lean_vision.py's modules, their linears swapped) and unit by unit as the server runs them
(engine/model/vision_encode.py on engine/model/vision_weights.py's float32 tensors, whatever the layout), and prints
the tower's time extrapolated to all layers, a unit's time and the weights' memory. `--full`: one whole encode in the first
layout too (the figure to set against llama-server's image encode).

Layouts: `f32` (F.linear on the checkpoint's weights in float32: what the server runs), `f32-packed` (oneDNN's
re-laid-out weight, engine/ops/linear.py), `int8` (engine/ops/quantized.py's NativeInt8Linear as the runner
calls it: its AVX2 kernel below KERNEL_ROWS rows, the weight dequantized per call from there),
`int8-kernel` (the kernel at every row count), `bf16` (bfloat16 weights, rows cast to bfloat16 for the GEMM:
engine/model/vision_layout.py's `Bf16VisionLinear`), `q8a7` and `q8` (int8 weights times activations quantized per
block of 32 to 7 or 8 bits: engine/model/vision_layout.py). The server runs `bf16` beside the integer text layouts
on a CPU with fast bf16 GEMMs, `q8a7` on others. `--quality`: one whole encode in float32 and in each of the
server's layouts (`q8a7`, `q8`, `bf16`) of `--layouts`, the projected features' cosine and errors against float32's
(`--layers 0`: no timings).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.model.lean import fill, read_checkpoint
from ..engine.model.lean_config import model_config
from ..engine.model.lean_vision import BiasedLinear, Projector, VisionTower, checkpoint_name
from ..engine.model.vision_encode import VisionEncode
from ..engine.model.vision_layout import Bf16VisionLinear, VisionLinear, to_bf16, to_q8
from ..engine.model.vision_weights import VisionWeights, embed, from_modules

LAYOUTS = ("f32", "f32-packed", "int8", "int8-kernel", "bf16", "q8a7", "q8")


def load_tower(source: str) -> nn.Module:
    """An nn.Module with `vision_tower` and `multi_modal_projector`, float32, from `source`'s checkpoint."""
    config, why = model_config(source)
    if config is None or getattr(config, "vision_config", None) is None:
        raise SystemExit(f"{source}: not a multimodal Gemma-3 checkpoint ({why})")
    holder = nn.Module()
    holder.config = config
    holder.vision_tower, holder.multi_modal_projector = VisionTower(config.vision_config), Projector(config)
    wanted = ("model.vision_tower.", "model.multi_modal_projector.")
    tensors = {}
    for key, tensor in read_checkpoint(Path(source)).items():
        name = checkpoint_name(key)
        if name.startswith(wanted):
            tensors[name.removeprefix("model.")] = tensor
    fill(holder, tensors, source, torch.float32, tied=False)
    return holder.eval()


class _Swapped(nn.Module):
    def __init__(self, call, bias: torch.Tensor, nbytes: int):
        super().__init__()
        self.call, self.bias, self.nbytes = call, bias, nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.call(x.reshape(-1, x.shape[-1])).float() + self.bias
        return y.view(*x.shape[:-1], -1).to(x.dtype)


def relayout(holder: nn.Module, layout: str) -> int:
    """Every BiasedLinear of the tower in `layout`, in place; the bytes of the linears' weights now."""
    from ..engine.ops import quantized
    from ..engine.ops.linear import FrozenLinear

    total = 0
    for name, module in list(holder.vision_tower.named_modules()):
        if not isinstance(module, BiasedLinear):
            continue
        weight, bias = module.weight.detach(), module.bias.detach()
        if layout == "f32":
            swapped, nbytes = module, weight.numel() * 4
        elif layout == "f32-packed":
            frozen = FrozenLinear(weight)
            swapped, nbytes = _Swapped(frozen, bias, frozen.packed_bytes or weight.numel() * 4), 0
        elif layout in ("q8", "q8a7"):
            pad = -holder.vision_tower.config.intermediate_size % 32
            pads = (pad, 0) if name.endswith("fc1") else (0, pad) if name.endswith("fc2") else (0, 0)
            q8 = VisionLinear(weight, bias, *pads, activations=7 if layout == "q8a7" else 8)
            swapped = _Swapped(q8, torch.zeros(()), q8.packed_bytes)
        elif layout == "bf16":
            bf16 = Bf16VisionLinear(weight, bias)  # the server's layout, its bias inside
            swapped = _Swapped(bf16, torch.zeros(()), bf16.weight.numel() * 2)
        else:
            q = quantized.NativeInt8Linear(weight)
            call = q if layout == "int8" else (lambda x, q=q: _kernel(q, x))
            swapped = _Swapped(call, bias, q.packed.numel() + q.scale.numel() * 4)
        nbytes = nbytes if layout in ("f32", "f32-packed") and nbytes else swapped.nbytes
        total += nbytes
        if swapped is not module:
            owner, _, leaf = name.rpartition(".")
            setattr(holder.vision_tower.get_submodule(owner), leaf, swapped)
    return total


def _kernel(q, x: torch.Tensor) -> torch.Tensor:
    from ..engine.ops import quantized

    saved, quantized.KERNEL_ROWS = quantized.KERNEL_ROWS, 1 << 30
    try:
        return q(x.float())
    finally:
        quantized.KERNEL_ROWS = saved


def time_layers(holder: nn.Module, weights: VisionWeights, layers: int, pixels: torch.Tensor, rows: int = 0) -> dict:
    """Seconds for `layers` encoder layers unit by unit (`weights`) and one-call (`holder`'s modules), and the
    slowest unit's seconds."""
    tower = holder.vision_tower
    job = VisionEncode(weights, pixels, rows)
    with torch.inference_mode():
        hidden = embed(weights, pixels).contiguous()
        began = last = time.perf_counter()
        slowest = 0.0
        for layer in weights.layers[:layers]:
            for _ in job._layer(layer, hidden):
                now = time.perf_counter()
                slowest, last = max(slowest, now - last), now
        units = time.perf_counter() - began
        x = tower.embeddings(pixels)
        began = time.perf_counter()
        for layer in list(tower.encoder.layers)[:layers]:
            x = layer(x)
        one_call = time.perf_counter() - began
    return {"unit_rows": job.rows, "slowest_unit_s": slowest, "units_s": units, "one_call_s": one_call}


SERVED = {"q8a7": lambda weights: to_q8(weights, 7), "q8": lambda weights: to_q8(weights, 8), "bf16": to_bf16}
"""The server's tower layouts (engine/model/vision_layout.py), each applied to float32 VisionWeights."""


def quality(source: str, pixels: torch.Tensor, layouts: list[str]) -> list[dict]:
    """One whole encode in float32 and in each of the server's layouts in `layouts` (unit by unit, as the server runs them): their projected
    features against float32's: cosine per token (min, mean), relative error (norm of the difference over the
    float32 features' norm), largest absolute error beside the largest float32 value, and the encode's seconds."""
    out, seconds = {}, {}
    for layout in ("f32", *(name for name in layouts if name in SERVED)):
        weights = from_modules(load_tower(source))
        job = VisionEncode(SERVED[layout](weights) if layout in SERVED else weights, pixels)
        job.run(1e9)
        out[layout], seconds[layout] = job.features, job.seconds
    ref, rows = out.pop("f32"), []
    for layout, got in out.items():
        cosine = F.cosine_similarity(got, ref, dim=-1)
        rows.append({"quality": f"{layout} vs f32", "cosine_min": round(cosine.min().item(), 6),
                     "cosine_mean": round(cosine.mean().item(), 6), "relative_error": round(((got - ref).norm() / ref.norm()).item(), 5),
                     "max_abs_error": round((got - ref).abs().max().item(), 5), "max_abs_f32": round(ref.abs().max().item(), 5),
                     "encode_s": round(seconds[layout], 2), "f32_encode_s": round(seconds["f32"], 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--rows", type=int, default=0, help="rows per unit (default: the encode's own choice)")
    parser.add_argument("--quality", action="store_true", help="the server's layouts' features against float32's, one whole encode each")
    args = parser.parse_args(argv)
    pixels = torch.randn(1, 3, 896, 896, generator=torch.Generator().manual_seed(0))
    for layout in args.layouts.split(",") if args.layers else ():  # --layers 0: --quality alone
        holder = load_tower(args.source)
        weights = from_modules(holder)  # before the swap: the server's float32 tensors (q8a7, q8, bf16: their own layout)
        weights = SERVED[layout](weights) if layout in SERVED else weights
        nbytes = relayout(holder, layout)
        timing = time_layers(holder, weights, args.layers, pixels, args.rows)
        units = timing["units_s"]
        count = holder.vision_tower.config.num_hidden_layers
        row = {"layout": layout, "linear_weight_mib": round(nbytes / 2**20, 1), "layers_timed": args.layers,
               "units_s_per_layer": round(units / args.layers, 3), "one_call_s_per_layer": round(timing["one_call_s"] / args.layers, 3),
               "tower_s_estimate": round(units / args.layers * count, 1), "unit_rows": timing["unit_rows"],
               "slowest_unit_s": round(timing["slowest_unit_s"], 3)}
        print(json.dumps(row), flush=True)
        if args.full and layout == args.layouts.split(",")[0]:
            job = VisionEncode(weights, pixels)
            job.run(1e9)
            print(json.dumps({"layout": layout, "full_encode_s": round(job.seconds, 2), "units": job.units_done}), flush=True)
    if args.quality:
        for row in quality(args.source, pixels, args.layouts.split(",")):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
