"""What one pass through the decoder does with the KV cache, and what its fresh tokens see.

A pass is of one of three kinds (`PassKind`), fixed by the caller and handed down from
`decoder_layers` (models/llama.py) to every layer's attention:

- PREFILL: a prompt into an empty cache. The fresh tokens attend to each other alone (reading the
  all-zero cache would cost work and let XLA constant-fold attention over it, minutes of compile
  time), and their keys and values are written at slot 0 on.
- WRITE_FIRST: a decoding pass that writes its fresh keys and values at each row's length first,
  then attends to the cache's visible slots. Writing before reading leaves the old buffer dead
  once written, so XLA updates it in place.
- READ_ONLY: a decoding pass that only reads the cache (`write=False`: a verify pass inside the
  loop's `lax.cond`, which cannot update a cache in place): the queries attend to the committed
  slots and the fresh entries in one softmax, and the entries are returned for storing after the
  cond (models/cache.py, FreshEntries).

The backend may have a kernel for the pass's attention (specjax/kernels/backend.py): a blocked
prefill, or a decoding kernel that reads each row's committed slots only. `plan_pass` asks it
once per pass; a `PassPlan` carries the kind and that kernel. Each layer reads its cache through
a `LayerCache`: its own buffers, or a stack's and the layer's index in it (models/llama.py,
`LayerStack`).

Einsum letters: B batch, T fresh tokens, U fresh keys, S cache slots, K kv heads, E head dim,
R rotary dims.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import backend
from specjax.models.cache import KVCache, rows_of_pool


class PassKind(enum.Enum):
    """How a pass meets the cache (see the module docstring)."""

    PREFILL = "prefill"
    WRITE_FIRST = "write-first"
    READ_ONLY = "read-only"


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """A pass's kind and the backend's attention kernel for it: for PREFILL its blocked kernel
    (contract of specjax.kernels.attention.prefill_attention), for a decoding pass the kernel that
    reads each row's committed slots (contract of specjax.kernels.cache_attention); None where
    attention is XLA's own forms (models/attention.py)."""

    kind: PassKind
    kernel: Callable | None = None
    # Which page sizes `kernel` (a decoding pass's) reads a paged cache of through its tables
    # (keyword `pages`: Backend.cache_attention_reads_pages); for the others, and with None, a
    # paged cache's rows are gathered for it.
    kernel_reads_pages: Callable[[int], bool] | None = None

    @property
    def writes(self) -> bool:
        """Whether the pass writes its fresh keys and values into the cache."""
        return self.kind is not PassKind.READ_ONLY

    @property
    def reads_committed_by_kernel(self) -> bool:
        """Whether a decoding pass reads each row's committed slots through the backend's kernel
        (and merges its fresh tokens in itself) rather than XLA scoring every slot, masked."""
        return self.kind is not PassKind.PREFILL and self.kernel is not None


