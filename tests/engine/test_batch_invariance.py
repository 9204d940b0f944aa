"""Batch-invariant mode on the real model: a greedy or seeded request gives the same tokens alone, batched with
others (more requests than slots, beside a long prompt), with its prompt prefilled in 16-token chunks, and served
from the prefix cache; a prompt's logits are bitwise the same however its prefill is chunked and whatever decodes
beside it; and the row-exact kernels the mode calls untiled give a row the same bits alone and in any batch.

Cut for time (issue 40: 517 s before): the first LAYERS decoder layers only (a sliding and a global layer both run,
through the same layer functions and kernels as all 18), one weights build per configuration shared by its
runners, a few seeds and tokens. Configurations: float32 `int8` (the default on AVX2 CPUs: the native kernel's rows,
`auto`), float32 `none` (oneDNN whole, `auto`), bf16 `none` (oneDNN in 32-row tiles, `on`) and bf16 `per-step`
(bf16 CPUs' default layout: the native kernel, bf16 in and out)."""

import asyncio
import functools
import random

import pytest
import torch

from oai_gemma.chat import render_chat
from oai_gemma.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from oai_gemma.engine.engine import Engine
from oai_gemma.engine.model.loader import load
from oai_gemma.engine.model.invariance_check import measure_invariance
from oai_gemma.engine.model.runner import ModelRunner, StepItem, load_weights
from oai_gemma.engine.ops import native
from oai_gemma.engine.ops.int_dot import Q4Linear, Q5Linear, Q8Linear
from oai_gemma.engine.ops.quantized import NativeInt8Linear, NativeQ8Linear
from oai_gemma.engine.types import GenerationRequest, SamplingParams
from oai_gemma.settings import ModelSettings

pytestmark = pytest.mark.slow

SEEDS = range(6)
TOKENS = 10
LAYERS = 6
"""Decoder layers run: layers 0-4 slide, layer 5 is global (every sixth)."""
COMPANIONS = ("Describe Paris in detail. " * 12, "List ten fruits with their colours.")


@functools.cache
def loaded_model(dtype: str):
    return load(ModelSettings(dtype=dtype))


@functools.cache
def weights_of(dtype: str, quantization: str):
    """One weights build per configuration (quantized in memory), and the mode measured on it once."""
    loaded = loaded_model(dtype)
    config = EngineConfig(
        model=ModelConfig(dtype=dtype, quantization=quantization),
        scheduler=SchedulerConfig(max_num_seqs=8, max_prefill_tokens=512),
    )
    return load_weights(loaded, config.model), loaded


def runner(dtype: str, quantization: str, mode: str, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int,
           prefix_caching: bool = True) -> tuple[ModelRunner, EngineConfig]:
    """A runner on the shared weights, cut to LAYERS layers, the mode measured on them for its configuration."""
    weights, loaded = weights_of(dtype, quantization)
    config = EngineConfig(
        model=ModelConfig(dtype=dtype, quantization=quantization, batch_invariant=mode, max_model_len=max_model_len),
        cache=CacheConfig(prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens),
    )
    invariance, _ = measure_invariance(weights, config)
    built = ModelRunner(weights, config, loaded.model, invariance)
    built.weights = built.weights[:LAYERS]
    return built, config


class Engines:
    """Two engines on one weights build: prompts prefilled whole (512-token chunks) with the prefix cache, and in
    16-token chunks without it; 4 slots each."""

    def __init__(self, dtype: str, quantization: str, mode: str):
        self.loop = asyncio.new_event_loop()
        engines = []
        for chunk, caching in ((512, True), (16, False)):
            built, config = runner(dtype, quantization, mode, max_num_seqs=4, max_prefill_tokens=chunk,
                                   max_model_len=1024, prefix_caching=caching)
            engines.append(Engine(loaded_model(dtype), config, runner=built))
        self.whole, self.chunked = engines
        for engine in (self.whole, self.chunked):
            engine.start(self.loop)
        self.counter = 0

    def prompt(self, text: str) -> list[int]:
        return self.whole.encode(render_chat([{"role": "user", "content": text}]).prompt)

    async def _one(self, engine: Engine, ids: list[int], seed: int | None, max_tokens: int = TOKENS):
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0, seed=seed)
        events = [e async for e in engine.generate(GenerationRequest(f"r{self.counter}", ids, params))]
        return [e.token_id for e in events if e.token_id is not None], events[-1].num_cached_tokens

    def together(self, engine: Engine, ids: list[int], seeds) -> list[tuple[list[int], int]]:
        """Every seed's request at once, beside the companions; returns (tokens, cached prompt tokens) per seed."""
        async def main():
            companions = [self._one(engine, self.prompt(text), 99, 24) for text in COMPANIONS]
            return (await asyncio.gather(*[self._one(engine, ids, seed) for seed in seeds], *companions))[: len(seeds)]
        return self.loop.run_until_complete(main())

    def alone(self, engine: Engine, ids: list[int], seed: int | None) -> tuple[list[int], int]:
        return self.loop.run_until_complete(self._one(engine, ids, seed))

    def close(self) -> None:
        for engine in (self.whole, self.chunked):
            engine.shutdown()
        self.loop.close()


