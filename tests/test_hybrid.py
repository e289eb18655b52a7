"""Hybrid drafting: per row, the first proposer's drafts where it has any, the second's otherwise.
Greedy output equals plain decoding (n-gram + EAGLE-3, n-gram + a draft model, batch 1 and 4),
sampled output with a sampling draft model reproduces, and the per-proposer counts add up."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax.models import DFlashHead, Eagle3Head

TARGET = tiny_model(seed=11, num_layers=4)
DRAFT = tiny_model(seed=12, num_layers=1)
HEAD = Eagle3Head.init(TARGET, jax.random.key(0), aux_layer_ids=(1, 2, 4), scale=1.0)
FLASH = DFlashHead.init(TARGET, jax.random.key(1), block_size=5, aux_layer_ids=(1, 3))
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


@pytest.mark.parametrize(
    "first, then",
    [
        (specjax.NGram(k=3, n_min=2), specjax.Eagle3(HEAD, k=4)),
        (specjax.NGram(k=4), specjax.DFlash(FLASH)),
    ],
    ids=["ngram+eagle3", "ngram+dflash"],
)
def test_hybrid_greedy_equals_plain(plain_greedy, first, then):
    proposer = specjax.Hybrid(first, then)
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    assert (
        specjax.generate(TARGET, PROMPTS[:1], proposer=proposer, max_new_tokens=24).tokens == plain_greedy[:1]
    )
    counts = result.metrics.proposer
    m = result.metrics
    # every drafting step drafted from exactly one of the two; their accepted drafts add up
    np.testing.assert_array_equal(counts["first_steps"] + counts["then_steps"], m.drafting_steps)
    np.testing.assert_array_equal(counts["first_accepted"] + counts["then_accepted"], m.accepted)
    np.testing.assert_array_equal(counts["first_drafted"] + counts["then_drafted"], m.drafted)
    assert counts["first_steps"].sum() > 0 and counts["then_steps"].sum() > 0  # both were used


def test_hybrid_sampled_reproduces():
    proposer = specjax.Hybrid(specjax.NGram(k=4), specjax.Eagle3(HEAD, k=4))
    sampling = specjax.Sampling(temperature=0.8, seed=4)
    first = specjax.generate(TARGET, PROMPTS, proposer=proposer, sampling=sampling, max_new_tokens=16)
    again = specjax.generate(TARGET, PROMPTS, proposer=proposer, sampling=sampling, max_new_tokens=16)
    assert first.tokens == again.tokens


def test_bad_hybrid_arguments():
    medusa = specjax.models.MedusaHead.init(TARGET, num_heads=2)
    with pytest.raises(ValueError, match="Hybrid then drafts a token tree"):
        specjax.generate(
            TARGET,
            [[1, 2]],
            proposer=specjax.Hybrid(specjax.NGram(), specjax.Medusa(medusa, tree=[(0,), (1,)])),
            max_new_tokens=2,
        )
    with pytest.raises(ValueError, match="a DraftModel or SelfDraft keeps a cache"):
        specjax.generate(
            TARGET, [[1, 2]], proposer=specjax.Hybrid(specjax.NGram(), specjax.DraftModel(DRAFT))
        )
    with pytest.raises(ValueError, match="Hybrid then drafts k=3 but the other part k=5"):
        specjax.generate(
            TARGET, [[1, 2]], proposer=specjax.Hybrid(specjax.NGram(k=5), specjax.Eagle3(HEAD, k=3))
        )
    eagle1 = specjax.models.EagleHead.init(TARGET, jax.random.key(1))
    with pytest.raises(ValueError, match="different target features"):
        specjax.generate(
            TARGET,
            [[1, 2]],
            proposer=specjax.Hybrid(specjax.Eagle(eagle1), specjax.Eagle3(HEAD)),
            max_new_tokens=2,
        )
