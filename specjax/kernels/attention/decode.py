"""Flash-decoding: a pass's queries attend to each cache entry's committed slots, as Pallas
kernels for TPU (Mosaic) and GPU (Triton).

Letters: N cache entries (row b's kv head k is entry b*K + k), R query rows of an entry (G query
heads times T fresh tokens, any order), E head dim, S slots, P splits.

An entry's slots are cut into blocks of `block_k`. Only the blocks that hold a visible slot are
read: from the block of the entry's lowest window start (0 without a window) up to the block of
its last committed slot. That range is shared out evenly among P splits, so a short entry keeps
all P at work; each split runs an online softmax over its blocks and returns its partial state
(running max m, sum l, unnormalized output acc), and `combine_splits` merges the P partials
outside the kernel. Both kernels mask scores outside [window start, length) and zero the keys
and values read there, so stale or padded slots (whatever they hold, NaN included) never reach
the result.

A stacked cache (keys [L, N, E, S], values [L, N, S, E], with a layer index, traced or not) is
read in place: the TPU kernel's index maps and the GPU kernel's loads pick the layer's blocks.
Slicing the layer out in XLA first would copy its whole cache at every layer of every step.

GPU: the Triton backend of Pallas. It runs on every NVIDIA GPU that Triton supports (Ampere and
later), and its kernels read the lengths in the kernel and loop over the needed blocks with a
dynamic trip count and masked loads, which is all flash-decoding needs. Mosaic GPU targets
Hopper and later only and builds its pipelines from warpgroup primitives; nothing here needs them.
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

from specjax.kernels.attention.online import LANES, NEG, normalized, online_softmax, precision


def split_range(length, window_lo, split, *, block_k: int, num_splits: int):
    """The blocks [lo, hi) that split `split` of an entry visits (hi <= lo: none): the entry's
    needed blocks, from the one holding slot window_lo to the one holding slot length - 1, cut
    into num_splits runs of equal length (the last ones shorter or empty). Scalars in, scalars
    out; used by the kernels and by the TPU index maps alike. Every operand is >= 0, so
    lax.div (rounding toward zero) is the floor division; jnp's `//` also corrects for signs,
    with an op that Mosaic cannot lower without knowing the TPU generation."""
    first = lax.div(window_lo, block_k)
    end = lax.div(length + block_k - 1, block_k)  # one past the last needed block
    per = lax.div(jnp.maximum(end - first, 0) + num_splits - 1, num_splits)
    lo = first + split * per
    return lo, jnp.minimum(lo + per, end)


def window_starts(starts, lengths):
    """[N] int32: the lowest slot any query row of an entry sees (0 without a window; per-row
    starts may be negative or past the length)."""
    if starts is None:
        return jnp.zeros_like(lengths)
    return jnp.maximum(jnp.min(starts, axis=1), 0)


def combine_splits(m, l, acc):
    """Merge per-split partial softmaxes m, l [N, P, R] and acc [N, P, R, E] into the output
    [N, R, E] and log-sum-exp [N, R] (-inf and 0 where no split saw a slot)."""
    m_all = jnp.max(m, axis=1)  # [N, R]
    scale = jnp.exp(m - m_all[:, None])  # [N, P, R]; splits that saw nothing have l = acc = 0
    total = jnp.sum(l * scale, axis=1)  # [N, R]
    out = normalized(total, jnp.sum(acc * scale[..., None], axis=1))
    seen = total > 0
    return out, jnp.where(seen, m_all + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


# ----------------------------------------------------------------------------------------------
# TPU


def tpu_cache_attention(
    queries, keys, values, lengths, starts, layer, *, block_k, num_splits, interpret, entries=None
):
    """See `specjax.kernels.attention.cache_attention`. Grid (N, P, steps): step i of split j
    of entry n reads block lo + i of its range. The lengths and each entry's lowest window start
    arrive by scalar prefetch, so the index maps know the range: past its end they repeat the
    split's last block (the pipeline then issues no new copy) and `pl.when` skips the compute.
    A stacked cache's layer (an int32 scalar, or None) arrives by scalar prefetch too, last; the
    key and value index maps lead with it and their blocks squeeze the layer axis.

    A paged cache (`entries` [N, W]: entry n's block w is the pool's entry entries[n, w]; keys
    [M, E, P], values [M, P, E], block_k = P): the table arrives by scalar prefetch, flattened,
    and the index maps read each block from the pool entry it names."""
    N, R, E = queries.shape
    S = values.shape[-2] if entries is None else entries.shape[1] * values.shape[-2]
    block_k = min(block_k, S)  # a block as long as the whole slot axis is always a legal shape
    steps = pl.cdiv(pl.cdiv(S, block_k), num_splits)  # the most blocks one split can get
    dtype = jnp.result_type(queries, keys, values)
    window_lo = window_starts(starts, lengths)
    ranges = functools.partial(split_range, block_k=block_k, num_splits=num_splits)

    def block(n, j, i, lengths_ref, window_lo_ref, *_):
        lo, hi = ranges(lengths_ref[n], window_lo_ref[n], j)
        return jnp.maximum(jnp.minimum(lo + i, hi - 1), 0)

    key_block, value_block = (None, E, block_k), (None, block_k, E)
    key_at = lambda n, j, i, *refs: (n, 0, block(n, j, i, *refs))  # noqa: E731
    value_at = lambda n, j, i, *refs: (n, block(n, j, i, *refs), 0)  # noqa: E731
    prefetch = [lengths, window_lo]
    if entries is not None:  # (never with a layer: a paged cache is one layer's pools)
        W = entries.shape[1]
        prefetch.append(entries.reshape(-1))
        key_at = lambda n, j, i, *refs: (refs[2][n * W + block(n, j, i, *refs)], 0, 0)  # noqa: E731
        value_at = key_at
    if layer is not None:
        prefetch.append(layer.reshape(1))
        key_block, value_block = (None, *key_block), (None, *value_block)
        key_at, value_at = _in_layer(key_at), _in_layer(value_at)
    in_specs = [
        pl.BlockSpec((None, R, E), lambda n, j, i, *_: (n, 0, 0)),
        pl.BlockSpec(key_block, key_at),
        pl.BlockSpec(value_block, value_at),
    ]
    operands = [queries.astype(dtype), keys.astype(dtype), values.astype(dtype)]
    if starts is not None:  # one start per row, as a column [R, 1] to mask scores [R, block_k]
        in_specs.append(pl.BlockSpec((None, R, 1), lambda n, j, i, *_: (n, 0, 0)))
        operands.append(starts[..., None])
    lm_spec = pl.BlockSpec((None, None, R, LANES), lambda n, j, i, *_: (n, j, 0, 0))
    out_specs = [lm_spec, lm_spec, pl.BlockSpec((None, None, R, E), lambda n, j, i, *_: (n, j, 0, 0))]
    out_shape = [
        jax.ShapeDtypeStruct((N, num_splits, R, LANES), jnp.float32),  # m
        jax.ShapeDtypeStruct((N, num_splits, R, LANES), jnp.float32),  # l
        jax.ShapeDtypeStruct((N, num_splits, R, E), jnp.float32),  # acc
    ]
    kernel = functools.partial(
        _tpu_kernel,
        ranges=ranges,
        block_k=block_k,
        steps=steps,
        windowed=starts is not None,
        stacked=layer is not None,
        paged=entries is not None,
    )
    m, l, acc = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(N, num_splits, steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((R, LANES), jnp.float32),
                pltpu.VMEM((R, LANES), jnp.float32),
                pltpu.VMEM((R, E), jnp.float32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="specjax_decode_attention",
    )(*prefetch, *operands)
    return combine_splits(m[..., 0], l[..., 0], acc)


def _in_layer(index_map):
    """A TPU index map into a stacked buffer: `index_map`'s block, in the layer that the last
    scalar prefetch operand holds."""
    return lambda n, j, i, *refs: (refs[-1][0], *index_map(n, j, i, *refs))


def _tpu_kernel(lengths_ref, window_lo_ref, *refs, ranges, block_k, steps, windowed, stacked, paged):
    if stacked or paged:  # a stacked cache's layer, a paged one's table: only the index maps read it
        refs = refs[1:]
    q_ref, k_ref, v_ref, *refs = refs
    starts_ref = refs.pop(0) if windowed else None
    m_out, l_out, acc_out, m_ref, l_ref, acc_ref = refs
    n, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, window_lo = lengths_ref[n], window_lo_ref[n]
    lo, hi = ranges(length, window_lo, j)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(lo + i < hi)
    def _block():
        first_slot = (lo + i) * block_k
        slots = first_slot + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # as a row
        slot_column = first_slot + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # and a column
        readable = (slots >= window_lo) & (slots < length)  # [1, block_k]
        keys = jnp.where(readable, k_ref[...], 0)  # [E, block_k]
        values = jnp.where((slot_column >= window_lo) & (slot_column < length), v_ref[...], 0)
        q = q_ref[...]
        scores = jnp.dot(q, keys, precision=precision(q.dtype), preferred_element_type=jnp.float32)
        keep = readable if starts_ref is None else readable & (slots >= starts_ref[...])  # [R, block_k]
        state = online_softmax(m_ref[...], l_ref[...], acc_ref[...], scores, keep, values, lanes=True)
        m_ref[...], l_ref[...], acc_ref[...] = state

    @pl.when(i == steps - 1)
    def _finish():
        m_out[...], l_out[...], acc_out[...] = m_ref[...], l_ref[...], acc_ref[...]


# ----------------------------------------------------------------------------------------------
# GPU (Triton)


def gpu_cache_attention(
    queries, keys, values, lengths, starts, layer, *, block_k, num_splits, interpret, entries=None
):
    """See `specjax.kernels.attention.cache_attention`. Grid (N, P, row blocks): each program
    reads its entry's length, computes its split's block range and loops over exactly those
    blocks. Triton needs power-of-two tiles, so rows are padded to one (at least 16, the
    smallest matrix product) and taken in blocks of at most 64.

    A stacked cache's layer (an int32 scalar, or None) is one more input, last: Triton's index
    maps cannot read data, so a program takes its entry in every layer as its block (a pointer,
    nothing is copied) and its loads offset into the layer.

    A paged cache (`entries` [N, W]: entry n's block w is the pool's entry entries[n, w]; keys
    [M, E, P], values [M, P, E], block_k = P): a program takes the whole pool as its block (a
    pointer) and its entry's row of the table, and loads each block from the entry it names."""
    N, R, E = queries.shape
    S = values.shape[-2] if entries is None else entries.shape[1] * values.shape[-2]
    rows = max(16, pl.next_power_of_2(R))
    block_r = min(rows, 64)
    dtype = jnp.result_type(queries, keys, values)
    window_lo = window_starts(starts, lengths)
    queries = jnp.pad(queries.astype(dtype), ((0, 0), (0, rows - R), (0, 0)))
    if starts is None:
        starts = jnp.zeros((N, rows), jnp.int32)
    else:  # padded rows start past every slot: they see nothing and are dropped
        starts = jnp.pad(starts, ((0, 0), (0, rows - R)), constant_values=np.iinfo(np.int32).max)
    entry = lambda n, j, r: (n,)  # noqa: E731
    # Keys and values: the whole entry (in every layer, for a stacked cache); the loads pick blocks.
    if entries is not None:
        M, P = values.shape[:2]
        key_spec = pl.BlockSpec((M, E, P), lambda n, j, r: (0, 0, 0))
        value_spec = pl.BlockSpec((M, P, E), lambda n, j, r: (0, 0, 0))
    elif layer is None:
        key_spec = pl.BlockSpec((None, E, S), lambda n, j, r: (n, 0, 0))
        value_spec = pl.BlockSpec((None, S, E), lambda n, j, r: (n, 0, 0))
    else:
        L = keys.shape[0]
        key_spec = pl.BlockSpec((L, None, E, S), lambda n, j, r: (0, n, 0, 0))
        value_spec = pl.BlockSpec((L, None, S, E), lambda n, j, r: (0, n, 0, 0))
    in_specs = [
        pl.BlockSpec((None,), entry),  # lengths
        pl.BlockSpec((None,), entry),  # window_lo
        pl.BlockSpec((None, block_r, E), lambda n, j, r: (n, r, 0)),
        key_spec,
        value_spec,
        pl.BlockSpec((None, block_r), lambda n, j, r: (n, r)),
    ]
    operands = [lengths, window_lo, queries, keys.astype(dtype), values.astype(dtype), starts]
    if layer is not None:
        in_specs.append(pl.BlockSpec((None,), lambda n, j, r: (0,)))
        operands.append(layer.reshape(1))
    if entries is not None:  # its row of the table, padded to a power of two (a Triton tile)
        width = max(16, pl.next_power_of_2(entries.shape[1]))
        in_specs.append(pl.BlockSpec((None, width), lambda n, j, r: (n, 0)))
        operands.append(jnp.pad(entries, ((0, 0), (0, width - entries.shape[1]))))
    lm_spec = pl.BlockSpec((None, None, block_r), lambda n, j, r: (n, j, r))
    out_specs = [lm_spec, lm_spec, pl.BlockSpec((None, None, block_r, E), lambda n, j, r: (n, j, r, 0))]
    out_shape = [
        jax.ShapeDtypeStruct((N, num_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((N, num_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((N, num_splits, rows, E), jnp.float32),
    ]
    ranges = functools.partial(split_range, block_k=block_k, num_splits=num_splits)
    m, l, acc = pl.pallas_call(
        functools.partial(
            _gpu_kernel, ranges=ranges, block_k=block_k, stacked=layer is not None, paged=entries is not None
        ),
        grid=(N, num_splits, rows // block_r),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="specjax_decode_attention",
    )(*operands)
    out, lse = combine_splits(m, l, acc)
    return out[:, :R], lse[:, :R]


def _gpu_kernel(
    lengths_ref, window_lo_ref, q_ref, k_ref, v_ref, starts_ref, *refs, ranges, block_k, stacked, paged
):
    # A stacked cache's refs are k_ref [L, E, S] and v_ref [L, S, E], this entry in every layer:
    # its loads lead with the layer's index (one indexer: Triton's loads take no chained `.at`).
    # A paged one's are the whole pools, k_ref [M, E, P] and v_ref [M, P, E]: a block's loads
    # lead with the pool entry its table names, and read its page from slot 0.
    layer, table = (), None
    if stacked:
        layer_ref, *refs = refs
        layer = (layer_ref[...],)
    if paged:
        table_ref, *refs = refs
        table = table_ref[...]  # [width] this entry's pool entries, block by block
    m_out, l_out, acc_out = refs
    length, window_lo = lengths_ref[...], window_lo_ref[...]
    lo, hi = ranges(length, window_lo, pl.program_id(1))
    q = q_ref[...]  # [block_r, E]
    row_starts = starts_ref[...]  # [block_r]
    E = q.shape[1]

    def visit(b, carry):
        m, l, acc = carry
        slots = b * block_k + jnp.arange(block_k)
        readable = (slots >= window_lo) & (slots < length)  # [block_k]
        lead, first = layer, b * block_k
        if paged:  # block b is page table[b], read from its slot 0 (a sum picks it: no gather)
            lead = (jnp.sum(jnp.where(jnp.arange(table.shape[0]) == b, table, 0)),)
            first = 0
        # Masked loads: slots outside the range (past S included) are not read at all.
        keys = plgpu.load(
            k_ref.at[*lead, :, pl.ds(first, block_k)],
            mask=jnp.broadcast_to(readable[None, :], (E, block_k)),
            other=0.0,
        )
        values = plgpu.load(
            v_ref.at[*lead, pl.ds(first, block_k), :],
            mask=jnp.broadcast_to(readable[:, None], (block_k, E)),
            other=0.0,
        )
        scores = jnp.dot(q, keys, precision=precision(q.dtype), preferred_element_type=jnp.float32)
        keep = readable[None, :] & (slots[None, :] >= row_starts[:, None])  # [block_r, block_k]
        return online_softmax(m, l, acc, scores, keep, values)

    block_r = q.shape[0]
    init = (
        jnp.full((block_r,), NEG, jnp.float32),
        jnp.zeros((block_r,), jnp.float32),
        jnp.zeros((block_r, E), jnp.float32),
    )
    m, l, acc = lax.fori_loop(lo, jnp.maximum(lo, hi), visit, init)
    m_out[...], l_out[...], acc_out[...] = m, l, acc