@pytest.mark.parametrize("dtype, quantization, mode", [("float32", "int8", "auto"), ("bfloat16", "none", "on")])
def test_seeded_and_greedy_tokens_ignore_what_runs_beside_them(dtype, quantization, mode):
    engines = Engines(dtype, quantization, mode)
    try:
        for engine in (engines.whole, engines.chunked):
            assert engine.core.runner.batch_invariant, "the mode is on: otherwise this test proves nothing"
        ids = engines.prompt("Write a short poem about the sea and the wind, in four lines.")
        seeds = [None, *SEEDS]
        alone = [engines.alone(engines.chunked, ids, seed)[0] for seed in seeds]  # 16-token chunks, no prefix cache
        assert len({tuple(tokens) for tokens in alone}) > len(seeds) // 2, "seeds should give different texts"
        batched = engines.together(engines.whole, ids, seeds)  # whole prompts and prefix-cache hits, 9 through 4 slots
        assert [tokens for tokens, _ in batched] == alone
        whole_blocks = (len(ids) - 1) // 16 * 16
        assert any(cached == whole_blocks > 0 for _, cached in batched), "some request should be served from the prefix cache"
        assert [tokens for tokens, _ in engines.together(engines.chunked, ids, seeds)] == alone
    finally:
        engines.close()


def test_a_prefix_cached_by_one_prompt_path_is_never_served_to_the_other():
    """A short prompt (the row-exact kernel's path, chosen per request by its length) that starts with a long
    prompt's cached blocks (the dequantized matmul's path) computes them itself, and gets the tokens it gets alone
    with no cache in 16-token chunks; run again, it hits its own path's blocks, with the same tokens; so does the
    long prompt."""
    engines = Engines("float32", "int8", "auto")
    try:
        below = engines.whole.core.runner.kernel_prompts_below
        for seed in (None, 3):
            long = engines.prompt(f"[{seed}] " + "Describe Paris in detail. " * 12)  # new to the cache each round
            short = long[:40]
            assert len(short) < below <= len(long)
            reference = {name: engines.alone(engines.chunked, ids, seed)[0] for name, ids in (("long", long), ("short", short))}
            first = {name: engines.alone(engines.whole, ids, seed) for name, ids in (("long", long), ("short", short))}
            again = {name: engines.alone(engines.whole, ids, seed) for name, ids in (("short", short), ("long", long))}
            assert {name: tokens for name, (tokens, _) in first.items()} == reference
            assert {name: tokens for name, (tokens, _) in again.items()} == reference
            assert first["short"][1] == 0 and again["short"][1] == 32 and again["long"][1] > 32, (first, again)
    finally:
        engines.close()


def logits_under(runner: ModelRunner, splits: list[int], beside: list[int], rng: random.Random, kernel: bool = False,
                 long_beside: bool = False) -> list[torch.Tensor]:
    """The logits of a 23-token prompt (slot 0) prefilled in chunks of `splits` tokens, each step beside
    `beside[i]` decoding rows of random lengths (slots 1-4; one of 300 crosses the 256-key span step), then of 4
    decode steps beside random rows. `kernel`: the prompt's rows through the row-exact kernel (StepItem `kernel`);
    `long_beside`: each chunk's step also prefills a 24-token chunk of another prompt (slot 5, the matmul path)."""
    lengths = {}
    for row in range(1, 5):
        lengths[row] = rng.choice((5, 40, 300))
        runner.forward([StepItem(runner.sequence_blocks(row), list(range(100, 100 + lengths[row])), 0)], [])

    def others(count: int) -> list[StepItem]:
        items = [StepItem(runner.sequence_blocks(row), [7], lengths[row]) for row in range(1, 1 + count)]
        for row in range(1, 1 + count):
            lengths[row] += 1
        return items

    prompt, start, out = list(range(2000, 2023)), 0, []
    for index, (size, count) in enumerate(zip(splits, beside)):
        chunk = [StepItem(runner.sequence_blocks(0), prompt[start : start + size], start, start + size == len(prompt), kernel=kernel)]
        if long_beside:  # after the short prompt's chunk: the runner puts the matmul rows first
            chunk.append(StepItem(runner.sequence_blocks(5), list(range(500, 524)), 24 * index, False))
        logits = runner.forward(chunk, others(count))
        start += size
    out.append(logits[0].clone())
    for position, token in enumerate(range(3000, 3004), start=len(prompt)):
        out.append(runner.forward([], [StepItem(runner.sequence_blocks(0), [token], position)] + others(rng.randint(0, 4)))[0].clone())
    return out


