"""Speculative decoding's pieces on their own (no model): the draft sources, the verifier's exactness (the same
tokens as without drafts for the same uniforms; the target distribution, chi-square), the planner's budget, and
the scheduler's roll-back of rejected positions (blocks, prefix index)."""

import random

import pytest
import torch

from oai_gemma.engine.cache.block_pool import BlockPool
from oai_gemma.engine.config import SpeculativeConfig
from oai_gemma.engine.scheduler import Scheduler
from oai_gemma.engine.sequence import Sequence, Step, StepItem
from oai_gemma.engine.sampling.sampler import RowRandom, sample_with_logprobs
from oai_gemma.engine.speculative.lookup import PromptLookup
from oai_gemma.engine.speculative.planner import Speculator, fair_shares
from oai_gemma.engine.speculative.prediction import PredictionDraft, prediction_counts
from oai_gemma.engine.speculative.verify import accept, sampler_rows
from oai_gemma.engine.types import GenerationRequest, SamplingParams

VOCAB = 6


def sequence(prompt=(1, 2, 3), seed=None, max_tokens=64, prediction=(), speculator=None, **params) -> Sequence:
    request = GenerationRequest("r", list(prompt), SamplingParams(max_tokens=max_tokens, seed=seed, **params), prediction=prediction)
    seq = Sequence(request=request, sink=None, random=RowRandom(seed), detokenizer=None, stopper=None, cache_keys=list(prompt))
    seq.speculation = (speculator or Speculator(SpeculativeConfig())).start(request, grammar=False)
    return seq


def verify(seqs: list[Sequence], logits: torch.Tensor, speculator: Speculator):
    """One step's sampling and acceptance over `logits` (a row per sequence, and one per draft)."""
    items = [StepItem([0], [seq.output_ids[-1] if seq.output_ids else 0, *seq.draft], 0) for seq in seqs]
    step = Step([], items, [], seqs)
    rows = sampler_rows(seqs)
    tokens, logprobs = sample_with_logprobs(logits, rows)
    return accept(seqs, step, tokens, logprobs, speculator), items


# ---- draft sources -------------------------------------------------------------------------------


def test_prompt_lookup_drafts_what_followed_the_latest_occurrence_of_the_longest_match():
    lookup = PromptLookup(n_max=3, n_min=2)
    lookup.sync([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 4, 6, 7])
    assert lookup.propose(3) == [2, 3, 4]  # "6 7" last followed by 2 (the 3-gram "4 6 7" never occurred before)
    lookup.sync([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 4, 6, 7, 2, 3, 4, 5, 6, 7, 8])
    assert lookup.propose(2) == [9, 1]  # the 3-gram "6 7 8" occurred once, at the start
    assert PromptLookup(3, 2).propose(4) == []
    lonely = PromptLookup(3, 2)
    lonely.sync([1, 2, 3, 4])
    assert lonely.propose(4) == []  # no n-gram of its end occurred before
    loop = PromptLookup(3, 2)
    loop.sync([4, 1, 2, 1, 2])
    assert loop.propose(5) == [1, 2, 1, 2, 1]  # a repeat that reaches the end goes on with its period


def test_a_prediction_is_followed_and_realigned_after_an_edit():
    predicted = (10, 11, 12, 13, 14, 15, 16, 17)
    draft = PredictionDraft(predicted, n_max=3, n_min=2)
    assert draft.propose([], 4) == [10, 11, 12, 13]
    assert draft.propose([10, 11, 99], 4) == []  # lost: "11 99" is not in the prediction
    assert draft.propose([10, 11, 99, 13, 14], 3) == [15, 16, 17]  # "13 14" found again: aligned after it


