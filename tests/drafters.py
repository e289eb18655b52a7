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
- `first_layer_eagle`: an EAGLE head built from the target's weights: the target's first layer over
  the next token's embedding and a little of the feature, so it drafts about what SelfDraft does.
- `trained_medusa`: Medusa heads fitted with specjax.train on the target's own continuations.
- `check_acceptance`: the accepted fraction lies in a band, and steps that accepted every draft
  and steps that rejected some both occurred.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tiny import tiny_model

import specjax
from specjax.models import EagleHead, MedusaHead, Model, init_params
from specjax.models.eagle import EagleConfig, EagleParams
from specjax.models.signature import target_signature
from specjax.train import distill_data, train_medusa


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


def first_layer_eagle(target: Model, feature_weight: float = 0.1) -> EagleHead:
    """An EAGLE head whose layer is the target's first and whose fc feeds it the next token's
    embedding plus `feature_weight` times the target's feature: over the pairs (f_t, x_{t+1}) its
    layer sees about what the target's first layer sees at t + 1, so through the target's head it
    drafts about what SelfDraft(layers=1) drafts (the target's final norm aside), and it reads
    both of its inputs."""
    D, V = target.config.hidden_size, target.config.vocab_size
    fc = jnp.concatenate([feature_weight * jnp.eye(D), jnp.eye(D)], axis=0)  # [2D, D]: (f, embed)
    params = EagleParams(fc=fc, fc_bias=jnp.zeros((D,), jnp.float32), layer=target.params.layers[0])
    config = EagleConfig.for_target(target.config)
    return EagleHead(config, params, np.arange(V, dtype=np.int32), target_signature(target))


def trained_medusa(
    target: Model, num_heads: int = 2, steps: int = 400, num_prompts: int = 64, new_tokens: int = 40
) -> MedusaHead:
    """Medusa heads trained by `specjax.train.train_medusa` (seeded, so the same every run) on the
    target's greedy continuations of random prompts. Head i must learn the token i + 2 places on
    from a hidden state, which the target's own weights give no closed form for."""
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    prompts = [rng.integers(0, V, size=int(rng.integers(2, 9))).tolist() for _ in range(num_prompts)]
    answers = specjax.generate(target, prompts, max_new_tokens=new_tokens).tokens
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    data = distill_data(target, sequences, max_len=new_tokens + 8)
    return train_medusa(target, data, num_heads, steps=steps, learning_rate=1e-2, progress=False)


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
