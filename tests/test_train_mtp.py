"""MTP layers trained here (`specjax.train.train_mtp`) for a tiny target with none of its own:
training lowers the loss and raises the layer's agreement with the target, the trained layer drafts
greedy-losslessly through `specjax.MTP` with acceptance in a band, and it survives save_head /
load_head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, layered_target, own_continuations
from tiny import tiny_model

import specjax
from specjax.models import MTPLayers
from specjax.models.draft_vocab import draft_head_matrix
from specjax.models.mtp import mtp_layer_config
from specjax.train import mtp_loss, save_head, train_mtp
from specjax.train.mtp import initial_mtp_layer

TARGET = layered_target(seed=11, late_scale=0.3)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6]]
TRAINING = dict(learning_rate=1e-2, positions_per_sequence=None, progress=False)


@pytest.fixture(scope="module")
def data():
    return own_continuations(TARGET, num_prompts=16, new_tokens=32)


@pytest.fixture(scope="module")
def trained(data):
    return train_mtp(TARGET, data, steps=100, **TRAINING)


@pytest.fixture(scope="module")
def plain():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


def _loss(layers, data):
    """The loss and per-layer accuracy of `layers` over every position of `data`."""
    B, T = data.tokens.shape
    scored = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    head_matrix = draft_head_matrix(TARGET.params, jnp.arange(TARGET.config.vocab_size))
    loss, metrics = jax.jit(mtp_loss, static_argnums=1)(
        layers,
        mtp_layer_config(TARGET.config),
        TARGET.params.embed,
        head_matrix,
        data.hidden,
        data.tokens,
        data.mask,
        scored,
    )
    return float(loss), np.asarray(metrics["accuracy"])


def test_training_lowers_the_loss_and_raises_agreement(trained, data):
    start = (initial_mtp_layer(TARGET, jax.random.fold_in(jax.random.key(0), 0)),)  # the trainer's
    before, before_accuracy = _loss(start, data)
    after, after_accuracy = _loss(trained.layers, data)
    assert after < 0.5 * before, (before, after)
    assert (after_accuracy > before_accuracy + 0.2).all(), (before_accuracy, after_accuracy)
    assert trained.meta["trainer"] == "specjax.train.train_mtp" and trained.meta["steps_done"] == 100


def test_trained_layer_drafts_losslessly_and_accepts_part(trained, plain):
    """Batch 4, ragged, one draft a step: greedy-equal to plain, part of the drafts accepted."""
    result = specjax.generate(TARGET.with_mtp(trained), PROMPTS, proposer=specjax.MTP(k=1), max_new_tokens=24)
    assert result.tokens == plain
    check_acceptance(result.metrics, 0.2, 0.8)


def test_save_and_load_round_trip(trained, tmp_path):
    save_head(tmp_path / "mtp", trained)
    again = specjax.load_head(tmp_path / "mtp", TARGET)
    assert isinstance(again, MTPLayers) and again.meta == trained.meta and again.target == trained.target
    assert again.config == trained.config
    for a, b in zip(jax.tree.leaves(again.layers), jax.tree.leaves(trained.layers), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="holds MTP layers: load them with their target"):
        specjax.load_head(tmp_path / "mtp")
    other = tiny_model(seed=12)
    with pytest.raises(ValueError, match="MTP head was trained for target"):
        specjax.load_head(tmp_path / "mtp", other)
    with pytest.raises(ValueError, match="MTP head was trained for target"):
        other.with_mtp(trained)
    with pytest.raises(ValueError, match="with_mtp: layers must be a specjax.models.MTPLayers"):
        TARGET.with_mtp(trained.layers)


@pytest.mark.parametrize(
    "argument, value, message",
    [
        ("num_layers", 0, "num_layers must be an integer >= 1, got 0"),
        ("positions_per_sequence", 0, "positions_per_sequence must be an integer >= 1, got 0"),
        ("init", "first", "init must be one of last_layer, random, got 'first'"),
    ],
)
def test_bad_arguments_are_refused(data, argument, value, message):
    with pytest.raises(ValueError, match=message):
        train_mtp(TARGET, data, steps=2, progress=False, **{argument: value})


@pytest.mark.slow  # ~20 s: the chain of 3 and a second, two-layer run
def test_trained_chains_and_two_layers_are_lossless(trained, data, plain, tmp_path):
    result = specjax.generate(
        TARGET.with_mtp(trained), PROMPTS[:1], proposer=specjax.MTP(k=3), max_new_tokens=24
    )
    assert result.tokens == plain[:1]
    two = train_mtp(TARGET, data, num_layers=2, steps=150, **TRAINING)
    save_head(tmp_path / "two", two)
    two = specjax.load_head(tmp_path / "two", TARGET)
    assert len(two.layers) == 2
    result = specjax.generate(TARGET.with_mtp(two), PROMPTS, proposer=specjax.MTP(k=3), max_new_tokens=24)
    assert result.tokens == plain
    check_acceptance(result.metrics, 0.1, 0.8)