@pytest.mark.parametrize("prediction, output, counts", [
    ((10, 11, 12, 13, 14), (10, 11, 12, 13, 14), (5, 0)),  # copied whole
    ((10, 11, 12, 13, 14, 15, 16, 17), (10, 11, 99, 13, 14, 15, 16, 17), (7, 1)),  # one token replaced
    ((10, 11, 12, 13), (10, 11, 50, 51, 52, 12, 13), (4, 0)),  # an insertion: every predicted token still appears
    ((10, 11, 12, 13, 14, 15), (10, 11, 14, 15), (4, 2)),  # a deletion
    ((10, 11, 12, 13), (10, 11), (2, 2)),  # the output stopped early (max_tokens): the rest did not appear
    ((10, 11, 12), (), (0, 3)),
    ((7, 7, 7, 7), (7, 7), (2, 2)),  # each predicted token matched at most once
    ((1, 2, 3, 4, 5, 6), (4, 5, 6, 1, 2, 3), (3, 3)),  # moved blocks: an alignment keeps one order
])
def test_prediction_counts_are_the_predicted_tokens_that_appear_in_the_output_and_the_rest(prediction, output, counts):
    assert prediction_counts(prediction, list(output)) == counts


class StandInGrammar:
    """A stand-in for a sequence's DocumentMatcher: it forces `forced`, then takes only the tokens in `allowed`."""

    def __init__(self, forced: list[int], allowed: set[int]):
        self.forced, self.allowed = forced, allowed

    def forced_run(self, most: int) -> list[int]:
        return self.forced[:most]

    def grammatical(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and (tokens[n] in self.allowed if n >= len(self.forced) else tokens[n] == self.forced[n]):
            n += 1
        return n


def test_under_a_grammar_lookup_goes_on_after_the_forced_tokens_while_the_grammar_takes_it():
    speculator = Speculator(SpeculativeConfig())
    seq = sequence(prompt=(5, 6, 7, 8, 9, 1))
    seq.speculation = speculator.start(seq.request, grammar=True)
    seq.output_ids, seq.matcher = [2], StandInGrammar(forced=[5, 6], allowed={7, 8})
    spec = seq.speculation
    assert spec.propose(seq, 32) == [5, 6, 7, 8]  # "5 6" followed by 7 8 9 1; the grammar stops it at 9
    assert spec.sure == 2
    spec.verified(4, 3)  # the forced tokens and 7 kept: only the guess counts towards the draft length
    assert spec.k == 2 and spec.rate == pytest.approx(0.85)
    spec.verified(4, 1)  # a forced token rejected (the model chose another tokenization)
    assert spec.k == 1
    spec.rate = 0.1  # few guesses kept: the forced tokens still come, guesses only every few steps
    assert spec.propose(seq, 32) == [5, 6]
    seq.matcher = StandInGrammar(forced=[], allowed=set())
    assert spec.propose(seq, 32) == []


# ---- the verifier --------------------------------------------------------------------------------


def toy_logits(tokens: list[int]) -> torch.Tensor:
    """A deterministic 'model': the next token's logits from the last two tokens."""
    generator = torch.Generator().manual_seed(hash(tuple(tokens[-2:])) % 2**31)
    return torch.randn(VOCAB, generator=generator) * 2


def generate(seed, params: dict, draft_with: random.Random | None, length: int = 24) -> list[int]:
    """`length` tokens from the toy model, one per step, or with drafts (right or wrong at random) verified."""
    speculator = Speculator(SpeculativeConfig())
    seq = sequence(seed=seed, speculator=speculator, **params)
    while len(seq.output_ids) < length:
        if draft_with is not None:
            seq.draft = [draft_with.randrange(VOCAB) for _ in range(draft_with.randrange(4))]
        context = seq.prompt_ids + seq.output_ids
        logits = torch.stack([toy_logits(context + seq.draft[:j]) for j in range(len(seq.draft) + 1)])
        runs, _ = verify([seq], logits, speculator)
        seq.output_ids += [token for token, _, _ in runs[0]]
    return seq.output_ids[:length]


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5, "min_p": 0.05},
    {"temperature": 1.2, "repetition_penalty": 1.3, "logit_bias": ((2, 1.5),)},
])
def test_drafts_right_or_wrong_give_the_tokens_of_plain_decoding(params):
    for seed in range(3):
        plain = generate(seed, params, None)
        assert generate(seed, params, random.Random(seed)) == plain
        assert generate(seed, params, random.Random(seed + 100)) == plain


