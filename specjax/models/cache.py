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


@flax.struct.dataclass
class KVCache:
    """One k and one v buffer per layer (separate buffers, as the layers' weights are: see
    llama.py): values [B*K, S, E] (rows and kv heads merged into one leading axis, entry b*K + k
    being row b's kv head k, then slots, then head dim), keys [B*K, E, S] (the same entries with
    the slot axis last).

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
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32: committed slots per row

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def capacity(self) -> int:
        return self.v[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def write_keys(self, buffer: jax.Array, new: jax.Array, fresh: bool = False) -> jax.Array:
        """Store T fresh keys per row at slots `lengths .. lengths + T - 1` of one layer's key
        buffer [B*K, E, S]; new [B, T, K, E]. See `_write_slots`."""
        return self._write_slots(buffer, jnp.transpose(new, (0, 2, 3, 1)), slot_axis=2, fresh=fresh)

    def write_values(self, buffer: jax.Array, new: jax.Array, fresh: bool = False) -> jax.Array:
        """Store T fresh values per row at slots `lengths .. lengths + T - 1` of one layer's value
        buffer [B*K, S, E]; new [B, T, K, E]. See `_write_slots`."""
        return self._write_slots(buffer, jnp.swapaxes(new, 1, 2), slot_axis=1, fresh=fresh)

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
        B = self.batch_size
        rows = jnp.arange(B)[:, None]

        def by_row(buf):  # [B, K, ...]; the gathers below read every source before any write
            return buf.reshape(B, buf.shape[0] // B, *buf.shape[1:])

        # Each gather gives [B, D, K, E]: the sources' entries, written at lengths + d.
        return self.replace(
            k=tuple(self.write_keys(buf, by_row(buf)[rows, :, :, sources]) for buf in self.k),
            v=tuple(self.write_values(buf, by_row(buf)[rows, :, sources]) for buf in self.v),
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

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    def pad_to(self, width: int) -> FreshEntries:
        """Zero entries appended up to `width` tokens, so that branches of different widths agree
        in shape (slots past what a step commits are stale and never read)."""

        def pad(x):
            return jnp.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0), (0, 0)))

        return FreshEntries(k=tuple(map(pad, self.k)), v=tuple(map(pad, self.v)))


def init_cache(
    config: LlamaConfig, batch_size: int, capacity: int, dtype=jnp.float32, num_layers: int | None = None
) -> KVCache:
    """An empty cache of `capacity` slots per row, allocated with zeros; `num_layers` (default all)
    sizes it for an early-exit pass over the first layers only."""
    num_layers = config.num_layers if num_layers is None else num_layers
    entries = batch_size * config.num_kv_heads
    return KVCache(
        k=tuple(jnp.zeros((entries, config.head_dim, capacity), dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros((entries, capacity, config.head_dim), dtype) for _ in range(num_layers)),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def cache_bytes(
    config: LlamaConfig, batch_size: int, capacity: int, itemsize: int = 4, num_layers: int | None = None
) -> int:
    """Bytes the k and v arrays of a cache take, to check before allocating."""
    num_layers = config.num_layers if num_layers is None else num_layers
    return 2 * num_layers * batch_size * capacity * config.kv_size * itemsize
