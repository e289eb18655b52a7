"""Batches are padded to a bucket (1, 2, 4, 8, ... or the caller's `batch_buckets`): a new number
of prompts inside a bucket reuses the program, and the padding rows change nothing in the result
(tokens, texts, per-row metrics and their totals equal those of the same rows run unpadded)."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax import programs
from specjax.planner import batch_bucket

TARGET = tiny_model(seed=21)
WORDY = specjax.Model(TARGET.config, TARGET.params, tiny_tokenizer(), name="tiny-wordy-21")
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [3, 9], [40, 41, 42, 40, 41, 42, 40, 41], [12, 13], [60]]


def test_batch_bucket_sizes():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [batch_bucket(n, multiple_of=2) for n in (1, 2, 3, 5)] == [2, 2, 4, 8]
    assert [batch_bucket(n, multiple_of=3) for n in (1, 4, 7)] == [3, 6, 12]
    assert [batch_bucket(n, (3, 6)) for n in (1, 3, 4, 6)] == [3, 3, 6, 6]
    assert batch_bucket(3, (2, 3, 4, 6), multiple_of=2) == 4


def _batch_sizes(used) -> list[int]:
    return sorted(key[0].batch_size for key in used)


def test_batch_sizes_in_one_bucket_share_a_program():
    model = tiny_model(seed=21, num_layers=3)  # a config no other test compiles
    count = programs.compiled_program_count()
    with programs.programs_used() as used:
        three = specjax.generate(model, PROMPTS[:3], max_new_tokens=4)
        specjax.generate(model, PROMPTS[:4], max_new_tokens=4)
    assert _batch_sizes(used) == [4] and programs.compiled_program_count() == count + 1
    assert len(three.tokens) == 3 and three.metrics.emitted.tolist() == [4, 4, 4]
    with programs.programs_used() as used:
        specjax.generate(model, PROMPTS[:5], max_new_tokens=4)
    assert _batch_sizes(used) == [8] and programs.compiled_program_count() == count + 2


def test_the_callers_batch_buckets():
    model = tiny_model(seed=21, num_layers=3)
    count = programs.compiled_program_count()
    with programs.programs_used() as used:
        for n in (2, 3):
            specjax.generate(model, PROMPTS[:n], max_new_tokens=4, batch_buckets=[3, 6])
    assert _batch_sizes(used) == [3] and programs.compiled_program_count() == count + 1
    with programs.programs_used() as used:
        result = specjax.generate(model, PROMPTS[:4], max_new_tokens=4, batch_buckets=(3, 6))
    assert _batch_sizes(used) == [6] and programs.compiled_program_count() == count + 2
    assert len(result.tokens) == 4


SAMPLED_ROWS = [  # every per-row option, so each is padded along with the batch
    specjax.Sampling(temperature=0.9, top_p=0.9, seed=7, stop="ab"),
    specjax.Sampling(temperature=1.2, top_k=5, frequency_penalty=0.4, logit_bias={3: 1.0}),
    specjax.Sampling(temperature=0.7, min_p=0.05, repetition_penalty=1.2, stop_token_ids=(10,)),
]


# The sampled case (every per-row option, under SelfDraft) runs in make test-all: the default
# suite keeps the greedy one, and test_sampling_options covers the options in a padded batch too.
@pytest.mark.parametrize(
    "sampled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["greedy", "sampled"]
)
def test_a_padded_batch_equals_the_rows_unpadded(sampled):
    """Three rows padded to 4 (the default bucket) against the same three in a bucket of 3."""
    options = dict(sampling=SAMPLED_ROWS, key=jax.random.key(3)) if sampled else {}
    results = [
        specjax.generate(
            WORDY,
            PROMPTS[:3],
            proposer=specjax.SelfDraft(layers=1, k=3),
            max_new_tokens=16,
            batch_buckets=buckets,
            **options,
        )
        for buckets in (None, [3])
    ]
    padded, unpadded = results
    assert padded.tokens == unpadded.tokens and padded.texts == unpadded.texts
    assert padded.prompt_tokens == unpadded.prompt_tokens == PROMPTS[:3]
    # Counts are equal; the sums of min(p, q) only up to rounding, since XLA:CPU's products over 3
    # and 4 rows round the logits differently in the last bits (the sampled tokens are the same).
    for field in dataclasses.fields(specjax.SpecMetrics):
        if field.name in ("compile_time_s", "run_time_s", "proposer"):
            continue
        got, expected = (np.asarray(getattr(r.metrics, field.name)) for r in results)
        assert got.shape == expected.shape, field.name
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=0, err_msg=field.name)
        if got.dtype.kind == "i":
            np.testing.assert_array_equal(got, expected, err_msg=field.name)
    timing = ("tokens_per_second", "compile_time_s", "run_time_s")
    totals = [{k: v for k, v in r.metrics.summary().items() if k not in timing} for r in results]
    assert totals[0].keys() == totals[1].keys()
    for name, value in totals[0].items():
        np.testing.assert_allclose(value, totals[1][name], rtol=1e-5, atol=0, err_msg=name)
        if isinstance(value, int):
            assert value == totals[1][name], name
    assert padded.metrics.drafted.sum() > 0 and padded.metrics.accepted.sum() > 0


@pytest.mark.parametrize(
    "buckets",
    [[0], [4, 2], [2, 2], [1.5, 3], [True, 4], [], "4", 4, [-1, 4]],
    ids=["zero", "decreasing", "repeated", "float", "bool", "empty", "str", "int", "negative"],
)
def test_bad_batch_buckets(buckets):
    message = (
        r"batch_buckets must be None \(1, 2, 4, 8, \.\.\.\) or a non-empty list of increasing positive "
        rf"integers \(the batch sizes to pad to\), got {re.escape(repr(buckets))}"
    )
    with pytest.raises(ValueError, match=message):
        specjax.generate(TARGET, PROMPTS[:2], max_new_tokens=4, batch_buckets=buckets)


def test_a_batch_larger_than_every_bucket():
    message = (
        r"batch_buckets: 3 prompts do not fit the largest bucket of \[1, 2\]; add a bucket >= 3, or "
        r"pass batch_buckets=None"
    )
    with pytest.raises(ValueError, match=message):
        specjax.generate(TARGET, PROMPTS[:3], max_new_tokens=4, batch_buckets=[1, 2])
