"""EAGLE-3 and DFlash training (specjax.train) on a tiny random target: each loss scores what
drafting does (checked against the library's drafting path), training lowers it and raises the
heads' agreement with the target, runs are deterministic per seed and resume to the same params
(MTP layers' and MLP speculators' runs too, tests/test_train_mtp.py and tests/test_mlp_speculator.py
have the rest of theirs), and the trained heads decode losslessly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax.models import DFlashHead, Eagle3Head, MTPLayers, init_cache
from specjax.models.dflash import dflash_block, dflash_context, dflash_logits
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.eagle3 import eagle3_features, eagle3_logits, fuse_features
from specjax.train import common as train_common
from specjax.train import distill_data
from specjax.train.data import target_features
from specjax.train.dflash import dflash_loss, evaluate_dflash, train_dflash
from specjax.train.eagle3 import eagle3_loss, evaluate_eagle3, train_eagle3
from specjax.train.mlp_speculator import train_mlp_speculator
from specjax.train.mtp import train_mtp

TARGET = tiny_model(seed=11, num_layers=4)
AUX = (1, 2, 4)
EAGLE3 = dict(
    draft_vocab_size=48, aux_layer_ids=AUX, steps=30, batch_size=4, learning_rate=1e-2, progress=False
)
DFLASH = dict(
    block_size=4,
    draft_vocab_size=48,
    aux_layer_ids=AUX,
    anchors_per_sequence=4,
    steps=30,
    batch_size=4,
    learning_rate=1e-2,
    progress=False,
)
MTP = dict(positions_per_sequence=8, steps=20, batch_size=4, learning_rate=1e-2, progress=False)
MLP_SPECULATOR = dict(n_predict=2, **MTP)
SETTINGS = {train_eagle3: EAGLE3, train_dflash: DFLASH, train_mlp_speculator: MLP_SPECULATOR}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, TARGET.config.vocab_size, size=int(rng.integers(3, 9))).tolist() for _ in range(8)
    ]
    result = specjax.generate(TARGET, prompts, max_new_tokens=24)
    return distill_data(TARGET, [p + t for p, t in zip(prompts, result.tokens, strict=True)], max_len=32)


@pytest.fixture(scope="module")
def eagle3_head(data):
    return train_eagle3(TARGET, data, **EAGLE3)


@pytest.fixture(scope="module")
def dflash_head(data):
    return train_dflash(TARGET, data, **DFLASH)


def same(a, b) -> bool:
    def weights(head):  # trained MTP layers hold theirs as `layers`
        return head.layers if isinstance(head, MTPLayers) else head.params

    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(weights(a)), jax.tree.leaves(weights(b)), strict=True)
    )


def test_unrolled_eagle3_loss_scores_what_drafting_does(data):
    """Pass p's accuracy is the agreement, with the target's next token, of what the head drafts
    p - 1 steps past the target's features: a prefill of the true pairs 0 .. t-p+1, then p - 1
    one-token steps over the head's cache, each feeding its previous output."""
    head = Eagle3Head.init(TARGET, jax.random.key(4), vocab=np.arange(0, 97, 2), aux_layer_ids=AUX, scale=2.0)
    c, p = head.config, head.params
    teacher = draft_head_matrix(TARGET.params, jnp.asarray(head.vocab))
    aux = target_features(TARGET, data, AUX)
    rows = slice(0, 3)
    loss, metrics = jax.jit(eagle3_loss, static_argnums=1, static_argnames="unroll")(
        p,
        c,
        TARGET.params.embed,
        teacher,
        aux[rows],
        data.hidden[rows],
        data.tokens[rows],
        data.mask[rows],
        unroll=3,
    )
    agree = {q: [] for q in (1, 2, 3)}
    for a, h, x, length in zip(
        aux[rows], data.hidden[rows], data.tokens[rows], data.mask[rows].sum(1), strict=True
    ):
        n = length - 1
        fused = fuse_features(p, c, jnp.asarray(a[None, :n]))
        cache = init_cache(c.layer_config, 1, n + 3)
        prefill, cache = eagle3_features(
            p, c, TARGET.params.embed, fused, x[None, 1:length], jnp.arange(n)[None], cache, empty_cache=True
        )
        wanted = np.argmax(np.asarray(draft_logits(teacher, jnp.asarray(h[1:length]))), -1)
        for q in (1, 2, 3):
            for t in range(q - 1, n):
                out = prefill[:, t - q + 1]
                step = cache.replace(lengths=jnp.asarray([t - q + 2], jnp.int32))
                for position in range(t - q + 2, t + 1):
                    out, step = eagle3_features(
                        p,
                        c,
                        TARGET.params.embed,
                        out[:, None],
                        x[None, position + 1 : position + 2],
                        jnp.asarray([[position]]),
                        step,
                    )
                    step = step.advance(jnp.asarray([1], jnp.int32))
                    out = out[:, 0]
                agree[q].append(int(np.argmax(np.asarray(eagle3_logits(p, c, out))[0])) == wanted[t])
    np.testing.assert_allclose(metrics["accuracy"], np.mean(agree[1]), rtol=1e-6)
    for q in (2, 3):
        np.testing.assert_allclose(metrics[f"accuracy_{q}"], np.mean(agree[q]), rtol=1e-6)
    assert 0 < np.mean(agree[3]) < 1 and np.isfinite(loss)


