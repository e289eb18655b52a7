"""Medusa and EAGLE training (specjax.train) on a tiny random target: the loss falls, runs are
deterministic, an interrupted run resumes to the same params, heads survive a save/load round trip,
refuse another target, and Medusa heads decode losslessly inside specjax.generate."""

import json
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tiny import tiny_model

import specjax
from specjax.models import EagleHead, MedusaHead, frequent_tokens
from specjax.train import (
    DistillationData,
    distill_data,
    evaluate_eagle,
    evaluate_medusa,
    load_head,
    save_head,
    train_eagle,
    train_medusa,
)
from specjax.train import common as train_common

TARGET = tiny_model(seed=11)
NUM_HEADS = 3
SETTINGS = dict(num_heads=NUM_HEADS, steps=30, batch_size=4, learning_rate=1e-2, progress=False)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, TARGET.config.vocab_size, size=int(rng.integers(3, 9))).tolist() for _ in range(8)
    ]


@pytest.fixture(scope="module")
def data(prompts):
    result = specjax.generate(TARGET, prompts, max_new_tokens=24)
    sequences = [p + t for p, t in zip(prompts, result.tokens, strict=True)]
    return distill_data(TARGET, sequences, max_len=32)


@pytest.fixture(scope="module")
def head(data):
    return train_medusa(TARGET, data, **SETTINGS)


def _same_params(a: MedusaHead | EagleHead, b: MedusaHead | EagleHead) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True)
    )


def test_data_shapes_and_mask(data, prompts):
    assert data.hidden.shape == (8, 32, TARGET.config.hidden_size)
    assert data.tokens.shape == data.mask.shape == (8, 32)
    lengths = data.mask.sum(axis=1)
    assert lengths.tolist() == [len(p) + 24 for p in prompts]
    assert (data.tokens[~data.mask] == 0).all()


def test_training_reduces_loss(data, head):
    before = evaluate_medusa(MedusaHead.init(TARGET, NUM_HEADS), TARGET, data)
    after = evaluate_medusa(head, TARGET, data)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert all(a < b for a, b in zip(after["head_loss"], before["head_loss"], strict=True))
    assert np.mean(after["head_accuracy"]) > np.mean(before["head_accuracy"])
    assert head.target == specjax.models.target_signature(TARGET)
    assert head.meta["steps_done"] == 30 and head.meta["seed"] == 0
    assert head.meta["data"] == {"num_sequences": 8, "num_tokens": int(data.mask.sum())}


def test_deterministic_given_seed(data, head):
    again = train_medusa(TARGET, data, **SETTINGS)
    assert _same_params(head, again)
    other_seed = train_medusa(TARGET, data, **{**SETTINGS, "seed": 1})
    assert not _same_params(head, other_seed)


def _interrupt_after_step_15(train, data, settings, monkeypatch):
    """Run `train` until its 15th step is done, then stop it as a Ctrl-C would."""
    update = train_common.Progress.update

    def interrupt_at_15(self, step, loss, metrics):
        if step == 15:
            raise KeyboardInterrupt
        update(self, step, loss, metrics)

    monkeypatch.setattr(train_common.Progress, "update", interrupt_at_15)
    with pytest.raises(KeyboardInterrupt):
        train(TARGET, data, **settings)
    monkeypatch.setattr(train_common.Progress, "update", update)


def test_interrupted_run_resumes_to_the_same_params(data, head, tmp_path, monkeypatch):
    settings = {**SETTINGS, "checkpoint_dir": tmp_path / "run", "checkpoint_every": 10}
    _interrupt_after_step_15(train_medusa, data, settings, monkeypatch)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["10"]

    resumed = train_medusa(TARGET, data, **settings)
    assert _same_params(head, resumed)
    assert resumed.meta == head.meta

    # the finished run's last checkpoint gives the same head without training again
    assert _same_params(head, train_medusa(TARGET, data, **settings))
    with pytest.raises(ValueError, match="holds a run with"):
        train_medusa(TARGET, data, **{**settings, "learning_rate": 2e-2})
    with pytest.raises(ValueError, match="resume=True"):
        train_medusa(TARGET, data, **{**settings, "resume": False})


