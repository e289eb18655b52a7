"""Multi-head latent attention (DeepSeek-V2/V3), with the latent cached and absorbed.

Each token's keys and values come from one latent: c = norm(x @ kv_a)[:r] (r = kv_lora_rank),
and one rotated key k_r (R = rotary_dim dims) shared by every head. Head h's key is
[c @ W_uk_h | k_r] and its value c @ W_uv_h, with W_uk, W_uv the two parts of kv_b. The cache
stores c and k_r only: one entry of r + R numbers per token and layer (the key buffer of a
KVCache with one "kv head"; its value buffer is 0 wide), where a per-head cache stores
H * (head_dim + v_head_dim). DeepSeek-V3 (H 128, head_dim 192, v_head_dim 128, r 512, R 64)
caches 576 numbers per token and layer instead of 40,960: 71 times less.

Attention never expands the latent into per-head keys and values. The key product is absorbed
into the query: q_h . k_h = (W_uk_h q_nope_h) . c + q_rope_h . k_r, so each head's query becomes
[W_uk_h q_nope_h | q_rope_h] (r + R wide) and scores the cached entries directly; the weighted
sum of the latents is then mapped by W_uv_h and the output projection. Every pass (prefill,
decoding, verifying drafts) uses this form: one home for the maths, and a decoding step reads
the cache once for all heads.

Einsum letters: B batch, T new tokens, U fresh entries, S cache slots, D hidden, H query heads,
E head dim, R rotary dims, r the latent (kv_lora_rank), N the nope dims of a query head
(head_dim - R), C the latent and rotary key side by side (r + R), A a value head (v_head_dim); in
the attention primitives' products (models/attention_primitives.py) the cache's one "kv head"
is k (1 wide) and the query heads g; q a query row, s a slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.attention_primitives import F32, cache_scores, drop_masked, masked_scores, softmax
from specjax.models.config import LlamaConfig
from specjax.models.norms import rms_norm
from specjax.models.passes import LayerCache, LayerPass, PassKind
from specjax.models.products import project
from specjax.models.rotary import apply_rope

# DeepSeek's q_a and kv_a norms are built with their default epsilon, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def checkpoint_attention_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's attention weights by checkpoint name -> shape ([in, out]), in
    HF's order: q_a, q_a_norm (with q_lora_rank), q_b (the query projection, from q_a's latent or
    from x), kv_a (latent and rotary key), kv_a_norm, kv_b (per head: nope key, value), o."""
    D, H, E, R = config.hidden_size, config.num_heads, config.head_dim, config.rotary_dim
    r, A = config.kv_lora_rank, config.v_head_dim
    shapes = {"attn_norm": (D,)}
    if config.q_lora_rank:
        shapes.update(q_a=(D, config.q_lora_rank), q_a_norm=(config.q_lora_rank,))
    shapes["q_b"] = (config.q_lora_rank or D, H * E)
    shapes.update(kv_a=(D, r + R), kv_a_norm=(r,), kv_b=(r, H * (E - R + A)), o=(H * A, D))
    return shapes


def rotate(config: LlamaConfig, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """The rotary part x [B, T, n, R] rotated: DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...
    are first laid out as halves (evens, then odds), which is also the layout it returns, as
    transformers does; YaRN's attention factor scales cos and sin (`rotary.apply_rope`)."""
    if config.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions, inv_freq, config.rotary_factor)


def latent_entries(config: LlamaConfig, lp, h: jax.Array, positions, inv_freq) -> jax.Array:
    """The cache entries [B, T, 1, C] of inputs h [B, T, D]: the normed latent and the rotated
    shared key, side by side."""
    r = config.kv_lora_rank
    latent = project(h, lp.kv_a)  # [B, T, r + R]
    c = rms_norm(latent[..., :r], lp.kv_a_norm, LATENT_NORM_EPS)
    k_rope = rotate(config, latent[..., None, r:], positions, inv_freq)  # [B, T, 1, R]
    return jnp.concatenate([c[:, :, None, :], k_rope], axis=-1)