def test_verified_sampling_keeps_the_target_distribution():
    """Chi-square of the first two emitted tokens over 6,000 draws against the target's own distribution, with
    a draft that is likely, and a penalty that makes the second position depend on the first draft."""
    row0, row1 = torch.tensor([1.0, 2.0, 0.5, 0.0, -1.0, 1.5]), torch.tensor([0.3, 0.2, 2.0, 1.0, 0.0, -0.5])
    params = {"temperature": 1.0, "presence_penalty": 1.0}
    speculator = Speculator(SpeculativeConfig())
    draws = 200
    firsts, seconds = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for r in range(30):  # seeded: an unseeded request draws from the OS, and 1 run in 1,000 fails a p = 0.001 test
        seqs = [sequence(prompt=(3,), seed=r * draws + i, **params) for i in range(draws)]
        for seq in seqs:
            seq.output_ids, seq.draft = [3], [1, 2]
        logits = torch.stack([row0, row1, row1] * draws)
        runs, _ = verify(seqs, logits, speculator)
        for run in runs:
            firsts[run[0][0]] += 1
            if run[0][0] == 1:
                seconds[run[1][0]] += 1
    p0 = torch.softmax(row0 - torch.tensor([0, 0, 0, 1.0, 0, 0]), 0)  # 3 is in the output: presence penalty
    p1 = torch.softmax(row1 - torch.tensor([0, 1.0, 0, 1.0, 0, 0]), 0)  # and so is the accepted draft 1
    for counts, p in ((firsts, p0), (seconds, p1)):
        expected = p * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (chi2, counts, expected)  # 5 degrees of freedom, p = 0.001
    assert speculator.num_drafts == 30 * draws and speculator.accepted_per_pos == [int(firsts[1]), int(seconds[2])]


def test_the_step_item_is_cut_back_to_the_accepted_positions():
    speculator = Speculator(SpeculativeConfig())
    seq = sequence(temperature=0.0)
    seq.output_ids, seq.draft = [4], [1, 2, 3]
    logits = torch.full((4, VOCAB), -5.0)
    for row, token in enumerate([1, 2, 5, 0]):  # the model agrees with drafts 1 and 2, then says 5
        logits[row, token] = 5.0
    runs, items = verify([seq], logits, speculator)
    assert [(t, drafted) for t, _, drafted in runs[0]] == [(1, True), (2, True), (5, False)]
    assert items[0].token_ids == [4, 1, 2] and seq.draft == []
    assert speculator.accepted_per_pos == [1, 1, 0]


# ---- the planner ---------------------------------------------------------------------------------


def running(n: int, output: list[int], max_tokens: int = 64) -> list[Sequence]:
    seqs = [sequence(prompt=(7, 8, 9) * 4, max_tokens=max_tokens) for _ in range(n)]
    for seq in seqs:
        seq.output_ids = list(output)
        seq.num_computed = 12 + len(output) - 1
    return seqs


