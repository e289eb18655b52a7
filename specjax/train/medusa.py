"""Training Medusa heads by self-distillation on the target's own continuations.

The data are sequences (prompt + what the target generated for it, from `specjax.generate`) and
the target's final-normed hidden states along them, computed once (`distill_medusa_data`): the
target stays frozen, so training touches only the heads. Head i at position t predicts token
t + 2 + i, read through the target's own LM head (`medusa_logits`).

Einsum letters: B batch, T positions, M heads, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models.cache import init_cache
from specjax.models.llama import LlamaParams, forward_hidden
from specjax.models.medusa import (
    MedusaConfig,
    MedusaHead,
    MedusaParams,
    init_medusa,
    medusa_logits,
    target_signature,
)
from specjax.models.model import Model


@dataclasses.dataclass(frozen=True)
class MedusaData:
    """Distillation data, host-side numpy arrays.

    hidden [N, T, D] float32: the target's final-normed states; tokens [N, T] int32; mask [N, T]
    bool, True on the sequence's tokens, False on the right padding.
    """

    hidden: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray

    def __post_init__(self):
        N, T = self.tokens.shape
        if self.hidden.shape[:2] != (N, T) or self.mask.shape != (N, T):
            raise ValueError(
                f"MedusaData shapes disagree: hidden {self.hidden.shape}, tokens {self.tokens.shape}, "
                f"mask {self.mask.shape} (allowed: [N, T, D], [N, T], [N, T])"
            )

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


@functools.partial(jax.jit, static_argnames=("config",))
def _hidden_states(params: LlamaParams, config, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] (right-padded: causal attention keeps padding out of real positions) ->
    final-normed hidden states [B, T, D]."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = forward_hidden(params, config, tokens, positions, init_cache(config, B, T), empty_cache=True)
    return hidden.astype(jnp.float32)


def distill_medusa_data(
    target: Model, sequences: list[list[int]], max_len: int, batch_size: int = 8
) -> MedusaData:
    """The target's hidden states along `sequences` (prompt + the target's continuation each),
    right-padded to `max_len`, computed `batch_size` rows at a time (one compiled program: the
    last batch is padded with empty rows)."""
    if not isinstance(target, Model):
        raise ValueError(f"target must be a specjax.Model, got {type(target).__name__}")
    _check_int("max_len", max_len, 2)
    _check_int("batch_size", batch_size, 1)
    if max_len > target.config.max_position_embeddings:
        raise ValueError(
            f"max_len must be at most the target's max_position_embeddings "
            f"{target.config.max_position_embeddings}, got {max_len}"
        )
    if isinstance(sequences, str) or not sequences:
        raise ValueError("sequences must be a non-empty list of token-id lists")
    N, V = len(sequences), target.config.vocab_size
    tokens = np.zeros((N, max_len), np.int32)
    mask = np.zeros((N, max_len), bool)
    for i, seq in enumerate(sequences):
        seq = np.asarray(seq)
        if seq.ndim != 1 or not 1 <= len(seq) <= max_len:
            raise ValueError(
                f"sequences[{i}] must be a list of 1 to max_len={max_len} token ids, got shape {seq.shape}"
            )
        if not np.issubdtype(seq.dtype, np.integer) or seq.min() < 0 or seq.max() >= V:
            raise ValueError(f"sequences[{i}] must hold token ids in [0, {V}), got {seq.tolist()[:8]}...")
        tokens[i, : len(seq)] = seq
        mask[i, : len(seq)] = True
    hidden = np.zeros((N, max_len, target.config.hidden_size), np.float32)
    for start in range(0, N, batch_size):
        rows = tokens[start : start + batch_size]
        padded = np.zeros((batch_size, max_len), np.int32)
        padded[: len(rows)] = rows
        out = _hidden_states(target.params, target.config, jnp.asarray(padded))
        hidden[start : start + len(rows)] = np.asarray(out)[: len(rows)]
    return MedusaData(hidden=hidden, tokens=tokens, mask=mask)


def medusa_loss(
    params: MedusaParams, target_params: LlamaParams, hidden: jax.Array, tokens: jax.Array, mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of every head on its shifted tokens.

    hidden [B, T, D], tokens [B, T], mask [B, T]. Head i at position t is scored on token t + 2 + i,
    where that token is in the sequence. Returns the mean of the per-head losses and
    {"loss": [M], "accuracy": [M]} (top-1, over the scored positions).
    """
    M = params.w.shape[0]
    B, T = tokens.shape
    logits = medusa_logits(params, target_params, hidden)  # [B, T, M, V]
    tokens_ext = jnp.concatenate([tokens, jnp.zeros((B, M + 1), tokens.dtype)], axis=1)
    mask_ext = jnp.concatenate([mask, jnp.zeros((B, M + 1), bool)], axis=1)
    labels = jnp.stack([tokens_ext[:, 2 + i : 2 + i + T] for i in range(M)], axis=-1)  # [B, T, M]
    valid = jnp.stack([mask_ext[:, 2 + i : 2 + i + T] for i in range(M)], axis=-1) & mask[..., None]
    valid = valid.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, T, M]
    counts = jnp.maximum(valid.sum(axis=(0, 1)), 1.0)  # [M]
    head_loss = (losses * valid).sum(axis=(0, 1)) / counts
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    head_accuracy = (correct * valid).sum(axis=(0, 1)) / counts
    return head_loss.mean(), {"loss": head_loss, "accuracy": head_accuracy}


