"""Training IBM's MLP speculator by self-distillation on the target's own continuations.

The data (`specjax.train.distill_data`, the same sets the other heads train on) are the target's
own continuations and its final-normed hidden states along them; the target stays frozen. As its
authors train it, every stage is fed the sequence's own tokens (teacher forcing): from the hidden
state at t, stage i reads token t + 1 + i and is scored on token t + 2 + i. A step scores
`positions_per_sequence` random positions of each sequence: the hidden states and tokens are
gathered there before the stages run, so the vocabulary-wide logits, the step's main cost, are
taken at those only.

Einsum letters: B batch, T positions, A scored positions, n stages, V vocab.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.models.mlp_speculator import (
    MLPSpeculatorConfig,
    MLPSpeculatorHead,
    MLPSpeculatorParams,
    init_mlp_speculator,
    mlp_speculator_logits,
)
from specjax.models.model import Model
from specjax.models.signature import target_signature
from specjax.train.common import (
    at_positions,
    batch_order,
    check_positions_per_sequence,
    head_meta,
    optimizer_settings,
    per_head_loss,
    scored_positions,
    shifted_tokens,
    train_head_params,
)
from specjax.train.data import DistillationData, check_training_data


def mlp_speculator_loss(
    params: MLPSpeculatorParams,
    config: MLPSpeculatorConfig,
    hidden: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    scored: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of every stage, teacher-forced: hidden [B, T, D], tokens [B, T], mask [B, T],
    scored [B, A] the positions t scored (None: every position, in order). Stage i at position t
    reads token t + 1 + i and is scored on token t + 2 + i where that token is in the sequence.
    Returns the mean of the per-stage losses and {"loss": [n], "accuracy": [n]} (top-1, over the
    scored positions, a position drawn twice counting twice)."""
    n = config.n_predict
    ahead, real = shifted_tokens(tokens, mask, 1, n + 1)  # [B, T, n+1]: tokens t+1 .. t+n+1
    valid = real[..., 1:] & mask[..., None]  # [B, T, n]
    if scored is not None:  # only the scored positions reach the stages and their heads
        hidden, ahead, valid = (at_positions(x, scored) for x in (hidden, ahead, valid))
    logits = mlp_speculator_logits(params, config, hidden, ahead[..., :n])  # [B, A, n, V]
    return per_head_loss(logits, ahead[..., 1:], valid)


@functools.lru_cache(maxsize=8)
def _objective(config: MLPSpeculatorConfig, positions_per_sequence: int | None):
    """`mlp_speculator_loss` with its config bound and the scored positions drawn per step (all of
    them with None): one function object per setting, so the cached optimizer step
    (`optimizer_and_step`) compiles once for it."""

    def loss(params, hidden, tokens, mask, key):
        scored = scored_positions(key, mask, positions_per_sequence, config.n_predict + 2)  # to t + 1 + n
        return mlp_speculator_loss(params, config, hidden, tokens, mask, scored)

    return loss


def train_mlp_speculator(
    target: Model,
    data: DistillationData,
    n_predict: int = 3,
    inner_dim: int | None = None,
    tie_weights: bool = False,
    scale_input: bool = False,
    positions_per_sequence: int | None = 64,
    steps: int = 1000,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    clip_norm: float = 1.0,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    resume: bool = True,
    progress: bool = True,
) -> MLPSpeculatorHead:
    """Train an MLP speculator of `n_predict` stages for `target` on `data` (from `distill_data`).

    inner_dim (default: the target's hidden size), tie_weights and scale_input as in the published
    config (models/mlp_speculator.py). Each step scores `positions_per_sequence` random positions
    of every sequence (None: all of them; module docstring). AdamW with gradient clipping and a
    warmup-cosine schedule (`warmup_steps` default: steps // 10) from the authors' initialisation;
    deterministic given `seed` (init, batch order, scored positions). With `checkpoint_dir`,
    params, optimizer state and step are saved every `checkpoint_every` steps and at the end;
    `resume=True` continues from the latest one.
    """
    check_training_data(target, data)
    check_int("n_predict", n_predict, 1)
    inner_dim = target.config.hidden_size if inner_dim is None else inner_dim
    check_int("inner_dim", inner_dim, 1)
    check_positions_per_sequence(positions_per_sequence)
    for name, value in (("tie_weights", tie_weights), ("scale_input", scale_input)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    c = target.config
    config = MLPSpeculatorConfig(c.hidden_size, inner_dim, c.vocab_size, n_predict, tie_weights, scale_input)
    settings = optimizer_settings(
        steps, batch_size, learning_rate, warmup_steps, weight_decay, clip_norm, seed, checkpoint_every
    )
    settings = {
        "n_predict": n_predict,
        "inner_dim": inner_dim,
        "tie_weights": tie_weights,
        "scale_input": scale_input,
        "positions_per_sequence": positions_per_sequence,
        **settings,
    }
    order = batch_order(seed, data.num_sequences, steps, batch_size)
    position_root = jax.random.fold_in(jax.random.key(seed), 1)  # apart from the init's key(seed)

    def batch(step: int) -> tuple:
        rows = order[step]
        key = jax.random.fold_in(position_root, step)
        return (
            jnp.asarray(data.hidden[rows]),
            jnp.asarray(data.tokens[rows]),
            jnp.asarray(data.mask[rows]),
            key,
        )

    params = train_head_params(
        "mlp_speculator",
        _objective(config, positions_per_sequence),
        init_mlp_speculator(config, jax.random.key(seed)),
        batch,
        settings=settings,
        vocab=np.arange(c.vocab_size, dtype=np.int32),  # it drafts over the whole vocabulary
        data=data,
        target=target,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        progress=progress,
    )
    meta = head_meta("specjax.train.train_mlp_speculator", settings, data.summary())
    return MLPSpeculatorHead(config, params, target_signature(target), meta)