def plan_pass(kind: PassKind, head_dim: int, dtype, kernels: bool = True) -> PassPlan:
    """The plan of a pass of `kind` over heads of `head_dim` in `dtype`, with the active backend's
    kernel for it where it has one; `kernels=False` keeps XLA's forms (a pass told what to attend
    to, `visible`; latent attention, which reads its cache itself)."""
    if not kernels:
        return PassPlan(kind)
    on = backend.active()
    if kind is PassKind.PREFILL:
        return PassPlan(kind, on.prefill_attention(head_dim))
    reads_pages = functools.partial(on.cache_attention_reads_pages, head_dim, dtype)
    return PassPlan(kind, on.cache_attention(head_dim, dtype), reads_pages)


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's view of the cache: its key and value buffers (keys [B*K, E, S], values
    [B*K, S, E]; see KVCache), or a stack's ([n, B*K, ...]) and the index `layer` of the layer in
    it (an int, or a traced index inside the stack's loop). Of a paged cache, its pools and the
    page tables `pages` [B, W] (`heads` kv heads per page): `read` gathers the rows."""

    keys: jax.Array
    values: jax.Array
    layer: int | jax.Array | None = None
    pages: jax.Array | None = None
    heads: int = 0

    @classmethod
    def of(cls, cache: KVCache, keys: jax.Array, values: jax.Array, layer=None) -> LayerCache:
        """The view of buffers `keys`, `values` of `cache` (its page tables with them)."""
        return cls(keys, values, layer, cache.pages, cache.paged_heads)

    def read(self) -> tuple[jax.Array, jax.Array]:
        """The layer's keys and values in the dense layout (a stack's slices: XLA reads them in
        its products; a paged cache's rows gathered from its pools, `rows_of_pool`)."""
        keys, values = self.keys, self.values
        if self.layer is not None:
            keys = jax.lax.dynamic_index_in_dim(keys, self.layer, keepdims=False)
            values = jax.lax.dynamic_index_in_dim(values, self.layer, keepdims=False)
        if self.pages is None:
            return keys, values
        return (
            rows_of_pool(keys, self.pages, self.heads, keys=True),
            rows_of_pool(values, self.pages, self.heads, keys=False),
        )


@dataclasses.dataclass(frozen=True)
class LayerMasks:
    """What the fresh tokens of one pass attend to in layers of one kind (full attention, or one
    sliding window), as `attention` takes it (`layer_masks`)."""

    # WRITE_FIRST: the slots [B, T, S] each token sees in the written cache; READ_ONLY: the
    # committed slots [B, S] (or [B, T, S] under a window); None in a prefill.
    visible: jax.Array | None
    window_keep: jax.Array | None = None  # [B, T, T]: the fresh pairs a window keeps
    starts: jax.Array | None = None  # [B, T]: the first committed slot each token sees (window, kernel)
    window: int | None = None  # the window, for a prefill's blocked kernel
    positions: jax.Array | None = None  # [B, T], likewise
    committed: jax.Array | None = None  # [B]: each row's committed slots, for the decoding kernel


def layer_masks(
    window: int | None, positions: jax.Array, cache: KVCache, visible: jax.Array | None, plan: PassPlan
) -> LayerMasks:
    """Masks for the layers with sliding window `window` (None: full attention) of a pass `plan`,
    from the pass's full-attention `visible` (None for a prefill; see LayerMasks) and the tokens'
    positions [B, T]."""
    committed = cache.lengths if plan.reads_committed_by_kernel else None
    if window is None:
        return LayerMasks(visible, committed=committed)
    keep = in_window(positions, positions, window)  # [B, T, T]
    if plan.kind is PassKind.PREFILL:  # only fresh pairs
        return LayerMasks(None, keep, window=window, positions=positions)
    S = cache.capacity
    if committed is not None:  # the kernel: committed slots from positions - window + 1 on
        return LayerMasks(visible, keep, positions - (window - 1), committed=committed)
    if plan.kind is PassKind.READ_ONLY:  # committed slots [B, S] -> [B, T, S]; slot s holds position s
        slots = jnp.broadcast_to(jnp.arange(S)[None, :], (positions.shape[0], S))
        return LayerMasks(visible[:, None, :] & in_window(positions, slots, window), keep)
    near = in_window(positions, slot_positions(cache.lengths, positions, S), window)
    return LayerMasks(visible & near)


@dataclasses.dataclass(frozen=True)
class LayerPass:
    """One pass as the layers of one kind see it (one sliding window or none, one rotary base;
    Gemma 3 interleaves two kinds, other families have one): the pass's plan, the tokens'
    positions [B, T], the fresh tokens' mask [T, T] and the cache the pass runs over, with the
    kind's masks and rotary frequencies. What `decoder_layers` hands each layer."""

    plan: PassPlan
    masks: LayerMasks
    inv_freq: np.ndarray  # [R/2]: models/rotary.py
    positions: jax.Array
    fresh_mask: jax.Array | np.ndarray
    cache: KVCache

    def write(self, buffers: LayerCache, keys: jax.Array, values: jax.Array) -> LayerCache:
        """`buffers` with the fresh keys and values [B, T, K, E] written at slots `lengths + t`
        (at slot 0 on in a prefill)."""
        fresh = self.plan.kind is PassKind.PREFILL
        return dataclasses.replace(
            buffers,
            keys=self.cache.write_keys(buffers.keys, keys, fresh, buffers.layer),
            values=self.cache.write_values(buffers.values, values, fresh, buffers.layer),
        )


def causal_mask(num_tokens: int) -> np.ndarray:
    """[T, T] bool: fresh token t sees fresh tokens u <= t (a chain; trees pass their own). A
    numpy array, so that its values are known while tracing (models/attention.py: a prefill goes
    in chunks by it)."""
    return np.tril(np.ones((num_tokens, num_tokens), bool))


def visible_slots(cache_lengths: jax.Array, fresh_mask: jax.Array, num_slots: int) -> jax.Array:
    """[B, T, S] bool: which cache slots each of the T fresh tokens attends to, once the fresh
    tokens sit at slots `lengths .. lengths + T - 1`: every committed slot, and the fresh slots
    that `fresh_mask [T, T]` allows (a chain's causal mask, or a tree's ancestors)."""
    T = fresh_mask.shape[0]
    offset = jnp.arange(num_slots)[None, :] - cache_lengths[:, None]  # [B, S]: slot - length
    is_fresh = (offset >= 0) & (offset < T)
    fresh_visible = jnp.asarray(fresh_mask)[:, jnp.clip(offset, 0, T - 1)]  # [T, B, S]
    return (offset < 0)[:, None, :] | (is_fresh[:, None, :] & jnp.swapaxes(fresh_visible, 0, 1))


def slot_positions(cache_lengths: jax.Array, positions: jax.Array, num_slots: int) -> jax.Array:
    """[B, S] int32: the position each cache slot holds once the T fresh tokens (positions
    [B, T]) sit at slots `lengths .. lengths + T - 1`. A committed slot s holds position s: a row's
    sequence starts at slot 0 and a tree's accepted path is moved to where a chain puts it."""
    T = positions.shape[1]
    slots = jnp.arange(num_slots)[None, :]
    offset = slots - cache_lengths[:, None]  # [B, S]
    fresh = jnp.take_along_axis(positions, jnp.clip(offset, 0, T - 1), axis=1)
    return jnp.where((offset >= 0) & (offset < T), fresh, slots)


def in_window(query_positions: jax.Array, key_positions: jax.Array, window: int) -> jax.Array:
    """[B, T, U] bool: a query at position p sees a key at position p' when p - p' < window (HF's
    sliding-window rule); query_positions [B, T], key_positions [B, U]."""
    return query_positions[:, :, None] - key_positions[:, None, :] < window
