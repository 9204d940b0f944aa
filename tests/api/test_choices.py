"""The choice assembler (`api/choices.py`), pure: token events in, the deltas every wire format encodes out."""

import asyncio

import pytest

from oai_gemma.api.choices import ChoiceAssembler, Finish, TextDelta, ToolCallArguments, ToolCallStart, assemble
from oai_gemma.api.errors import APIError
from oai_gemma.chat.tools import Function, ToolPlan
from oai_gemma.engine.types import TokenEvent

WEATHER = Function("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}})


def event(text, finish=None, index=0, logprob=None, token=1):
    return TokenEvent("r", token, text, 0.0, finish, index, logprob=logprob, top_logprobs=[] if logprob else None)


def feed_all(assembler, *events):
    return [delta for e in events for delta in assembler.feed(e)]


def test_text_streams_as_text_deltas_and_ends_with_finish():
    a = ChoiceAssembler(0)
    deltas = feed_all(a, event("Hel"), event("lo"), event("", "stop"))
    assert deltas == [TextDelta("Hel"), TextDelta("lo"), Finish("stop")]
    assert (a.text, a.finish_reason, a.done, a.tool_calls) == ("Hello", "stop", True, None)


def test_an_event_with_no_text_sends_nothing_and_its_token_goes_with_the_next_delta():
    a = ChoiceAssembler(0, logprobs=True)
    first, second = event("", logprob=-1.0, token=5), event("é", logprob=-2.0, token=6)
    assert a.feed(first) == []
    assert a.feed(second) == [TextDelta("é", (first, second))]
    assert a.tokens == [first, second]


def test_events_after_the_end_are_dropped():
    a = ChoiceAssembler(0)
    feed_all(a, event("x", "length"))
    assert a.feed(event("late")) == [] and a.text == "x"


def test_a_forced_call_streams_as_start_then_arguments_and_finishes_as_tool_calls():
    a = ChoiceAssembler(0, ToolPlan([WEATHER], [WEATHER], parallel=False))
    deltas = feed_all(a, event('{"name": "get_weather", "parameters": {"city": '), event('"Paris"}}'), event("more"))
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    arguments = "".join(d.arguments for d in deltas if isinstance(d, ToolCallArguments))
    assert [(s.call, s.name) for s in starts] == [(0, "get_weather")] and starts[0].id.startswith("call_")
    assert arguments == '{"city": "Paris"}'
    assert deltas[-1] == Finish("tool_calls") and a.finish_reason == "tool_calls"
    assert [c.name for c in a.tool_calls] == ["get_weather"] and a.text == ""


def test_prose_with_tools_offered_is_text():
    a = ChoiceAssembler(0, ToolPlan([WEATHER], None, parallel=True))
    deltas = feed_all(a, event("It is "), event("sunny.", "stop"))
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "It is sunny."
    assert a.finish_reason == "stop" and a.tool_calls is None


def test_lead_text_goes_out_with_the_first_event_even_without_text():
    a = ChoiceAssembler(0, lead="prompt ")
    assert feed_all(a, event(""), event("x", "stop")) == [TextDelta("prompt "), TextDelta("x"), Finish("stop")]


def test_a_failed_choice_raises_its_error_after_its_last_deltas():
    assemblers = {0: ChoiceAssembler(0), 1: ChoiceAssembler(1)}

    async def events():
        yield 0, event("a")
        yield 1, TokenEvent("r", None, "", 0.0, "timeout", 1, error="too slow")
        yield 0, event("never")

    async def run():
        seen = []
        with pytest.raises(APIError) as info:
            async for assembler, deltas in assemble(events(), assemblers):
                seen.append((assembler.index, deltas))
        return seen, info.value

    seen, error = asyncio.run(run())
    assert seen == [(0, [TextDelta("a")]), (1, [])]
    assert error.status == 504 and assemblers[1].failure is not None


def test_assemble_stops_once_every_choice_is_done():
    assemblers = {0: ChoiceAssembler(0), 1: ChoiceAssembler(1)}
    pulled = []

    async def events():
        for item in ((0, event("a", "stop")), (1, event("b", "length", index=1)), (0, event("extra"))):
            pulled.append(item)
            yield item

    async def run():
        return [deltas async for _, deltas in assemble(events(), assemblers)]

    assert asyncio.run(run()) == [[TextDelta("a"), Finish("stop")], [TextDelta("b"), Finish("length")]]
    assert len(pulled) == 2
