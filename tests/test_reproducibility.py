"""Reproducibility: the same key and inputs give the same tokens, bit for bit, across calls; at
temperature 0 a prompt's tokens do not depend on the batch it shares a call with (its neighbours,
their lengths and so the prompt bucket, its place in the batch), for plain and speculative
decoding; and a seeded sampled row gives its own tokens whatever the batch."""

import jax
import pytest
from tiny import tiny_model

import specjax

TARGET = tiny_model(seed=5)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9], [10, 11, 12, 13, 14, 15, 10, 11, 12], [40, 41, 42, 40, 41]]
LONG = [list(range(1, 90))]  # moves every batch it joins to a larger prompt bucket (128)
PROPOSERS = {
    "plain": None,
    "ngram": specjax.NGram(k=3, n_max=2),
    "selfdraft": specjax.SelfDraft(layers=1, k=3),
    "dynamic": specjax.Dynamic(specjax.SelfDraft(layers=1, k=4)),
}


# The default set keeps plain decoding here (tests/test_speculative.py and
# tests/test_builtin_generate.py compare speculative batches with plain ones); `make test-all`
# runs every proposer.
@pytest.mark.parametrize(
    "name", ["plain", *(pytest.param(name, marks=pytest.mark.slow) for name in list(PROPOSERS)[1:])]
)
def test_greedy_tokens_do_not_depend_on_the_batch(name):
    proposer = PROPOSERS[name]

    def run(prompts):
        return specjax.generate(TARGET, prompts, proposer=proposer, max_new_tokens=20).tokens

    together = run(PROMPTS)
    assert run(PROMPTS) == together  # across calls
    for i, prompt in enumerate(PROMPTS):
        assert run([prompt]) == [together[i]], f"prompt {i} alone"
    assert run(PROMPTS[::-1]) == together[::-1]
    assert run(PROMPTS + LONG)[:4] == together  # another bucket, another batch size


@pytest.mark.parametrize("name", ["selfdraft", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_sampled_tokens_repeat_with_the_same_key_and_seeded_rows_ignore_the_batch(name):
    # Dynamic: the batch's largest k picks how many drafts are drawn and verified; a row's random
    # numbers must not depend on it (jax's counter-based bits make a shorter draw a prefix).
    sampling = specjax.Sampling(temperature=0.9, top_p=0.95)
    proposer = PROPOSERS[name]
    key = jax.random.key(7)
    first = specjax.generate(TARGET, PROMPTS, proposer, sampling, max_new_tokens=20, key=key).tokens
    again = specjax.generate(TARGET, PROMPTS, proposer, sampling, max_new_tokens=20, key=key).tokens
    assert first == again
    other = specjax.generate(TARGET, PROMPTS, proposer, sampling, max_new_tokens=20, key=jax.random.key(8))
    assert other.tokens != first
    seeded = [specjax.Sampling(temperature=0.9, seed=100 + i) for i in range(4)]
    batch = specjax.generate(TARGET, PROMPTS, proposer, seeded, max_new_tokens=20).tokens
    for i in range(4):
        alone = specjax.generate(TARGET, [PROMPTS[i]], proposer, seeded[i], max_new_tokens=20).tokens
        assert alone == [batch[i]], f"seeded row {i}"