def test_a_full_batch_or_a_long_prefill_chunk_leaves_no_drafts_and_drafts_stop_short_of_max_tokens():
    speculator = Speculator(SpeculativeConfig(budget=8))
    full = running(8, [7])
    speculator.plan(full, 1000)
    assert all(seq.draft == [] for seq in full)
    few = running(2, [7])
    speculator.plan(few, 1000)
    assert [len(seq.draft) for seq in few] == [3, 3]  # each wants its first draft's length (4): the 6 left, shared
    assert few[0].draft == [8, 9, 7]
    beside_prefill = running(2, [7])
    speculator.plan(beside_prefill, 1000, prefill_tokens=5)
    assert [len(seq.draft) for seq in beside_prefill] == [1, 0]  # a prefill chunk's tokens count against the budget
    speculator.plan(beside_prefill, 1000, prefill_tokens=64)
    assert all(seq.draft == [] for seq in beside_prefill)
    near_end = running(1, [7], max_tokens=3)
    speculator.plan(near_end, 1000)
    assert near_end[0].draft == [8]  # two more tokens allowed: one draft and the model's own
    opted_out = sequence()
    assert Speculator(SpeculativeConfig(method="off")).start(opted_out.request, grammar=False) is None


@pytest.mark.parametrize("wants, total, shares", [
    ([20, 20, 20, 20], 40, [10, 10, 10, 10]),  # copy-heavy streams alike: equal parts
    ([2, 30, 30], 20, [2, 9, 9]),  # a small want is met whole, the others split the rest
    ([30, 1, 30], 7, [3, 1, 3]),  # order does not matter: only the wants do
    ([5, 5], 40, [5, 5]),  # room for all: every want met
    ([4, 4, 4], 5, [2, 2, 1]),  # parts rounded up while the total lasts, never past it
    ([], 8, []),
])
def test_the_draft_budget_is_shared_max_min_fairly(wants, total, shares):
    assert fair_shares(wants, total) == shares and sum(shares) <= total


def test_one_copy_heavy_stream_cannot_take_the_whole_budget_of_a_step():
    speculator = Speculator(SpeculativeConfig(budget=16, k=32))
    seqs = running(4, [7, 8, 9, 7])  # each repeats its prompt: prompt lookup would draft up to k
    for seq in seqs:
        seq.speculation = speculator.start(seq.request, grammar=False)
        seq.speculation.k = 32
    speculator.plan(seqs, 1000)
    assert [len(seq.draft) for seq in seqs] == [3, 3, 3, 3]  # 16 - 4 decode rows, shared


# ---- the scheduler: roll-back ----------------------------------------------------------------------


class FixedDrafts:
    """A speculator that gives every decoding sequence the same draft."""

    def __init__(self, draft):
        self.draft = draft

    def plan(self, decoding, max_len, prefill_tokens=0):
        for seq in decoding:
            seq.draft = list(self.draft)


def test_rejected_positions_are_rolled_back_never_indexed_and_every_block_comes_back():
    pool = BlockPool(32, 4)
    scheduler = Scheduler(pool, 2, 100, 1000, speculator=FixedDrafts([21, 22, 23, 24, 25, 26]))
    free = pool.available
    seq = sequence(prompt=(1, 2, 3, 4, 5, 6), max_tokens=16)
    scheduler.add(seq)
    scheduler.advance(scheduler.schedule(0.0))  # the prompt: blocks [1 2 3 4] [5 6 . .]
    seq.output_ids.append(20)
    step = scheduler.schedule(0.0)
    item = step.decodes[0]
    assert item.token_ids == [20, 21, 22, 23, 24, 25, 26] and item.start == 6 and item.num_logits == 7
    assert len(seq.blocks) == 4  # positions 6..12 need blocks 1..3
    del item.token_ids[3:]  # the verifier kept 21 and 22, then the model said 30
    scheduler.advance(step)
    seq.output_ids += [21, 22, 30]
    assert seq.num_computed == 9  # 20, 21, 22 computed; 30 is the next step's
    indexed = {pool.hash_of.get(block) is not None for block in seq.blocks}
    assert pool.hash_of.get(seq.blocks[1]) is not None  # [5 6 20 21] is all accepted: offered for reuse
    assert pool.hash_of.get(seq.blocks[2]) is None  # [22 (23 24 25: rejected)] is not
    assert pool.key_of[seq.blocks[1]][1] == (5, 6, 20, 21) and indexed
    scheduler.finish(seq)
    assert pool.available == free
