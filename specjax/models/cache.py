"""A static-shaped key/value cache with per-row lengths.

Rows of a batch hold sequences of different lengths. `lengths[b]` counts the committed slots of
row b; slots at or beyond it are stale (rejected drafts, padding) and masked by attention until a
later write overwrites them. Rolling back a rejected draft is therefore just not advancing the
length: nothing is ever cleared.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.kernels import backend
from specjax.models.config import LlamaConfig

# Batches up to this many rows write their fresh keys and values row by row (see _write_slots).
UNROLLED_WRITE_ROWS = 16
# The page of a paged pool that no row holds (specjax/serve/pages.py never hands it out): unused
# table entries point at it, and writes past a row's table land in it, where nothing reads them.
NULL_PAGE = 0


@flax.struct.dataclass
class KVCache:
    """One key and one value buffer per layer (separate buffers, as the layers' weights are: see
    models/params.py), with each row's committed length. Per layer, keys [B*K, E, S] and values
    [B*K, S, E]: rows and kv heads merged into one leading axis (entry b*K + k being row b's kv
    head k); then, for values, slots and then the head dim, and for keys the head dim and then
    slots (the slot axis last).

    Why these shapes: attention's two products read the cache in place as matrices whose rows are
    contiguous: values [S, E] per entry, contracted over slots, and keys [E, S], contracted over
    the head dim. With keys stored [S, E] too, XLA:CPU's scores product took four times as long
    as the values product over the same bytes (125 against 30 us per layer at 896 slots, measured
    here); stored [E, S] it takes ~70 us. A fresh token's key is then a strided column
    write of E floats, which costs nothing measurable. With slots before kv heads, XLA:CPU
    transposed the whole cache in every layer of every step. One merged leading axis, rather than
    [B, K, ...], because at batch 1 the size-1 row axis made XLA:CPU write each fresh key twice,
    into copies of the cache (four copies of every k buffer per step), one for the attention
    product and one for the loop's state; the merged axis needs none (37.9 -> 31.0 ms per plain
    step at 952 cached tokens; docs/notes/benchmarks-history.md).

    On a mesh the buffers are split over ("data", "model") along the merged axis: each device
    holds its rows and its kv heads, ordered b-major as above. Only code that runs per device (the
    forward, `write` and `move_slots`, under shard_map: specjax/sharding) reads the entries there.

    Layers are unrolled by default on every platform, one buffer each. Where a program runs them
    as a loop (`scan_layers=True`: a `LayerStack` of its params, models/params.py and
    models/llama.py), the buffer of a stack of n layers holds them all on a leading axis: keys
    [n, B*K, E, S], values [n, B*K, S, E]. The cache's buffers follow its params' layers, one
    buffer per single layer or per stack (`init_cache(..., like=params.layers)`).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32: committed slots per row
    # [B, W] int32 page tables of a paged cache (None: dense). Paged, each buffer is a pool of
    # pages of P = its slot axis' size, laid out as the dense rows are with a page for a row:
    # keys [N*K, E, P], values [N*K, P, E] for N pages (a stack's with [n, ...] in front), entry
    # p*K + k page p's kv head k. Slot s of row b is slot s % P of page pages[b, s // P]: a row
    # holds W * P slots. Which pages a row holds is the host's business (specjax/serve/pages.py);
    # here only the reads and writes go through the table. See `paged_cache`.
    pages: jax.Array | None = None
    paged_heads: int = flax.struct.field(pytree_node=False, default=0)  # paged: kv heads per page

    @property
    def num_layers(self) -> int:
        return sum(layers_in(buffer) for buffer in self.k)

    @property
    def layout(self) -> tuple[int | None, ...]:
        """Per buffer: None for one layer's, n for a stack's [n, B*K, ...] (see `cache_layout`)."""
        return tuple(None if buffer.ndim == 3 else buffer.shape[0] for buffer in self.k)

    @property
    def is_latent(self) -> bool:
        """A latent-attention cache (models/mla.py): one entry per row, values 0 wide."""
        return self.v[0].shape[-1] == 0

    @property
    def capacity(self) -> int:
        """Slots per row (a paged row's: its table's pages of slots)."""
        if self.pages is not None:
            return self.pages.shape[1] * self.page_size
        return self.v[0].shape[-2]

    @property
    def page_size(self) -> int:
        """Slots per page of a paged cache."""
        return self.v[0].shape[-2]

    def kv_heads(self, buffer: jax.Array) -> int:
        """The kv heads one of its buffers holds per row (dense) or per page (paged)."""
        return self.paged_heads if self.pages is not None else buffer.shape[-3] // self.batch_size

    @property
    def num_pages(self) -> int:
        """Pages in a paged cache's pool (the null page among them: specjax/serve/pages.py)."""
        return self.k[0].shape[-3] // self.paged_heads

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def write_keys(self, buffer: jax.Array, new: jax.Array, fresh: bool = False, layer=None) -> jax.Array:
        """Store T fresh keys per row at slots `lengths .. lengths + T - 1` of one layer's key
        buffer [B*K, E, S]; new [B, T, K, E]. See `_write_slots`. A stack's buffer
        [n, B*K, E, S] takes new [B, T, K, E] for its layer `layer` (an int or a traced index), or
        [n, B, T, K, E] for all n with `layer` None (`_write_stacked`). A paged cache's through
        its page tables (`_write_paged`)."""
        if self.pages is not None:
            return self._write_paged(buffer, new, keys=True, fresh=fresh, layer=layer)
        if buffer.ndim == 4:
            return self._write_stacked(buffer, new, keys=True, fresh=fresh, layer=layer)
        return self._write_slots(buffer, jnp.transpose(new, (0, 2, 3, 1)), slot_axis=2, fresh=fresh)

    def write_values(self, buffer: jax.Array, new: jax.Array, fresh: bool = False, layer=None) -> jax.Array:
        """Store T fresh values per row at slots `lengths .. lengths + T - 1` of one layer's value
        buffer [B*K, S, E]; new [B, T, K, E]. See `_write_slots`; a stack's buffer as in
        `write_keys`."""
        if self.pages is not None:
            return self._write_paged(buffer, new, keys=False, fresh=fresh, layer=layer)
        if buffer.ndim == 4:
            return self._write_stacked(buffer, new, keys=False, fresh=fresh, layer=layer)
        return self._write_slots(buffer, jnp.swapaxes(new, 1, 2), slot_axis=1, fresh=fresh)

    def page_entries(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Where slots [B, T] of each row live in a paged pool: (entries [B, T, K], the page's kv
        heads' entries, and offsets [B, T, K] within the page). A slot past the row's table maps
        to the null page, so a stale write there lands where nothing reads."""
        P, K, W = self.page_size, self.paged_heads, self.pages.shape[1]
        index = slots // P
        page = jnp.take_along_axis(self.pages, jnp.minimum(index, W - 1), axis=1)
        page = jnp.where(index < W, page, NULL_PAGE)  # [B, T]
        entries = page[..., None] * K + jnp.arange(K, dtype=page.dtype)
        return entries, jnp.broadcast_to((slots % P)[..., None], entries.shape)

    def _write_paged(self, buffer: jax.Array, new: jax.Array, keys: bool, fresh: bool, layer) -> jax.Array:
        """Write new [B, T, K, E] at slots `lengths ..` of each row (0 .. with `fresh`) into a
        pool (keys [N*K, E, P], values [N*K, P, E]) through the page tables, one scatter; a
        stack's pool [n, N*K, ...] takes them for its layer `layer`, or new [n, B, T, K, E] for
        all n with `layer` None. Rows write disjoint slots (the host gives a row a copy of any
        page it shares before it writes there; a packed prefill's one-token rows of one prompt
        share its pages at distinct positions), so the scatter's only repeated targets are the
        null page's."""
        stacked = buffer.ndim == 4
        if not stacked or layer is not None:
            new = new[None]
        T = new.shape[2]
        starts = jnp.zeros_like(self.lengths) if fresh else self.lengths
        entries, offsets = self.page_entries(starts[:, None] + jnp.arange(T, dtype=jnp.int32))
        new = new.astype(buffer.dtype)
        if not stacked:  # [B, T, K] indices, the head dim a slice: the update is [B, T, K, E]
            at = buffer.at[entries, :, offsets] if keys else buffer.at[entries, offsets]
            return at.set(new[0])
        layers = (0 if layer is None else layer) + jnp.arange(new.shape[0])[:, None, None, None]
        at = buffer.at[layers, entries, :, offsets] if keys else buffer.at[layers, entries, offsets]
        return at.set(new)

    def _write_stacked(self, buffer: jax.Array, new: jax.Array, keys: bool, fresh: bool, layer) -> jax.Array:
        """Write into a stack's buffer (keys [n, B*K, E, S] or values [n, B*K, S, E]) the entries
        new [B, T, K, E] of its layer `layer`, or new [n, B, T, K, E] of every layer (`layer`
        None), at each row's length (at slot 0 with `fresh`). One scatter of the T slots per entry
        and layer, which XLA does in place inside the layer loop: taking the layer's buffer out,
        writing it and putting it back would copy the whole layer every time."""
        first = 0 if layer is None else layer
        if layer is not None:
            new = new[None]
        n, B, T, K, E = new.shape
        entries = new.astype(buffer.dtype).transpose(0, 1, 3, 2, 4).reshape(n, B * K, T, E)
        if fresh:  # as the buffer lays the slots out: keys [n, B*K, E, T], values [n, B*K, T, E]
            block = jnp.swapaxes(entries, 2, 3) if keys else entries
            return jax.lax.dynamic_update_slice(buffer, block, (first, 0, 0, 0))
        layers = first + jnp.arange(n)[:, None, None]  # [n, 1, 1]
        rows = jnp.arange(B * K)[None, :, None]  # [1, B*K, 1]
        slots = (jnp.repeat(self.lengths, K)[:, None] + jnp.arange(T)[None, :])[None]  # [1, B*K, T]
        # Indexed [n, B*K, T] with the head dim a slice: the update is [n, B*K, T, E] either way.
        at = buffer.at[layers, rows, :, slots] if keys else buffer.at[layers, rows, slots]
        return at.set(entries, unique_indices=True)

    def _write_slots(self, buffer: jax.Array, new: jax.Array, slot_axis: int, fresh: bool) -> jax.Array:
        """Write new [B, K, ...] (each row's K entries, laid out as one entry of `buffer` is, with
        T slots on `slot_axis`) at each row's length. The caller decides how many to commit
        (advance). `fresh=True` promises an empty cache (every length 0, a prefill): one write at
        slot 0.

        On the CPU a small batch writes each row's K entries with one `dynamic_update_slice` (a
        scalar start), which XLA:CPU does in place; the vmapped form becomes a scatter that also
        reads the old slots. Past UNROLLED_WRITE_ROWS rows, and off the CPU (the backend seam,
        specjax/kernels/backend.py), the vmapped form keeps the program small. The
        capacity leaves room for T slots past every row's length (see LoopSpec), so no write is
        clamped.
        """
        B, K = new.shape[:2]
        new = new.astype(buffer.dtype)

        def at_slot(slot, first_entry=0):  # a start index: the entry, then the slot on its axis
            return (first_entry, slot, 0) if slot_axis == 1 else (first_entry, 0, slot)

        if fresh:
            return jax.lax.dynamic_update_slice(buffer, new.reshape(B * K, *new.shape[2:]), at_slot(0))
        if not backend.active().unrolled_cache_writes(B, UNROLLED_WRITE_ROWS):

            def write_row(row, new_row, start):  # [K, ...] each, and a scalar
                return jax.lax.dynamic_update_slice(row, new_row, at_slot(start))

            rows = buffer.reshape(B, K, *buffer.shape[1:])
            return jax.vmap(write_row)(rows, new, self.lengths).reshape(buffer.shape)
        for b in range(B):
            buffer = jax.lax.dynamic_update_slice(buffer, new[b], at_slot(self.lengths[b], b * K))
        return buffer

    def write(self, fresh: FreshEntries) -> KVCache:
        """Every layer's fresh entries (a pass run with `write=False`) stored at slots `lengths ..`."""
        return self.replace(
            k=tuple(self.write_keys(buf, new) for buf, new in zip(self.k, fresh.k, strict=True)),
            v=tuple(self.write_values(buf, new) for buf, new in zip(self.v, fresh.v, strict=True)),
        )

    def move_slots(self, sources: jax.Array) -> KVCache:
        """Copy, in every layer, slot `sources[b, d]` of row b to slot `lengths[b] + d`; sources
        [B, D] int32 with every source at or after its destination (a token tree's accepted path,
        fed at `lengths .. lengths + N`, moved to where a chain would have put it). Entries whose
        source is their destination stay as they are."""
        if self.pages is not None:
            return self._move_paged(sources)
        B = self.batch_size
        rows = jnp.arange(B)[:, None]

        def by_row(buf):  # [B, K, ...]; the gathers below read every source before any write
            return buf.reshape(B, buf.shape[0] // B, *buf.shape[1:])

        def keys(buf):  # the sources' entries [B, D, K, E], written at lengths + d
            if buf.ndim == 4:  # a stack's [n, B*K, E, S]: [n, B, D, K, E]
                return jnp.moveaxis(
                    buf.reshape(buf.shape[0], B, -1, *buf.shape[2:])[:, rows, :, :, sources], 2, 0
                )
            return by_row(buf)[rows, :, :, sources]

        def values(buf):
            if buf.ndim == 4:
                return jnp.moveaxis(
                    buf.reshape(buf.shape[0], B, -1, *buf.shape[2:])[:, rows, :, sources], 2, 0
                )
            return by_row(buf)[rows, :, sources]

        return self.replace(
            k=tuple(self.write_keys(buf, keys(buf)) for buf in self.k),
            v=tuple(self.write_values(buf, values(buf)) for buf in self.v),
        )

    def _move_paged(self, sources: jax.Array) -> KVCache:
        """`move_slots` through the page tables: every source's entries gathered, then written."""
        entries, offsets = self.page_entries(sources)  # [B, D, K]

        def gather(buf, keys):  # -> [B, D, K, E], a stack's [n, B, D, K, E]
            if buf.ndim == 3:
                return buf[entries, :, offsets] if keys else buf[entries, offsets]
            if keys:  # the indices apart: numpy puts their axes first, [B, D, K, n, E]
                return jnp.moveaxis(buf[:, entries, :, offsets], 3, 0)
            return buf[:, entries, offsets]

        return self.replace(
            k=tuple(self.write_keys(buf, gather(buf, True)) for buf in self.k),
            v=tuple(self.write_values(buf, gather(buf, False)) for buf in self.v),
        )

    def dense(self) -> KVCache:
        """This cache in the dense layout (itself where it is dense): each row's slots gathered
        from its pages, for code that reads a row's slots in place (a draft's cache started from
        the target's)."""
        if self.pages is None:
            return self
        K = self.paged_heads
        return KVCache(
            k=tuple(rows_of_pool(buf, self.pages, K, keys=True) for buf in self.k),
            v=tuple(rows_of_pool(buf, self.pages, K, keys=False) for buf in self.v),
            lengths=self.lengths,
        )

    def row(self, b: jax.Array) -> KVCache:
        """Row b (an int or a traced index) as a cache of one row: its entries of every buffer
        (axis -3 holds rows and kv heads, b-major) and its length. A chunk of one row's prompt
        runs over it (speculate/prefill.py, `chunked_prefill`), then `with_row` puts it back."""
        B = self.batch_size
        if self.pages is not None:  # the pool is every row's: the row is its table and length
            return self.replace(
                lengths=jax.lax.dynamic_slice_in_dim(self.lengths, b, 1),
                pages=jax.lax.dynamic_slice_in_dim(self.pages, b, 1),
            )

        def take(buffer):
            per_row = buffer.shape[-3] // B
            return jax.lax.dynamic_slice_in_dim(buffer, b * per_row, per_row, axis=buffer.ndim - 3)

        return KVCache(
            k=tuple(map(take, self.k)),
            v=tuple(map(take, self.v)),
            lengths=jax.lax.dynamic_slice_in_dim(self.lengths, b, 1),
        )

    def with_row(self, b: jax.Array, row: KVCache) -> KVCache:
        """This cache with row b replaced by `row` (a cache of one row, as `row` returns). A
        paged row's writes are in its pool already: the pool is taken from it."""
        if self.pages is not None:
            lengths = jax.lax.dynamic_update_slice_in_dim(self.lengths, row.lengths, b, 0)
            return self.replace(k=row.k, v=row.v, lengths=lengths)

        def put(buffer, new):
            start = b * new.shape[-3]
            return jax.lax.dynamic_update_slice_in_dim(buffer, new, start, axis=buffer.ndim - 3)

        return KVCache(
            k=tuple(map(put, self.k, row.k)),
            v=tuple(map(put, self.v, row.v)),
            lengths=jax.lax.dynamic_update_slice_in_dim(self.lengths, row.lengths, b, 0),
        )

    def advance(self, num_committed: jax.Array) -> KVCache:
        """Commit `num_committed[b]` more slots of each row (the ones `write` just filled)."""
        return self.replace(lengths=self.lengths + num_committed.astype(jnp.int32))


@flax.struct.dataclass
class FreshEntries:
    """The keys and values a pass computed without writing them (`forward_hidden(write=False)`):
    one [B, T, K, E] array per layer each, for `KVCache.write` to store at the rows' lengths.

    Why a pass would not write: the loop's batch-wide `lax.cond` (verify the drafts, or a
    one-token pass when no row drafted) cannot update the cache it is handed in place, so XLA:CPU
    copied every cache buffer in the branch that ran and once more around it (120 copies of the
    whole cache per step). Branches that only read the cache, with the writes after the cond,
    need none."""

    k: tuple[jax.Array, ...]  # one per buffer of the cache: a stack's [n, B, T, K, E]
    v: tuple[jax.Array, ...]

    def pad_to(self, width: int) -> FreshEntries:
        """Zero entries appended up to `width` tokens, so that branches of different widths agree
        in shape (slots past what a step commits are stale and never read)."""

        def pad(x):  # [B, T, K, E], or a stack's [n, B, T, K, E]
            widths = [(0, 0)] * x.ndim
            widths[-3] = (0, width - x.shape[-3])
            return jnp.pad(x, widths)

        return FreshEntries(k=tuple(map(pad, self.k)), v=tuple(map(pad, self.v)))


def init_cache(
    config: LlamaConfig,
    batch_size: int,
    capacity: int,
    dtype=jnp.float32,
    num_layers: int | None = None,
    like: tuple | None = None,
) -> KVCache:
    """An empty cache of `capacity` slots per row, allocated with zeros; `num_layers` (default all)
    sizes it for an early-exit pass over the first layers only. `like` (a params' `layers`):
    one buffer per single layer and one stacked buffer per `LayerStack` there (models/params.py),
    for the first `num_layers` layers; default one buffer per layer."""
    num_layers = config.num_layers if num_layers is None else num_layers
    entries = batch_size * config.num_kv_heads
    E, Ev = config.cache_key_dim, config.cache_value_dim  # Ev 0 under latent attention
    layout = (None,) * num_layers if like is None else cache_layout(like, num_layers)
    lead = [() if n is None else (n,) for n in layout]
    return KVCache(
        k=tuple(jnp.zeros((*n, entries, E, capacity), dtype) for n in lead),
        v=tuple(jnp.zeros((*n, entries, capacity, Ev), dtype) for n in lead),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def paged_cache(
    config: LlamaConfig,
    pages: jax.Array,
    page_size: int,
    num_pages: int,
    dtype=jnp.float32,
    like: tuple | None = None,
) -> KVCache:
    """An empty paged cache (KVCache.pages): a pool of `num_pages` pages of `page_size` slots per
    layer (laid out as `init_cache` lays out `num_pages` rows of `page_size` slots), and the rows'
    page tables `pages` [B, W] int32, every length 0."""
    if config.kv_lora_rank:
        raise ValueError("a paged cache: latent attention (models/mla.py) reads a dense cache itself")
    pool = init_cache(config, num_pages, page_size, dtype, like=like)
    B = pages.shape[0]
    return pool.replace(
        lengths=jnp.zeros((B,), jnp.int32),
        pages=jnp.asarray(pages, jnp.int32),
        paged_heads=config.num_kv_heads,
    )


def identity_pages(batch_size: int, capacity: int, page_size: int) -> tuple[jax.Array, int]:
    """Page tables [B, W] that give row b the W = capacity / page_size pages 1 + b*W .. (b+1)*W,
    and the pool's size (those and the null page): a paged cache laid out as a dense one, for a
    `generate` that runs on pages (LoopSpec.page_size)."""
    W = -(-capacity // page_size)
    return 1 + jnp.arange(batch_size * W, dtype=jnp.int32).reshape(batch_size, W), 1 + batch_size * W


def starting_from(empty: KVCache, source: KVCache) -> KVCache:
    """`empty`'s buffers holding the keys and values of `source`'s first layers, each cast to
    `empty`'s dtype and laid out as `empty` is (single layers or stacks), with `source`'s lengths:
    a draft's cache started from the target's over the prompt. Their rows, kv heads, dims and
    capacity must agree."""
    layers = []  # (k, v) per layer of source
    for k, v in zip(source.k, source.v, strict=True):
        layers.extend([(k, v)] if k.ndim == 3 else [(k[i], v[i]) for i in range(k.shape[0])])
    k_buffers, v_buffers, start = [], [], 0
    for k, v in zip(empty.k, empty.v, strict=True):
        n = layers_in(k)
        taken = layers[start : start + n]
        start += n
        k_new = taken[0][0] if k.ndim == 3 else jnp.stack([pair[0] for pair in taken])
        v_new = taken[0][1] if v.ndim == 3 else jnp.stack([pair[1] for pair in taken])
        if k_new.shape != k.shape or v_new.shape != v.shape:
            raise ValueError(
                f"a cache of buffers {k.shape}, {v.shape} cannot start from one of "
                f"{k_new.shape}, {v_new.shape}"
            )
        k_buffers.append(k_new.astype(k.dtype))
        v_buffers.append(v_new.astype(v.dtype))
    return KVCache(k=tuple(k_buffers), v=tuple(v_buffers), lengths=source.lengths)


def rows_of_pool(buffer: jax.Array, pages: jax.Array, heads: int, keys: bool) -> jax.Array:
    """The rows that page tables pages [B, W] make of a pool's buffer, in the dense layout: keys
    [..., N*K, E, P] -> [..., B*K, E, W*P], values [..., N*K, P, E] -> [..., B*K, W*P, E] (K =
    `heads`; a stack's leading axis kept). A gather, a copy of the rows: the XLA reads of a paged
    cache go through it."""
    B, W = pages.shape
    entries = pages[:, :, None] * heads + jnp.arange(heads, dtype=pages.dtype)  # [B, W, K]
    got = buffer[..., entries, :, :]  # [..., B, W, K, a, b]: a page's entry is its last two axes
    lead = buffer.shape[:-3]
    if keys:  # [..., B, W, K, E, P] -> [..., B, K, E, W, P]
        got = jnp.moveaxis(got, -4, -2)
        return got.reshape(*lead, B * heads, buffer.shape[-2], W * buffer.shape[-1])
    got = jnp.moveaxis(got, -4, -3)  # [..., B, W, K, P, E] -> [..., B, K, W, P, E]
    return got.reshape(*lead, B * heads, W * buffer.shape[-2], buffer.shape[-1])


def layers_in(buffer: jax.Array) -> int:
    """How many layers a cache buffer holds: 1, or a stack's n ([n, B*K, ...])."""
    return 1 if buffer.ndim == 3 else buffer.shape[0]


def cache_layout(layers: tuple, num_layers: int) -> tuple[int | None, ...]:
    """The buffers of a cache for the first `num_layers` of `layers` (a params' layers: single
    layers, or stacks with a `count`): None for a single layer's buffer, n for a stack's (its
    first n layers, where `num_layers` ends inside it)."""
    layout, left = [], num_layers
    for element in layers:
        if left <= 0:
            break
        count = getattr(element, "count", None)
        layout.append(None if count is None else min(count, left))
        left -= 1 if count is None else count
    if left > 0:
        raise ValueError(f"num_layers is {num_layers}; the params have {num_layers - left} layers")
    return tuple(layout)


def cache_bytes(
    config: LlamaConfig, batch_size: int, capacity: int, itemsize: int = 4, num_layers: int | None = None
) -> int:
    """Bytes the k and v arrays of a cache take, to check before allocating."""
    num_layers = config.num_layers if num_layers is None else num_layers
    return num_layers * batch_size * capacity * config.cache_token_size * itemsize