_loss_jit = jax.jit(medusa_loss)


def evaluate_medusa(head: MedusaHead, target: Model, data: MedusaData, batch_size: int = 8) -> dict:
    """Per-head loss and top-1 accuracy of `head` over all of `data` (host floats):
    {"loss": float, "head_loss": [M], "head_accuracy": [M]}, each head weighted by its positions."""
    head.check_target(target)
    M = head.config.num_heads
    totals, hits, counts = np.zeros(M), np.zeros(M), np.zeros(M)
    for start in range(0, data.num_sequences, batch_size):
        rows = slice(start, start + batch_size)
        _, metrics = _loss_jit(
            head.params, target.params, data.hidden[rows], data.tokens[rows], data.mask[rows]
        )
        n = _scored_positions(data.mask[rows], M)
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


def _scored_positions(mask: np.ndarray, num_heads: int) -> np.ndarray:
    """How many positions each head is scored on: a row of length L gives head i L - 2 - i."""
    lengths = mask.sum(axis=1)
    return np.array([np.maximum(lengths - 2 - i, 0).sum() for i in range(num_heads)], np.float64)


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(learning_rate, warmup_steps, steps, weight_decay, clip_norm):
    """The optimizer and its jitted step, cached so repeated runs with one setting compile once."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps, decay_steps=steps
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay)
    )

    @jax.jit
    def step(params, opt_state, target_params, hidden, tokens, mask):
        (loss, metrics), grads = jax.value_and_grad(medusa_loss, has_aux=True)(
            params, target_params, hidden, tokens, mask
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    return optimizer, step


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        allowed = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")


def _batch_order(seed: int, num_sequences: int, steps: int, batch_size: int) -> np.ndarray:
    """Row indices of every step's batch [steps, batch_size]: shuffled epochs from the seed, so a
    resumed run draws the batches an uninterrupted one would."""
    rng = np.random.default_rng(seed)
    needed = steps * batch_size
    epochs = [rng.permutation(num_sequences) for _ in range(-(-needed // num_sequences))]
    return np.concatenate(epochs)[:needed].reshape(steps, batch_size)


class _Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s (each redraw waits for the
    device to finish the step it shows)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.last, self.width = total, enabled, 0.0, 0

    def update(self, step: int, loss, metrics) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.2 and step != self.total):
            return
        self.last = now
        accuracy = " ".join(f"{a:.2f}" for a in np.asarray(metrics["accuracy"]))
        width = 20
        filled = width * step // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"medusa [{bar}] {step}/{self.total} loss {float(loss):.4f} acc {accuracy}"
        sys.stderr.write("\r" + line.ljust(self.width))  # padded over a longer previous line
        self.width = len(line)
        if step == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def train_medusa(
    target: Model,
    data: MedusaData,
    num_heads: int = 4,
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
) -> MedusaHead:
    """Train `num_heads` Medusa heads for `target` on `data` (from `distill_medusa_data`).

    AdamW with gradient clipping and a warmup-cosine schedule (`warmup_steps` default: steps // 10);
    heads start as the identity (Medusa's initialisation). Deterministic given `seed`, which fixes
    the batch order. With `checkpoint_dir`, params, optimizer state and step are saved every
    `checkpoint_every` steps and at the end; `resume=True` continues from the latest one there (a
    resumed run ends with the params of an uninterrupted one).
    """
    if not isinstance(target, Model):
        raise ValueError(f"target must be a specjax.Model, got {type(target).__name__}")
    if not isinstance(data, MedusaData):
        raise ValueError(f"data must be a MedusaData (from distill_medusa_data), got {type(data).__name__}")
    if data.hidden.shape[2] != target.config.hidden_size:
        raise ValueError(
            f"data has hidden size {data.hidden.shape[2]}, the target {target.config.hidden_size}: "
            "distill the data from this target"
        )
    _check_int("num_heads", num_heads, 1)
    _check_int("steps", steps, 1)
    _check_int("batch_size", batch_size, 1)
    _check_positive("learning_rate", learning_rate)
    warmup_steps = steps // 10 if warmup_steps is None else warmup_steps
    _check_int("warmup_steps", warmup_steps, 0)
    if warmup_steps >= steps:
        raise ValueError(f"warmup_steps must be less than steps={steps}, got {warmup_steps}")
    _check_positive("weight_decay", weight_decay, allow_zero=True)
    _check_positive("clip_norm", clip_norm)
    _check_int("seed", seed, 0)
    _check_int("checkpoint_every", checkpoint_every, 1)

    settings = {
        "num_heads": num_heads,
        "steps": steps,
        "batch_size": batch_size,
        "learning_rate": float(learning_rate),
        "warmup_steps": warmup_steps,
        "weight_decay": float(weight_decay),
        "clip_norm": float(clip_norm),
        "seed": seed,
    }
    data_size = {"num_sequences": data.num_sequences, "num_tokens": data.num_tokens}
    config = MedusaConfig(num_heads, target.config.hidden_size, target.config.vocab_size)
    optimizer, train_step = _optimizer_and_step(
        float(learning_rate), warmup_steps, steps, float(weight_decay), float(clip_norm)
    )
    params = init_medusa(config)
    opt_state = optimizer.init(params)
    start = 0

    manager = None
    if checkpoint_dir is not None:
        from specjax.train.checkpoint import open_training_checkpoints

        run_info = {"settings": settings, "data": data_size, "target": target_signature(target)}
        manager, restored = open_training_checkpoints(checkpoint_dir, run_info, params, opt_state, resume)
        if restored is not None:
            params, opt_state, start = restored

    order = _batch_order(seed, data.num_sequences, steps, batch_size)
    bar = _Progress(steps, progress)
    try:
        for step in range(start, steps):
            rows = order[step]
            params, opt_state, loss, metrics = train_step(
                params, opt_state, target.params, data.hidden[rows], data.tokens[rows], data.mask[rows]
            )
            bar.update(step + 1, loss, metrics)
            if manager is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
                manager.save(step + 1, params, opt_state)
    finally:
        if manager is not None:
            manager.close()

    meta = {"trainer": "specjax.train.train_medusa", **settings, "steps_done": steps, "data": data_size}
    meta = json.loads(json.dumps(meta))  # host scalars only, as the checkpoint's metadata file holds
    return MedusaHead(config, params, target_signature(target), meta)
