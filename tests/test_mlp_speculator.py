"""IBM's MLP speculator (specjax.models.MLPSpeculatorHead, specjax.MLPSpeculator).

Its authors' code (fms-extras) is not on PyPI, so the reference here is a float64 numpy
implementation written from the paper (arXiv 2404.19124) and vLLM's definition
(vllm/model_executor/models/mlp_speculator.py): it reads the published tensors by their names
(`speculator.{emb,proj,head,ln}.{i}.*`, torch's [out, in] matrices), and specjax's draft logits,
read from the same folder by `specjax.load_head`, match it within 1e-4 relative with scale_input
on and off, tied and untied stages, inner_dim equal to and apart from the target's width. A
speculator trained here (`specjax.train.train_mlp_speculator`) decodes greedy-equal to plain
decoding while accepting part of its drafts."""

from __future__ import annotations

import json
import math

import by_hand
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, layered_target, own_continuations, trained_mlp_speculator
from scipy.special import erf, logsumexp
from tiny import tiny_model

import specjax
from specjax.models import MLPSpeculatorHead
from specjax.models.mlp_speculator import mlp_speculator_logits
from specjax.models.tensors import of_array, write_safetensors
from specjax.speculate.proposers.base import LastHiddenState
from specjax.speculate.sampling import SamplingParams, WarpSpec
from specjax.train import mlp_speculator_loss, save_head
from specjax.train.common import scored_positions

TARGET = layered_target(seed=11, late_scale=0.3)
E, V = TARGET.config.hidden_size, TARGET.config.vocab_size
N_PREDICT = 3
# Ragged prompts (tests/test_speculative.py's), so that rows accept different counts in one step.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]


# ---------------------------------------------------------------------------------------------
# The float64 reference, from the published tensors


def rms_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def reference_logits(config: dict, tensors: dict, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """hidden [B, E] (the target's h_t), tokens [B, n] (x_{t+1} .. x_{t+n}) -> logits [B, n, V]
    in float64, each stage teacher-forced, as vLLM's generate_proposals computes one stage."""
    n_predict, inner = config["n_predict"], config["inner_dim"] or config["emb_dim"]
    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * (inner / 2))

    def weight(kind: str, i: int, part: str = "weight") -> np.ndarray:
        if config["tie_weights"]:  # one emb, head and norm; proj 0 apart and one for the rest
            i = min(i, 1) if kind == "proj" else 0
        return np.asarray(tensors[f"speculator.{kind}.{i}.{part}"], np.float64)

    state = np.asarray(hidden, np.float64)
    if config["scale_input"]:
        state = rms_norm(state) / math.sqrt(2)
    logits = []
    for i in range(tokens.shape[1]):
        mixed = state @ weight("proj", i).T + (emb_weight / state_weight) * weight("emb", i)[tokens[:, i]]
        normed = rms_norm(mixed) * weight("ln", i) + weight("ln", i, "bias")
        state = 0.5 * normed * (1 + erf(normed / math.sqrt(2)))  # exact GELU
        logits.append(state @ weight("head", i).T)
    return np.stack(logits, axis=1)


def published_speculator(folder, inner_dim: int, tie_weights: bool, scale_input: bool, aliases=False):
    """A random MLP speculator for TARGET written as IBM publishes one: config.json and
    model.safetensors. With `aliases` (tied only), every stage's copy is written too, as torch's
    state_dict of a tied model holds them. Returns (config, tensors)."""
    rng = np.random.default_rng(inner_dim + 2 * tie_weights + scale_input)
    I = inner_dim
    stages = 1 if tie_weights and not aliases else N_PREDICT
    tensors = {}
    for i in range(stages):
        tensors[f"speculator.emb.{i}.weight"] = rng.normal(size=(V, I))
        tensors[f"speculator.head.{i}.weight"] = rng.normal(size=(V, I)) / math.sqrt(I)
        tensors[f"speculator.ln.{i}.weight"] = 1 + 0.3 * rng.normal(size=I)
        tensors[f"speculator.ln.{i}.bias"] = 0.3 * rng.normal(size=I)
    projs = 2 if tie_weights and not aliases else N_PREDICT
    for i in range(projs):
        tensors[f"speculator.proj.{i}.weight"] = rng.normal(size=(I, E if i == 0 else I)) / math.sqrt(I)
    if tie_weights and aliases:  # the copies equal stage 0's (proj: stage 1's)
        for name in list(tensors):
            kind, i = name.split(".")[1], int(name.split(".")[2])
            first = 1 if kind == "proj" else 0
            if i > first:
                tensors[name] = tensors[name.replace(f".{i}.", f".{first}.")]
    tensors = {name: value.astype(np.float32) for name, value in tensors.items()}
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": V,
        "emb_dim": E,
        "inner_dim": 0 if inner_dim == E else inner_dim,  # 0: emb_dim, as published configs say
        "n_predict": N_PREDICT,
        "top_k_tokens_per_head": [4, 3, 2],
        "n_candidates": 4,
        "tie_weights": tie_weights,
        "scale_input": scale_input,
    }
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", {n: of_array(v, n) for n, v in tensors.items()})
    (folder / "config.json").write_text(json.dumps(config))
    return config, tensors


