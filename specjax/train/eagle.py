"""Training EAGLE heads (Li et al. 2024) by self-distillation on the target's own continuations.

The data (`specjax.train.distill_data`) are the target's own continuations and its final-normed
hidden states f along them; the target stays frozen. Training is teacher-forced, every position
of a sequence at once: the head's input at t is (f_t + uniform noise, x_{t+1}) and its prediction
is scored against f_{t+1} twice, as EAGLE-1 does: a smooth-L1 regression on the features, and a
soft cross-entropy between the tokens both read through the target's LM head (restricted to the
head's draft vocabulary) - the second is what drafting needs, the first keeps the features usable
as the next step's input. The noise stands in for the errors of the head's own predictions,
which replace f when it drafts.

Einsum letters: B batch, T positions, D hidden, V vocab, W draft vocab.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.checks import check_int
from specjax.models.cache import init_cache
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.eagle import EagleConfig, EagleHead, EagleParams, eagle_features, init_eagle
from specjax.models.model import Model
from specjax.models.params import LlamaParams
from specjax.models.signature import target_signature
from specjax.train.common import (
    batch_order,
    check_number,
    head_meta,
    optimizer_settings,
    train_head_params,
)
from specjax.train.data import DistillationData, check_training_data, choose_draft_vocab


def eagle_loss(
    params: EagleParams,
    config: EagleConfig,
    target_params: LlamaParams,
    head_matrix: jax.Array,
    hidden: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    noise_key: jax.Array,
    noise: float | jax.Array,
    reg_weight: float | jax.Array = 1.0,
    cls_weight: float | jax.Array = 0.1,
    unroll: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """EAGLE-1's teacher-forced loss on a batch, optionally unrolled over the head's own
    predictions.

    hidden [B, T, D], tokens [B, T], mask [B, T]; head_matrix [D, W] (`draft_head_matrix`). The
    input at t = 0..T-2 is (hidden[:, t] + U(-noise, noise), tokens[:, t+1]); the prediction there
    targets hidden[:, t+1], scored where both tokens t and t+1 are in the sequence.

    `unroll = n > 1` adds n - 1 passes that train the head as it drafts (EAGLE-3's "training-time
    test"): pass p feeds, at t, the feature pass p - 1 predicted at t - 1 (for f_t) with token
    t + 1, and attends as a depth-(p-1) draft node does: to the true-feature inputs 0 .. t-p+1 of
    pass 1, to the pass-q input at t-p+q for q = 2 .. p-1, and to itself. Each pass is scored
    like the first, where tokens t-p+1 .. t+1 are in the sequence; the loss is the passes' mean.

    Returns reg_weight * regression + cls_weight * classification and {"loss", "regression",
    "classification", "accuracy"} (top-1 agreement with the target over the draft vocabulary), of
    pass 1; with `unroll > 1` also "accuracy_p" for each later pass p.
    """
    B, T, _ = hidden.shape
    P = T - 1  # inputs per pass
    inputs = hidden[:, :-1] + jax.random.uniform(noise_key, hidden[:, :-1].shape, minval=-noise, maxval=noise)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # Pass p's keys and values sit in slots (p-1)*P .. p*P-1 of one cache, so later passes see them.
    cache = init_cache(config.layer_config, B, unroll * P)
    predicted, cache = eagle_features(
        params, config, target_params.embed, inputs, tokens[:, 1:], positions, cache, empty_cache=True
    )  # [B, P, D]: causal attention among the inputs
    wanted = hidden[:, 1:]  # [B, P, D]
    pair_valid = mask[:, :-1] & mask[:, 1:]  # [B, P]

    def score(predicted, valid):
        valid = valid.astype(jnp.float32)
        count = jnp.maximum(valid.sum(), 1.0)
        regression = optax.huber_loss(predicted, wanted, delta=1.0).mean(axis=-1)  # smooth L1, [B, P]
        logits = draft_logits(head_matrix, predicted)  # [B, P, W]
        wanted_logits = jax.lax.stop_gradient(draft_logits(head_matrix, wanted))
        classification = optax.softmax_cross_entropy(logits, jax.nn.softmax(wanted_logits))  # [B, P]
        agree = (jnp.argmax(logits, axis=-1) == jnp.argmax(wanted_logits, axis=-1)).astype(jnp.float32)
        metrics = {
            "regression": (regression * valid).sum() / count,
            "classification": (classification * valid).sum() / count,
            "accuracy": (agree * valid).sum() / count,
        }
        return reg_weight * metrics["regression"] + cls_weight * metrics["classification"], metrics

    loss, metrics = score(predicted, pair_valid)
    total = loss
    t = jnp.arange(P)
    slot = jnp.arange(unroll * P)
    slot_pass, slot_input = slot // P + 1, slot % P  # which pass and input a slot holds
    valid = pair_valid
    for p in range(2, unroll + 1):
        # f^_t from pass p-1's output at t-1; the first input has none (never scored).
        fed = jnp.concatenate([jnp.zeros_like(predicted[:, :1]), predicted[:, :-1]], axis=1)
        first = (slot_pass[None, :] == 1) & (slot_input[None, :] <= t[:, None] - p + 1)
        later = (slot_pass[None, :] >= 2) & (slot_pass[None, :] <= p)
        later &= slot_input[None, :] == t[:, None] - p + slot_pass[None, :]
        visible = jnp.broadcast_to((first | later)[None], (B, P, unroll * P))
        predicted, cache = eagle_features(
            params,
            config,
            target_params.embed,
            fed,
            tokens[:, 1:],
            positions,
            cache.replace(lengths=jnp.full((B,), (p - 1) * P, jnp.int32)),  # writes after pass p-1
            visible=visible,
        )
        valid = valid & jnp.concatenate([jnp.zeros_like(valid[:, :1]), valid[:, :-1]], axis=1)
        pass_loss, pass_metrics = score(predicted, valid)
        total = total + pass_loss
        metrics[f"accuracy_{p}"] = pass_metrics["accuracy"]
    loss = total / unroll
    return loss, {"loss": loss, **metrics}


_loss_jit = jax.jit(eagle_loss, static_argnums=1, static_argnames=("unroll",))


@functools.lru_cache(maxsize=8)
def _objective(config: EagleConfig, reg_weight: float, cls_weight: float, unroll: int):
    """`eagle_loss` with its static parts bound: one function object per setting, so the cached
    optimizer step (`optimizer_and_step`) compiles once for it."""

    def loss(params, target_params, head_matrix, hidden, tokens, mask, noise_key, noise):
        return eagle_loss(
            params,
            config,
            target_params,
            head_matrix,
            hidden,
            tokens,
            mask,
            noise_key,
            noise,
            reg_weight,
            cls_weight,
            unroll,
        )

    return loss


def evaluate_eagle(
    head: EagleHead, target: Model, data: DistillationData, batch_size: int = 8, unroll: int = 1
) -> dict:
    """The loss (default weights), its two parts and top-1 accuracy of `head` over all of `data`,
    without noise: {"loss", "regression", "classification", "accuracy"}, host floats. With
    `unroll = n > 1`, also "accuracy_p" for p = 2..n: the head fed its own predicted features
    p - 1 times before the scored position, as it drafts, and "loss" is `eagle_loss`'s mean over
    the passes (its parts and "accuracy" stay pass 1's). Each figure weights every batch by the
    positions it scores: pass p needs tokens t-p+1 .. t+1 in the mask."""
    if not isinstance(head, EagleHead):
        raise ValueError(f"head must be a specjax.models.EagleHead, got {type(head).__name__}")
    head.check_target(target)
    check_int("batch_size", batch_size, 1)
    check_int("unroll", unroll, 1)
    head_matrix = draft_head_matrix(target.params, jnp.asarray(head.vocab))
    key = jax.random.key(0)  # unused: no noise
    names = ["loss", "regression", "classification", "accuracy"] + [
        f"accuracy_{p}" for p in range(2, unroll + 1)
    ]
    totals, counts = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    for start in range(0, data.num_sequences, batch_size):
        rows = slice(start, start + batch_size)
        mask = data.mask[rows]
        _, metrics = _loss_jit(
            head.params,
            head.config,
            target.params,
            head_matrix,
            data.hidden[rows],
            data.tokens[rows],
            mask,
            key,
            0.0,
            unroll=unroll,
        )
        scored = mask[:, :-1] & mask[:, 1:]  # pass 1's positions; the loss's parts are pass 1's
        for p in range(1, unroll + 1):
            if p > 1:
                scored = scored & np.pad(scored[:, :-1], ((0, 0), (1, 0)))
            for name in names[:4] if p == 1 else [f"accuracy_{p}"]:
                totals[name] += float(metrics[name]) * int(scored.sum())
                counts[name] += int(scored.sum())
    return {name: totals[name] / max(counts[name], 1) for name in names}


def train_eagle(
    target: Model,
    data: DistillationData,
    draft_vocab_size: int | None = None,
    steps: int = 1000,
    batch_size: int = 8,
    learning_rate: float = 3e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    clip_norm: float = 0.5,
    noise: float = 0.1,
    reg_weight: float = 1.0,
    cls_weight: float = 0.1,
    unroll: int = 1,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    resume: bool = True,
    progress: bool = True,
) -> EagleHead:
    """Train an EAGLE head for `target` on `data` (from `distill_data`).

    The head drafts from the `draft_vocab_size` most frequent tokens of the data (default: the
    whole vocabulary) and starts from `init_eagle` with `jax.random.key(seed)`. AdamW with
    gradient clipping and a warmup-cosine schedule (`warmup_steps` default: steps // 10); inputs
    get uniform noise in [-noise, noise]; the loss is `eagle_loss` with `reg_weight` and
    `cls_weight` (EAGLE-1's 1.0 and 0.1), unrolled over `unroll` passes (1: EAGLE-1's teacher
    forcing; more: also trained on its own predicted features, as it drafts). Deterministic given
    `seed`, which fixes the init, the batch order and the noise. With `checkpoint_dir`, params,
    optimizer state and step are saved every `checkpoint_every` steps and at the end;
    `resume=True` continues from the latest one there (a resumed run ends with the params of an
    uninterrupted one).
    """
    check_training_data(target, data)
    vocab = choose_draft_vocab(target, data, draft_vocab_size)
    if data.tokens.shape[1] < 2:
        raise ValueError(f"data sequences must span at least 2 positions, got {data.tokens.shape[1]}")
    settings = optimizer_settings(
        steps, batch_size, learning_rate, warmup_steps, weight_decay, clip_norm, seed, checkpoint_every
    )
    check_number("noise", noise, allow_zero=True)
    check_number("reg_weight", reg_weight, allow_zero=True)
    check_number("cls_weight", cls_weight, allow_zero=True)
    if reg_weight == cls_weight == 0:
        raise ValueError("reg_weight and cls_weight must not both be 0")
    check_int("unroll", unroll, 1)
    if unroll >= data.tokens.shape[1]:
        raise ValueError(
            f"unroll must be below the data's sequence length {data.tokens.shape[1]}, got {unroll}"
        )

    settings = {
        "draft_vocab_size": len(vocab),
        **settings,
        "noise": float(noise),
        "reg_weight": float(reg_weight),
        "cls_weight": float(cls_weight),
        "unroll": unroll,
    }
    config = EagleConfig.for_target(target.config, len(vocab))
    head_matrix = draft_head_matrix(target.params, jnp.asarray(vocab))  # [D, W], once per run
    order = batch_order(seed, data.num_sequences, steps, batch_size)
    noise_root = jax.random.fold_in(jax.random.key(seed), 1)  # apart from the init's key

    def batch(step: int) -> tuple:
        rows = order[step]
        noise_key = jax.random.fold_in(noise_root, step)
        return (
            target.params,
            head_matrix,
            data.hidden[rows],
            data.tokens[rows],
            data.mask[rows],
            noise_key,
            noise,
        )

    params = train_head_params(
        "eagle",
        _objective(config, settings["reg_weight"], settings["cls_weight"], unroll),
        init_eagle(config, jax.random.key(seed)),
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
    meta = head_meta("specjax.train.train_eagle", settings, data.summary())
    return EagleHead(config, params, vocab, target_signature(target), meta)
