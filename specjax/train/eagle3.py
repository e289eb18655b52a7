"""Training EAGLE-3 heads (Li et al. 2025) by self-distillation, with training-time test.

The data are `specjax.train.distill_data`'s: the target's own continuations, with its final-normed
hidden states; the streams entering the head's fused layers are computed once from the tokens
(`target_features`). The head fuses them at t (fc), reads them beside the embedding of x_{t+1},
and its logits over its draft vocabulary are scored against the target's distribution at t + 1
(the next token's), by cross-entropy: EAGLE-3 drops EAGLE-1's feature regression, since its
output only has to read tokens, not be a target feature.

Training-time test (the paper's name): the head is unrolled on its own outputs, as it drafts.
Pass p feeds, at t, the output pass p - 1 made at t - 1 (in place of the fused target features)
with token t + 1, attending as a depth-(p-1) draft does: to pass 1's inputs up to t - p + 1, to
the pass-q input at t - p + q for q = 2 .. p - 1, and to itself (the same masks as EAGLE's
`eagle_loss` with `unroll`, train/eagle.py). The loss is the passes' mean.

Einsum letters: B batch, T positions, D hidden, A fused width, W draft vocab.
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
from specjax.models.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    Eagle3Params,
    default_aux_layer_ids,
    eagle3_features,
    eagle3_logits,
    fuse_features,
    init_eagle3,
)
from specjax.models.model import Model
from specjax.models.quantized import as_array
from specjax.models.signature import target_signature
from specjax.train.common import (
    batch_order,
    head_meta,
    optimizer_settings,
    train_head_params,
)
from specjax.train.data import DistillationData, check_training_data, choose_draft_vocab, target_features


def unrolled_visible(B: int, P: int, p: int, unroll: int) -> jax.Array:
    """[B, P, unroll * P] bool: which cache slots pass p's input at t sees, when pass q's inputs
    sit in slots (q-1)*P .. q*P-1 (see the module docstring)."""
    t = jnp.arange(P)
    slot = jnp.arange(unroll * P)
    slot_pass, slot_input = slot // P + 1, slot % P
    first = (slot_pass[None, :] == 1) & (slot_input[None, :] <= t[:, None] - p + 1)
    later = (slot_pass[None, :] >= 2) & (slot_pass[None, :] <= p)
    later &= slot_input[None, :] == t[:, None] - p + slot_pass[None, :]
    return jnp.broadcast_to((first | later)[None], (B, P, unroll * P))


def eagle3_loss(
    params: Eagle3Params,
    config: Eagle3Config,
    embed: jax.Array,
    teacher_matrix: jax.Array,
    aux: jax.Array,
    hidden: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    unroll: int = 3,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of a batch: aux [B, T, A] (the target's fused streams), hidden [B, T, D] (its
    final-normed states: the teacher's logits are teacher_matrix [D, W], the target's head over the
    draft vocabulary), tokens, mask [B, T]. Returns the mean over passes of the cross-entropy
    between the head's and the target's distributions at t + 1, and {"loss", "accuracy" (pass 1's
    top-1 agreement), "accuracy_p" for later passes}."""
    B, T, _ = aux.shape
    P = T - 1
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = init_cache(config.layer_config, B, unroll * P)
    fused = fuse_features(params, config, aux[:, :-1])
    outputs, cache = eagle3_features(
        params, config, embed, fused, tokens[:, 1:], positions, cache, empty_cache=True
    )
    teacher = jax.lax.stop_gradient(jax.nn.softmax(draft_logits(teacher_matrix, hidden[:, 1:])))
    teacher_top = jnp.argmax(teacher, axis=-1)
    valid = mask[:, :-1] & mask[:, 1:]

    def score(outputs, valid):
        weight = valid.astype(jnp.float32)
        count = jnp.maximum(weight.sum(), 1.0)
        logits = eagle3_logits(params, config, outputs)
        loss = (optax.softmax_cross_entropy(logits, teacher) * weight).sum() / count
        accuracy = ((jnp.argmax(logits, -1) == teacher_top) * weight).sum() / count
        return loss, accuracy

    total, accuracy = score(outputs, valid)
    metrics = {"accuracy": accuracy}
    for p in range(2, unroll + 1):
        fed = jnp.concatenate([jnp.zeros_like(outputs[:, :1]), outputs[:, :-1]], axis=1)
        outputs, cache = eagle3_features(
            params,
            config,
            embed,
            fed,
            tokens[:, 1:],
            positions,
            cache.replace(lengths=jnp.full((B,), (p - 1) * P, jnp.int32)),
            visible=unrolled_visible(B, P, p, unroll),
        )
        valid = valid & jnp.concatenate([jnp.zeros_like(valid[:, :1]), valid[:, :-1]], axis=1)
        loss, metrics[f"accuracy_{p}"] = score(outputs, valid)
        total = total + loss
    loss = total / unroll
    return loss, {"loss": loss, **metrics}