CASES = [  # (inner_dim, tie_weights, scale_input): each switch both ways, inner_dim == E and not
    pytest.param(E, False, False, id="inner=emb-untied-unscaled"),
    pytest.param(48, False, True, id="inner=48-untied-scaled"),
    pytest.param(48, True, False, id="inner=48-tied-unscaled"),
    pytest.param(E, True, True, id="inner=emb-tied-scaled"),
]


@pytest.mark.parametrize("inner_dim, tie_weights, scale_input", CASES)
def test_draft_logits_and_drafts_match_the_float64_reference(tmp_path, inner_dim, tie_weights, scale_input):
    config, tensors = published_speculator(
        tmp_path / "head", inner_dim, tie_weights, scale_input, aliases=tie_weights and scale_input
    )
    head = specjax.load_head(tmp_path / "head", TARGET)
    assert isinstance(head, MLPSpeculatorHead) and head.config.inner_dim == inner_dim
    rng = np.random.default_rng(1)
    B = 6
    hidden = rng.normal(size=(B, E)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, N_PREDICT))
    want = reference_logits(config, tensors, hidden, tokens)
    got = np.asarray(
        mlp_speculator_logits(head.params, head.config, jnp.asarray(hidden), jnp.asarray(tokens))
    )
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()

    # The proposer's greedy chain: each stage fed the previous stage's argmax (from the reference).
    chain = [tokens[:, 0]]
    for i in range(N_PREDICT):
        step = reference_logits(config, tensors, hidden, np.stack(chain, axis=1))
        chain.append(step[:, i].argmax(-1))
    spec = specjax.MLPSpeculator(head).spec(TARGET, WarpSpec())
    lengths = jnp.full((B,), 5, jnp.int32)
    committed = jnp.zeros((B, 8), jnp.int32).at[:, 4].set(jnp.asarray(tokens[:, 0]))
    proposal, _ = by_hand.propose(
        spec,
        TARGET.params,
        head.params,
        LastHiddenState(hidden=jnp.asarray(hidden)),
        committed,
        lengths,
        jax.random.split(jax.random.key(0), B),
        SamplingParams.of(specjax.Sampling(), B, V),
        None,
    )
    np.testing.assert_array_equal(np.asarray(proposal.draft_tokens), np.stack(chain[1:], axis=1))
    assert proposal.draft_probs is None  # greedy: q one-hot