def chunkings(rng: random.Random, count: int):
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, 23), rng.randint(1, 3)))
        splits = [b - a for a, b in zip([0, *cuts], [*cuts, 23])]
        yield splits, [rng.randint(0, 4) for _ in splits]


def small_runner(dtype: str, quantization: str, mode: str) -> ModelRunner:
    return runner(dtype, quantization, mode, max_num_seqs=8, max_model_len=1024, max_prefill_tokens=56)[0]  # 64 tokens a step


def prefill(built: ModelRunner, slot: int, length: int) -> None:
    for start in range(0, length, 48):
        built.forward([StepItem(built.sequence_blocks(slot), list(range(100 + start, min(length, start + 48) + 100)), start,
                                False)], [])


def decode_row(built: ModelRunner, rows: list[tuple[int, int]]) -> torch.Tensor:
    """The logits of the first of `rows` (slot, position), decoded in one step beside the others."""
    return built.forward([], [StepItem(built.sequence_blocks(slot), [7], length) for slot, length in rows])[0].clone()


def test_a_decode_row_ignores_longer_rows_beside_it():
    """Decode spans are padded to the step start-up measured (`span_step`), or, a row of few keys, to its own small
    span (`small_spans`, each its own call): rows of 200 keys (where padding to 256 beside longer rows once gave
    other bits) and 700, and of 40 and 100 (their own spans), alone and beside rows of other spans. (The rows
    beside are prefilled once: a row reads only its own slot's blocks, so theirs need not be written again.)"""
    built = small_runner("float32", "int8", "auto")
    assert built.invariance.small_spans, "rows of few keys read their own small spans here"
    for slot, length in ((1, 400), (2, 900), (3, 60), (4, 130)):
        prefill(built, slot, length)
    for length in (200, 700, 40, 100):
        prefill(built, 0, length)
        prefill(built, 5, length + 3)
        alone = decode_row(built, [(0, length)])
        assert torch.equal(alone, decode_row(built, [(0, length), (1, 400), (2, 900)])), length
        assert torch.equal(alone, decode_row(built, [(0, length), (3, 60), (4, 130), (5, length + 3), (2, 900)])), length


def test_a_drafted_sequences_rows_read_its_blocks_once_and_keep_each_positions_bits():
    """A drafted sequence's k + 1 rows read the same blocks, so their keys are gathered once for all of them
    (attention.py `_shared`), and each row's logits are bitwise those of its position decoded alone, one step per
    token (speculation on = off), beside other rows (drafted or not): across a small span's end (64, 256 keys), into
    the rows padded to 512, and past a sliding layer's window moving on by a block (positions 527+)."""
    built = small_runner("float32", "int8", "auto")
    tokens = [7, 11, 12, 13, 14, 15, 16, 17]
    for slot, length in ((1, 300), (2, 700)):
        prefill(built, slot, length)
    for length in (58, 250, 524):
        prefill(built, 0, length)
        blocks = built.sequence_blocks(0)
        one_by_one = torch.cat([built.forward([], [StepItem(blocks, [token], length + i)]) for i, token in enumerate(tokens)])
        step = [StepItem(built.sequence_blocks(1), [5], 300), StepItem(blocks, tokens, length, num_logits=len(tokens)),
                StepItem(built.sequence_blocks(2), [9, 10, 11], 700, num_logits=3)]
        groups = [keys for kind in built._pack([], step).decode.values() for keys in kind]
        assert any(keys.tables.shape[0] == 1 < keys.mask.shape[0] for keys in groups), "drafted rows' keys gathered once"
        assert torch.equal(built.forward([], step)[1 : 1 + len(tokens)], one_by_one), length


