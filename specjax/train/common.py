"""What the head trainers (Medusa, EAGLE, EAGLE-3, DFlash, MLP speculator, MTP) share: argument
checks, the optimizer and its jitted step, the seeded batch order, the progress bar, the
checkpointed training loop, the teacher-forced tokens and the positions a step scores."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.checks import check_int, is_number


def check_number(name: str, value, allow_zero: bool = False) -> None:
    """A finite real > 0 (or >= 0 with `allow_zero`)."""
    ok = is_number(value) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        allowed = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")


def optimizer_settings(
    steps: int,
    batch_size: int,
    learning_rate: float,
    warmup_steps: int | None,
    weight_decay: float,
    clip_norm: float,
    seed: int,
    checkpoint_every: int,
) -> dict:
    """Check the arguments every trainer takes; returns them as the run's settings (JSON values),
    `warmup_steps` resolved (default: steps // 10)."""
    check_int("steps", steps, 1)
    check_int("batch_size", batch_size, 1)
    check_number("learning_rate", learning_rate)
    warmup_steps = steps // 10 if warmup_steps is None else warmup_steps
    check_int("warmup_steps", warmup_steps, 0)
    if warmup_steps >= steps:
        raise ValueError(f"warmup_steps must be less than steps={steps}, got {warmup_steps}")
    check_number("weight_decay", weight_decay, allow_zero=True)
    check_number("clip_norm", clip_norm)
    check_int("seed", seed, 0)
    check_int("checkpoint_every", checkpoint_every, 1)
    return {
        "steps": steps,
        "batch_size": batch_size,
        "learning_rate": float(learning_rate),
        "warmup_steps": warmup_steps,
        "weight_decay": float(weight_decay),
        "clip_norm": float(clip_norm),
        "seed": seed,
    }


@functools.lru_cache(maxsize=8)
def optimizer_and_step(loss: Callable, learning_rate, warmup_steps, steps, weight_decay, clip_norm):
    """AdamW with global-norm clipping and a warmup-cosine schedule, and its jitted step
    `step(params, opt_state, *loss_args) -> (params, opt_state, loss, metrics)` for
    `loss(params, *loss_args) -> (loss, metrics)`. Cached, so repeated runs with one setting (and
    one `loss` object) compile once."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps, decay_steps=steps
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay)
    )

    @jax.jit
    def step(params, opt_state, *loss_args):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, *loss_args)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, metrics

    return optimizer, step


def batch_order(seed: int, num_sequences: int, steps: int, batch_size: int) -> np.ndarray:
    """Row indices of every step's batch [steps, batch_size]: shuffled epochs from the seed, so a
    resumed run draws the batches an uninterrupted one would."""
    rng = np.random.default_rng(seed)
    needed = steps * batch_size
    epochs = [rng.permutation(num_sequences) for _ in range(-(-needed // num_sequences))]
    return np.concatenate(epochs)[:needed].reshape(steps, batch_size)


class Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s (each redraw waits for the
    device to finish the step it shows). `metrics["accuracy"]` is one number or one per head."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled, self.last, self.width = label, total, enabled, 0.0, 0

    def update(self, step: int, loss, metrics) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.2 and step != self.total):
            return
        self.last = now
        accuracy = " ".join(f"{a:.2f}" for a in np.atleast_1d(np.asarray(metrics["accuracy"])))
        width = 20
        filled = width * step // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"{self.label} [{bar}] {step}/{self.total} loss {float(loss):.4f} acc {accuracy}"
        sys.stderr.write("\r" + line.ljust(self.width))  # padded over a longer previous line
        self.width = len(line)
        if step == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_training(
    label: str,
    step: Callable,
    optimizer: optax.GradientTransformation,
    params,
    batch: Callable[[int], tuple],
    steps: int,
    run_info: dict,
    checkpoint_dir: str | Path | None,
    checkpoint_every: int,
    resume: bool,
    progress: bool,
):
    """Train `params` for `steps` steps of `step(params, opt_state, *batch(i))` and return them.

    With `checkpoint_dir`, params, optimizer state and step are saved every `checkpoint_every`
    steps and at the end, and `resume` continues from the latest checkpoint there; `run_info`
    (settings, data, target) keeps two different runs from sharing one directory.
    """
    opt_state = optimizer.init(params)
    start, manager = 0, None
    if checkpoint_dir is not None:
        from specjax.train.checkpoint import open_training_checkpoints

        manager, restored = open_training_checkpoints(checkpoint_dir, run_info, params, opt_state, resume)
        if restored is not None:
            params, opt_state, start = restored
    bar = Progress(label, steps, progress)
    try:
        for i in range(start, steps):
            params, opt_state, loss, metrics = step(params, opt_state, *batch(i))
            bar.update(i + 1, loss, metrics)
            if manager is not None and ((i + 1) % checkpoint_every == 0 or i + 1 == steps):
                manager.save(i + 1, params, opt_state)
    finally:
        if manager is not None:
            manager.close()
    return params


def train_head_params(
    label: str,
    loss: Callable,
    params,
    batch: Callable[[int], tuple],
    *,
    settings: dict,
    vocab: np.ndarray,
    data,
    target,
    checkpoint_dir: str | Path | None,
    checkpoint_every: int,
    resume: bool,
    progress: bool,
):
    """What every head's trainer does once its loss, initial params and batches are set: AdamW
    from the `optimizer_settings` in `settings` (`loss(params, *batch) -> (loss, metrics)`), then
    `run_training` with the run identified by its settings, draft vocabulary, data and target (a
    checkpoint directory of another run is refused). Returns the trained params."""
    from specjax.models.signature import target_signature

    optimizer, train_step = optimizer_and_step(
        loss,
        settings["learning_rate"],
        settings["warmup_steps"],
        settings["steps"],
        settings["weight_decay"],
        settings["clip_norm"],
    )
    run_info = {
        "settings": settings,
        "vocab_digest": hashlib.sha256(vocab.tobytes()).hexdigest()[:16],
        "data": data.summary(),
        "target": target_signature(target),
    }
    return run_training(
        label,
        train_step,
        optimizer,
        params,
        batch,
        steps=settings["steps"],
        run_info=run_info,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        progress=progress,
    )


def head_meta(trainer: str, settings: dict, data_summary: dict) -> dict:
    """How a head was made, as host JSON values (what the saved head's metadata file holds)."""
    meta = {"trainer": trainer, **settings, "steps_done": settings["steps"], "data": data_summary}
    return json.loads(json.dumps(meta))  # host scalars only


def shifted_tokens(tokens: jax.Array, mask: jax.Array, first: int, count: int) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T], mask [B, T] -> (at each position t the tokens t + first .. t + first + count - 1
    [B, T, count] (0 past the end), and whether each is a sequence token [B, T, count])."""
    B, T = tokens.shape
    pad = first + count
    tokens = jnp.concatenate([tokens, jnp.zeros((B, pad), tokens.dtype)], axis=1)
    mask = jnp.concatenate([mask, jnp.zeros((B, pad), bool)], axis=1)
    offsets = range(first, first + count)
    return (
        jnp.stack([tokens[:, j : j + T] for j in offsets], axis=-1),
        jnp.stack([mask[:, j : j + T] for j in offsets], axis=-1),
    )


def per_head_loss(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> tuple[jax.Array, dict]:
    """Cross-entropy of heads that each predict one token: logits [B, T, M, V], labels [B, T, M],
    valid [B, T, M] bool (the positions scored). Returns the mean of the per-head losses and
    {"loss": [M], "accuracy": [M]} (top-1, over each head's scored positions)."""
    valid = valid.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, T, M]
    counts = jnp.maximum(valid.sum(axis=(0, 1)), 1.0)  # [M]
    head_loss = (losses * valid).sum(axis=(0, 1)) / counts
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    head_accuracy = (correct * valid).sum(axis=(0, 1)) / counts
    return head_loss.mean(), {"loss": head_loss, "accuracy": head_accuracy}


def anchor_positions(key: jax.Array, mask: jax.Array, num_anchors: int, block: int) -> jax.Array:
    """[B, A] random anchors per row, each with its whole block inside the row's sequence (rows
    too short for one get anchors whose slots are all invalid, see `dflash_loss`)."""
    lengths = mask.sum(axis=1)
    room = jnp.maximum(lengths - block + 1, 1)  # anchors 0 .. length - block
    u = jax.random.uniform(key, (mask.shape[0], num_anchors))
    return jnp.minimum((u * room[:, None]).astype(jnp.int32), room[:, None] - 1)


def check_positions_per_sequence(positions_per_sequence) -> None:
    """None (every position) or an integer >= 1 (see `scored_positions`)."""
    if positions_per_sequence is not None:
        check_int("positions_per_sequence", positions_per_sequence, 1)


def scored_positions(
    key: jax.Array, mask: jax.Array, positions_per_sequence: int | None, span: int
) -> jax.Array:
    """The positions t a training step scores, [B, A]: with `positions_per_sequence` None every
    position (A = T, in order), else that many per row drawn at random from `key` (with
    replacement) among those whose tokens t .. t + span - 1 all lie in the row's sequence
    (`anchor_positions`). Heads that predict from one position each (the MLP
    speculator's stages, MTP layers) then take the vocabulary-wide logits, a step's main cost,
    at these positions only."""
    B, T = mask.shape
    if positions_per_sequence is None:
        return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return anchor_positions(key, mask, positions_per_sequence, span)


def at_positions(x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, ...] at positions [B, A] -> [B, A, ...]."""
    return jax.vmap(lambda row, index: row[index])(x, positions)