def test_save_head_writes_the_published_format_back(tmp_path):
    config, _ = published_speculator(tmp_path / "release", 48, True, True)
    release = specjax.load_head(tmp_path / "release", TARGET)
    save_head(tmp_path / "ours", release)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == "mlp_speculator" and written["tie_weights"] and written["scale_input"]
    again = specjax.load_head(tmp_path / "ours", TARGET)
    assert again.config == release.config and again.meta == release.meta
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(release.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loss_at_scored_positions_is_the_full_loss_restricted_to_them(tmp_path):
    """`mlp_speculator_loss` at scored positions [B, A] equals a float64 reference computed at every
    position: each stage's teacher-forced cross-entropy and top-1 agreement from `reference_logits`,
    kept where the stage's token is in the row and weighted by how often the position is scored (a
    position drawn twice counts twice; scored=None: every position once). Positions drawn by
    `scored_positions` (each with every stage's token in its row) and chosen by hand (repeats, and
    positions near a row's end where only the first stages, or none, are scored)."""
    config, tensors = published_speculator(tmp_path / "head", 48, False, True)
    head = specjax.load_head(tmp_path / "head", TARGET)
    rng = np.random.default_rng(2)
    B, T, n = 3, 12, N_PREDICT
    lengths = np.array([12, 9, 6])
    hidden = rng.normal(size=(B, T, E)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T))
    for t in range(T - 2):  # half the tokens stage 0's argmax, so that agreement is not all zero
        if rng.random() < 0.5:
            tokens[:, t + 2] = reference_logits(config, tensors, hidden[:, t], tokens[:, t + 1 : t + 2])[
                :, 0
            ].argmax(-1)
    mask = np.arange(T) < lengths[:, None]
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    padded = np.concatenate([tokens, np.zeros((B, n + 1), np.int32)], axis=1)
    ahead = np.stack([padded[:, 1 + i : 1 + i + T] for i in range(n + 1)], axis=-1)  # [B, T, n+1]
    logits = reference_logits(config, tensors, hidden.reshape(B * T, E), ahead[..., :n].reshape(B * T, n))
    logits = logits.reshape(B, T, n, V)
    labels = ahead[..., 1:]  # [B, T, n]: stage i's token, t + 2 + i
    cross_entropy = logsumexp(logits, -1) - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    correct = logits.argmax(-1) == labels
    valid = np.arange(T)[None, :, None] + 2 + np.arange(n) < lengths[:, None, None]  # [B, T, n]

    drawn = np.asarray(scored_positions(jax.random.key(5), jnp.asarray(mask), 16, n + 2))  # [B, 16]
    assert (drawn + n + 1 < lengths[:, None]).all()  # every stage's token in the row
    by_hand = np.array([[0, 4, 4, 9, 11], [1, 6, 6, 7, 8], [0, 2, 3, 3, 5]], np.int32)
    loss = jax.jit(mlp_speculator_loss, static_argnums=1)
    for scored in (None, drawn, by_hand):
        times = (
            np.ones((B, T)) if scored is None else np.stack([np.bincount(row, minlength=T) for row in scored])
        )
        weight = times[..., None] * valid  # [B, T, n]
        want_loss = (weight * cross_entropy).sum((0, 1)) / weight.sum((0, 1))
        want_accuracy = (weight * correct).sum((0, 1)) / weight.sum((0, 1))
        got, metrics = loss(head.params, head.config, hidden, tokens, mask, scored)
        np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-4)
        np.testing.assert_allclose(float(got), want_loss.mean(), rtol=1e-4)
        np.testing.assert_allclose(metrics["accuracy"], want_accuracy, rtol=1e-6)
        assert want_accuracy[0] > 0.2, want_accuracy


# ---------------------------------------------------------------------------------------------
# Trained here, in the loop


@pytest.fixture(scope="module")
def data():
    return own_continuations(TARGET, num_prompts=32)  # half trained_medusa's: the default suite's time


@pytest.fixture(scope="module")
def trained(data):  # every position scored at every step
    return trained_mlp_speculator(TARGET, data, steps=300, n_predict=N_PREDICT, positions_per_sequence=None)


@pytest.fixture(scope="module")
def trained_at_positions(data):  # 8 random positions of each 48 scored a step (the default is 64)
    return trained_mlp_speculator(TARGET, data, steps=300, n_predict=N_PREDICT, positions_per_sequence=8)


@pytest.fixture(scope="module")
def plain():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


def test_trained_speculator_decodes_losslessly_and_accepts_part(trained, plain):
    """Batch 4, ragged: greedy-equal to plain; 34% of the drafts accepted here."""
    result = specjax.generate(TARGET, PROMPTS, proposer=specjax.MLPSpeculator(trained), max_new_tokens=24)
    assert result.tokens == plain
    check_acceptance(result.metrics, 0.2, 0.8)