def test_save_load_round_trip(head, tmp_path):
    save_head(tmp_path / "head", head)
    metadata = json.loads((tmp_path / "head" / "head.json").read_text())
    assert metadata["kind"] == "medusa" and metadata["specjax_version"] == specjax.__version__
    loaded = load_head(tmp_path / "head", TARGET)
    assert loaded.config == head.config
    assert _same_params(head, loaded)
    assert loaded.target == head.target and loaded.meta == head.meta
    assert _same_params(head, load_head(tmp_path / "head"))  # without a target: no check


def test_load_refuses_another_target_and_bad_paths(head, tmp_path):
    save_head(tmp_path / "head", head)
    with pytest.raises(ValueError, match="trained for"):
        load_head(tmp_path / "head", tiny_model(seed=12))
    with pytest.raises(ValueError, match="missing"):
        load_head(tmp_path / "missing")
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="other"):
        load_head(tmp_path / "other")
    metadata = json.loads((tmp_path / "head" / "head.json").read_text())
    (tmp_path / "head" / "head.json").write_text(json.dumps({**metadata, "kind": "hydra"}))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{str(tmp_path / 'head')!r} holds a head of kind 'hydra', expected 'medusa', 'eagle' or 'mtp'"
        ),
    ):
        load_head(tmp_path / "head")


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("steps", 0),
        ("batch_size", 0),
        ("learning_rate", 0.0),
        ("learning_rate", -1e-3),
        ("num_heads", 0),
        ("warmup_steps", 30),
        ("checkpoint_every", 0),
    ],
)
def test_bad_arguments(data, argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be"):
        train_medusa(TARGET, data, **{**SETTINGS, argument: value})


def test_bad_sequences():
    with pytest.raises(ValueError, match="max_len"):
        distill_data(TARGET, [[1, 2, 3]], max_len=2)
    with pytest.raises(ValueError, match="token ids in"):
        distill_data(TARGET, [[1, 200]], max_len=8)
    with pytest.raises(ValueError, match="sequences must be"):
        distill_data(TARGET, [], max_len=8)


def test_trained_head_decodes_losslessly(head, prompts, tmp_path):
    save_head(tmp_path / "head", head)
    loaded = load_head(tmp_path / "head", TARGET)
    plain = specjax.generate(TARGET, prompts[:4], max_new_tokens=16)
    medusa = specjax.generate(TARGET, prompts[:4], proposer=specjax.Medusa(loaded), max_new_tokens=16)
    assert medusa.tokens == plain.tokens


# --- distillation data -------------------------------------------------------------------------


def test_distillation_data_save_load_round_trip(data, tmp_path):
    data.save(tmp_path / "set.npz")
    loaded = DistillationData.load(tmp_path / "set.npz")
    for name in ("hidden", "tokens", "mask"):
        assert np.array_equal(getattr(loaded, name), getattr(data, name))
        assert getattr(loaded, name).dtype == getattr(data, name).dtype
    assert loaded.target == data.target == specjax.models.target_signature(TARGET)
    np.savez(tmp_path / "bad.npz", hidden=data.hidden, tokens=data.tokens[:, :-1], mask=data.mask)
    with pytest.raises(ValueError, match="shapes disagree"):
        DistillationData.load(tmp_path / "bad.npz")
    np.savez(tmp_path / "partial.npz", hidden=data.hidden)
    with pytest.raises(ValueError, match=r"has no \['mask', 'tokens'\]"):
        DistillationData.load(tmp_path / "partial.npz")
    with pytest.raises(ValueError, match="no such distillation data file"):
        DistillationData.load(tmp_path / "missing.npz")


def test_data_from_another_target_is_refused(data):
    other = tiny_model(seed=12)
    with pytest.raises(ValueError, match="data were distilled from target"):
        train_eagle(other, data, **EAGLE_SETTINGS)
    with pytest.raises(ValueError, match="data were distilled from target"):
        train_medusa(other, data, **SETTINGS)


def test_frequent_tokens_are_the_most_frequent_in_order():
    sequences = [[5, 3, 5, 7], np.array([3, 5, 9]), [9, 2]]  # 5 x3, 3 x2, 9 x2, 7 and 2 once
    assert frequent_tokens(sequences, 10, 4).tolist() == [5, 3, 9, 2]  # ties by id
    assert frequent_tokens(sequences, 10, 7).tolist() == [5, 3, 9, 2, 7, 0, 1]  # then unseen ids
    with pytest.raises(ValueError, match="draft vocab size"):
        frequent_tokens(sequences, 10, 11)


# --- EAGLE -------------------------------------------------------------------------------------

DRAFT_VOCAB = 32
EAGLE_SETTINGS = dict(
    draft_vocab_size=DRAFT_VOCAB, steps=30, batch_size=4, learning_rate=1e-2, progress=False
)


@pytest.fixture(scope="module")
def eagle_head(data):
    return train_eagle(TARGET, data, **EAGLE_SETTINGS)


def _loss_args(head, head_matrix, hidden, tokens, mask) -> tuple:
    """`eagle_loss`'s arguments up to the noise level (0: no noise), for `head` on a batch."""
    return (
        head.params,
        head.config,
        TARGET.params,
        head_matrix,
        hidden,
        tokens,
        mask,
        jax.random.key(0),
        0.0,
    )


def _reference_terms(predicted, wanted, matrix):
    """Per position, in float64: smooth-L1 regression, the cross-entropy of the head's draft-vocab
    distribution against the target's, and top-1 agreement; predicted, wanted [n, D]."""
    predicted = np.asarray(predicted, np.float64)
    diff = np.abs(predicted - wanted)
    regression = np.where(diff < 1, 0.5 * diff**2, diff - 0.5).mean(axis=-1)
    logits, wanted_logits = predicted @ matrix, np.asarray(wanted, np.float64) @ matrix  # [n, W]
    p = np.exp(wanted_logits - wanted_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    log_q = logits - logits.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    return regression, -(p * log_q).sum(-1), logits.argmax(-1) == wanted_logits.argmax(-1)


def test_eagle_loss_matches_a_numpy_reference(data):
    """Scores every real position against the next state, with padding kept out of the prediction
    (each row run alone, at its own length) and out of the means."""
    from specjax.models.cache import init_cache
    from specjax.models.draft_vocab import draft_head_matrix
    from specjax.models.eagle import eagle_features
    from specjax.train import eagle_loss

    head = EagleHead.init(TARGET, jax.random.key(3), vocab=np.arange(0, 97, 3), scale=2.0)
    head_matrix = draft_head_matrix(TARGET.params, head.vocab)
    rows = slice(0, 2)  # of different lengths
    hidden, tokens, mask = data.hidden[rows], data.tokens[rows], data.mask[rows]
    assert mask[0].sum() != mask[1].sum()
    loss_jit = jax.jit(eagle_loss, static_argnums=1)
    features_jit = jax.jit(eagle_features, static_argnums=1, static_argnames="empty_cache")
    args = _loss_args(head, head_matrix, hidden, tokens, mask)
    loss, metrics = loss_jit(*args, 0.7, 0.2)

    matrix = np.asarray(TARGET.params.lm_head, np.float64)[:, head.vocab]  # the draft vocab's columns
    per_sequence = []  # the reference's per-position terms
    for h, x, length in zip(hidden, tokens, mask.sum(axis=1), strict=True):
        n = length - 1  # inputs (f_t, x_{t+1}) for t < length - 1
        positions = np.arange(n)[None]
        predicted, _ = features_jit(
            head.params,
            head.config,
            TARGET.params.embed,
            h[None, :n],
            x[None, 1:length],
            positions,
            init_cache(head.config.layer_config, 1, n),
            empty_cache=True,
        )
        per_sequence.append(_reference_terms(predicted[0], h[1:length], matrix))
    regression, classification, agree = (np.concatenate(terms) for terms in zip(*per_sequence, strict=True))
    np.testing.assert_allclose(metrics["regression"], np.mean(regression), rtol=1e-4)
    np.testing.assert_allclose(metrics["classification"], np.mean(classification), rtol=1e-4)
    np.testing.assert_allclose(metrics["accuracy"], np.mean(agree), rtol=1e-6)
    np.testing.assert_allclose(loss, 0.7 * np.mean(regression) + 0.2 * np.mean(classification), rtol=1e-4)
    assert 0 < np.mean(agree) < 1  # a test that can tell a shifted target from the right one

    noisy, _ = loss_jit(
        head.params, head.config, TARGET.params, head_matrix, hidden, tokens, mask, jax.random.key(0), 0.5
    )
    assert noisy != metrics["loss"]


def test_unrolled_eagle_loss_matches_drafting(data):
    """Pass p of the unrolled loss predicts what drafting does p - 1 steps past the true features:
    a prefill of the true inputs 0 .. t-p+1 into the head's cache, then p - 1 one-token steps,
    each feeding the previous prediction (the library's decoding path, not the loss's masks)."""
    from specjax.models.cache import init_cache
    from specjax.models.draft_vocab import draft_head_matrix
    from specjax.models.eagle import eagle_features
    from specjax.train import eagle_loss

    unroll = 3
    head = EagleHead.init(TARGET, jax.random.key(4), vocab=np.arange(0, 97, 2), scale=2.0)
    head_matrix = draft_head_matrix(TARGET.params, head.vocab)
    rows = slice(0, 2)
    hidden, tokens, mask = data.hidden[rows], data.tokens[rows], data.mask[rows]
    loss_jit = jax.jit(eagle_loss, static_argnums=1, static_argnames="unroll")
    args = _loss_args(head, head_matrix, hidden, tokens, mask)
    loss, metrics = loss_jit(*args, 1.0, 0.1, unroll=unroll)
    loss_1, metrics_1 = loss_jit(*args, 1.0, 0.1)
    assert metrics["accuracy"] == metrics_1["accuracy"]  # pass 1 is the plain loss

    features_jit = jax.jit(eagle_features, static_argnums=1, static_argnames="empty_cache")
    matrix = np.asarray(TARGET.params.lm_head, np.float64)[:, head.vocab]
    losses = {p: [] for p in range(1, unroll + 1)}
    agree = {p: [] for p in range(1, unroll + 1)}
    for h, x, length in zip(hidden, tokens, mask.sum(axis=1), strict=True):
        n = length - 1
        prefill, cache = features_jit(
            head.params,
            head.config,
            TARGET.params.embed,
            h[None, :n],
            x[None, 1:length],
            np.arange(n)[None],
            init_cache(head.config.layer_config, 1, n + unroll),
            empty_cache=True,
        )
        for p in range(1, unroll + 1):
            for t in range(p - 1, n):
                predicted = prefill[:, t - p + 1]  # from the true inputs 0 .. t-p+1
                step_cache = cache.replace(lengths=np.array([t - p + 2], np.int32))
                for position in range(t - p + 2, t + 1):  # p - 1 drafting steps
                    out, step_cache = features_jit(
                        head.params,
                        head.config,
                        TARGET.params.embed,
                        predicted[:, None],
                        x[None, position + 1 : position + 2],
                        np.array([[position]]),
                        step_cache,
                    )
                    step_cache = step_cache.advance(np.array([1], np.int32))
                    predicted = out[:, 0]
                (regression,), (classification,), (agrees,) = _reference_terms(
                    predicted, h[None, t + 1], matrix
                )
                losses[p].append(regression + 0.1 * classification)
                agree[p].append(agrees)
    for p in range(2, unroll + 1):
        np.testing.assert_allclose(metrics[f"accuracy_{p}"], np.mean(agree[p]), rtol=1e-6)
    assert 0 < np.mean(agree[unroll]) < 1
    expected = np.mean([np.mean(losses[p]) for p in range(1, unroll + 1)])
    np.testing.assert_allclose(loss, expected, rtol=1e-4)
    np.testing.assert_allclose(loss_1, np.mean(losses[1]), rtol=1e-4)


@pytest.mark.slow  # ~20 s: a second EAGLE training run; the unrolled loss itself is checked above
def test_unrolled_training_lowers_the_unrolled_loss(data):
    from specjax.models.draft_vocab import draft_head_matrix
    from specjax.train import eagle_loss

    head = train_eagle(TARGET, data, **{**EAGLE_SETTINGS, "unroll": 2})
    assert head.meta["unroll"] == 2
    fresh = EagleHead.init(TARGET, jax.random.key(0), vocab=head.vocab)

    def unrolled_loss(h):
        matrix = draft_head_matrix(TARGET.params, h.vocab)
        batch = (data.hidden[:8], data.tokens[:8], data.mask[:8], jax.random.key(0), 0.0)
        return eagle_loss(h.params, h.config, TARGET.params, matrix, *batch, unroll=2)

    (before, _), (after, metrics) = unrolled_loss(fresh), unrolled_loss(head)
    assert after < 0.7 * before and metrics["accuracy_2"] > 0


def test_eagle_training_reduces_loss_and_raises_accuracy(data, eagle_head):
    vocab = frequent_tokens([data.tokens[data.mask]], TARGET.config.vocab_size, DRAFT_VOCAB)
    assert np.array_equal(eagle_head.vocab, vocab) and eagle_head.config.draft_vocab_size == DRAFT_VOCAB
    before = evaluate_eagle(EagleHead.init(TARGET, jax.random.key(0), vocab=vocab), TARGET, data)
    after = evaluate_eagle(eagle_head, TARGET, data)
    assert after["loss"] < 0.6 * before["loss"], (before, after)
    assert after["regression"] < before["regression"] and after["classification"] < before["classification"]
    assert after["accuracy"] > before["accuracy"] + 0.3, (before, after)
    assert eagle_head.target == specjax.models.target_signature(TARGET)
    assert eagle_head.meta["steps_done"] == 30 and eagle_head.meta["draft_vocab_size"] == DRAFT_VOCAB
    assert eagle_head.meta["trainer"] == "specjax.train.train_eagle"
    assert eagle_head.meta["data"] == {"num_sequences": 8, "num_tokens": int(data.mask.sum())}


def test_evaluate_eagle_weights_each_pass_by_its_positions(data, eagle_head):
    """Batch by batch, each pass's accuracy is weighted by the positions that pass scores (rows of
    different lengths score L - p positions in pass p), so one sequence per batch gives what one
    batch of all of them gives."""
    from specjax.models.draft_vocab import draft_head_matrix
    from specjax.train import eagle_loss

    assert len(set(data.mask.sum(axis=1))) > 1  # rows of different lengths: the weights differ
    matrix = draft_head_matrix(TARGET.params, eagle_head.vocab)
    args = _loss_args(eagle_head, matrix, data.hidden, data.tokens, data.mask)
    _, whole = jax.jit(eagle_loss, static_argnums=1, static_argnames="unroll")(*args, unroll=3)
    by_row = evaluate_eagle(eagle_head, TARGET, data, batch_size=1, unroll=3)
    for name in ("accuracy", "accuracy_2", "accuracy_3", "regression", "classification"):
        np.testing.assert_allclose(by_row[name], whole[name], rtol=1e-5)
    assert evaluate_eagle(eagle_head, TARGET, data)["accuracy"] == pytest.approx(by_row["accuracy"])


def test_eagle_deterministic_given_seed(data, eagle_head):
    assert _same_params(eagle_head, train_eagle(TARGET, data, **EAGLE_SETTINGS))
    assert not _same_params(eagle_head, train_eagle(TARGET, data, **{**EAGLE_SETTINGS, "seed": 1}))


def test_eagle_interrupted_run_resumes_to_the_same_params(data, eagle_head, tmp_path, monkeypatch):
    settings = {**EAGLE_SETTINGS, "checkpoint_dir": tmp_path / "run", "checkpoint_every": 10}
    _interrupt_after_step_15(train_eagle, data, settings, monkeypatch)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["10"]
    resumed = train_eagle(TARGET, data, **settings)
    assert _same_params(eagle_head, resumed) and resumed.meta == eagle_head.meta
    with pytest.raises(ValueError, match="holds a run with"):
        train_eagle(TARGET, data, **{**settings, "noise": 0.2})
    with pytest.raises(ValueError, match="holds a run with"):
        train_eagle(TARGET, data, **{**settings, "draft_vocab_size": DRAFT_VOCAB + 1})


def test_eagle_save_load_round_trip(eagle_head, tmp_path):
    save_head(tmp_path / "head", eagle_head)
    metadata = json.loads((tmp_path / "head" / "head.json").read_text())
    assert metadata["kind"] == "eagle" and metadata["config"]["draft_vocab_size"] == DRAFT_VOCAB
    loaded = load_head(tmp_path / "head", TARGET)
    assert isinstance(loaded, EagleHead) and loaded.config == eagle_head.config
    assert _same_params(eagle_head, loaded)
    assert np.array_equal(loaded.vocab, eagle_head.vocab) and loaded.vocab.dtype == np.int32
    assert loaded.target == eagle_head.target and loaded.meta == eagle_head.meta

    # a target with q/k/v biases and rope scaling: the optional fields survive too
    scaled = tiny_model(seed=5, qkv_bias=True, rope_scaling=specjax.models.RopeScaling(factor=4.0))
    fresh = EagleHead.init(scaled, jax.random.key(1), vocab=[7, 3, 11], scale=2.0)
    save_head(tmp_path / "biased", fresh)
    loaded = load_head(tmp_path / "biased", scaled)
    assert loaded.config == fresh.config and loaded.params.layer.qkv_bias is not None
    assert _same_params(fresh, loaded) and loaded.vocab.tolist() == [7, 3, 11]
    # on disk the layer keeps q, k and v apart (the checkpoint layout), as heads saved before the
    # params fused them did
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(tmp_path / "biased" / "params").item_metadata["layer"]
    assert {"q", "k", "v", "q_bias", "k_bias", "v_bias"} <= set(saved) and "qkv" not in saved


def test_eagle_load_refuses_another_target(eagle_head, tmp_path):
    save_head(tmp_path / "head", eagle_head)
    with pytest.raises(ValueError, match=r"EAGLE head was trained for target .*specjax.train.train_eagle"):
        load_head(tmp_path / "head", tiny_model(seed=12))
    with pytest.raises(ValueError, match="EAGLE head has hidden size"):
        load_head(tmp_path / "head", tiny_model(seed=11, hidden_size=32))


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("draft_vocab_size", 0),
        ("draft_vocab_size", 98),
        ("steps", 0),
        ("batch_size", 0),
        ("learning_rate", 0.0),
        ("warmup_steps", 30),
        ("clip_norm", -1.0),
        ("noise", -0.1),
        ("reg_weight", float("nan")),
        ("cls_weight", -1.0),
        ("seed", -1),
        ("unroll", 0),
        ("unroll", 1000),  # not below the sequence length
    ],
)
def test_eagle_bad_arguments(data, argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be"):
        train_eagle(TARGET, data, **{**EAGLE_SETTINGS, argument: value})


def test_medusa_heads_train_on_a_draft_vocabulary(data):
    """With draft_vocab_size, the heads draft from the data's most frequent tokens and learn there."""
    head = train_medusa(TARGET, data, **{**SETTINGS, "draft_vocab_size": 30})
    expected = frequent_tokens([data.tokens[data.mask]], TARGET.config.vocab_size, 30)
    assert np.array_equal(head.vocab, expected) and head.config.draft_vocab_size == 30
    before = evaluate_medusa(MedusaHead.init(TARGET, NUM_HEADS, vocab=expected), TARGET, data)
    after = evaluate_medusa(head, TARGET, data)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert np.mean(after["head_accuracy"]) > np.mean(before["head_accuracy"])
