"""Training Medusa heads by self-distillation on the target's own continuations.

The data (`specjax.train.distill_data`) are the target's own continuations and its hidden states
along them; the target stays frozen, so training touches only the heads. Head i at position t
predicts token t + 2 + i, read through the target's own LM head restricted to the heads' draft
vocabulary (models/draft_vocab.py); tokens outside it cannot be drafted and are not scored.

Einsum letters: B batch, T positions, M heads, D hidden, V vocab, W draft vocab.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.medusa import MedusaConfig, MedusaHead, MedusaParams, init_medusa, medusa_hidden
from specjax.models.model import Model
from specjax.models.signature import target_signature
from specjax.train.common import (
    batch_order,
    head_meta,
    optimizer_settings,
    per_head_loss,
    shifted_tokens,
    train_head_params,
)
from specjax.train.data import DistillationData, check_training_data, choose_draft_vocab


def medusa_loss(
    params: MedusaParams,
    head_matrix: jax.Array,
    draft_index: jax.Array,
    hidden: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of every head on its shifted tokens, over the draft vocabulary.

    head_matrix [D, W] (`draft_head_matrix`), draft_index [V] (token id -> its draft-vocabulary
    index, -1 outside it: `draft_index_of`); hidden [B, T, D], tokens [B, T], mask [B, T]. Head i at
    position t is scored on token t + 2 + i, where that token is in the sequence and in the draft
    vocabulary. Returns the mean of the per-head losses and {"loss": [M], "accuracy": [M]} (top-1,
    over the scored positions).
    """
    M = params.w.shape[0]
    logits = draft_logits(head_matrix, medusa_hidden(params, hidden))  # [B, T, M, W]
    labels, valid = shifted_tokens(tokens, mask, 2, M)  # [B, T, M]: head i's token, t + 2 + i
    labels = draft_index[labels]  # into the draft vocabulary
    valid = valid & mask[..., None] & (labels >= 0)
    return per_head_loss(logits, jnp.maximum(labels, 0), valid)


_loss_jit = jax.jit(medusa_loss)


def evaluate_medusa(head: MedusaHead, target: Model, data: DistillationData, batch_size: int = 8) -> dict:
    """Per-head loss and top-1 accuracy of `head` over all of `data` (host floats):
    {"loss": float, "head_loss": [M], "head_accuracy": [M]}, each head weighted by its positions."""
    head.check_target(target)
    M = head.config.num_heads
    head_matrix = draft_head_matrix(target.params, jnp.asarray(head.vocab))
    draft_index = draft_index_of(head.vocab, target.config.vocab_size)
    totals, hits, counts = np.zeros(M), np.zeros(M), np.zeros(M)
    for start in range(0, data.num_sequences, batch_size):
        rows = slice(start, start + batch_size)
        _, metrics = _loss_jit(
            head.params, head_matrix, draft_index, data.hidden[rows], data.tokens[rows], data.mask[rows]
        )
        n = _scored_positions(data.tokens[rows], data.mask[rows], M, head.vocab)
        totals += np.asarray(metrics["loss"]) * n
        hits += np.asarray(metrics["accuracy"]) * n
        counts += n
    counts = np.maximum(counts, 1)
    head_loss = (totals / counts).tolist()
    return {
        "loss": float(np.mean(head_loss)),
        "head_loss": head_loss,
        "head_accuracy": (hits / counts).tolist(),
    }


def _scored_positions(tokens: np.ndarray, mask: np.ndarray, num_heads: int, vocab: np.ndarray) -> np.ndarray:
    """How many positions each head is scored on: head i at t where token t + 2 + i is real and in
    the draft vocabulary."""
    scored = mask & np.isin(tokens, vocab)
    return np.array([scored[:, 2 + i :].sum() for i in range(num_heads)], np.float64)


def draft_index_of(vocab: np.ndarray, vocab_size: int) -> jax.Array:
    """[V] int32: each token id's index in the draft vocabulary, -1 for tokens outside it."""
    index = np.full(vocab_size, -1, np.int32)
    index[vocab] = np.arange(len(vocab), dtype=np.int32)
    return jnp.asarray(index)


def train_medusa(
    target: Model,
    data: DistillationData,
    num_heads: int = 4,
    steps: int = 1000,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    clip_norm: float = 1.0,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    resume: bool = True,
    progress: bool = True,
) -> MedusaHead:
    """Train `num_heads` Medusa heads for `target` on `data` (from `distill_data`).

    The heads draft from the `draft_vocab_size` most frequent tokens of the data (default: the
    whole vocabulary). AdamW with gradient clipping and a warmup-cosine schedule (`warmup_steps`
    default: steps // 10); heads start as the identity (Medusa's initialisation). Deterministic
    given `seed`, which fixes the batch order. With `checkpoint_dir`, params, optimizer state and
    step are saved every `checkpoint_every` steps and at the end; `resume=True` continues from the
    latest one there (a resumed run ends with the params of an uninterrupted one).
    """
    check_training_data(target, data)
    check_int("num_heads", num_heads, 1)
    vocab = choose_draft_vocab(target, data, draft_vocab_size)
    settings = optimizer_settings(
        steps, batch_size, learning_rate, warmup_steps, weight_decay, clip_norm, seed, checkpoint_every
    )
    settings = {"num_heads": num_heads, "draft_vocab_size": len(vocab), **settings}
    config = MedusaConfig(num_heads, target.config.hidden_size, target.config.vocab_size, len(vocab))
    head_matrix = draft_head_matrix(target.params, jnp.asarray(vocab))  # [D, W], once per run
    draft_index = draft_index_of(vocab, target.config.vocab_size)
    order = batch_order(seed, data.num_sequences, steps, batch_size)

    def batch(step: int) -> tuple:
        rows = order[step]
        return head_matrix, draft_index, data.hidden[rows], data.tokens[rows], data.mask[rows]

    params = train_head_params(
        "medusa",
        medusa_loss,
        init_medusa(config),
        batch,
        settings=settings,
        vocab=vocab,
        data=data,
        target=target,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        progress=progress,
    )
    meta = head_meta("specjax.train.train_medusa", settings, data.summary())
    return MedusaHead(config, params, target_signature(target), meta, vocab)
