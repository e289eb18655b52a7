"""The attention kernels' contracts in plain jnp, for any backend XLA compiles for.

Letters as in decode.py and prefill.py: N cache entries, R query rows of an entry, S slots,
E head dim; T fresh tokens, G query heads per kv head, B rows.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from specjax.kernels.attention.blocks import BlockTable
from specjax.kernels.attention.online import NEG, normalized, online_softmax, precision


def cache_attention(queries, keys, values, lengths, starts=None, layer=None):
    """`specjax.kernels.attention.cache_attention` in plain jnp: scores every slot and masks.

    It reads all S slots of every entry at every step, committed or not: its decode cost is the
    capacity's, not the lengths'. Stale slots get weight 0, but a slot holding a non-finite value
    would still poison the product (0 * inf); the cache never holds one (it starts zeroed and
    only ever receives computed keys and values).

    layer: an int32 scalar, with keys [L, N, E, S] and values [L, N, S, E]: the layer's slice
    is left to XLA, which can fuse it into the products that read it."""
    if layer is not None:
        keys = lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)
        values = lax.dynamic_index_in_dim(values, layer, 0, keepdims=False)
    S = values.shape[1]
    dtype = jnp.result_type(queries, keys, values)
    scores = jnp.einsum(
        "nre,nes->nrs",
        queries.astype(dtype),
        keys.astype(dtype),
        precision=precision(dtype),
        preferred_element_type=jnp.float32,
    )
    slots = jnp.arange(S)
    keep = slots[None, None, :] < lengths[:, None, None]  # [N, 1, S]
    if starts is not None:
        keep = keep & (slots[None, None, :] >= starts[:, :, None])  # [N, R, S]
    scores = jnp.where(keep, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # rows that see nothing: every weight 0
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1)  # [N, R]
    seen = total > 0
    lse = jnp.where(seen, peak[..., 0] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    probs = weights / jnp.where(seen, total, 1.0)[..., None]
    out = jnp.einsum(
        "nrs,nse->nre",
        probs.astype(dtype),
        values.astype(dtype),
        precision=precision(dtype),
        preferred_element_type=jnp.float32,
    )
    return out, lse


def prefill_attention(
    queries, keys, values, *, table: BlockTable | None, positions, window, block_q, block_k, sinks=None
):
    """`specjax.kernels.attention.prefill_attention` in plain jnp, blocked as the kernels are:
    a scan over query blocks, and for each an online softmax over the key blocks it needs
    (causal: those at or below the diagonal; a mask: those its `table` lists). Working memory
    [N, G, block_q, block_k]; never [T, T]."""
    N, T, G, E = queries.shape
    num_q, num_k = -(-T // block_q), -(-T // block_k)
    dtype = jnp.result_type(queries, keys, values)
    queries = _pad_tokens(queries.astype(dtype), num_q * block_q)
    keys = _pad_tokens(keys.astype(dtype), num_k * block_k)
    values = _pad_tokens(values.astype(dtype), num_k * block_k)
    if positions is not None:  # [B, T] -> [N, T]: entry n belongs to row n // (N // B)
        B = positions.shape[0]
        positions = jnp.repeat(positions, N // B, axis=0)
    product = functools.partial(
        jnp.einsum, "ngqk,nke->ngqe", precision=precision(dtype), preferred_element_type=jnp.float32
    )

    def query_block(qi):
        q = lax.dynamic_slice_in_dim(queries, qi * block_q, block_q, axis=1)  # [N, bq, G, E]
        q_tokens = qi * block_q + jnp.arange(block_q)

        def key_block(i, carry):
            m, l, acc = carry
            ki = i if table is None else jnp.asarray(table.kv_block)[qi, i]
            k = lax.dynamic_slice_in_dim(keys, ki * block_k, block_k, axis=1)  # [N, bk, E]
            v = lax.dynamic_slice_in_dim(values, ki * block_k, block_k, axis=1)
            k_tokens = ki * block_k + jnp.arange(block_k)
            if table is None:
                keep = k_tokens[None, :] <= q_tokens[:, None]  # [bq, bk]
            else:
                keep = jnp.asarray(table.tiles)[jnp.asarray(table.tile)[qi, i]]
            keep = keep[None, None]  # [1, 1, bq, bk]
            if positions is not None:
                keep = keep & _window_keep(positions, q_tokens, k_tokens, window)[:, None]
            s = jnp.einsum(
                "nqge,nke->ngqk", q, k, precision=precision(dtype), preferred_element_type=jnp.float32
            )
            return online_softmax(m, l, acc, s, keep, v, product=product)

        init = (
            jnp.full((N, G, block_q), NEG, jnp.float32),
            jnp.zeros((N, G, block_q), jnp.float32),
            jnp.zeros((N, G, block_q, E), jnp.float32),
        )
        if sinks is not None:  # the sink starts the softmax: a running max of it, a sum of 1
            init = (jnp.broadcast_to(sinks[:, :, None], (N, G, block_q)), jnp.ones_like(init[1]), init[2])
        if table is None:  # key blocks 0 .. the one holding the block's last token
            count = jnp.minimum(((qi + 1) * block_q + block_k - 1) // block_k, num_k)
        else:
            count = jnp.asarray(table.count)[qi]
        _, l, acc = lax.fori_loop(0, count, key_block, init)
        return normalized(l, acc).transpose(0, 2, 1, 3)  # [N, bq, G, E]

    out = lax.map(query_block, jnp.arange(num_q))  # [num_q, N, bq, G, E]
    return out.transpose(1, 0, 2, 3, 4).reshape(N, num_q * block_q, G, E)[:, :T]


def _pad_tokens(x, length):
    """x [N, T, ...] padded with zeros to `length` tokens."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _window_keep(positions, q_tokens, k_tokens, window):
    """[N, bq, bk] bool: the sliding window's pairs, positions [N, T] per entry. Padding tokens
    (index T and up) borrow the last position: their pairs are dropped by the causal mask or
    the table, or belong to query rows that are cut off."""
    last = positions.shape[1] - 1
    pq = positions[:, jnp.minimum(q_tokens, last)]
    pk = positions[:, jnp.minimum(k_tokens, last)]
    return pq[:, :, None] - pk[:, None, :] < window
