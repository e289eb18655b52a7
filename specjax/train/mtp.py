"""Training MTP layers (models/mtp.py) for a target that has none, by self-distillation.

DeepSeek-V3's multi-token-prediction module, trained here on the frozen target's own
continuations (`distill_data`, the sets the other heads train on): layer 0 reads the target's
final-normed hidden state at t and the embedding of token t + 1 and is scored on token t + 2
through the target's own LM head; layer j > 0 reads layer j - 1's post-norm output at t and token
t + 1 + j and is scored on token t + 2 + j, as `specjax.MTP` chains them. Only the layers train
(enorm, hnorm, eh_proj, the decoder block, shared_head.norm); the embedding and the head are the
target's. A step scores `positions_per_sequence` random positions of each sequence: every
position runs through the layer, but the vocabulary-wide logits, the step's main cost, are taken
at those only.

Einsum letters: B batch, T positions, A scored positions, M layers, D hidden, V vocab.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.models.cache import init_cache
from specjax.models.config import LlamaConfig
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.model import Model
from specjax.models.mtp import MTPLayerParams, MTPLayers, init_mtp_layer, mtp_features, mtp_layer_config
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

INITS = ("last_layer", "random")


def mtp_loss(
    layers: tuple[MTPLayerParams, ...],
    config: LlamaConfig,
    embed: jax.Array,
    head_matrix: jax.Array,
    hidden: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    scored: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of each layer, teacher-forced: hidden [B, T, D] (the target's), tokens [B, T],
    mask [B, T], scored [B, A] the positions t scored (layer j on token t + 2 + j, where that token
    is in the sequence). `config` is `mtp_layer_config(target)`, embed [V, D] and head_matrix
    [D, V] the target's. Returns the mean of the per-layer losses and {"loss": [M], "accuracy":
    [M]} (top-1 over the scored positions)."""
    B, T = tokens.shape
    M = len(layers)
    ahead, real = shifted_tokens(tokens, mask, 1, M + 1)  # [B, T, M+1]: tokens t+1 .. t+M+1
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    features, outputs = hidden.astype(embed.dtype), []
    for j, layer in enumerate(layers):
        cache = init_cache(config, B, T, embed.dtype)
        features, _ = mtp_features(
            layer, config, embed, features, ahead[..., j], positions, cache, empty_cache=True
        )
        outputs.append(at_positions(features, scored))  # [B, A, D]
    logits = draft_logits(head_matrix, jnp.stack(outputs, axis=2))  # [B, A, M, V]
    labels = at_positions(ahead[..., 1:], scored)  # [B, A, M]
    valid = at_positions(real[..., 1:] & mask[..., None], scored)
    return per_head_loss(logits, labels, valid)


@functools.lru_cache(maxsize=8)
def _objective(config: LlamaConfig, positions_per_sequence: int | None, num_layers: int):
    """`mtp_loss` with the scored positions drawn per step (all of them with None): one function
    object per setting, so the cached optimizer step compiles once for it."""

    def loss(layers, embed, head_matrix, hidden, tokens, mask, key):
        scored = scored_positions(key, mask, positions_per_sequence, num_layers + 2)  # tokens to t + 1 + M
        return mtp_loss(layers, config, embed, head_matrix, hidden, tokens, mask, scored)

    return loss


def initial_mtp_layer(target: Model, key: jax.Array, init: str = "last_layer") -> MTPLayerParams:
    """A starting MTP layer for `target`: "random" is `init_mtp_layer`; "last_layer" (default) takes
    the target's last decoder layer as its block and the target's final norm as its head norm, so
    its output starts in the space the LM head reads, with eh_proj [I; I] / sqrt(2) passing both
    inputs (normed embedding, normed hidden state) on at unit scale, plus noise at 1% of the random
    init's."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    fresh = init_mtp_layer(target.config, key, target.params.embed.dtype)
    if init == "random":
        return fresh
    D = target.config.hidden_size
    block = target.params.layers[-1]
    if jax.tree.structure(block) != jax.tree.structure(fresh.block):  # e.g. a dense last layer, MoE MTP block
        raise ValueError(
            "init='last_layer': the target's last layer is not shaped like its MTP block; use init='random'"
        )
    eh_proj = jnp.concatenate([jnp.eye(D), jnp.eye(D)], axis=0) / np.sqrt(2) + 0.01 * fresh.eh_proj
    return fresh.replace(
        eh_proj=eh_proj.astype(fresh.eh_proj.dtype), block=block, head_norm=target.params.final_norm
    )


def train_mtp(
    target: Model,
    data: DistillationData,
    num_layers: int = 1,
    init: str = "last_layer",
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
) -> MTPLayers:
    """Train `num_layers` MTP layers for `target` on `data` (from `distill_data`); returns them as
    `MTPLayers`: draft with `specjax.MTP(k)` over `target.with_mtp(layers)`.

    Each layer starts as `initial_mtp_layer(target, key, init)`; each step scores
    `positions_per_sequence` random positions of every sequence (None: all of them; module
    docstring). AdamW with gradient clipping and a warmup-cosine schedule (`warmup_steps` default:
    steps // 10); deterministic given `seed` (init, batch order, scored positions). With
    `checkpoint_dir`, params, optimizer state and step are saved every `checkpoint_every` steps
    and at the end; `resume=True` continues from the latest one there.
    """
    check_training_data(target, data)
    check_int("num_layers", num_layers, 1)
    check_positions_per_sequence(positions_per_sequence)
    if num_layers + 2 > data.tokens.shape[1]:
        raise ValueError(
            f"data sequences must span at least num_layers + 2 = {num_layers + 2} positions, got "
            f"{data.tokens.shape[1]}"
        )
    settings = optimizer_settings(
        steps, batch_size, learning_rate, warmup_steps, weight_decay, clip_norm, seed, checkpoint_every
    )
    settings = {
        "num_layers": num_layers,
        "init": init,
        "positions_per_sequence": positions_per_sequence,
        **settings,
    }
    config = mtp_layer_config(target.config)
    V = target.config.vocab_size
    vocab = np.arange(V, dtype=np.int32)  # the target's head: the whole vocabulary
    head_matrix = draft_head_matrix(target.params, jnp.asarray(vocab))  # [D, V], once per run
    layers = tuple(
        initial_mtp_layer(target, jax.random.fold_in(jax.random.key(seed), j), init)
        for j in range(num_layers)
    )
    order = batch_order(seed, data.num_sequences, steps, batch_size)
    position_root = jax.random.fold_in(jax.random.key(seed), num_layers)  # apart from the inits' keys

    def batch(step: int) -> tuple:
        rows = order[step]
        key = jax.random.fold_in(position_root, step)
        return (target.params.embed, head_matrix, data.hidden[rows], data.tokens[rows], data.mask[rows], key)

    layers = train_head_params(
        "mtp",
        _objective(config, positions_per_sequence, num_layers),
        layers,
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
    meta = head_meta("specjax.train.train_mtp", settings, data.summary())
    return MTPLayers(config, tuple(layers), target_signature(target), meta)
