"""Attention kernels for accelerators, and their plain-XLA fallback, behind two contracts.

`cache_attention`: a decoding or verify pass's queries attend to each cache entry's committed
slots (flash-decoding: only the blocks below each entry's length, and inside its window, are read).
`prefill_attention`: the T fresh tokens of a prefill into an empty cache attend to each other
(blocked flash attention: never a [T, T] score tensor, and blocks the mask drops are skipped).

Each takes `implementation`: "tpu" (Pallas on Mosaic TPU), "cuda" (Pallas on Triton; see
decode.py for why Triton) or "xla" (plain jnp, any backend). `interpret=True` runs a Pallas
kernel on the host (Pallas' interpreter), which is how the CPU tests them.

Letters: N cache entries (row b's kv head k is entry b*K + k), R query rows of an entry, S slots,
E head dim, T fresh tokens, G query heads per kv head, B rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from specjax.kernels.attention import decode, prefill, xla
from specjax.kernels.attention.blocks import BlockTable, block_table

IMPLEMENTATIONS = ("tpu", "cuda", "xla")
PALLAS_HEAD_DIMS = (64, 128, 256)  # what the Pallas kernels are built for on a device
INTERPRET_HEAD_DIMS = (16, 32, 64, 128, 256)  # in interpret mode also tiny test models' heads
DECODE_BLOCK_K = {"tpu": 256, "cuda": 128}  # slots per block (cuda: 64 at head dim 256)
DECODE_SPLITS = {"tpu": 2, "cuda": 8}
# Prefill tokens per block (block_q, block_k). TPU: block_q is chosen so that a step's
# block_q * G query rows are about TPU_PREFILL_ROWS (see prefill_blocks). cuda: 64 x 64 keeps a
# program's tiles in registers up to head dim 256. Not tuned on hardware.
PREFILL_BLOCKS = {"tpu": (None, 128), "cuda": (64, 64), "xla": (128, 128)}
TPU_PREFILL_ROWS = 512

__all__ = ["cache_attention", "prefill_attention", "BlockTable", "block_table", "IMPLEMENTATIONS"]


def cache_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    lengths: jax.Array,
    starts: jax.Array | None = None,
    *,
    implementation: str,
    interpret=False,
    block_k: int | None = None,
    num_splits: int | None = None,
    layer: int | jax.Array | None = None,
    pages: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of queries [N, R, E] (already scaled) to the first lengths[n] slots of cache
    entry n: keys [N, E, S], values [N, S, E] (the KVCache's layouts), lengths [N] int32 (0..S).

    pages: a paged cache's page tables [B, W] int32 (models/cache.py, KVCache.pages): keys and
    values are then pools of pages, keys [M*K, E, P] and values [M*K, P, E] (entry m*K + k: page
    m's kv head k, K = N / B), and entry n = b*K + k's slot s is slot s % P of the pool's entry
    pages[b, s // P]*K + k (S = W*P). The Pallas kernels read each entry's pages in place, a block
    a page (block_k is the page size: a multiple of 128 on tpu); "xla" gathers the rows.

    layer: with a stacked cache, keys [L, N, E, S] and values [L, N, S, E] (every layer's cache
    in one buffer), the layer to attend to: a Python int in 0..L-1, or an integer scalar array
    (a traced one, e.g. the index of a loop over layers, is clamped to 0..L-1 as
    `lax.dynamic_index_in_dim` does). The kernels read that layer's blocks from the stacked
    buffers themselves: `keys[layer]` in front of a custom call would copy the layer's whole
    cache at every layer of every step.

    starts [N, R] int32 (a sliding window: a query at position p with window W starts at
    p - W + 1, so it may be negative): query r of entry n sees only slots
    max(starts[n, r], 0) .. lengths[n] - 1. None: every row from slot 0.

    Returns the output [N, R, E] float32 and each query's log-sum-exp of its scores [N, R]
    float32 (minus infinity, with output 0, where a query sees no slot), so that a caller can
    merge more keys into the same softmax: the contract of specjax.kernels.cache_attention.
    Float32 or bfloat16 operands; products accumulate in float32.

    implementation: "tpu", "cuda" or "xla" (module docstring). The Pallas ones read only the
    blocks of `block_k` slots that hold a visible slot (default DECODE_BLOCK_K; a multiple of 128
    on TPU, a power of two on cuda) and share them among `num_splits` partial softmaxes
    (default DECODE_SPLITS). interpret: run a Pallas kernel in Pallas' interpreter (True, or on
    "tpu" a `pltpu.InterpretParams`).
    """
    N, R, E = _shape("queries", queries, 3, "[N, R, E]")
    if pages is not None:
        return _paged_cache_attention(
            queries, keys, values, lengths, starts, pages, implementation, interpret, num_splits, layer
        )
    if layer is None:
        S = _shape("values", values, 3, "[N, S, E] (without layer)")[1]
        _expect("keys", keys, (N, E, S), "[N, E, S] (N, E of queries, S of values; without layer)")
        _expect("values", values, (N, S, E), "[N, S, E] (N, E of queries; without layer)")
    else:
        L, _, S, _ = _shape("values", values, 4, "[L, N, S, E] (a stacked cache, with layer)")
        _expect("keys", keys, (L, N, E, S), "[L, N, E, S] (N, E of queries, L, S of values; with layer)")
        _expect("values", values, (L, N, S, E), "[L, N, S, E] (N, E of queries; with layer)")
        layer = _layer(layer, L)
    lengths, starts = _checked_rows(queries, keys, values, lengths, starts, implementation)
    if implementation == "xla":
        return xla.cache_attention(queries, keys, values, lengths, starts, layer)
    _head_dim(E, implementation, interpret)
    if block_k is None:
        block_k = 64 if implementation == "cuda" and E > 128 else DECODE_BLOCK_K[implementation]
    _block("block_k", block_k, implementation, lanes=True)
    return _pallas_decode(
        implementation, queries, keys, values, lengths, starts, layer, block_k, num_splits, interpret
    )


