"""Training DFlash heads by self-distillation: blocks anchored at random positions of the target's
own continuations, each scored as the head drafts it.

For an anchor a in a sequence, the block is [x_a, mask, ..., mask] at positions a .. a+B-1; it
sees the context (the target's fused features at positions before a, projected into each layer's
keys and values, as `dflash_context` writes them) and itself, and slot i >= 1 is scored against
the target's distribution at a + i - 1 (the token at a + i), by cross-entropy weighted
exp(-(i-1)/gamma): the first drafts matter most, since a chain stops at its first rejection
(speculators' weighting). Many anchors of a sequence share one pass: every block's queries sit
side by side, each seeing the context before its own anchor and its own block only.

Einsum letters: B batch, T positions, A anchors, K block size, D hidden, W draft vocab.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from specjax.checks import check_int
from specjax.models.cache import init_cache
from specjax.models.dflash import DFlashConfig, DFlashHead, DFlashParams, dflash_context, init_dflash
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.eagle3 import default_aux_layer_ids
from specjax.models.llama import decoder_layers
from specjax.models.model import Model
from specjax.models.norms import rms_norm
from specjax.models.quantized import as_array
from specjax.models.signature import target_signature
from specjax.train.common import (
    anchor_positions,
    batch_order,
    check_number,
    head_meta,
    optimizer_settings,
    train_head_params,
)
from specjax.train.data import DistillationData, check_training_data, choose_draft_vocab, target_features


def dflash_loss(
    params: DFlashParams,
    config: DFlashConfig,
    embed: jax.Array,
    teacher_matrix: jax.Array,
    aux: jax.Array,
    hidden: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    anchors: jax.Array,
    gamma: float = 4.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of a batch of blocks: aux [B, T, A'] the target's fused streams, hidden [B, T, D]
    its final-normed states (the teacher: teacher_matrix [D, W], its head over the draft
    vocabulary), anchors [B, A]. Returns the weighted cross-entropy and {"loss", "accuracy" (top-1
    agreement at slot 1), "accuracy_i" for slots 2 .. K-1}."""
    B, T, _ = aux.shape
    K = config.block_size
    A = anchors.shape[1]
    c = config.layer_config
    cache = init_cache(c, B, T + A * K)
    cache = dflash_context(params, config, aux, jnp.broadcast_to(jnp.arange(T), (B, T)), cache)
    cache = cache.replace(lengths=jnp.full((B,), T, jnp.int32))  # the blocks go after the context
    offsets = jnp.arange(K)
    positions = (anchors[:, :, None] + offsets).reshape(B, A * K)  # [B, A*K]
    block_tokens = jnp.full((B, A, K), config.mask_token_id, jnp.int32)
    block_tokens = block_tokens.at[:, :, 0].set(jnp.take_along_axis(tokens, anchors, axis=1))
    # Query (block j, slot i) sees context slots before anchor j, and every slot of block j.
    slot = jnp.arange(T + A * K)
    query_anchor = jnp.repeat(anchors, K, axis=1)  # [B, A*K]
    query_block = jnp.repeat(jnp.arange(A), K)  # [A*K]
    context = (slot[None, None, :] < T) & (slot[None, None, :] < query_anchor[:, :, None])
    own = (slot[None, None, :] >= T) & ((slot[None, None, :] - T) // K == query_block[None, :, None])
    outputs, _ = decoder_layers(
        params.layers, c, embed[block_tokens.reshape(B, A * K)], positions, cache, visible=context | own
    )
    outputs = rms_norm(outputs, params.norm, c.rms_norm_eps).reshape(B, A, K, -1)[:, :, 1:]  # [B, A, K-1, D]
    logits = draft_logits(teacher_matrix if params.lm_head is None else params.lm_head, outputs)
    target_at = anchors[:, :, None] + jnp.arange(
        K - 1
    )  # the target's position whose next token slot i drafts
    taught = jnp.take_along_axis(hidden, target_at.reshape(B, -1)[..., None], axis=1).reshape(B, A, K - 1, -1)
    teacher = jax.lax.stop_gradient(jax.nn.softmax(draft_logits(teacher_matrix, taught)))
    valid = jnp.take_along_axis(mask, jnp.minimum(target_at + 1, T - 1).reshape(B, -1), axis=1).reshape(
        B, A, K - 1
    )
    valid = valid & (target_at + 1 < T)
    weight = valid * jnp.exp(-jnp.arange(K - 1) / gamma)
    cross_entropy = optax.softmax_cross_entropy(logits, teacher)
    loss = (cross_entropy * weight).sum() / jnp.maximum(weight.sum(), 1e-6)
    agree = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)) & valid
    counts = jnp.maximum(valid.sum(axis=(0, 1)), 1)
    per_slot = agree.sum(axis=(0, 1)) / counts
    metrics = {"loss": loss, "accuracy": per_slot[0]}
    metrics.update({f"accuracy_{i + 1}": per_slot[i] for i in range(1, K - 1)})
    return loss, metrics


