"""Stop strings never leak, however the text is split into deltas."""

import pytest

from oai_gemma.engine.sampling.detokenizer import StopMatcher


def run(stops, deltas):
    matcher, out = StopMatcher(tuple(stops)), []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_stop_string_split_across_deltas_is_cut_and_never_emitted(split):
    text = "Hello world. END of story"
    deltas = [text[i : i + split] for i in range(0, len(text), split)]
    assert run(["END"], deltas) == ("Hello world. ", True)


def test_held_back_prefix_that_is_no_stop_is_emitted_at_the_end():
    assert run(["ENDING"], ["the END"]) == ("the END", False)


def test_earliest_of_several_stops_wins():
    assert run(["b", "a"], ["xxab"]) == ("xx", True)


def test_nothing_after_a_partial_prefix_is_lost_when_it_diverges():
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("ART") == ("START", False)


def test_no_stops_passes_text_through():
    assert StopMatcher(()).feed("anything") == ("anything", False)
