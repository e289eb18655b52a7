"""Training IBM's MLP speculator by self-distillation on the target's own continuations.

The data (`specjax.train.distill_data`, the same sets the other heads train on) are the target's
own continuations and its final-normed hidden states along them; the target stays frozen. As its
authors train it, every stage is fed the sequence's own tokens (teacher forcing): from the hidden
state at t, stage i reads token t + 1 + i and is scored on token t + 2 + i.

Einsum letters: B batch, T positions, n stages, V vocab.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

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
    batch_order,
    check_int,
    head_meta,
    optimizer_settings,
    per_head_loss,
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of every stage, teacher-forced: hidden [B, T, D], tokens [B, T], mask [B, T].
    Stage i at position t reads token t + 1 + i and is scored on token t + 2 + i where that token
    is in the sequence. Returns the mean of the per-stage losses and {"loss": [n], "accuracy": [n]}
    (top-1, over the scored positions)."""
    n = config.n_predict
    ahead, real = shifted_tokens(tokens, mask, 1, n + 1)  # [B, T, n+1]: tokens t+1 .. t+n+1
    logits = mlp_speculator_logits(params, config, hidden, ahead[..., :n])  # [B, T, n, V]
    return per_head_loss(logits, ahead[..., 1:], real[..., 1:] & mask[..., None])


@functools.lru_cache(maxsize=8)
def _objective(config: MLPSpeculatorConfig):
    """`mlp_speculator_loss` with its config bound: one function object per config, so the cached
    optimizer step (`optimizer_and_step`) compiles once for it."""

    def loss(params, hidden, tokens, mask):
        return mlp_speculator_loss(params, config, hidden, tokens, mask)

    return loss


def train_mlp_speculator(
    target: Model,
    data: DistillationData,
    n_predict: int = 3,
    inner_dim: int | None = None,
    tie_weights: bool = False,
    scale_input: bool = False,
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
    config (models/mlp_speculator.py). AdamW with gradient clipping and a warmup-cosine schedule
    (`warmup_steps` default: steps // 10) from the authors' initialisation, seeded by `seed`, which
    also fixes the batch order. With `checkpoint_dir`, params, optimizer state and step are saved
    every `checkpoint_every` steps and at the end; `resume=True` continues from the latest one.
    """
    check_training_data(target, data)
    check_int("n_predict", n_predict, 1)
    inner_dim = target.config.hidden_size if inner_dim is None else inner_dim
    check_int("inner_dim", inner_dim, 1)
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
        **settings,
    }
    order = batch_order(seed, data.num_sequences, steps, batch_size)

    def batch(step: int) -> tuple:
        rows = order[step]
        return jnp.asarray(data.hidden[rows]), jnp.asarray(data.tokens[rows]), jnp.asarray(data.mask[rows])

    params = train_head_params(
        "mlp_speculator",
        _objective(config),
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
