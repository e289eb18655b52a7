"""Drafters that agree with their tiny random target part of the time, by construction.

Verification is lossless, so a drafter with a bug still yields the target's greedy output: it only
loses acceptance. "Speculative equals plain" tests a drafter only where its drafts are accepted
part of the time: often enough that accepted drafts make the output, rarely enough that
rejections and rollbacks happen too. A random one-layer draft of a random target accepted none of
368 drafts; these are built to land in between:

- `layered_target`: a tiny random target whose layers after the first add small residual updates
  (their attention and MLP output projections scaled by `late_scale`), so that its first layer
  with the final norm and head, `SelfDraft(layers=1)`, predicts its next token part of the time.
- `noisy_copy`: a draft model that is the target with Gaussian noise on every weight, plus extra
  layers whose residual updates are as small, so that its config (and its own KV cache) differ
  from the target's.
- `check_acceptance`: the accepted fraction lies in a band, and steps that accepted every draft
  and steps that rejected some both occurred.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tiny import tiny_model

from specjax.models import Model, init_params


def scale_residual_updates(layer, scale: float):
    """A layer whose attention and MLP add `scale` times their updates to the residual stream."""
    return layer.replace(o=scale * layer.o, down=scale * layer.down)


def layered_target(seed: int = 11, late_scale: float = 0.3, **overrides) -> Model:
    """`tiny_model(seed, **overrides)` with every layer after the first scaled by `late_scale`."""
    model = tiny_model(seed=seed, **overrides)
    first, *later = model.params.layers
    layers = (first, *(scale_residual_updates(layer, late_scale) for layer in later))
    return Model(model.config, model.params.replace(layers=layers), name=f"layered-{seed}-{late_scale}")


def noisy_copy(model: Model, noise: float, seed: int = 0, extra_layers: int = 1) -> Model:
    """`model` with N(0, noise^2) times each weight's RMS added to that weight, and `extra_layers`
    random layers appended whose residual updates are scaled by `noise` (for a draft whose config
    and cache have more layers than the target's)."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves) + 1)
    noisy = [
        w + noise * jnp.sqrt(jnp.mean(w * w)) * jax.random.normal(key, w.shape, w.dtype)
        for w, key in zip(leaves, keys[:-1], strict=True)
    ]
    params = jax.tree.unflatten(treedef, noisy)
    config = dataclasses.replace(model.config, num_layers=model.config.num_layers + extra_layers)
    extra = init_params(dataclasses.replace(config, num_layers=extra_layers), keys[-1]).layers
    layers = (*params.layers, *(scale_residual_updates(layer, noise) for layer in extra))
    return Model(config, params.replace(layers=layers), model.tokenizer, name=f"{model.name}-noisy-{noise}")


def accepted_fraction(metrics) -> float:
    """Accepted drafts per draft position verified: accepted / (k * drafting steps), k the most a
    step can accept (a tree's depth). For a chain that drafts k tokens every step this is the
    acceptance rate; for a tree, whose nodes outnumber its depth, it is the mean accepted length
    over k."""
    return float(metrics.accepted.sum() / (metrics.num_speculative_tokens * metrics.drafting_steps.sum()))


def check_acceptance(metrics, low: float, high: float) -> float:
    """Assert that the accepted fraction lies in [low, high] and that some steps accepted all k
    drafts and some rejected one: with k > 1, a step that accepted some but not all (0 < n < k);
    with k = 1, a step that accepted none. Returns the fraction."""
    k = metrics.num_speculative_tokens
    hist = np.asarray(metrics.accept_hist).sum(0)  # [k+1]: drafting steps that accepted 0..k
    fraction = accepted_fraction(metrics)
    assert low <= fraction <= high, (fraction, hist.tolist())
    assert hist[k] > 0, ("no step accepted all k drafts", hist.tolist())
    rejected = hist[1:k].sum() if k > 1 else hist[0]
    assert rejected > 0, ("no step rejected a draft after accepting some" if k > 1 else "none rejected", hist)
    return fraction
