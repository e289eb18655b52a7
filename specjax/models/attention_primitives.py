"""The pieces every attention here is built from (models/attention.py, and the latent attention
of models/mla.py): scores of queries against fresh keys or against the cache, the pairs a mask
drops, the softmax (with attention sinks), and the weighted sum over the cache's values.

Einsum letters: B batch, T new tokens (queries), U fresh keys, S cache slots, K kv heads,
G query heads per kv head, E head dim; r an entry of the cache's merged (row, kv head) axis
(b*K + k), q one of its query rows, s a slot, e the head dim.

The cache's layout (models/cache.py): keys [B*K, E, S], values [B*K, S, E].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Attention's products accumulate and return float32 (a no-op for a float32 model). In bfloat16,
# a verify pass and a one-token pass then differ only in float32 summation order, not in where
# partial results are rounded to bfloat16: the rounding happens once, at the attention's output.
F32 = {"preferred_element_type": jnp.float32}


def drop_masked(scores, keep):
    """scores where `keep` (broadcast against them), the lowest float elsewhere: the pairs a mask
    drops get no weight in the softmax."""
    return jnp.where(keep, scores, jnp.finfo(jnp.float32).min)


def softmax(scores, dtype, sinks=None):
    """The softmax of scores [..., U] over the last axis, in float32, cast to `dtype`. `sinks`
    (broadcast against scores[..., 0]; gpt-oss): one more logit per row that takes its share of
    the softmax and adds no value, so the row's weights sum to less than 1."""
    scores = scores.astype(jnp.float32)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1).astype(dtype)
    sinks = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32), scores.shape[:-1])[..., None]
    peak = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sinks)
    weights = jnp.exp(scores - peak)
    return (weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sinks - peak))).astype(dtype)


def head_sinks(sinks):
    """Sinks [K, G] shaped to broadcast against a row of scores [B, K, G, T] (None stays None)."""
    return None if sinks is None else sinks[None, :, :, None]


def cache_scores(q, k_cache):
    """Scores [B, K, G, T, S] of queries q [B, T, K, G, E] against the key cache [B*K, E, S].
    The product runs over the cache's own merged row-and-head axis, with each kv head's G*T
    queries as the rows of one product, so XLA reads the buffer as it is stored."""
    B, T, K, G, E = q.shape
    rows = q.transpose(0, 2, 3, 1, 4).reshape(B * K, G * T, E)  # entry b*K + k: its G*T queries
    return jnp.einsum("rqe,res->rqs", rows, k_cache.astype(q.dtype), **F32).reshape(B, K, G, T, -1)


def cache_values(probs, v_cache):
    """Attention weights probs [B, K, G, T, S] applied to the value cache [B*K, S, E]: [B, T, K, G, E]."""
    B, K, G, T, S = probs.shape
    out = jnp.einsum("rqs,rse->rqe", probs.reshape(B * K, G * T, S), v_cache.astype(probs.dtype), **F32)
    return out.reshape(B, K, G, T, -1).transpose(0, 3, 1, 2, 4)


def _per_row(mask):
    """A mask [T, U] or [B, T, U] shaped to broadcast against scores [B, K, G, T, U]."""
    return mask[None, None, None] if mask.ndim == 2 else mask[:, None, None]


def masked_scores(q, k, mask):
    """Scores [B, K, G, T, U] of queries q [B, T, K, G, E] against keys k [B, U, K, E], with the
    pairs mask [T, U] (or [B, T, U]) drops set to the lowest float."""
    scores = jnp.einsum("btkge,buke->bkgtu", q, k, **F32)
    return drop_masked(scores, _per_row(mask))
