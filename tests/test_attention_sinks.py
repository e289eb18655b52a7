"""Attention sinks (gpt-oss: one learned logit per query head that joins the softmax and adds no
value) in every form of `attention` against float64 numpy: prefills (the CPU's chunks, a traced
mask, the blocked XLA form and both Pallas kernels in Pallas' interpreter) and decoding passes
(write-first, read-only, the CPU kernel and both Pallas decode kernels, whose outputs merge with
the fresh tokens' by log-sum-exp, the sink one more term of it), under a sliding window, with
rows whose fresh tokens sit before, at and past it.

The rule: query head h's weights are exp(s) / (sum over what it sees of exp(s') + exp(sink[h]));
they sum to less than 1, and a query that sees nothing gets 0."""

from __future__ import annotations

import numpy as np
import pytest
from jax import numpy as jnp

from specjax.kernels.backend import Backend
from specjax.models import KVCache
from specjax.models.attention import attention
from specjax.models.passes import (
    LayerCache,
    LayerMasks,
    PassKind,
    PassPlan,
    causal_mask,
    layer_masks,
    plan_pass,
    visible_slots,
)

B, K, G, E, S, W = 6, 2, 2, 16, 64, 8
LENGTHS = np.array([0, 3, W - 1, W, W + 1, 40])  # committed slots per row
# Around the scores' own size (unit queries and keys, scaled by 1/sqrt(E)): a share of every
# softmax from a few percent to most of it.
SINKS = np.array([1.5, -0.5, 0.0, 3.0], np.float32)


def float64_reference(q, k_new, v_new, k_cache, v_cache, positions, fresh_mask, lengths, sinks):
    """[B, T, H*E]: each query over the committed slots and fresh tokens it may see (window W),
    its head's sink in the softmax's denominator."""
    Bq, T, H, _ = q.shape
    out = np.zeros((Bq, T, H, E))
    for b in range(Bq):
        for t in range(T):
            p = positions[b, t]
            slots = [s for s in range(lengths[b]) if p - s < W]
            fresh = [u for u in range(T) if fresh_mask[t, u] and p - positions[b, u] < W]
            for h in range(H):
                j = h // G  # its kv head
                keys = [k_cache[b * K + j][:, s] for s in slots] + [k_new[b, u, j] for u in fresh]
                values = [v_cache[b * K + j][s] for s in slots] + [v_new[b, u, j] for u in fresh]
                scores = np.array([q[b, t, h].astype(np.float64) @ key for key in keys]) / np.sqrt(E)
                peak = max(scores.max(), sinks[h])
                weights = np.exp(scores - peak)
                total = weights.sum() + np.exp(np.float64(sinks[h]) - peak)
                out[b, t, h] = (weights / total) @ np.array(values, np.float64)
    return out.reshape(Bq, T, -1)


def backend_for(form: str) -> Backend:
    """The CPU's kernels ("kernel"), a Pallas kernel in the interpreter ("pallas:..."), the blocked
    XLA prefill an accelerator without Pallas runs ("blocked"), or plain XLA on the CPU."""
    if form.startswith("pallas:"):
        return Backend(platforms=("cpu",), kernels=form)
    if form == "blocked":
        return Backend(platforms=("cuda",), kernels="xla")
    return Backend(platforms=("cpu",), kernels="auto" if form == "kernel" else "xla")


