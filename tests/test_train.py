"""Medusa training (specjax.train) on a tiny random target: the loss falls, runs are deterministic,
an interrupted run resumes to the same params, heads survive a save/load round trip, refuse another
target, and decode losslessly inside specjax.generate."""

import json
import re

import jax
import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax.models import MedusaHead
from specjax.train import distill_medusa_data, evaluate_medusa, load_head, save_head, train_medusa
from specjax.train import medusa as train_module

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
    return distill_medusa_data(TARGET, sequences, max_len=32)


@pytest.fixture(scope="module")
def head(data):
    return train_medusa(TARGET, data, **SETTINGS)


def _same_params(a: MedusaHead, b: MedusaHead) -> bool:
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


def test_interrupted_run_resumes_to_the_same_params(data, head, tmp_path, monkeypatch):
    update = train_module._Progress.update

    def interrupt_at_15(self, step, loss, metrics):
        if step == 15:
            raise KeyboardInterrupt
        update(self, step, loss, metrics)

    settings = {**SETTINGS, "checkpoint_dir": tmp_path / "run", "checkpoint_every": 10}
    monkeypatch.setattr(train_module._Progress, "update", interrupt_at_15)
    with pytest.raises(KeyboardInterrupt):
        train_medusa(TARGET, data, **settings)
    monkeypatch.setattr(train_module._Progress, "update", update)
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
    (tmp_path / "head" / "head.json").write_text(json.dumps({**metadata, "kind": "eagle"}))
    with pytest.raises(
        ValueError, match=re.escape(f"{str(tmp_path / 'head')!r} holds a head of kind 'eagle'")
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
        distill_medusa_data(TARGET, [[1, 2, 3]], max_len=2)
    with pytest.raises(ValueError, match="token ids in"):
        distill_medusa_data(TARGET, [[1, 200]], max_len=8)
    with pytest.raises(ValueError, match="sequences must be"):
        distill_medusa_data(TARGET, [], max_len=8)


def test_trained_head_decodes_losslessly(head, prompts, tmp_path):
    save_head(tmp_path / "head", head)
    loaded = load_head(tmp_path / "head", TARGET)
    plain = specjax.generate(TARGET, prompts[:4], max_new_tokens=16)
    medusa = specjax.generate(TARGET, prompts[:4], proposer=specjax.Medusa(loaded), max_new_tokens=16)
    assert medusa.tokens == plain.tokens
