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
- `quiet_target`: a `layered_target` whose token embeddings are small next to its first layer's
  updates, for heads whose residual stream does not carry the token's embedding (EAGLE-3, DFlash);
  with `constant_queries`, its first layer asks the same query whatever the token (for DFlash,
  whose block slots are masks).
- `first_layer_mtp`: a target with MTP layers built the same way (the target's first layer over the
  next token's embedding and a little of the hidden state).
- `first_layer_eagle3`: an EAGLE-3 head whose layer is the target's first reading the token, with
  a little of the fused feature: over a `quiet_target` it drafts about what SelfDraft does.
- `first_layer_dflash`: a DFlash head whose layer is the first of a `quiet_target` with constant
  queries, reading the target's embedding stream as context: each slot drafts about SelfDraft's
  next token, so blocks are accepted in part, and whole where the target repeats a token.
- `trained_medusa`: Medusa heads fitted with specjax.train on the target's own continuations;
  `trained_mlp_speculator`: an MLP speculator fitted the same way.
- `check_acceptance`: the accepted fraction lies in a band, and steps that accepted every draft
  and steps that rejected some both occurred; `check_drafted_acceptance`: the band of a proposer
  whose drafts per step vary; `check_part_acceptance`: a Hybrid part's band.

EAGLE-3 and DFlash heads trained instead (specjax.train on these targets' own continuations)
took 12 to 40 s each here, mostly compiling; the EAGLE-3 heads accepted 13% of a chain of 4, the
DFlash heads 3-33% at a block of 2 and at most 10% at a block of 5, seldom two drafts in a step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tiny import tiny_model

import specjax
from specjax.models import (
    DFlashHead,
    Eagle3Head,
    EagleHead,
    MedusaHead,
    MLPSpeculatorHead,
    Model,
    init_params,
)
from specjax.models.dflash import DFlashConfig, DFlashParams
from specjax.models.draft_vocab import draft_head_matrix
from specjax.models.eagle import EagleConfig, EagleParams
from specjax.models.eagle3 import Eagle3Config, Eagle3Params
from specjax.models.mtp import MTPLayerParams
from specjax.models.params import fuse_qkv, split_qkv
from specjax.models.signature import target_signature
from specjax.train import distill_data, train_medusa, train_mlp_speculator


def scale_residual_updates(layer, scale: float):
    """A layer whose attention and MLP add `scale` times their updates to the residual stream."""
    return layer.replace(o=scale * layer.o, down=scale * layer.down)


def layered_target(seed: int = 11, late_scale: float = 0.3, **overrides) -> Model:
    """`tiny_model(seed, **overrides)` with every layer after the first scaled by `late_scale`.
    Seed 11's greedy continuations of the tests' prompts hold long runs of one token, where a
    head that drafts the target's last prediction again (a fresh EAGLE or Medusa head) is right
    too: such heads accepted 10-25% of their drafts there, 4% at most on seed 15, whose
    continuations hardly repeat a token."""
    model = tiny_model(seed=seed, **overrides)
    first, *later = model.params.layers
    layers = (first, *(scale_residual_updates(layer, late_scale) for layer in later))
    return Model(model.config, model.params.replace(layers=layers), name=f"layered-{seed}-{late_scale}")


def quiet_target(
    seed: int = 11,
    late_scale: float = 0.1,
    embed_scale: float = 0.05,
    constant_queries: bool = False,
    **overrides,
) -> Model:
    """`layered_target(seed, late_scale, **overrides)` with its token embeddings scaled by
    `embed_scale`, for heads whose residual stream does not carry the token's embedding (an
    EAGLE-3 head's carries its feature, a DFlash block's slots a mask): after the target's first
    layer its residual is nearly that layer's updates alone, which a head built from that layer
    can reproduce.

    With `constant_queries` (for DFlash), its first layer is Qwen3-style (q/k norms, DFlash's
    layer form, and biases) without query weights: every token asks the same query, its bias,
    so where that layer attends depends on the keys (tokens and positions) and not on the token
    that asks. Its key and value biases are zero and its last token id (DFlash's mask) has a zero
    embedding, so that a mask's key and value are zero."""
    if constant_queries:
        overrides = {"qk_norm": True, "qkv_bias": True, **overrides}
    model = layered_target(seed, late_scale, **overrides)
    c = model.config
    embed = embed_scale * model.params.embed
    first, *later = model.params.layers
    if constant_queries:
        H, K = c.num_heads, c.num_kv_heads
        q, k, v = split_qkv(first.qkv, H, K)
        q_bias, k_bias, v_bias = split_qkv(first.qkv_bias, H, K)
        first = first.replace(
            qkv=fuse_qkv(jnp.zeros_like(q), k, v, K),
            qkv_bias=fuse_qkv(q_bias, jnp.zeros_like(k_bias), jnp.zeros_like(v_bias), K),
        )
        embed = embed.at[c.vocab_size - 1].set(0.0)
    params = model.params.replace(embed=embed, layers=(first, *later))
    name = f"quiet-{seed}-{late_scale}-{embed_scale}" + ("-constant_queries" if constant_queries else "")
    return Model(c, params, name=name)


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
    extra = (
        ()
        if extra_layers == 0
        else init_params(dataclasses.replace(config, num_layers=extra_layers), keys[-1]).layers
    )
    layers = (*params.layers, *(scale_residual_updates(layer, noise) for layer in extra))
    return Model(config, params.replace(layers=layers), model.tokenizer, name=f"{model.name}-noisy-{noise}")


def first_layer_eagle(target: Model, feature_weight: float = 0.1, vocab=None) -> EagleHead:
    """An EAGLE head whose layer is the target's first and whose fc feeds it the next token's
    embedding plus `feature_weight` times the target's feature: over the pairs (f_t, x_{t+1}) its
    layer sees about what the target's first layer sees at t + 1, so through the target's head it
    drafts about what SelfDraft(layers=1) drafts (the target's final norm aside), and it reads
    both of its inputs. It drafts from `vocab` (default: all tokens)."""
    D, V = target.config.hidden_size, target.config.vocab_size
    fc = jnp.concatenate([feature_weight * jnp.eye(D), jnp.eye(D)], axis=0)  # [2D, D]: (f, embed)
    params = EagleParams(fc=fc, fc_bias=jnp.zeros((D,), jnp.float32), layer=target.params.layers[0])
    vocab = np.arange(V, dtype=np.int32) if vocab is None else np.asarray(vocab, np.int32)
    config = EagleConfig.for_target(target.config, len(vocab))
    return EagleHead(config, params, vocab, target_signature(target))


def first_layer_mtp(target: Model, num_layers: int = 1, hidden_weight: float = 0.1) -> Model:
    """`target` with `num_layers` MTP layers, each with the target's first layer as its block, fed
    the next token's embedding (through enorm, at the embeddings' mean scale) plus `hidden_weight`
    times the normed hidden state: each drafts about what SelfDraft(layers=1) drafts after its
    token, so its drafts are accepted part of the time, and it reads both of its inputs."""
    embed = target.params.embed
    D = target.config.hidden_size
    scale = float(jnp.sqrt(jnp.mean(embed * embed)))
    layer = MTPLayerParams(
        enorm=jnp.full((D,), scale),
        hnorm=jnp.full((D,), scale),
        eh_proj=jnp.concatenate([jnp.eye(D), hidden_weight * jnp.eye(D)], axis=0),  # [2D, D]: (embed, hidden)
        block=target.params.layers[0],
        head_norm=target.params.final_norm,
    )
    return Model(
        target.config, target.params, name=f"{target.name}-mtp{num_layers}", mtp=(layer,) * num_layers
    )


def first_layer_eagle3(target: Model, aux_layer_ids, vocab=None, feature_weight: float = 0.02) -> Eagle3Head:
    """An EAGLE-3 head whose layer is the target's first: the token half of its attention's
    input goes through that layer's own projections, so over the pairs (g_t, x_{t+1}) its
    queries, keys and values are the target's first layer's at t + 1. Its residual is its
    feature (EAGLE-3's design), here the normed feature times `feature_weight` (fc passing the
    lowest fused stream; the feature half of the attention reads it at that weight too), where
    the target's is the token's embedding: over a `quiet_target` both are small next to the
    layer's updates, and the head drafts about what SelfDraft(layers=1) drafts, from the target's
    final norm and its head's columns for `vocab` (default: all tokens)."""
    c = target.config
    D, V = c.hidden_size, c.vocab_size
    vocab = np.arange(V, dtype=np.int32) if vocab is None else np.asarray(vocab, np.int32)
    config = Eagle3Config.for_target(
        c,
        len(vocab),
        aux_layer_ids=aux_layer_ids,
        norm_before_residual=True,
        qk_norm=c.qk_norm,
        qkv_bias=c.qkv_bias,
    )
    first = target.params.layers[0]
    params = Eagle3Params(
        fc=jnp.zeros((config.feature_size, D)).at[:D].set(jnp.eye(D)),  # [A, D]: the lowest stream
        layers=(first.replace(qkv=jnp.concatenate([first.qkv, first.qkv])),),  # [2D, .]: token, feature
        hidden_norm=jnp.full((D,), feature_weight),
        norm=target.params.final_norm,
        lm_head=draft_head_matrix(target.params, jnp.asarray(vocab)),
    )
    return Eagle3Head(config, params, vocab, target_signature(target))


def first_layer_dflash(target: Model, block_size: int, aux_layer_ids, vocab=None) -> DFlashHead:
    """A DFlash head whose one layer is the first of a `quiet_target(constant_queries=True)`.
    Its context is the target's embedding stream (aux id 0, first in `aux_layer_ids`) normed by
    that layer's own norm, so the context's keys and values are the target's first layer's; a
    slot asks the target's one query whatever its token, and the masks' zero keys and values
    only dilute. Slot i so attends as the target's first layer would at the anchor's position
    + i, and every slot drafts about the token SelfDraft(layers=1) drafts after the anchor:
    the first slot is right part of the time, a whole block where the target repeats a token.
    It reads tokens with the target's head, or the target's columns for `vocab`."""
    c = target.config
    D = c.hidden_size
    if not c.qk_norm or aux_layer_ids[0] != 0:
        raise ValueError("first_layer_dflash needs a quiet_target(constant_queries=True) and aux id 0 first")
    config = DFlashConfig(
        hidden_size=D,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        num_layers=1,
        aux_layer_ids=tuple(aux_layer_ids),
        block_size=block_size,
        mask_token_id=c.vocab_size - 1,
        draft_vocab_size=None if vocab is None else len(vocab),
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        rms_norm_eps=c.rms_norm_eps,
        qkv_bias=c.qkv_bias,
    )
    first = target.params.layers[0]
    params = DFlashParams(
        fc=jnp.zeros((config.feature_size, D)).at[:D].set(jnp.eye(D)),  # [A, D]: the embeddings
        hidden_norm=first.attn_norm,
        layers=(first,),
        norm=target.params.final_norm,
        lm_head=None if vocab is None else draft_head_matrix(target.params, jnp.asarray(vocab)),
    )
    vocab = np.arange(c.vocab_size, dtype=np.int32) if vocab is None else np.asarray(vocab, np.int32)
    return DFlashHead(config, params, vocab, target_signature(target))


def own_continuations(target: Model, num_prompts: int = 64, new_tokens: int = 40):
    """Distillation data (specjax.train.distill_data) of the target's greedy continuations of
    seeded random prompts: what the trained drafters below learn from."""
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    prompts = [rng.integers(0, V, size=int(rng.integers(2, 9))).tolist() for _ in range(num_prompts)]
    answers = specjax.generate(target, prompts, max_new_tokens=new_tokens).tokens
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    return distill_data(target, sequences, max_len=new_tokens + 8)


def trained_medusa(
    target: Model, num_heads: int = 2, steps: int = 400, num_prompts: int = 64, new_tokens: int = 40
) -> MedusaHead:
    """Medusa heads trained by `specjax.train.train_medusa` (seeded, so the same every run) on the
    target's greedy continuations of random prompts. Head i must learn the token i + 2 places on
    from a hidden state, which the target's own weights give no closed form for."""
    data = own_continuations(target, num_prompts, new_tokens)
    return train_medusa(target, data, num_heads, steps=steps, learning_rate=1e-2, progress=False)


def trained_mlp_speculator(target: Model, data=None, steps: int = 400, **options) -> MLPSpeculatorHead:
    """An MLP speculator trained by `specjax.train.train_mlp_speculator` (seeded) on `data`
    (default: `own_continuations(target)`); `options` are the trainer's (n_predict, inner_dim,
    tie_weights, scale_input, positions_per_sequence). Over `layered_target(11)` a chain of 3
    accepted 41-48% of its drafts at batch 4 here (untied, and tied with scale_input and inner_dim
    32) after 400 steps on 64 continuations, 34% after 300 steps on 32 (every position scored)."""
    data = own_continuations(target) if data is None else data
    return train_mlp_speculator(target, data, steps=steps, learning_rate=1e-2, progress=False, **options)


def accepted_fraction(metrics) -> float:
    """Accepted drafts per draft position verified: accepted / (k * drafting steps), k the most a
    step can accept (a tree's depth). For a chain that drafts k tokens every step this is the
    acceptance rate; for a tree, whose nodes outnumber its depth, it is the mean accepted length
    over k."""
    return float(metrics.accepted.sum() / (metrics.num_speculative_tokens * metrics.drafting_steps.sum()))


def check_drafted_acceptance(metrics, low: float, high: float) -> float:
    """Assert that the fraction of the drafts verified that were accepted lies in [low, high],
    for proposers whose number of drafts varies by step (a confidence threshold, a goodput
    schedule), where "all k accepted" is not in the histogram. Returns the fraction."""
    fraction = float(metrics.accepted.sum() / metrics.drafted.sum())
    assert low <= fraction <= high, fraction
    return fraction


def check_part_acceptance(metrics, part: str, low: float, high: float) -> float:
    """Assert that the fraction of a Hybrid part's drafts ("first" or "then") that were accepted
    lies in [low, high]. Returns the fraction."""
    counts = metrics.proposer
    fraction = float(counts[f"{part}_accepted"].sum() / counts[f"{part}_drafted"].sum())
    assert low <= fraction <= high, (part, fraction)
    return fraction


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