@pytest.mark.parametrize("dtype, quantization, mode", [
    ("float32", "int8", "auto"), ("float32", "none", "auto"), ("bfloat16", "none", "on"), ("bfloat16", "per-step", "on"),
])
def test_logits_are_bitwise_equal_however_the_prompt_is_chunked_and_whatever_decodes_beside(dtype, quantization, mode):
    rng = random.Random(0)
    built = small_runner(dtype, quantization, mode)
    assert built.batch_invariant
    alone = logits_under(built, [23], [0], rng)
    for splits, beside in chunkings(rng, 5):
        assert all(torch.equal(a, b) for a, b in zip(logits_under(built, splits, beside, rng), alone)), (splits, beside)


def test_a_short_prompt_through_the_kernel_keeps_its_bits_beside_a_long_prompt_however_chunked():
    """Rows by role with the path chosen per request: a short prompt's rows (StepItem `kernel`, the scheduler's
    choice by its length) run through the row-exact kernel with the decode rows, beside another prompt's chunk
    through the dequantized matmul: its logits are bitwise those of the prompt alone in one chunk, however chunked;
    and they differ from the matmul path's (why the prefix cache keys the two paths apart)."""
    rng = random.Random(1)
    built = small_runner("float32", "int8", "auto")
    assert built.invariance.by_role and 23 < built.kernel_prompts_below
    alone = logits_under(built, [23], [0], rng, kernel=True)
    for splits, beside in chunkings(rng, 4):
        got = logits_under(built, splits, beside, rng, kernel=True, long_beside=True)
        assert all(torch.equal(a, b) for a, b in zip(got, alone)), (splits, beside)
    assert not torch.equal(logits_under(built, [23], [0], rng)[0], alone[0])


def test_without_the_mode_the_same_compositions_differ():
    """The check above can fail: the engine's own kernels, mode off, change a prompt's last bits."""
    rng = random.Random(0)
    built = small_runner("float32", "none", "off")
    alone = logits_under(built, [23], [0], rng)
    assert any(
        not all(torch.equal(a, b) for a, b in zip(logits_under(built, splits, beside, rng), alone))
        for splits, beside in chunkings(rng, 5)
    )