def absorbed_queries(config: LlamaConfig, lp, h: jax.Array, positions, inv_freq, kv_b) -> jax.Array:
    """Each head's query [B, T, H, C] against the cache entries: W_uk_h q_nope_h beside the
    rotated q_rope_h, times the softmax scale. kv_b [r, H, N + A]; H is the local heads' count
    (a tensor-parallel slice holds some heads' columns of q_b and kv_b)."""
    B, T, _ = h.shape
    E, R = config.head_dim, config.rotary_dim
    q_in = h if lp.q_a is None else rms_norm(project(h, lp.q_a), lp.q_a_norm, LATENT_NORM_EPS)
    q = project(q_in, lp.q_b).reshape(B, T, -1, E)  # [B, T, H, E]
    q_nope = jnp.einsum("bthn,rhn->bthr", q[..., : E - R], kv_b[..., : E - R], **F32)
    query = jnp.concatenate(
        [q_nope.astype(q.dtype), rotate(config, q[..., E - R :], positions, inv_freq)], -1
    )
    return query * config.attention_scale


def mla_attention(
    config: LlamaConfig, seen: LayerPass, h: jax.Array, lp, buffers: LayerCache, writes: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One latent-attention block in the pass `seen` (models/passes.py): input h [B, T, D]
    (normed) -> its output [B, T, D] (before the tensor-parallel sum), and the buffers with the
    fresh entries written (`writes`), or the fresh entries [B, T, 1, C] and empty values
    [B, T, 1, 0]. The kinds of pass are the same as `attention.attention`'s: a prefill attends to
    the fresh entries alone; a decoding pass that writes attends to the visible slots of the
    written cache; a read-only one, to the committed slots and the fresh entries in one softmax."""
    B, T, _ = h.shape
    E, R, r = config.head_dim, config.rotary_dim, config.kv_lora_rank
    positions, inv_freq, kind = seen.positions, seen.inv_freq, seen.plan.kind
    kv_b = lp.kv_b.reshape(r, -1, E - R + config.v_head_dim)  # [r, H, N + A]
    entries = latent_entries(config, lp, h, positions, inv_freq)  # [B, T, 1, C]
    no_values = jnp.zeros((B, T, 1, 0), entries.dtype)
    query = absorbed_queries(config, lp, h, positions, inv_freq, kv_b)[:, :, None]  # [B, T, 1, H, C]
    if writes:
        buffers = seen.write(buffers, entries, no_values)
    keys = None if kind is PassKind.PREFILL else buffers.read()[0]  # [B, C, S]
    mixed = _latent_attention(
        query, entries, keys, seen.masks.visible, seen.fresh_mask, kind, r
    )  # [B, T, H, r]
    out = jnp.einsum("bthr,rha->btha", mixed, kv_b[..., E - R :], **F32).astype(h.dtype)
    out = project(out.reshape(B, T, -1), lp.o)
    return (out, buffers.keys, buffers.values) if writes else (out, entries, no_values)


def _latent_attention(query, entries, keys, visible, fresh_mask, kind: PassKind, r):
    """Queries [B, T, 1, H, C] attend to latent entries; returns the weighted latents
    [B, T, H, r]. A prefill sees the fresh entries [B, T, 1, C] under fresh_mask; a written
    cache's keys [B, C, S] are seen where visible [B, T, S]; a read-only pass sees the committed
    slots (visible [B, S]) and the fresh entries in one softmax."""
    B, T, _, H, _ = query.shape
    dtype = query.dtype
    if kind is PassKind.PREFILL:
        probs = softmax(masked_scores(query, entries, fresh_mask), dtype)  # [B, 1, H, T, T]
        return jnp.einsum("bkgtu,bukr->btgr", probs, entries[..., :r], **F32).astype(dtype)
    write_first = kind is PassKind.WRITE_FIRST
    keep = visible[:, None, None] if write_first else visible[:, None, None, None, :]
    old = drop_masked(cache_scores(query, keys), keep)  # [B, 1, H, T, S]
    if write_first:
        probs = softmax(old, dtype)
        return _weighted_latents(probs, keys, r).astype(dtype)
    new = masked_scores(query, entries, fresh_mask)  # [B, 1, H, T, T]
    S = keys.shape[-1]
    probs = softmax(jnp.concatenate([old, new], axis=-1), dtype)
    fresh = jnp.einsum("bkgtu,bukr->btgr", probs[..., S:], entries[..., :r], **F32)
    return (_weighted_latents(probs[..., :S], keys, r) + fresh).astype(dtype)


def _weighted_latents(probs, keys, r):
    """probs [B, 1, H, T, S] applied to the cached latents (the first r rows of keys [B, C, S],
    read in place): [B, T, H, r] float32."""
    B, _, H, T, S = probs.shape
    out = jnp.einsum("bqs,brs->bqr", probs.reshape(B, H * T, S), keys[:, :r, :].astype(probs.dtype), **F32)
    return out.reshape(B, H, T, r).transpose(0, 2, 1, 3)