@functools.lru_cache(maxsize=8)
def _objective(config: Eagle3Config, unroll: int):
    def loss(params, embed, teacher_matrix, aux, hidden, tokens, mask):
        return eagle3_loss(params, config, embed, teacher_matrix, aux, hidden, tokens, mask, unroll)

    return loss


_loss_jit = jax.jit(eagle3_loss, static_argnums=1, static_argnames=("unroll",))


def evaluate_eagle3(
    head: Eagle3Head, target: Model, data: DistillationData, batch_size: int = 8, unroll: int = 3
) -> dict:
    """The loss and top-1 agreement of `head` over all of `data`, pass by pass (as `eagle3_loss`;
    each batch weighted by the positions it scores)."""
    head.check_target(target)
    check_int("batch_size", batch_size, 1)
    aux = target_features(target, data, head.config.aux_layer_ids, batch_size)
    teacher = draft_head_matrix(target.params, jnp.asarray(head.vocab))
    names = ["loss", "accuracy", *(f"accuracy_{p}" for p in range(2, unroll + 1))]
    totals, counts = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    for start in range(0, data.num_sequences, batch_size):
        rows = slice(start, start + batch_size)
        _, metrics = _loss_jit(
            head.params,
            head.config,
            target.params.embed,
            teacher,
            aux[rows],
            data.hidden[rows],
            data.tokens[rows],
            data.mask[rows],
            unroll=unroll,
        )
        scored = data.mask[rows][:, :-1] & data.mask[rows][:, 1:]
        for p, name in enumerate(names[1:], start=1):
            if p > 1:
                scored = scored & np.pad(scored[:, :-1], ((0, 0), (1, 0)))
            totals[name] += float(metrics[name]) * int(scored.sum())
            counts[name] += int(scored.sum())
        n = int((data.mask[rows][:, :-1] & data.mask[rows][:, 1:]).sum())
        totals["loss"] += float(metrics["loss"]) * n
        counts["loss"] += n
    return {name: totals[name] / max(counts[name], 1) for name in names}


def train_eagle3(
    target: Model,
    data: DistillationData,
    draft_vocab_size: int | None = None,
    aux_layer_ids=None,
    steps: int = 1000,
    batch_size: int = 8,
    learning_rate: float = 3e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    clip_norm: float = 0.5,
    unroll: int = 3,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    resume: bool = True,
    progress: bool = True,
) -> Eagle3Head:
    """Train an EAGLE-3 head for `target` on `data`, unrolled over `unroll` passes of its own
    outputs (training-time test; 1: teacher forcing only).

    The head fuses the streams entering `aux_layer_ids` (default: EAGLE-3's 2, L/2, L-3), drafts
    from the `draft_vocab_size` most frequent tokens of the data (default: all), and its LM head
    starts from the target's columns for them. AdamW with clipping and warmup-cosine
    (`warmup_steps` default steps // 10). Deterministic given `seed`; with `checkpoint_dir`,
    checkpointed every `checkpoint_every` steps and resumable (a resumed run ends with an
    uninterrupted run's params).
    """
    check_training_data(target, data)
    vocab = choose_draft_vocab(target, data, draft_vocab_size)
    settings = optimizer_settings(
        steps, batch_size, learning_rate, warmup_steps, weight_decay, clip_norm, seed, checkpoint_every
    )
    check_int("unroll", unroll, 1)
    if unroll >= data.tokens.shape[1]:
        raise ValueError(
            f"unroll must be below the data's sequence length {data.tokens.shape[1]}, got {unroll}"
        )
    ids = default_aux_layer_ids(target.config.num_layers) if aux_layer_ids is None else tuple(aux_layer_ids)
    config = Eagle3Config.for_target(target.config, len(vocab), aux_layer_ids=ids)
    settings = {"draft_vocab_size": len(vocab), "aux_layer_ids": list(ids), **settings, "unroll": unroll}
    aux = target_features(target, data, ids, batch_size)
    teacher = draft_head_matrix(target.params, jnp.asarray(vocab))  # [D, W]
    params = init_eagle3(config, jax.random.key(seed))
    params = params.replace(lm_head=as_array(teacher, params.lm_head.dtype))  # the target's columns
    order = batch_order(seed, data.num_sequences, steps, batch_size)

    def batch(step: int) -> tuple:
        rows = order[step]
        return target.params.embed, teacher, aux[rows], data.hidden[rows], data.tokens[rows], data.mask[rows]

    params = train_head_params(
        "eagle3",
        _objective(config, unroll),
        params,
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
    meta = head_meta("specjax.train.train_eagle3", settings, data.summary())
    return Eagle3Head(config, params, vocab, target_signature(target), meta)