@pytest.mark.skipif(native.native_unavailable() is not None, reason="the native kernels cannot run here")
@pytest.mark.parametrize("layout", [NativeInt8Linear, NativeQ8Linear, Q8Linear, Q4Linear, Q5Linear], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_row_exact_kernels_give_a_row_the_same_bits_alone_and_in_any_batch(layout, dtype):
    """Why the mode calls these untiled (`rowwise`): integer sums are exact and each output's float steps run in one
    order, so row i of M rows equals row i alone, for M across the kernels' tiles (4 rows), the AVX2 loop's panels
    (from 16 rows) and prefill sizes (from 128, where their plain call dequantizes instead)."""
    if layout in (Q8Linear, Q4Linear, Q5Linear) and native.int_dot_unavailable() is not None:
        pytest.skip(native.int_dot_unavailable())
    generator = torch.Generator().manual_seed(0)
    linear = layout(torch.randn(192, 320, generator=generator))
    x = torch.randn(530, 320, generator=generator).to(dtype)
    alone = torch.cat([linear.rowwise(x[i : i + 1]) for i in range(530)])
    for rows in (2, 3, 4, 5, 8, 15, 16, 17, 33, 127, 128, 129, 512, 530):
        assert torch.equal(linear.rowwise(x[:rows]), alone[:rows]), rows
    assert not torch.equal(linear(x[:512]), alone[:512]), "the plain call's prefill path differs: this test can fail"


def row_count_dependent(self, x, out_dtype=torch.float32):
    """A prefill path whose rows depend on the call's row count (its last bits), as oneDNN's do below 12 rows here."""
    out = self.dequantized_call(x, out_dtype)
    return out if x.shape[0] % 2 == 0 else out * (1 + 2**-20)


def test_the_start_up_check_holds_the_prefill_path_to_its_rows_and_can_fail(monkeypatch):
    """By role, prompt rows take the dequantized matmul (the plain call's prefill path), decode rows the row-exact
    kernel: start-up checks the prefill path's rows at every chunk size and place among other rows. A path whose rows
    depend on the row count fails the check, and the mode then runs every row in the row-exact kernel where that
    kernel keeps up on a prefill chunk (`prefill_rowwise`: the AVX2 loop's panels); where it does not (the AVX512
    loop), `auto` leaves the mode off (the next test) and `on` runs every row in the kernel."""
    weights, _ = weights_of("float32", "int8")

    def measured(mode: str):
        return measure_invariance(weights, EngineConfig(
            model=ModelConfig(quantization="int8", batch_invariant=mode),
            scheduler=SchedulerConfig(max_num_seqs=8, max_prefill_tokens=512)))[0]

    invariance = measured("auto")
    assert invariance is not None and invariance.by_role
    monkeypatch.setattr(NativeInt8Linear, "prefill", row_count_dependent)
    mode = "auto" if weights.layers[0].q.prefill_rowwise else "on"
    invariance = measured(mode)
    assert invariance is not None and not invariance.by_role, mode


def test_where_auto_leaves_the_mode_off_start_up_says_what_it_would_cost(caplog, monkeypatch):
    """Where the prefill path's rows are not exact and the row-exact kernel lags on a prefill chunk (the AVX512 loop:
    no panels), `auto` stays off and says by how much the mode would slow a prefill chunk's linears and how to turn
    it on (the figure is a timing: only its presence and type are checked). The AVX512 case is stood in for here by
    its flag."""
    monkeypatch.setattr(NativeInt8Linear, "prefill_rowwise", property(lambda self: False))
    monkeypatch.setattr(NativeInt8Linear, "prefill", row_count_dependent)
    weights, _ = weights_of("float32", "int8")
    with caplog.at_level("INFO", logger="oai_gemma"):
        invariance, cost = measure_invariance(weights, EngineConfig(
            model=ModelConfig(quantization="int8"),
            scheduler=SchedulerConfig(max_num_seqs=8, max_prefill_tokens=512),
        ))
    assert invariance is None and isinstance(cost, float)
    said = [r.getMessage() for r in caplog.records if "batch-invariant mode off (auto)" in r.getMessage()]
    assert said and "--batch-invariant on" in said[0] and "slower" in said[0], caplog.text


@pytest.mark.parametrize("invariant", [True, False], ids=["mode", "plain"])
def test_a_decode_row_alone_is_the_row_beside_others_in_bf16(invariant):
    """SDPA's CPU kernel computes a decode call of fewer (row, KV head) pairs than threads another way: one bf16 ulp
    in ~50,000 outputs, which turned greedy texts on an AVX512-bf16 EPYC (issue 40's acceptance). In the mode each
    call has `attention_rows` rows at least (the row repeated): 600 random rows of the 270M's layout (4 query
    heads on 1 KV head of 256) over 16 keys, each alone, equal their rows of one call. Without it (`plain`), on 2
    threads of that EPYC (torch 2.13), some differ: the check can fail there (elsewhere `plain` skips, saying so)."""
    from oai_gemma.engine.cache.kv_cache import KVCache
    from oai_gemma.engine.model.attention import DecodeKeys, decode_attention
    from oai_gemma.engine.shape import TextShape

    if torch.get_num_threads() < 2 and not invariant:
        pytest.skip("one thread: every call is computed alike")
    generator = torch.Generator().manual_seed(5)
    rows, span = 600, 16
    shape = TextShape(hidden=64, intermediate=128, heads=4, kv_heads=1, head_dim=256, vocab=1000, sliding_window=512,
                      sliding=(False,), rms_eps=1e-6, query_pre_attn_scalar=256, rope=None, final_softcap=None)
    cache = KVCache(shape, num_blocks=rows * span // 16, dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=generator) * 3)
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=generator))
    q = (torch.randn(rows, 4, 256, generator=generator) * 3).to(torch.bfloat16)
    tables = torch.arange(rows * span // 16).view(rows, span // 16)
    mask = torch.arange(span)[None, :] < torch.randint(1, span + 1, (rows, 1), generator=generator)

    def attend(ix) -> torch.Tensor:
        return decode_attention(cache, 0, [DecodeKeys(tables[ix], mask[ix])], q[ix], 0.0625, invariant)

    together = attend(slice(None))
    differ = sum(not torch.equal(attend(slice(r, r + 1))[0], together[r]) for r in range(rows))
    if not invariant and differ == 0:
        pytest.skip("this CPU's SDPA computes a one-row call as it computes the row beside others")
    assert (differ == 0) if invariant else differ > 0, differ
