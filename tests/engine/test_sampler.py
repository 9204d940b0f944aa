"""The batched sampler on small hand-made logits."""

import torch

from oai_gemma.engine.sampling.sampler import PlainRow, RowRandom, sample
from oai_gemma.engine.types import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]], dtype=torch.bfloat16)


def params(**kw):
    return SamplingParams(max_tokens=8, **kw)


def draw(logits, ps, seeds, outputs=None, stops=frozenset()):
    outputs = outputs or [[] for _ in ps]
    return sample(logits.clone(), [PlainRow(p, RowRandom(s), [], o) for p, s, o in zip(ps, seeds, outputs)], stops)


def test_greedy_rows_take_the_largest_logit():
    assert draw(LOGITS, [params(temperature=0.0)] * 2, [None, None]) == [1, 3]


def test_top_k_one_is_greedy_at_any_temperature():
    assert draw(LOGITS, [params(temperature=2.0, top_k=1)] * 2, [1, 2]) == [1, 3]


def test_tiny_top_p_keeps_only_the_most_likely_token():
    for seed in range(20):
        assert draw(LOGITS, [params(temperature=1.0, top_p=0.01)] * 2, [seed, seed]) == [1, 3]


def test_a_seeded_row_draws_the_same_alone_or_beside_other_rows():
    seeded = params(temperature=1.0, seed=5)
    flat = torch.zeros(1, 4, dtype=torch.bfloat16)
    alone = [draw(flat, [seeded], [5])[0] for _ in range(5)]
    together = [
        sample(torch.zeros(3, 4, dtype=torch.bfloat16), [
            PlainRow(params(temperature=0.0), RowRandom(None)), PlainRow(seeded, RowRandom(5)),
            PlainRow(params(temperature=1.0), RowRandom(None)),
        ])[1]
        for _ in range(5)
    ]
    assert together == alone


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]])
    rng = RowRandom(1234)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sample(logits.clone(), [PlainRow(params(temperature=1.0), rng)])[0]] += 1
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(counts / 3000, expected, atol=0.03), (counts / 3000, expected)
    assert counts[3] == 0


def test_frequency_penalty_turns_greedy_away_from_a_repeated_token():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    assert draw(logits, [params(temperature=0.0)], [None], [[0, 0]]) == [0]
    assert draw(logits, [params(temperature=0.0, frequency_penalty=0.5)], [None], [[0, 0]]) == [1]


def test_presence_penalty_counts_a_token_once():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    assert draw(logits, [params(temperature=0.0, presence_penalty=0.4)], [None], [[0, 0, 0]]) == [0]
    assert draw(logits, [params(temperature=0.0, presence_penalty=0.6)], [None], [[0, 0, 0]]) == [1]


def test_logit_bias_minus_100_bans_and_plus_100_forces():
    assert draw(LOGITS[:1], [params(temperature=0.0, logit_bias=((1, -100.0),))], [None]) == [2]
    assert draw(LOGITS[:1], [params(temperature=0.0, logit_bias=((0, 100.0),))], [None]) == [0]


def test_repetition_penalty_divides_seen_positive_logits():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    row = PlainRow(params(temperature=0.0, repetition_penalty=1.5), RowRandom(None), prompt_ids=[0])
    assert sample(logits.clone(), [row]) == [1]  # 2.0 / 1.5 < 1.5
    row = PlainRow(params(temperature=0.0, repetition_penalty=1.2), RowRandom(None), prompt_ids=[0])
    assert sample(logits.clone(), [row]) == [0]  # 2.0 / 1.2 > 1.5


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    assert draw(logits, [params(temperature=0.0, min_tokens=2)], [None], [[3]], stops=frozenset({0})) == [1]
    assert draw(logits, [params(temperature=0.0, min_tokens=2)], [None], [[3, 3]], stops=frozenset({0})) == [0]


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[3.0, 2.9, -2.0, -2.0]])
    seen = {draw(logits, [params(temperature=1.0, min_p=0.5)], [seed])[0] for seed in range(40)}
    assert seen == {0, 1}
