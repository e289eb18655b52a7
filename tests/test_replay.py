"""Lookup drafting replayed over finished greedy outputs (specjax.speculate.replay) against the
compiled loop's own counts, and the copy oracle as a bound on every NGram setting."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import tiny_model

import specjax
from specjax.speculate.replay import copy_oracle_accepts, ngram_replay

# A vocabulary of 12 tokens: greedy outputs of a random model revisit tokens and short n-grams
# often, so lookups match, and are right only some of the time. Token 5 ends a row.
SMALL = tiny_model(seed=5, vocab_size=12, eos_token_ids=(5,))
PROMPTS = [
    [1, 2, 3, 4, 1, 2, 3, 7, 8],
    [9, 10, 11, 0, 9, 10],
    [4, 4, 6, 7, 8, 6, 7, 8, 1, 2, 6, 7, 11, 3, 2],
    [2, 0],
]


@pytest.mark.parametrize("k, n_max, n_min", [(1, 1, 1), (3, 4, 1), (5, 3, 2), (8, 4, 3)])
def test_ngram_replay_matches_the_loop(k, n_max, n_min):
    """The replay of a plain greedy output takes exactly the steps and acceptances the compiled
    loop counts when it runs NGram on the same prompts."""
    plain = specjax.generate(SMALL, PROMPTS, max_new_tokens=40)
    lookup = specjax.generate(SMALL, PROMPTS, proposer=specjax.NGram(k, n_max, n_min), max_new_tokens=40)
    assert lookup.tokens == plain.tokens  # lossless, so one plain run is the truth for any setting
    assert any(len(t) < 40 for t in plain.tokens)  # some row stops at its EOS
    m = lookup.metrics
    for row, (prompt, output) in enumerate(zip(PROMPTS, plain.tokens, strict=True)):
        drafted, accepts = ngram_replay(prompt, output, k, n_max, n_min)
        assert len(accepts) == m.steps[row]
        assert drafted.sum() == m.drafted[row] and (drafted > 0).sum() == m.drafting_steps[row]
        # The loop's last step may count drafts that agree past the output's end (its EOS or the
        # limit), tokens the replay never sees; every earlier step must agree exactly.
        assert accepts[-1] <= m.accepted[row] - accepts[:-1].sum() <= k
    assert 0 < m.accepted.sum() < m.drafted.sum()  # lookups that hit and lookups that miss


def test_ngram_replay_by_hand():
    prompt, output = [7, 1, 2, 3, 4, 8], [1, 2, 3, 4, 9]

    def replay(k, n_min):
        drafted, accepted = ngram_replay(prompt, output, k, 4, n_min)
        return drafted.tolist(), accepted.tolist()

    # After the prefill's token 1, the suffix (1,) last occurred at index 1: draft 2, 3, 4, 8, 1
    # against the truth 2, 3, 4, 9 keeps 2, 3, 4 and the target adds 9. One step.
    assert replay(k=5, n_min=1) == ([5], [3])
    # k caps the draft at 2, 3, then the target adds 4; the next step's 4-gram (1, 2, 3, 4) ended
    # at index 4 before, so it drafts 8, 1, and the target adds the last token, 9.
    assert replay(k=2, n_min=1) == ([2, 2], [2, 0])
    # n_min = 2: the single token 1 is not enough to draft; (1, 2) then is.
    assert replay(k=5, n_min=2) == ([0, 5], [0, 2])


def test_copy_oracle_beats_the_most_recent_occurrence():
    # The most recent 1 (index 5) is followed by 9, 9: NGram's draft misses, then its 2-gram (1, 2)
    # finds 3. The oracle copies from index 2 (2, 3) and is done in one step.
    prompt, output = [5, 1, 2, 3, 6, 1, 9, 9], [1, 2, 3, 4]
    assert ngram_replay(prompt, output, k=5, n_max=4, n_min=1).accepted.tolist() == [0, 1]
    assert copy_oracle_accepts(prompt, output).tolist() == [2]
    assert copy_oracle_accepts(prompt, output, k=1).tolist() == [1, 0]
    assert copy_oracle_accepts(prompt, output, min_match=1).tolist() == [2]  # 2, 3 follows a 1 too
    # Here 2, 3 follows no 1: copying it needs a start that no suffix match leads to.
    prompt = [5, 2, 3, 7, 1, 9]
    assert copy_oracle_accepts(prompt, output).tolist() == [2]
    assert copy_oracle_accepts(prompt, output, min_match=1).tolist() == [0, 1]
    assert ngram_replay(prompt, output, k=5, n_max=4, n_min=1).accepted.tolist() == [0, 1]


@settings(max_examples=60, deadline=None)
@given(
    sequence=st.lists(st.integers(0, 4), min_size=3, max_size=60),
    split=st.integers(1, 30),
    k=st.integers(1, 8),
    n_max=st.integers(1, 4),
    n_min=st.integers(1, 4),
)
def test_copy_oracle_never_needs_more_steps(sequence, split, k, n_max, n_min):
    split = min(split, len(sequence) - 1)
    prompt, output = sequence[:split], sequence[split:]
    n_min = min(n_min, n_max)
    oracle = copy_oracle_accepts(prompt, output)
    lookup = ngram_replay(prompt, output, k, n_max, n_min).accepted
    matched = copy_oracle_accepts(prompt, output, k=k, min_match=n_min)
    assert len(oracle) <= len(copy_oracle_accepts(prompt, output, k=k)) <= len(matched) <= len(lookup)
    assert len(copy_oracle_accepts(prompt, output, min_match=n_min)) <= len(matched)
    # Every step emits its accepted tokens plus one; after the prefill's token that is the output.
    assert (oracle + 1).sum() == len(output) - 1 and (lookup + 1).sum() == len(output) - 1
    assert np.all(oracle >= 0) and np.all(lookup >= 0)
