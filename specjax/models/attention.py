"""Attention of a pass's fresh queries, in the form its kind calls for (models/passes.py): a
prefill's fresh tokens among themselves, or a decoding pass's queries over the cache and the fresh
tokens, through the backend's kernel where the pass's plan holds one.

Einsum letters: B batch, T fresh tokens (queries), U fresh keys, S cache slots, H query heads,
K kv heads, G query heads per kv head (H = K * G), E head dim; r an entry of the cache's merged
(row, kv head) axis, q one of its query rows, s a slot or key, e the head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.attention_primitives import (
    F32,
    cache_scores,
    cache_values,
    drop_masked,
    head_sinks,
    masked_scores,
    softmax,
)
from specjax.models.config import LlamaConfig
from specjax.models.passes import LayerCache, LayerMasks, PassKind, PassPlan, causal_mask

# Prefill attention handles its queries in about this many chunks, each at least
# MIN_PREFILL_CHUNK queries long; see _fresh_attention.
PREFILL_CHUNKS = 8
MIN_PREFILL_CHUNK = 64


def attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    buffers: LayerCache | None,
    masks: LayerMasks,
    fresh_mask,
    plan: PassPlan,
    scale: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of T fresh queries q [B, T, H, E], with their keys and values k_new, v_new
    [B, T, K, E], in a pass `plan`; returns [B, T, H*E]. Scores are scaled by `scale` (default
    1/sqrt(E)). `sinks` [H] (gpt-oss): each head's logit that joins its softmax with no value
    (compared with the scaled scores), in every form below. `masks` is what the layer's kind
    sees (passes.layer_masks); `fresh_mask` [T, T] which fresh tokens each sees.

    - PREFILL: the queries attend to the fresh keys alone (`buffers` unused, may be None), under
      fresh_mask and a window's `masks.window_keep`; the plan's blocked kernel where it has one.
    - A decoding pass whose plan holds the backend's kernel (`reads_committed_by_kernel`): the
      kernel reads each row's committed slots (`masks.committed`; from `masks.starts` on under a
      window) and the fresh tokens are merged in (`_kernel_attention`).
    - WRITE_FIRST otherwise: the fresh entries are already written into the layer's buffers
      (`buffers`: keys [B*K, E, S], values [B*K, S, E]), and the queries attend to the slots
      `masks.visible` [B, T, S] marks. Reading the old cache after the write kept both alive and
      copied the cache every step; see KVCache for the layout that keeps the write in place.
    - READ_ONLY otherwise: the buffers hold only committed entries, which `masks.visible` ([B, S],
      or [B, T, S] under a window) marks; the fresh keys join under fresh_mask.
    """
    B, T, H, E = q.shape
    K = k_new.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    q = q.reshape(B, T, K, H // K, E) * scale
    fresh = fresh_mask if masks.window_keep is None else jnp.asarray(fresh_mask) & masks.window_keep
    sinks = None if sinks is None else sinks.reshape(K, H // K)  # [K, G]: as the queries' heads
    if plan.reads_committed_by_kernel:
        out = _kernel_attention(
            plan.kernel,
            q,
            k_new,
            v_new,
            buffers,
            masks.committed,
            fresh,
            masks.starts,
            sinks,
            plan.writes,
            plan.kernel_reads_pages,
        )
    elif plan.kind is PassKind.PREFILL:
        out = _fresh_attention(q, k_new, v_new, fresh_mask, masks, plan.kernel, sinks)
    else:
        k_cache, v_cache = buffers.read()
        if plan.kind is PassKind.READ_ONLY:
            out = _committed_and_fresh_attention(
                q, k_new, v_new, k_cache, v_cache, masks.visible, fresh, sinks
            )
        else:
            out = _cache_attention(q, k_cache, v_cache, masks.visible, sinks)
    return out.reshape(B, T, H * E).astype(q.dtype)


def _fresh_attention(q, k_new, v_new, fresh_mask, masks: LayerMasks, kernel, sinks=None):
    """A prefill into an empty cache: T queries [B, T, K, G, E] attend to the T fresh keys alone,
    under fresh_mask [T, T] and, for a sliding-window layer (`masks.window`, the tokens at
    `masks.positions` [B, T]), masks.window_keep [B, T, T]. `sinks` [K, G]: each head's sink
    logit (`softmax`).

    Where the backend has a blocked prefill kernel (`kernel`, the pass plan's: accelerators'
    Pallas flash attention, or the blocked XLA form; specjax/kernels/backend.py) and the mask is
    known while tracing, that runs: working memory O(T x block), never [T, T] scores. Otherwise,
    on the CPU:

    When the mask is a known numpy array in which no token sees a later one (a causal mask, or a
    tree in node order), the queries go in chunks and chunk [a, b) scores keys [0, b) only.
    Scoring all [T, T] pairs spent half the work on pairs the mask drops, and passed a [K, G, T, T]
    score tensor through memory at every softmax pass: SmolLM2's prefill of 712 tokens took 1.44 s
    that way and 1.13 s in 8 chunks, of 1,912 tokens 6.8 s and 4.2 s (measured here). Each chunk
    is its own set of products to compile (2 to 3 s more per prompt bucket at 8 chunks; 16 chunks
    cost twice that and gained nothing more), hence PREFILL_CHUNKS.

    The operands are laid out once per layer as the cache holds its entries, one per row and kv
    head: queries [B*K, T*G, E] in (token, query head) order, keys and values [B*K, T, E]. A chunk
    then takes contiguous slices of each; sliced from [B, T, K, ...], every chunk's keys and
    values were transposed afresh, copies that grow with T squared (a layer's attention at T =
    832: 12.1 ms that way, 8.3 ms this way, in isolation).
    """
    T = q.shape[1]
    window_keep = masks.window_keep
    if kernel is not None and isinstance(fresh_mask, np.ndarray):
        return _blocked_fresh_attention(
            kernel, q, k_new, v_new, fresh_mask, masks.window, masks.positions, sinks
        )
    if not (isinstance(fresh_mask, np.ndarray) and not np.triu(fresh_mask, 1).any()):
        mask = fresh_mask if window_keep is None else jnp.asarray(fresh_mask) & window_keep
        return _masked_attention(q, k_new, v_new, mask, sinks)
    B, _, K, G, E = q.shape
    queries = q.transpose(0, 2, 1, 3, 4).reshape(B * K, T * G, E)
    keys = k_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    values = v_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    chunk = max(MIN_PREFILL_CHUNK, -(-T // PREFILL_CHUNKS))
    outs = []
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        row_sinks = None  # [B*K, t*G]: each query row's head's sink, rows laid out as the queries
        if sinks is not None:
            row_sinks = jnp.broadcast_to(sinks[None, :, None, :], (B, K, end - start, G))
            row_sinks = row_sinks.reshape(B * K, (end - start) * G)
        keep = np.repeat(fresh_mask[start:end, :end], G, axis=0)[None]  # rows in (token, head) order
        if window_keep is not None:  # [B, t, u] -> [B*K, t*G, u], as the queries are laid out
            window = jnp.broadcast_to(
                window_keep[:, None, start:end, None, :end], (B, K, end - start, G, end)
            )
            keep = keep & window.reshape(B * K, (end - start) * G, end)
        scores = jnp.einsum("rqe,rse->rqs", queries[:, start * G : end * G], keys[:, :end], **F32)
        scores = drop_masked(scores, keep)
        probs = softmax(scores, q.dtype, row_sinks)
        outs.append(jnp.einsum("rqs,rse->rqe", probs, values[:, :end], **F32))
    return jnp.concatenate(outs, axis=1).reshape(B, K, T, G, E).transpose(0, 2, 1, 3, 4)


def _blocked_fresh_attention(kernel, q, k_new, v_new, fresh_mask, window, positions, sinks=None):
    """`_fresh_attention` through a blocked kernel (contract of
    specjax.kernels.attention.prefill_attention), operands laid out one entry per row and kv head;
    sinks [K, G] as the kernel takes them, [B*K, G]."""
    B, T, K, G, E = q.shape
    queries = q.transpose(0, 2, 1, 3, 4).reshape(B * K, T, G, E)
    keys = k_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    values = v_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    mask = None if np.array_equal(fresh_mask, causal_mask(T)) else fresh_mask
    extra = {} if sinks is None else {"sinks": jnp.tile(sinks.astype(jnp.float32), (B, 1))}
    out = kernel(queries, keys, values, mask=mask, positions=positions, window=window, **extra)
    return out.reshape(B, K, T, G, E).transpose(0, 2, 1, 3, 4)


def _masked_attention(q, k, v, mask, sinks=None):
    """Queries q [B, T, K, G, E] attend to keys and values k, v [B, U, K, E] under mask [T, U] (or
    [B, T, U]); sinks [K, G] or None."""
    probs = softmax(masked_scores(q, k, mask), q.dtype, head_sinks(sinks))
    return jnp.einsum("bkgtu,buke->btkge", probs, v, **F32)


def _cache_attention(q, k_cache, v_cache, visible, sinks=None):
    """T queries [B, T, K, G, E] attend to the cache (keys [B*K, E, S], values [B*K, S, E])
    where visible [B, T, S]; sinks [K, G] or None."""
    scores = drop_masked(cache_scores(q, k_cache), visible[:, None, None])
    return cache_values(softmax(scores, q.dtype, head_sinks(sinks)), v_cache)


def _committed_and_fresh_attention(q, k_new, v_new, k_cache, v_cache, committed, fresh_mask, sinks=None):
    """T queries [B, T, K, G, E] attend, in one softmax, to the cache's committed slots
    (committed [B, S], or [B, T, S] under a sliding window; the cache is only read) and to the T
    fresh keys and values [B, T, K, E] under fresh_mask [T, T] (or [B, T, T]): what the
    write-first form computes, without writing."""
    S = v_cache.shape[1]
    keep = committed[:, None, None, None, :] if committed.ndim == 2 else committed[:, None, None]
    old = drop_masked(cache_scores(q, k_cache), keep)
    new = masked_scores(q, k_new, fresh_mask)
    probs = softmax(jnp.concatenate([old, new], axis=-1), q.dtype, head_sinks(sinks))
    new = jnp.einsum("bkgtu,buke->btkge", probs[..., S:], v_new, **F32)
    return cache_values(probs[..., :S], v_cache) + new


def _kernel_attention(
    kernel, q, k_new, v_new, buffers: LayerCache, committed, fresh_mask, starts, sinks, written, reads_pages
):
    """T queries [B, T, K, G, E] attend, in one softmax, to each row's committed cache slots
    (0 .. committed[b] - 1, or from starts[b, t] on under a sliding window; read by the backend's
    `kernel`, `Backend.cache_attention`: the CPU's specjax.kernels.cache_attention or a Pallas
    kernel) and to the T fresh keys and values [B, T, K, E] under fresh_mask [T, T] (or
    [B, T, T]): what `_committed_and_fresh_attention` and `_cache_attention` compute.

    A paged cache's pools go to the kernel with the page tables where it reads pages of their
    size (`reads_pages(page_size)`), and its rows gathered otherwise.

    `written`: the fresh keys and values are already in the cache, at slots committed[b] on. A
    pass of one token then needs no merge: the kernel reads one slot more, the token's own (a
    decoding step ran 8 small XLA ops a layer for the merge, about 1 us each, where its layer's
    kernels take 100-400 us in float32 and 40-150 in Q8_0).
    """
    B, T, K, G, E = q.shape
    queries = q.transpose(0, 2, 3, 1, 4).reshape(B * K, G * T, E)  # entry b*K + k: its G*T queries
    if starts is not None:  # [B, T] -> one per query row, in the same (entry, head, token) order
        starts = jnp.broadcast_to(starts[:, None, None, :], (B, K, G, T)).reshape(B * K, G * T)
    k_cache, v_cache = buffers.keys, buffers.values
    stacked = {} if buffers.layer is None else {"layer": buffers.layer}
    page_size = buffers.values.shape[-2]
    if buffers.pages is not None and buffers.layer is None and reads_pages and reads_pages(page_size):
        stacked = {"pages": buffers.pages}  # the kernel reads the pools through the tables
    elif buffers.pages is not None:  # the rows gathered from the pools, for a kernel of dense rows
        (k_cache, v_cache), stacked = buffers.read(), {}
    # (A one-token pass's mask is [[True]]: it sees itself. A cache of another dtype holds the
    # token's key rounded, which the merge below does not read.)
    own_slot = written and T == 1 and k_cache.dtype == k_new.dtype and v_cache.dtype == v_new.dtype
    lengths = jnp.repeat(committed + 1 if own_slot else committed, K)
    old, old_lse = kernel(queries, k_cache, v_cache, lengths, starts, **stacked)
    old = old.reshape(B, K, G, T, E)
    old_lse = old_lse.reshape(B, K, G, T)
    if own_slot:
        if sinks is not None:  # the sink's share of the softmax scales the output down
            old = old * jax.nn.sigmoid(old_lse - head_sinks(sinks).astype(jnp.float32))[..., None]
        return old.transpose(0, 3, 1, 2, 4).astype(q.dtype)
    scores = masked_scores(q, k_new, fresh_mask).astype(jnp.float32)  # [B, K, G, T, T]
    new_lse = jax.nn.logsumexp(scores, axis=-1)  # finite: a fresh token always sees itself
    new = jnp.einsum("bkgtu,buke->bkgte", jnp.exp(scores - new_lse[..., None]), v_new.astype(jnp.float32))
    lse = jnp.logaddexp(old_lse, new_lse)  # old_lse is -inf for a row with nothing committed
    if sinks is not None:
        lse = jnp.logaddexp(lse, head_sinks(sinks).astype(jnp.float32))
    out = old * jnp.exp(old_lse - lse)[..., None] + new * jnp.exp(new_lse - lse)[..., None]
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)  # [B, T, K, G, E]


def attention_workspace_bytes(
    config: LlamaConfig, batch_size: int, prompt_len: int, width: int, capacity: int, dtype, on
) -> int:
    """The most working memory one layer's attention takes on backend `on` (float32 scores and
    probabilities, partial outputs), beyond its inputs and outputs: the larger of a prefill of
    `prompt_len` tokens and a decoding pass of `width` tokens over `capacity` cache slots, for a
    batch of `batch_size` rows of a model in `dtype` (`on`: a specjax.kernels.backend.Backend). For the
    free-memory check: the score tensor of a long prompt can be larger than the cache."""
    B, H, E, T = batch_size, config.num_heads, config.head_dim, prompt_len
    if on.prefill_attention(E) is None:  # the CPU's chunks: one chunk's [chunk, T] scores at a time
        chunk = min(T, max(MIN_PREFILL_CHUNK, -(-T // PREFILL_CHUNKS)))
        prefill = 2 * B * H * chunk * T * 4
    else:  # blocked: per query a float32 output and its softmax statistics, O(T)
        prefill = 2 * B * H * T * (E + 2) * 4
    if on.cache_attention(E, dtype):
        decode = 4 * B * H * width * (E + 2 + width) * 4  # partial outputs; the fresh tokens' scores
    else:  # XLA scores every slot: [B, H, width, capacity + width], and its softmax
        decode = 2 * B * H * width * (capacity + width) * 4
    return max(prefill, decode)