@pytest.mark.slow  # make test-all: the default suite keeps within its 20 minutes
def test_dflash_loss_scores_what_drafting_does(data):
    """Each block's slot accuracies equal the agreement of `dflash_block` over a cache holding the
    context before its anchor (the drafting path) with the target's next tokens."""
    head = DFlashHead.init(TARGET, jax.random.key(5), block_size=4, aux_layer_ids=AUX, scale=2.0)
    c, p = head.config, head.params
    teacher = draft_head_matrix(TARGET.params, jnp.asarray(head.vocab))
    aux = target_features(TARGET, data, AUX)
    rows = slice(0, 2)
    mask = data.mask[rows]
    anchors = jnp.asarray([[0, 3, 7], [2, 5, 9]], jnp.int32)
    _, metrics = dflash_loss(
        p, c, TARGET.params.embed, teacher, aux[rows], data.hidden[rows], data.tokens[rows], mask, anchors
    )
    agree = {i: [] for i in (1, 2, 3)}
    for b in range(2):
        for a in np.asarray(anchors[b]):
            cache = init_cache(c.layer_config, 1, 40)
            cache = dflash_context(p, c, jnp.asarray(aux[b][None, :a]), jnp.arange(a)[None], cache).advance(
                jnp.asarray([a])
            )
            block = np.full((1, 4), c.mask_token_id, np.int32)
            block[0, 0] = data.tokens[b, a]
            out = dflash_block(p, c, TARGET.params.embed, jnp.asarray(block), a + jnp.arange(4)[None], cache)
            drafted = np.argmax(
                np.asarray(dflash_logits(p, c, TARGET.params, out[:, 1:], TARGET.config))[0], -1
            )
            wanted = np.argmax(np.asarray(draft_logits(teacher, jnp.asarray(data.hidden[b, a : a + 3]))), -1)
            for i in (1, 2, 3):
                if mask[b, a + i]:
                    agree[i].append(drafted[i - 1] == wanted[i - 1])
    np.testing.assert_allclose(metrics["accuracy"], np.mean(agree[1]), rtol=1e-6)
    for i in (2, 3):
        np.testing.assert_allclose(metrics[f"accuracy_{i}"], np.mean(agree[i]), rtol=1e-6)


