"""`cpu.Turns`: engines' steps and a load take the cores in turns, in arrival order; a load hands them over at its
`offer`s (issue 41: a model loading beside streaming ones). Orders of events, no timings."""

import threading
import time

import pytest
import torch

from oai_gemma.cpu import Turns


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


def step_thread(turns: Turns, events: list, name: str, steps: int = 1) -> threading.Thread:
    """An engine thread stepping `steps` times back to back (nothing between its turns, as the engine loop)."""
    def run() -> None:
        for i in range(steps):
            with turns.step():
                events.append(f"{name}{i}")

    return threading.Thread(target=run)


def test_a_load_hands_the_cores_to_a_waiting_step_at_an_offer_and_gets_them_back():
    turns, events = Turns(), []
    step = step_thread(turns, events, "step")

    def load() -> None:
        with turns.load():
            events.append("unit 1")
            step.start()
            until(lambda: turns.waiting == 1)
            turns.offer()  # the last step took 0 s: its share is spent
            events.append("unit 2")

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    step.join()
    assert events == ["unit 1", "step0", "unit 2"]


def test_a_load_keeps_the_cores_until_its_share_of_a_step_is_spent_or_while_nothing_waits():
    turns, events = Turns(), []
    turns.step_seconds = 3600.0  # a load's turn may last half an hour
    step = step_thread(turns, events, "step")

    def load() -> None:
        with turns.load():
            turns.offer()  # nothing waits
            events.append("unit 1")
            step.start()
            until(lambda: turns.waiting == 1)
            turns.offer()  # a step waits, but the share is not spent
            events.append("unit 2")

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    step.join()
    assert events == ["unit 1", "unit 2", "step0"]


def test_a_step_that_asks_again_at_once_goes_behind_a_waiting_load():
    """A FIFO, not a lock: an engine stepping back to back would take a lock again before the load's thread woke."""
    turns, events = Turns(), []
    gate = threading.Event()

    def run() -> None:
        with turns.step():
            events.append("step0")
            gate.wait()
        for i in (1, 2):
            with turns.step():
                events.append(f"step{i}")

    def load() -> None:
        with turns.load():
            events.append("load")

    engine, loader = threading.Thread(target=run), threading.Thread(target=load)
    engine.start()
    until(lambda: events == ["step0"])
    loader.start()
    until(lambda: turns.waiting == 1)
    gate.set()
    engine.join()
    loader.join()
    assert events == ["step0", "load", "step1", "step2"]


def test_two_engines_stepping_back_to_back_alternate():
    turns, events = Turns(), []
    gate = threading.Event()

    def first() -> None:
        with turns.step():
            gate.wait()
        for i in range(3):
            with turns.step():
                events.append(f"a{i}")

    engines = [threading.Thread(target=first), step_thread(turns, events, "b", 3)]
    engines[0].start()
    until(lambda: turns.waiting == 0 and turns._serving == 0 and turns._next == 1)
    engines[1].start()
    until(lambda: turns.waiting == 1)
    gate.set()
    for engine in engines:
        engine.join()
    assert events == ["b0", "a0", "b1", "a1", "b2", "a2"]


def test_an_offer_off_the_loading_thread_does_nothing():
    turns, events = Turns(), []
    holding, release = threading.Event(), threading.Event()

    def load() -> None:
        with turns.load():
            holding.set()
            release.wait()
            events.append("load")

    loader = threading.Thread(target=load)
    loader.start()
    holding.wait()
    turns.offer()  # this thread loads nothing: no turn given or taken (it would wait for ever for one)
    release.set()
    loader.join()
    assert events == ["load"] and turns.waiting == 0


def test_a_load_steps_aside_for_a_stretch_with_no_units_and_takes_a_turn_again_after():
    turns, events = Turns(), []
    turns.step_seconds = 3600.0  # no offer would hand the cores over
    step = step_thread(turns, events, "step")
    aside = threading.Event()

    def load() -> None:
        with turns.load():
            step.start()
            until(lambda: turns.waiting == 1)
            with turns.aside():  # the step runs meanwhile
                aside.set()
                until(lambda: events == ["step0"])
                events.append("aside")
            events.append("unit")

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    step.join()
    assert aside.is_set() and events == ["step0", "aside", "unit"] and turns.waiting == 0