@pytest.mark.parametrize("form", ["write-first", "read-only", "kernel", "pallas:tpu", "pallas:cuda"])
def test_decoding_attention_with_sinks(form):
    rng = np.random.default_rng(len(form))
    T = 5
    fresh_mask = causal_mask(T)
    positions = (LENGTHS[:, None] + np.arange(T)[None, :]).astype(np.int32)
    q = rng.standard_normal((B, T, K * G, E)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, T, K, E)).astype(np.float32) for _ in range(2))
    k_cache = rng.standard_normal((B * K, E, S)).astype(np.float32)
    v_cache = rng.standard_normal((B * K, S, E)).astype(np.float32)
    want = float64_reference(q, k_new, v_new, k_cache, v_cache, positions, fresh_mask, LENGTHS, SINKS)
    write = form == "write-first"
    if write:  # the fresh entries already in their slots, as the write-first form has them
        for b in range(B):
            for t in range(T):
                k_cache[b * K : (b + 1) * K, :, LENGTHS[b] + t] = k_new[b, t]
                v_cache[b * K : (b + 1) * K, LENGTHS[b] + t] = v_new[b, t]
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    cache = KVCache(k=(jnp.asarray(k_cache),), v=(jnp.asarray(v_cache),), lengths=lengths)
    if write:
        visible = visible_slots(lengths, jnp.asarray(fresh_mask), S)
    else:
        visible = jnp.arange(S)[None, :] < lengths[:, None]
    by_kernel = form not in ("write-first", "read-only")
    kernel = backend_for(form).cache_attention(E, jnp.float32) if by_kernel else None
    plan = PassPlan(PassKind.WRITE_FIRST if write else PassKind.READ_ONLY, kernel)
    masks = layer_masks(W, jnp.asarray(positions), cache, visible, plan)
    with backend_for(form).tracing():
        got = attention(
            jnp.asarray(q),
            jnp.asarray(k_new),
            jnp.asarray(v_new),
            LayerCache(cache.k[0], cache.v[0]),
            masks,
            fresh_mask,
            plan,
            sinks=jnp.asarray(SINKS),
        )
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("form", ["chunks", "traced-mask", "blocked", "pallas:tpu", "pallas:cuda"])
def test_prefill_attention_with_sinks(form):
    """A prefill of 70 tokens (the CPU's chunks: two) under the window, rows at positions 0 and 5."""
    T = 70
    rng = np.random.default_rng(T + len(form))
    q = rng.standard_normal((2, T, K * G, E)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((2, T, K, E)).astype(np.float32) for _ in range(2))
    positions = np.stack([np.arange(T), np.arange(T) + 5]).astype(np.int32)
    empty = np.zeros((2 * K, E, 0), np.float32)
    want = float64_reference(q, k_new, v_new, empty, empty, positions, causal_mask(T), [0, 0], SINKS)
    cache = KVCache(
        k=(jnp.zeros((2 * K, E, T)),), v=(jnp.zeros((2 * K, T, E)),), lengths=jnp.zeros(2, jnp.int32)
    )
    # A traced mask (not a numpy array) cannot be chunked: the whole [T, T] masked form runs.
    fresh_mask = jnp.asarray(causal_mask(T)) if form == "traced-mask" else causal_mask(T)
    masks = layer_masks(W, jnp.asarray(positions), cache, None, PassPlan(PassKind.PREFILL))
    with backend_for(form).tracing():
        plan = plan_pass(PassKind.PREFILL, E, jnp.float32)  # the backend's blocked kernel, where it has one
        got = attention(
            jnp.asarray(q),
            jnp.asarray(k_new),
            jnp.asarray(v_new),
            None,
            masks,
            fresh_mask,
            plan,
            sinks=jnp.asarray(SINKS),
        )
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_a_sink_takes_its_share():
    """Against the same attention without sinks: every output is scaled down by the keys' share
    of its softmax (so the sinks above are large enough to be seen), by exactly that share."""
    rng = np.random.default_rng(0)
    T = 6
    q = rng.standard_normal((1, T, K * G, E)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((1, T, K, E)).astype(np.float32) for _ in range(2))
    prefill = (LayerMasks(None), causal_mask(T), PassPlan(PassKind.PREFILL))
    args = (jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), None, *prefill)
    plain = np.asarray(attention(*args)).reshape(T, K * G, E)
    sunk = np.asarray(attention(*args, sinks=jnp.asarray(SINKS))).reshape(T, K * G, E)
    scores = np.einsum("the,uhe->thu", q[0], np.repeat(k_new[0], G, axis=1)) / np.sqrt(E)
    scores = np.where(causal_mask(T)[:, None, :], scores, -np.inf)
    keys = np.exp(scores).sum(-1)  # [T, H]
    share = keys / (keys + np.exp(SINKS)[None, :])
    assert share.min() < 0.2 and share.max() > 0.8
    np.testing.assert_allclose(sunk, plain * share[..., None], rtol=1e-5, atol=1e-6)