def _paged_cache_attention(
    queries, keys, values, lengths, starts, pages, implementation, interpret, num_splits, layer
):
    """`cache_attention` over a paged cache (its `pages` argument)."""
    N, R, E = queries.shape
    if layer is not None:
        raise ValueError("cache_attention: a paged cache (pages) is one layer's pools; layer must be None")
    B, W = _shape("pages", pages, 2, "[B, W] (page tables)")
    M, P = _shape("values", values, 3, "[M*K, P, E] (a pool, with pages)")[:2]
    if N % B:
        raise ValueError(f"cache_attention: {N} query entries for {B} page tables; allowed: a multiple")
    K = N // B
    _expect("keys", keys, (M, E, P), "[M*K, E, P] (a pool: E of queries, P, M*K of values; with pages)")
    lengths, starts = _checked_rows(queries, keys, values, lengths, starts, implementation)
    # Entry n's pool entry for its block w: pages[n // K, w] * K + n % K, [N, W]
    entries = jnp.asarray(pages, jnp.int32)[:, None, :] * K + jnp.arange(K, dtype=jnp.int32)[None, :, None]
    entries = entries.reshape(N, W)
    if implementation == "xla":  # the rows gathered: keys [N, E, W*P], values [N, W*P, E]
        rows_k = jnp.moveaxis(keys[entries], 1, 2).reshape(N, E, W * P)
        rows_v = values[entries].reshape(N, W * P, E)
        return xla.cache_attention(queries, rows_k, rows_v, lengths, starts, None)
    _head_dim(E, implementation, interpret)
    _block("the page size (block_k)", P, implementation, lanes=True)
    return _pallas_decode(
        implementation, queries, keys, values, lengths, starts, None, P, num_splits, interpret, entries
    )


def _pallas_decode(
    implementation,
    queries,
    keys,
    values,
    lengths,
    starts,
    layer,
    block_k,
    num_splits,
    interpret,
    entries=None,
):
    """decode.py's kernel for `implementation`, with num_splits checked (None: its default)."""
    run = decode.tpu_cache_attention if implementation == "tpu" else decode.gpu_cache_attention
    num_splits = _splits(num_splits, implementation)
    return run(
        queries,
        keys,
        values,
        lengths,
        starts,
        layer,
        block_k=block_k,
        num_splits=num_splits,
        interpret=interpret,
        entries=entries,
    )


