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

from specjax.models.config import LlamaConfig


@flax.struct.dataclass
class KVCache:
    """One k and one v buffer per layer (separate buffers, as the layers' weights are: see
    llama.py), each [B, S, K, E]: batch, slots, kv heads, head dim."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32: committed slots per row

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def write_slots(self, layer_cache: jax.Array, new: jax.Array) -> jax.Array:
        """Store T fresh entries per row at slots `lengths .. lengths + T - 1` of one layer's
        buffer [B, S, K, E]; new [B, T, K, E]. The caller decides how many to commit (advance)."""

        def write_row(row, new_row, start):  # [S, K, E], [T, K, E], []
            return jax.lax.dynamic_update_slice(row, new_row, (start, 0, 0))

        return jax.vmap(write_row)(layer_cache, new.astype(layer_cache.dtype), self.lengths)

    def advance(self, num_committed: jax.Array) -> KVCache:
        """Commit `num_committed[b]` more slots of each row (the ones `write` just filled)."""
        return self.replace(lengths=self.lengths + num_committed.astype(jnp.int32))


def init_cache(
    config: LlamaConfig, batch_size: int, capacity: int, dtype=jnp.float32, num_layers: int | None = None
) -> KVCache:
    """An empty cache of `capacity` slots per row, allocated with zeros; `num_layers` (default all)
    sizes it for an early-exit pass over the first layers only."""
    num_layers = config.num_layers if num_layers is None else num_layers
    shape = (batch_size, capacity, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def cache_bytes(config: LlamaConfig, batch_size: int, capacity: int, itemsize: int = 4) -> int:
    """Bytes the k and v arrays of a cache take, to check before allocating."""
    return 2 * config.num_layers * batch_size * capacity * config.kv_size * itemsize