@functools.lru_cache(maxsize=8)
def _objective(config: DFlashConfig, num_anchors: int, gamma: float):
    def loss(params, embed, teacher_matrix, aux, hidden, tokens, mask, anchor_key):
        anchors = anchor_positions(anchor_key, mask, num_anchors, config.block_size)
        return dflash_loss(params, config, embed, teacher_matrix, aux, hidden, tokens, mask, anchors, gamma)

    return loss


def train_dflash(
    target: Model,
    data: DistillationData,
    block_size: int = 8,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    aux_layer_ids=None,
    mask_token_id: int | None = None,
    anchors_per_sequence: int = 16,
    gamma: float = 4.0,
    steps: int = 1000,
    batch_size: int = 8,
    learning_rate: float = 3e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    clip_norm: float = 0.5,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    resume: bool = True,
    progress: bool = True,
) -> DFlashHead:
    """Train a DFlash head of `num_layers` layers drafting blocks of `block_size` for `target`.

    Each step scores `anchors_per_sequence` random blocks per sequence (see the module
    docstring). The head fuses the streams entering `aux_layer_ids` (default 2, L/2, L-3), feeds
    `mask_token_id` (default: the vocabulary's last id) in its drafted slots, and reads tokens
    over the `draft_vocab_size` most frequent tokens of the data with an LM head of its own that
    starts from the target's columns (default: the target's whole vocabulary). AdamW with
    clipping and warmup-cosine; deterministic given `seed`; checkpointed and resumable like the
    other trainers.
    """
    check_training_data(target, data)
    check_int("block_size", block_size, 2)
    check_int("num_layers", num_layers, 1)
    check_int("anchors_per_sequence", anchors_per_sequence, 1)
    check_number("gamma", gamma)
    if block_size > data.tokens.shape[1]:
        raise ValueError(
            f"block_size must be at most the data's sequence length {data.tokens.shape[1]}, got {block_size}"
        )
    vocab = choose_draft_vocab(target, data, draft_vocab_size)
    settings = optimizer_settings(
        steps, batch_size, learning_rate, warmup_steps, weight_decay, clip_norm, seed, checkpoint_every
    )
    t = target.config
    ids = default_aux_layer_ids(t.num_layers) if aux_layer_ids is None else tuple(aux_layer_ids)
    mask_token_id = t.vocab_size - 1 if mask_token_id is None else mask_token_id
    config = DFlashConfig(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab_size,
        num_layers=num_layers,
        aux_layer_ids=ids,
        block_size=block_size,
        mask_token_id=mask_token_id,
        draft_vocab_size=None if draft_vocab_size is None else len(vocab),
        rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling,
        rms_norm_eps=t.rms_norm_eps,
    )
    settings = {
        "block_size": block_size,
        "num_layers": num_layers,
        "draft_vocab_size": len(vocab),
        "aux_layer_ids": list(ids),
        "mask_token_id": mask_token_id,
        "anchors_per_sequence": anchors_per_sequence,
        "gamma": float(gamma),
        **settings,
    }
    aux = target_features(target, data, ids, batch_size)
    teacher = draft_head_matrix(target.params, jnp.asarray(vocab))
    params = init_dflash(config, jax.random.key(seed))
    if config.own_head:  # an LM head of its own over the draft vocabulary, from the target's columns
        params = params.replace(lm_head=as_array(teacher, params.norm.dtype))
    order = batch_order(seed, data.num_sequences, steps, batch_size)
    anchor_root = jax.random.fold_in(jax.random.key(seed), 1)

    def batch(step: int) -> tuple:
        rows = order[step]
        key = jax.random.fold_in(anchor_root, step)
        return (
            target.params.embed,
            teacher,
            aux[rows],
            data.hidden[rows],
            data.tokens[rows],
            data.mask[rows],
            key,
        )

    params = train_head_params(
        "dflash",
        _objective(config, anchors_per_sequence, float(gamma)),
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
    meta = head_meta("specjax.train.train_dflash", settings, data.summary())
    return DFlashHead(config, params, vocab, target_signature(target), meta)


def evaluate_dflash(
    head: DFlashHead,
    target: Model,
    data: DistillationData,
    batch_size: int = 8,
    anchors_per_sequence: int = 16,
) -> dict:
    """The loss and per-slot top-1 agreement of `head` on `data`, over blocks at fixed anchors
    (seed 0), weighted by the slots each batch scores."""
    head.check_target(target)
    aux = target_features(target, data, head.config.aux_layer_ids, batch_size)
    teacher = draft_head_matrix(target.params, jnp.asarray(head.vocab))
    params = head.params
    loss_jit = jax.jit(dflash_loss, static_argnums=1)
    totals, weights = {}, {}
    for start in range(0, data.num_sequences, batch_size):
        rows = slice(start, start + batch_size)
        mask = data.mask[rows]
        anchors = anchor_positions(
            jax.random.key(start), jnp.asarray(mask), anchors_per_sequence, head.config.block_size
        )
        _, metrics = loss_jit(
            params,
            head.config,
            target.params.embed,
            teacher,
            aux[rows],
            data.hidden[rows],
            data.tokens[rows],
            mask,
            anchors,
        )
        n = int(mask.sum())
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
            weights[name] = weights.get(name, 0) + n
    return {name: totals[name] / max(weights[name], 1) for name in totals}