@pytest.mark.parametrize("run, positions", [("trained", None), ("trained_at_positions", 8)])
def test_training_lowers_the_loss_and_raises_agreement(run, positions, data, request):
    """Over every position of the set, whether training scored all of them or 8 a sequence."""
    trained = request.getfixturevalue(run)
    fresh = MLPSpeculatorHead.init(TARGET, n_predict=N_PREDICT, key=jax.random.key(0))  # the trainer's start
    batch = (jnp.asarray(data.hidden), jnp.asarray(data.tokens), jnp.asarray(data.mask))
    loss = jax.jit(mlp_speculator_loss, static_argnums=1)
    before, before_metrics = loss(fresh.params, fresh.config, *batch)
    after, after_metrics = loss(trained.params, trained.config, *batch)
    assert float(after) < 0.5 * float(before), (float(before), float(after))
    assert (np.asarray(after_metrics["accuracy"]) > np.asarray(before_metrics["accuracy"]) + 0.2).all()
    assert trained.meta["trainer"] == "specjax.train.train_mlp_speculator"
    assert trained.meta["positions_per_sequence"] == positions


@pytest.mark.slow  # the batch-4 test above is the default case
def test_trained_speculator_at_batch_one_and_shorter_k(trained, plain):
    for k in (1, N_PREDICT):
        result = specjax.generate(
            TARGET, PROMPTS[:1], proposer=specjax.MLPSpeculator(trained, k=k), max_new_tokens=24
        )
        assert result.tokens == plain[:1]
        check_acceptance(result.metrics, 0.25, 0.95)  # 0.92 at k = 1, 0.76 at k = 3 here


@pytest.mark.slow  # ~15 s: a second training run
def test_tied_scaled_speculator_trained_here_is_lossless(data, plain, tmp_path):
    head = trained_mlp_speculator(
        TARGET,
        data,
        n_predict=N_PREDICT,
        inner_dim=32,
        tie_weights=True,
        scale_input=True,
        positions_per_sequence=None,
    )
    save_head(tmp_path / "head", head)
    head = specjax.load_head(tmp_path / "head", TARGET)
    result = specjax.generate(TARGET, PROMPTS, proposer=specjax.MLPSpeculator(head), max_new_tokens=24)
    assert result.tokens == plain
    check_acceptance(result.metrics, 0.2, 0.8)  # 41% here


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_arguments_and_folders_are_refused(tmp_path):
    head = MLPSpeculatorHead.init(TARGET, n_predict=2, inner_dim=16)
    with pytest.raises(ValueError, match="MLPSpeculator k=3 exceeds the head's n_predict=2"):
        specjax.MLPSpeculator(head, k=3)
    with pytest.raises(ValueError, match="MLPSpeculator k must be an integer in 1..16, got 0"):
        specjax.MLPSpeculator(head, k=0)
    with pytest.raises(ValueError, match="MLPSpeculator head must be a specjax.models.MLPSpeculatorHead"):
        specjax.MLPSpeculator("head")
    with pytest.raises(ValueError, match="tie_weights needs n_predict >= 2"):
        MLPSpeculatorHead.init(TARGET, n_predict=1, tie_weights=True)
    other = tiny_model(seed=11, vocab_size=50)
    with pytest.raises(ValueError, match="MLP speculator is for hidden size .* vocab 97, the target .* 50"):
        specjax.generate(other, [[1, 2]], proposer=specjax.MLPSpeculator(head), max_new_tokens=2)
    with pytest.raises(ValueError, match="mlp_speculator format only"):
        save_head(tmp_path / "x", head, format="speculators")

    config, tensors = published_speculator(tmp_path / "bad", 48, False, False)
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "n_predict": 4}))
    with pytest.raises(ValueError, match=r"missing \['emb.3.weight'"):
        specjax.load_head(tmp_path / "bad", TARGET)
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "inner_dim": 40}))
    with pytest.raises(ValueError, match=r"proj.0.weight has shape \(48, 64\), the config needs \(40, 64\)"):
        specjax.load_head(tmp_path / "bad", TARGET)
    (tmp_path / "bad" / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "emb_dim"})
    )
    with pytest.raises(ValueError, match="config.json has no 'emb_dim'"):
        specjax.load_head(tmp_path / "bad", TARGET)
    save_head(tmp_path / "narrow", MLPSpeculatorHead.init(tiny_model(seed=11, hidden_size=32), n_predict=2))
    with pytest.raises(ValueError, match=r"MLP speculator is for hidden size \(emb_dim\) 32 and vocab 97"):
        specjax.load_head(tmp_path / "narrow", TARGET)