def test_a_read_in_many_units_reads_the_same_bytes(tmp_path, monkeypatch):
    """`read_rows` reads READ_BYTES at a time (a unit of a load each, so a 300 MB lm_head is no single stall)."""
    import os

    from oai_gemma.engine.model import layout

    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(layout, "READ_BYTES", 7)
    offers = []
    monkeypatch.setattr(layout.TURNS, "offer", lambda: offers.append(1))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert bytes(layout.read_rows(fd, 3, 990).numpy()) == data[3:993]
    finally:
        os.close(fd)
    assert len(offers) == 142  # ceil(990 / 7)


def quantized_linears():
    """One linear of each native layout (256 outputs of 128 inputs), where its kernel runs here."""
    from oai_gemma.engine.ops import native
    from oai_gemma.engine.ops.int_dot import Q4Linear, Q8Linear
    from oai_gemma.engine.ops.quantized import NativeInt8Linear, NativeQ8Linear

    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    kinds = [] if native.native_unavailable() else [NativeInt8Linear, NativeQ8Linear]
    kinds += [] if native.int_dot_unavailable() else [Q8Linear, Q4Linear]
    return [kind(weight) for kind in kinds]


@pytest.mark.parametrize("linear", quantized_linears(), ids=lambda linear: type(linear).__name__)
@pytest.mark.parametrize("rows", [1, 4, 128])
def test_a_loads_quantized_call_goes_in_spans_of_outputs_an_offer_before_each_with_the_same_bits(linear, rows, monkeypatch):
    """The 4B's 128-row gate and up call of its warm-up is one native call of 6.7G multiply-adds: on a load's thread
    it goes in spans of outputs (ops/quantized.py `in_units`), so streaming models' steps wait for one span at most."""
    from oai_gemma.engine.ops import quantized

    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    # a prefill chunk's dequantized call (the integer dot-product layouts; int8's goes in tiles of its own), else the kernel
    prefill = rows >= quantized.KERNEL_ROWS and not isinstance(linear, quantized.NativeInt8Linear)
    call = linear if prefill else linear.rowwise
    alone = call(x)  # off a load's thread: one call
    turns, offers, events = Turns(), [], []
    monkeypatch.setattr(quantized, "TURNS", turns)
    monkeypatch.setattr(quantized, "UNIT_MACS", rows * 128 * 64)  # spans of 64 outputs: 4 of them
    monkeypatch.setattr(turns, "offer", lambda: offers.append(turns.loading))  # counted, never handed over
    step, found = step_thread(turns, events, "step"), {}

    def load() -> None:
        with turns.load():
            found["alone"] = call(x)  # nothing waits: one call
            step.start()
            until(lambda: turns.waiting == 1)
            found["beside"] = call(x)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    step.join()
    assert offers == [True] * 4 and torch.equal(found["alone"], alone) and torch.equal(found["beside"], alone)


def test_quantized_weights_are_written_in_units(tmp_path, monkeypatch):
    """`write_safetensors` writes READ_BYTES at a time, an offer before each (a first load's 2.5 GB of 4B weights)."""
    from safetensors.torch import load_file

    from oai_gemma.engine.model import layout

    tensors = {"a": torch.arange(100, dtype=torch.int32), "b": torch.ones(3, 5), "empty": torch.empty(0)}
    monkeypatch.setattr(layout, "READ_BYTES", 64)
    offers = []
    monkeypatch.setattr(layout.TURNS, "offer", lambda: offers.append(1))
    layout.write_safetensors(tmp_path / "w.safetensors", tensors, {"kind": "test"})
    read = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(read[name], tensor) for name, tensor in tensors.items())
    assert len(offers) == 7 + 1  # ceil(400 / 64) + ceil(60 / 64)


def test_a_load_beside_the_steps_computes_under_the_process_matmul_settings():
    """A unit that changes a process-wide matmul setting (the bf16 vision tower's attention) and a load's stretch
    beside the steps (`aside`: its invariance check's timed runs, a float weight's pack) never overlap: the load
    waits for the setting to be given back, and computes under the process's own."""
    from oai_gemma.cpu import TURNS
    from oai_gemma.engine.model.vision_weights import mkldnn_fp32_precision

    settings, seen = torch.backends.mkldnn.matmul, []

    def load() -> None:
        with TURNS.load(), TURNS.aside():
            seen.append(settings.fp32_precision)

    default = settings.fp32_precision
    with mkldnn_fp32_precision("bf16"):
        loader = threading.Thread(target=load)
        loader.start()
        loader.join(0.5)
        assert loader.is_alive() and not seen, "the load's stretch waits while the setting is changed"
    loader.join(30)
    assert seen == [default] and settings.fp32_precision == default
