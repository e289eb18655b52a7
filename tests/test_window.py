"""Sliding-window attention in the static cache against float64 numpy: every form of `attention`
(a prefill, a decoding pass that writes first, one that only reads, and the CPU kernel's), for a
chain and a token tree, with rows whose fresh tokens sit before, at and past the window.

The rule (HF's): a query at position p sees a key at position p' when 0 <= p - p' < window, and
when the chain's or tree's mask lets it; a committed cache slot s holds position s."""

from __future__ import annotations

import numpy as np
import pytest
from jax import numpy as jnp

from specjax.kernels.backend import Backend
from specjax.models import KVCache
from specjax.models.attention import attention
from specjax.models.passes import LayerCache, PassKind, PassPlan, causal_mask, layer_masks, visible_slots

B, K, G, E, S, W = 6, 2, 2, 16, 64, 8
LENGTHS = np.array([0, 3, W - 1, W, W + 1, 40])  # committed slots per row
TREE_PARENTS = (-1, 0, 0, 1, 2)  # node 0 the root, 1 and 2 its children, 3 under 1, 4 under 2


def tree_mask() -> tuple[np.ndarray, np.ndarray]:
    """The tree's [T, T] ancestor mask and each node's depth."""
    T = len(TREE_PARENTS)
    mask, depth = np.eye(T, dtype=bool), np.zeros(T, int)
    for node, parent in enumerate(TREE_PARENTS):
        if parent >= 0:
            mask[node] |= mask[parent]
            depth[node] = depth[parent] + 1
    return mask, depth


def float64_reference(q, k_new, v_new, k_cache, v_cache, positions, fresh_mask, lengths, window):
    """[B, T, H*E]: each query over the committed slots and fresh tokens it may see."""
    Bq, T, H, _ = q.shape
    out = np.zeros((Bq, T, H, E))
    for b in range(Bq):
        for t in range(T):
            p = positions[b, t]
            slots = [s for s in range(lengths[b]) if p - s < window]
            fresh = [u for u in range(T) if fresh_mask[t, u] and p - positions[b, u] < window]
            for h in range(H):
                j = h // G  # its kv head
                keys = [k_cache[b * K + j][:, s] for s in slots] + [k_new[b, u, j] for u in fresh]
                values = [v_cache[b * K + j][s] for s in slots] + [v_new[b, u, j] for u in fresh]
                scores = np.array([q[b, t, h].astype(np.float64) @ key for key in keys]) / np.sqrt(E)
                weights = np.exp(scores - scores.max())
                out[b, t, h] = (weights / weights.sum()) @ np.array(values, np.float64)
    return out.reshape(Bq, T, -1)


@pytest.mark.parametrize("form", ["write-first", "read-only", "kernel"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_decoding_attention_keeps_to_the_window(form, shape):
    rng = np.random.default_rng(len(form) * 10 + len(shape))
    if shape == "chain":
        fresh_mask, depth = causal_mask(5), np.arange(5)
    else:
        fresh_mask, depth = tree_mask()
    T = len(depth)
    positions = (LENGTHS[:, None] + depth[None, :]).astype(np.int32)
    q = rng.standard_normal((B, T, K * G, E)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, T, K, E)).astype(np.float32) for _ in range(2))
    k_cache = rng.standard_normal((B * K, E, S)).astype(np.float32)
    v_cache = rng.standard_normal((B * K, S, E)).astype(np.float32)
    want = float64_reference(q, k_new, v_new, k_cache, v_cache, positions, fresh_mask, LENGTHS, W)
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
    cpu = Backend(platforms=("cpu",), kernels="auto")  # the CPU kernel, for "kernel"
    kernel = cpu.cache_attention(E, jnp.float32) if form == "kernel" else None
    plan = PassPlan(PassKind.WRITE_FIRST if write else PassKind.READ_ONLY, kernel)
    masks = layer_masks(W, jnp.asarray(positions), cache, visible, plan)
    with cpu.tracing():
        got = attention(
            jnp.asarray(q),
            jnp.asarray(k_new),
            jnp.asarray(v_new),
            LayerCache(cache.k[0], cache.v[0]),
            masks,
            fresh_mask,
            plan,
        )
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_prefill_attention_keeps_to_the_window():
    """A prefill of 40 tokens (in chunks of 64 queries and up: one chunk) and of 200 (chunks)."""
    for T in (40, 200):
        rng = np.random.default_rng(T)
        q = rng.standard_normal((2, T, K * G, E)).astype(np.float32)
        k_new, v_new = (rng.standard_normal((2, T, K, E)).astype(np.float32) for _ in range(2))
        positions = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
        empty = np.zeros((2 * K, E, 0), np.float32)
        want = float64_reference(q, k_new, v_new, empty, empty, positions, causal_mask(T), [0, 0], W)
        cache = KVCache(
            k=(jnp.zeros((2 * K, E, T)),), v=(jnp.zeros((2 * K, T, E)),), lengths=jnp.zeros(2, jnp.int32)
        )
        plan = PassPlan(PassKind.PREFILL)
        masks = layer_masks(W, jnp.asarray(positions), cache, None, plan)
        got = attention(
            jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), None, masks, causal_mask(T), plan
        )
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