def _splits(num_splits, implementation: str) -> int:
    """`cache_attention`'s num_splits, checked (None: the implementation's default)."""
    num_splits = DECODE_SPLITS[implementation] if num_splits is None else num_splits
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"cache_attention: num_splits is {num_splits!r}; allowed: an int >= 1")
    return num_splits


def _checked_rows(queries, keys, values, lengths, starts, implementation):
    """`cache_attention`'s checks of everything but the cache's shapes: (lengths, starts) as int32."""
    N, R, _ = queries.shape
    _expect("lengths", lengths, (N,), "[N]")
    if starts is not None:
        _expect("starts", starts, (N, R), "[N, R] or None")
        starts = jnp.asarray(starts).astype(jnp.int32)
    _floats(queries=queries, keys=keys, values=values)
    _implementation(implementation)
    return jnp.asarray(lengths).astype(jnp.int32), starts


def prefill_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    *,
    mask: np.ndarray | None = None,
    positions: jax.Array | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
    implementation: str,
    interpret=False,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Attention of a prefill's T fresh tokens to each other, for a cache that was empty:
    queries [N, T, G, E] (already scaled), keys and values [N, T, E] (entry n = b*K + k).

    mask: None for causal (token t sees u <= t), or a numpy bool [T, T] known at trace time
    (a tree's ancestors, look-ahead blocks, anything); key blocks it drops entirely are skipped.
    positions [B, T] int32 with window (a static int) for a sliding window: additionally keep
    (t, u) only where positions[b, t] - positions[b, u] < window, b = n // (N // B). The window
    is applied by masking inside the blocks visited (positions are traced values, so which
    blocks it empties is not known when the kernel is built).

    sinks [N, G] float32 (gpt-oss's attention sinks), or None: head g of entry n has one more
    logit, sinks[n, g], in its softmax, with no value. It starts each query's online softmax (a
    running max of the sink and a sum of 1), so its weight is taken from the keys' and nothing
    is added to the output.

    Returns out [N, T, G, E] float32; a query that sees no key gets 0. block_q tokens of queries
    and block_k keys per step (capped at T; on TPU block_q a multiple of 8 and block_k of 128,
    on cuda powers of two; defaults: `prefill_blocks`).
    """
    N, T, G, E = _shape("queries", queries, 4, "[N, T, G, E]")
    _expect("keys", keys, (N, T, E), "[N, T, E] (N, T, E of queries)")
    _expect("values", values, (N, T, E), "[N, T, E] (N, T, E of queries)")
    _floats(queries=queries, keys=keys, values=values)
    _implementation(implementation)
    if mask is not None:
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != (T, T):
            raise ValueError(
                f"prefill_attention: mask is {_describe(mask)}; allowed: None (causal) or a numpy "
                f"bool array [T, T] = {(T, T)}"
            )
    if (positions is None) != (window is None):
        raise ValueError(
            f"prefill_attention: positions is {_describe(positions)} and window is {window!r}; "
            "allowed: both (a sliding window) or neither"
        )
    if window is not None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"prefill_attention: window is {window!r}; allowed: a static int >= 1")
        B = _shape("positions", positions, 2, "[B, T]")[0]
        if positions.shape[1] != T or N % B:
            raise ValueError(
                f"prefill_attention: positions has shape {tuple(positions.shape)}; allowed: [B, T] "
                f"with T = {T} and B dividing N = {N}"
            )
        positions = jnp.asarray(positions).astype(jnp.int32)
    if sinks is not None:
        _expect("sinks", sinks, (N, G), "[N, G] (N, G of queries) or None")
        sinks = jnp.asarray(sinks).astype(jnp.float32)
    block_q, block_k = prefill_blocks(implementation, G, block_q, block_k)
    if implementation != "xla":
        _head_dim(E, implementation, interpret)
        _block("block_q", block_q, implementation, lanes=False)
        _block("block_k", block_k, implementation, lanes=True)
    elif not (isinstance(block_q, int) and isinstance(block_k, int) and block_q > 0 and block_k > 0):
        raise ValueError(
            f"prefill_attention: block_q {block_q!r} and block_k {block_k!r}; allowed: ints >= 1"
        )
    block_q, block_k = _fit_block(block_q, T, implementation), _fit_block(block_k, T, implementation)
    table = None if mask is None else block_table(mask, block_q, block_k)
    options = dict(
        table=table, positions=positions, window=window, sinks=sinks, block_q=block_q, block_k=block_k
    )
    if implementation == "xla":
        return xla.prefill_attention(queries, keys, values, **options)
    run = prefill.tpu_prefill_attention if implementation == "tpu" else prefill.gpu_prefill_attention
    return run(queries, keys, values, interpret=interpret, **options)


def prefill_blocks(implementation: str, G: int, block_q: int | None = None, block_k: int | None = None):
    """(block_q, block_k) with the defaults of PREFILL_BLOCKS filled in for those that are None."""
    default_q, default_k = PREFILL_BLOCKS[implementation]
    if default_q is None:  # TPU: a step takes block_q tokens times G heads as its rows
        default_q = max(8, TPU_PREFILL_ROWS // G // 8 * 8)
    return (default_q if block_q is None else block_q), (default_k if block_k is None else block_k)


def _fit_block(block: int, T: int, implementation: str) -> int:
    """A block no longer than needed: T itself where T is shorter (on TPU a whole axis is always
    a legal block; Triton wants a power of two, at least 16 for its matrix products)."""
    if block < T:
        return block
    return max(16, pl.next_power_of_2(T)) if implementation == "cuda" else T


# ----------------------------------------------------------------------------------------------
# Checks at the door: each names the argument, its value and what is allowed.


def _describe(x) -> str:
    if x is None:
        return "None"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    return f"a {type(x).__name__} of shape {tuple(shape)} and dtype {dtype}" if shape is not None else repr(x)


def _shape(name: str, x, ndim: int, allowed: str) -> tuple[int, ...]:
    shape = tuple(jnp.shape(x))
    if len(shape) != ndim:
        raise ValueError(f"attention: {name} has shape {shape}; allowed: {allowed}")
    return shape


def _expect(name: str, x, shape: tuple[int, ...], allowed: str) -> None:
    if tuple(jnp.shape(x)) != shape:
        raise ValueError(
            f"attention: {name} has shape {tuple(jnp.shape(x))}, expected {shape}; allowed: {allowed}"
        )


def _layer(layer, L: int) -> jax.Array:
    """The layer of a stacked cache of L layers as an int32 scalar: a Python or numpy int must be
    in 0..L-1; a traced one is clamped there (an index map reading past the buffer would read
    another array's memory, or fault)."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= layer < L:
            raise ValueError(f"attention: layer is {layer!r}; allowed: 0..{L - 1} (L = {L} layers in keys)")
        return jnp.asarray(layer, jnp.int32)
    dtype = getattr(layer, "dtype", None)
    if dtype is None or jnp.shape(layer) != () or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"attention: layer is {_describe(layer)}; allowed: None, an int in 0..{L - 1} or an "
            "integer scalar array"
        )
    return jnp.clip(jnp.asarray(layer), 0, L - 1).astype(jnp.int32)


def _floats(**arrays) -> None:
    for name, x in arrays.items():
        if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"attention: {name} has dtype {x.dtype}; allowed: float32 or bfloat16")


def _implementation(implementation) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention: implementation is {implementation!r}; allowed: {IMPLEMENTATIONS}")


def _head_dim(E: int, implementation: str, interpret) -> None:
    allowed = INTERPRET_HEAD_DIMS if interpret else PALLAS_HEAD_DIMS
    if E not in allowed:
        raise ValueError(
            f"attention: head dim (last axis of queries) is {E}; allowed for implementation "
            f"{implementation!r}: {allowed} ({INTERPRET_HEAD_DIMS} in interpret mode; any with 'xla')"
        )


def _block(name: str, block, implementation: str, lanes: bool) -> None:
    """TPU: key blocks are lane (last-axis) tiles, multiples of 128; query blocks sublane tiles,
    multiples of 8. Triton: powers of two, at least 16 (its smallest matrix product)."""
    if implementation == "tpu":
        unit = 128 if lanes else 8
        if isinstance(block, int) and block >= unit and block % unit == 0:
            return
        allowed = f"a multiple of {unit} on tpu"
    else:
        if isinstance(block, int) and block >= 16 and block & (block - 1) == 0:
            return
        allowed = "a power of two >= 16 on cuda"
    raise ValueError(f"attention: {name} is {block!r}; allowed: {allowed}")