def test_eagle3_training_lowers_the_loss_and_raises_agreement(data, eagle3_head):
    from specjax.models.eagle3 import init_eagle3

    c = eagle3_head.config  # the run's start: init_eagle3(seed 0), its LM head the target's columns
    start = init_eagle3(c, jax.random.key(0)).replace(
        lm_head=draft_head_matrix(TARGET.params, eagle3_head.vocab)
    )
    fresh = Eagle3Head(c, start, eagle3_head.vocab)
    before, after = evaluate_eagle3(fresh, TARGET, data), evaluate_eagle3(eagle3_head, TARGET, data)
    assert after["loss"] < 0.85 * before["loss"], (
        before,
        after,
    )  # cross-entropy: the teacher's entropy stays
    assert after["accuracy"] > before["accuracy"] + 0.2 and after["accuracy_3"] > before["accuracy_3"], (
        before,
        after,
    )
    assert eagle3_head.meta["trainer"] == "specjax.train.train_eagle3" and eagle3_head.meta["unroll"] == 3


def test_dflash_training_lowers_the_loss_and_raises_agreement(data, dflash_head):
    from specjax.models.dflash import init_dflash

    c = dflash_head.config  # the run's start: init_dflash(seed 0), its LM head the target's columns
    start = init_dflash(c, jax.random.key(0)).replace(
        lm_head=draft_head_matrix(TARGET.params, dflash_head.vocab)
    )
    fresh = DFlashHead(c, start, dflash_head.vocab)
    before, after = evaluate_dflash(fresh, TARGET, data), evaluate_dflash(dflash_head, TARGET, data)
    assert after["loss"] < 0.85 * before["loss"], (before, after)
    assert after["accuracy"] > before["accuracy"] + 0.1, (before, after)


@pytest.mark.parametrize(
    "train, settings",
    [
        (train_eagle3, EAGLE3),
        (train_dflash, DFLASH),
        pytest.param(train_mtp, MTP, marks=pytest.mark.slow),  # ~10 s: four short runs
        (train_mlp_speculator, MLP_SPECULATOR),
    ],
    ids=["eagle3", "dflash", "mtp", "mlp_speculator"],
)
def test_deterministic_and_resumable(data, train, settings, tmp_path, monkeypatch):
    first = train(TARGET, data, **settings)
    assert same(first, train(TARGET, data, **settings))
    assert not same(first, train(TARGET, data, **{**settings, "seed": 1}))
    run = {**settings, "checkpoint_dir": tmp_path / "run", "checkpoint_every": 10}
    real = train_common.Progress.update

    def stop_after_15(self, step, loss, metrics):
        real(self, step, loss, metrics)
        if step == 15:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_common.Progress, "update", stop_after_15)
    with pytest.raises(KeyboardInterrupt):
        train(TARGET, data, **run)
    monkeypatch.setattr(train_common.Progress, "update", real)
    resumed = train(TARGET, data, **run)
    assert same(first, resumed) and resumed.meta == first.meta


def test_trained_heads_decode_losslessly(eagle3_head, dflash_head):
    prompts = [[5, 6, 7, 8, 5, 6], [3, 9, 4, 4]]
    plain = specjax.generate(TARGET, prompts, max_new_tokens=20).tokens
    for proposer in (specjax.Eagle3(eagle3_head, k=3), specjax.DFlash(dflash_head)):
        assert specjax.generate(TARGET, prompts, proposer=proposer, max_new_tokens=20).tokens == plain


@pytest.mark.parametrize(
    "train, argument, value, message",
    [
        (train_eagle3, "unroll", 0, "unroll must be an integer >= 1"),
        (train_eagle3, "unroll", 40, "unroll must be below"),
        (train_dflash, "block_size", 1, "block_size must be an integer >= 2"),
        (train_dflash, "anchors_per_sequence", 0, "anchors_per_sequence must be an integer >= 1"),
        (train_dflash, "gamma", -1.0, "gamma must be a finite number > 0"),
        *[
            (
                train_mlp_speculator,
                "positions_per_sequence",
                v,
                f"positions_per_sequence must be an integer >= 1, got {v}",
            )
            for v in (0, 8.0, True)
        ],
    ],
)
def test_bad_arguments(data, train, argument, value, message):
    with pytest.raises(ValueError, match=message):
        train(TARGET, data, **{**SETTINGS[train], argument: value})
