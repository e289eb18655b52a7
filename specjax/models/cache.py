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
    k: jax.Array  # [L, B, S, K, E]: layers, batch, slots, kv heads, head dim
    v: jax.Array  # [L, B, S, K, E]
    lengths: jax.Array  # [B] int32: committed slots per row

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write(self, new_k: jax.Array, new_v: jax.Array) -> KVCache:
        """Store T fresh entries per row at slots `lengths .. lengths + T - 1`; lengths stay put.

        new_k, new_v: [L, B, T, K, E]. The caller decides how many of them to commit (advance).
        """

        def write_row(cache_row, new_row, start):  # [L, S, K, E], [L, T, K, E], []
            return jax.lax.dynamic_update_slice(cache_row, new_row, (0, start, 0, 0))

        write = jax.vmap(write_row, in_axes=(1, 1, 0), out_axes=1)
        return self.replace(k=write(self.k, new_k, self.lengths), v=write(self.v, new_v, self.lengths))

    def advance(self, num_committed: jax.Array) -> KVCache:
        """Commit `num_committed[b]` more slots of each row (the ones `write` just filled)."""
        return self.replace(lengths=self.lengths + num_committed.astype(jnp.int32))


def init_cache(
    config: LlamaConfig, batch_size: int, capacity: int, dtype=jnp.float32, num_layers: int | None = None
) -> KVCache:
    """An empty cache of `capacity` slots per row, allocated with zeros; `num_layers` (default all)
    sizes it for an early-exit pass over the first layers only."""
    num_layers = config.num_layers if num_layers is None else num_layers
    shape = (num_layers, batch_size, capacity, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch_size,), jnp.int32)
    )


def cache_bytes(config: LlamaConfig, batch_size: int, capacity: int, itemsize: int = 4) -> int:
    """Bytes the k and v arrays of a cache take, to check before allocating."""
    return 2 * config.num_layers * batch_size * capacity * config.kv_size * itemsize
