"""Blocked flash attention for a prefill into an empty cache, as Pallas kernels for TPU (Mosaic)
and GPU (Triton).

Letters: N cache entries (entry n = b*K + k), T fresh tokens, G query heads per kv head, E head
dim, B rows; Q query blocks of block_q tokens, V the most key blocks one query block visits.

Each query block runs an online softmax over the key blocks it needs, listed on the host
(`visits`): under the causal mask, blocks 0 .. the one holding the query block's last token
(blocks above the diagonal are never read); under a numpy mask, the blocks its BlockTable keeps.
A sliding window is applied by masking inside the visited blocks: positions are traced values,
so which blocks the window empties is not known when the kernel is built. Attention sinks (one
more logit per head, no value) start each query's online softmax: running max the sink, sum 1.

TPU: one grid step per (entry, query block, visit); the visit list arrives by scalar prefetch
and picks the key block in the index maps. The step takes the block's tokens for all G heads at
once, as rows r = t*G + g of queries [N, T*G, E] (a free reshape), so a key block is read once
for G heads. GPU (Triton, see decode.py for why): one program per (entry, head, query block)
loops over its visits; Triton's tiles are powers of two, so rows per step cannot hold a G that
is not one, and each head takes its queries with a strided load instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from specjax.kernels.attention.blocks import BlockTable
from specjax.kernels.attention.online import LANES, NEG, normalized, online_softmax, precision


def visits(table: BlockTable | None, T: int, block_q: int, block_k: int):
    """(kv_block [Q*V], count [Q], tile [Q*V]) int32 host arrays: the key blocks each query
    block visits, flattened row-major (scalar memory holds 1-D arrays best). Causal (table None):
    key blocks 0 .. the one holding query block qi's last token, repeated past the end."""
    if table is not None:
        return table.kv_block.reshape(-1), table.count, table.tile.reshape(-1)
    num_q, num_k = -(-T // block_q), -(-T // block_k)
    count = np.minimum(-(-(np.arange(1, num_q + 1) * block_q) // block_k), num_k).astype(np.int32)
    kv_block = np.minimum(np.arange(num_k)[None, :], count[:, None] - 1).astype(np.int32)
    return kv_block.reshape(-1), count, np.zeros(num_q * num_k, np.int32)


# ----------------------------------------------------------------------------------------------
# TPU


def tpu_prefill_attention(
    queries, keys, values, *, table, positions, window, block_q, block_k, interpret, sinks=None
):
    """See `specjax.kernels.attention.prefill_attention`."""
    N, T, G, E = queries.shape
    dtype = jnp.result_type(queries, keys, values)
    kv_block, count, tile = visits(table, T, block_q, block_k)
    num_q, width = count.shape[0], kv_block.shape[0] // count.shape[0]
    rows = block_q * G  # query rows per step: block_q tokens, each with its G heads

    def key_index(n, qi, i, kv_block_ref, count_ref, tile_ref):
        return (n, kv_block_ref[qi * width + i], 0)

    in_specs = [
        pl.BlockSpec((None, rows, E), lambda n, qi, i, *_: (n, qi, 0)),
        pl.BlockSpec((None, block_k, E), key_index),
        pl.BlockSpec((None, block_k, E), key_index),
    ]
    operands = [queries.astype(dtype).reshape(N, T * G, E), keys.astype(dtype), values.astype(dtype)]
    if table is not None:  # each tile's rows repeated for the G heads of its tokens
        tiles = np.repeat(table.tiles, G, axis=1)  # [P, rows, block_k]
        in_specs.append(
            pl.BlockSpec(
                (None, rows, block_k), lambda n, qi, i, kv, c, tile_ref: (tile_ref[qi * width + i], 0, 0)
            )
        )
        operands.append(jnp.asarray(tiles))
    if window is not None:
        per_row = N // positions.shape[0]  # entries per row of the batch
        row = lambda n: lax.div(n, per_row)  # noqa: E731  (jnp's // needs the TPU generation to lower)
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda n, qi, i, *_: (row(n), qi, 0)))
        in_specs.append(
            pl.BlockSpec((None, 1, block_k), lambda n, qi, i, kv, *_: (row(n), 0, kv[qi * width + i]))
        )
        operands.append(jnp.repeat(positions, G, axis=1)[..., None])  # [B, T*G, 1]: each row's position
        operands.append(positions[:, None, :])  # [B, 1, T]
    if sinks is not None:  # row r = t*G + g of every query block: head g's sink
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda n, qi, i, *_: (n, 0, 0)))
        operands.append(jnp.tile(sinks, (1, block_q))[..., None])  # [N, rows, 1]
    kernel = functools.partial(
        _tpu_kernel,
        G=G,
        T=T,
        width=width,
        block_k=block_k,
        masked=table is not None,
        window=window,
        sinks=sinks is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(N, num_q, width),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, rows, E), lambda n, qi, i, *_: (n, qi, 0)),
            scratch_shapes=[
                pltpu.VMEM((rows, LANES), jnp.float32),
                pltpu.VMEM((rows, LANES), jnp.float32),
                pltpu.VMEM((rows, E), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((N, T * G, E), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="specjax_prefill_attention",
    )(jnp.asarray(kv_block), jnp.asarray(count), jnp.asarray(tile), *operands)
    return out.reshape(N, T, G, E)


def _tpu_kernel(
    kv_block_ref, count_ref, tile_ref, q_ref, k_ref, v_ref, *refs, G, T, width, block_k, masked, window, sinks
):
    refs = list(refs)
    tile_mask_ref = refs.pop(0) if masked else None
    q_pos_ref, k_pos_ref = (refs.pop(0), refs.pop(0)) if window is not None else (None, None)
    sinks_ref = refs.pop(0) if sinks else None
    out_ref, m_ref, l_ref, acc_ref = refs
    qi, i = pl.program_id(1), pl.program_id(2)
    rows = q_ref.shape[0]

    @pl.when(i == 0)
    def _init():
        if sinks:  # the sink starts the softmax: a running max of it, a sum of 1
            m_ref[...] = jnp.broadcast_to(sinks_ref[...], m_ref.shape)
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        else:
            m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i < count_ref[qi])
    def _block():
        first_key = kv_block_ref[qi * width + i] * block_k
        q = q_ref[...]  # [rows, E]
        values = v_ref[...]  # [block_k, E]
        if T % block_k:  # the last key block runs past T: its padding may hold anything
            key_column = first_key + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            values = jnp.where(key_column < T, values, 0)
        scores = lax.dot_general(
            q,
            k_ref[...],
            (((1,), (1,)), ((), ())),
            precision=precision(q.dtype),
            preferred_element_type=jnp.float32,
        )  # [rows, block_k]
        if masked:  # the tile's pairs; padding pairs are dropped in it
            keep = tile_mask_ref[...]
        else:  # causal: key u is kept by row r = t*G + g when u <= t, i.e. u*G <= r
            key = first_key + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
            row = qi * rows + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
            keep = key * G <= row
        if window is not None:
            keep = keep & (q_pos_ref[...] - k_pos_ref[...] < window)  # [rows, 1] - [1, block_k]
        state = online_softmax(m_ref[...], l_ref[...], acc_ref[...], scores, keep, values, lanes=True)
        m_ref[...], l_ref[...], acc_ref[...] = state

    @pl.when(i == width - 1)
    def _finish():
        out_ref[...] = normalized(l_ref[...], acc_ref[...], lanes=True)


# ----------------------------------------------------------------------------------------------
# GPU (Triton)


def gpu_prefill_attention(
    queries, keys, values, *, table, positions, window, block_q, block_k, interpret, sinks=None
):
    """See `specjax.kernels.attention.prefill_attention`. Tokens are padded to whole blocks
    (a copy of O(T) elements; the padding keys are zeros and never kept)."""
    N, T, G, E = queries.shape
    dtype = jnp.result_type(queries, keys, values)
    kv_block, count, tile = visits(table, T, block_q, block_k)
    num_q, width = count.shape[0], kv_block.shape[0] // count.shape[0]
    t_q, t_k = num_q * block_q, -(-T // block_k) * block_k
    queries = jnp.pad(queries.astype(dtype), ((0, 0), (0, t_q - T), (0, 0), (0, 0)))
    keys = jnp.pad(keys.astype(dtype), ((0, 0), (0, t_k - T), (0, 0)))
    values = jnp.pad(values.astype(dtype), ((0, 0), (0, t_k - T), (0, 0)))
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    kv_block, count, tile = jnp.asarray(kv_block), jnp.asarray(count), jnp.asarray(tile)
    in_specs = [
        whole(kv_block),
        whole(count),
        whole(tile),
        pl.BlockSpec((None, block_q, None, E), lambda n, g, qi: (n, qi, g, 0)),
        pl.BlockSpec((None, t_k, E), lambda n, g, qi: (n, 0, 0)),  # the whole entry: loads pick blocks
        pl.BlockSpec((None, t_k, E), lambda n, g, qi: (n, 0, 0)),
    ]
    operands = [kv_block, count, tile, queries, keys, values]
    if table is not None:
        tiles = jnp.asarray(table.tiles.astype(np.int8))  # [P, block_q, block_k]
        in_specs.append(whole(tiles))
        operands.append(tiles)
    if window is not None:
        per_row = N // positions.shape[0]
        padded = jnp.pad(positions, ((0, 0), (0, max(t_q, t_k) - T)))
        in_specs.append(pl.BlockSpec((None, padded.shape[1]), lambda n, g, qi: (lax.div(n, per_row), 0)))
        operands.append(padded)
    if sinks is not None:  # [N*G, block_q]: head g of entry n's sink at every query of a block
        in_specs.append(pl.BlockSpec((None, block_q), lambda n, g, qi: (n * G + g, 0)))
        operands.append(jnp.broadcast_to(sinks.reshape(N * G, 1), (N * G, block_q)))
    kernel = functools.partial(
        _gpu_kernel,
        width=width,
        block_q=block_q,
        block_k=block_k,
        masked=table is not None,
        window=window,
        sinks=sinks is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid=(N, G, num_q),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, E), lambda n, g, qi: (n, qi, g, 0)),
        out_shape=jax.ShapeDtypeStruct((N, t_q, G, E), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4 if E <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="specjax_prefill_attention",
    )(*operands)
    return out[:, :T]


def _gpu_kernel(
    kv_block_ref,
    count_ref,
    tile_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    width,
    block_q,
    block_k,
    masked,
    window,
    sinks,
):
    refs = list(refs)
    tiles_ref = refs.pop(0) if masked else None
    positions_ref = refs.pop(0) if window is not None else None
    sinks_ref = refs.pop(0) if sinks else None
    (out_ref,) = refs
    qi = pl.program_id(2)
    q = q_ref[...]  # [block_q, E]
    q_tokens = qi * block_q + jnp.arange(block_q)
    if window is not None:
        q_positions = positions_ref[pl.ds(qi * block_q, block_q)]

    def visit(i, carry):
        m, l, acc = carry
        ki = kv_block_ref[qi * width + i]
        keys = k_ref[pl.ds(ki * block_k, block_k), :]  # [block_k, E]
        values = v_ref[pl.ds(ki * block_k, block_k), :]
        scores = lax.dot_general(
            q,
            keys,
            (((1,), (1,)), ((), ())),
            precision=precision(q.dtype),
            preferred_element_type=jnp.float32,
        )  # [block_q, block_k]
        k_tokens = ki * block_k + jnp.arange(block_k)
        if masked:
            keep = tiles_ref[tile_ref[qi * width + i]] != 0
        else:
            keep = k_tokens[None, :] <= q_tokens[:, None]
        if window is not None:
            k_positions = positions_ref[pl.ds(ki * block_k, block_k)]
            keep = keep & (q_positions[:, None] - k_positions[None, :] < window)
        return online_softmax(m, l, acc, scores, keep, values)

    E = q.shape[1]
    init = (
        jnp.full((block_q,), NEG, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, E), jnp.float32),
    )
    if sinks:  # the sink starts the softmax: a running max of it, a sum of 1
        init = (sinks_ref[...], jnp.ones((block_q,), jnp.float32), init[2])
    _, l, acc = lax.fori_loop(0, count_ref[qi], visit, init)
    out_ref[...] = normalized(l, acc)
