"""The KV cache's buffers (models/cache.py): entry b*K + k of each [B*K, S, E] buffer is row b's kv
head k; writes land at each row's own length, and tree moves copy each row's slots, both checked
against numpy on random contents, for a batch written row by row and one past
UNROLLED_WRITE_ROWS (written by vmap)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import LlamaConfig, init_cache
from specjax.models.cache import UNROLLED_WRITE_ROWS, KVCache

K, S, E, T = 2, 12, 4, 3


def random_cache(batch_size, seed):
    rng = np.random.default_rng(seed)
    buffer = rng.standard_normal((batch_size * K, S, E)).astype(np.float32)
    lengths = rng.integers(0, S - T, batch_size).astype(np.int32)
    cache = KVCache(k=(jnp.asarray(buffer),), v=(jnp.asarray(buffer) + 1,), lengths=jnp.asarray(lengths))
    return cache, buffer, lengths, rng


def test_an_empty_cache_merges_rows_and_kv_heads():
    config = LlamaConfig(num_layers=3, num_heads=4, num_kv_heads=K, head_dim=E)
    cache = init_cache(config, batch_size=5, capacity=S, num_layers=2)
    assert cache.num_layers == 2 and cache.capacity == S and cache.batch_size == 5
    assert cache.k[0].shape == (5 * K, S, E) and not np.any(np.asarray(cache.v[1]))


@pytest.mark.parametrize("batch_size", [3, UNROLLED_WRITE_ROWS + 2])
def test_write_slots_stores_each_row_at_its_length(batch_size):
    cache, buffer, lengths, rng = random_cache(batch_size, seed=batch_size)
    new = rng.standard_normal((batch_size, T, K, E)).astype(np.float32)  # [B, T, K, E]
    written = np.asarray(jax.jit(cache.write_slots)(cache.k[0], jnp.asarray(new)))
    expected = buffer.copy()
    for b in range(batch_size):
        for k in range(K):
            expected[b * K + k, lengths[b] : lengths[b] + T] = new[b, :, k]
    np.testing.assert_array_equal(written, expected)


@pytest.mark.parametrize("batch_size", [3, UNROLLED_WRITE_ROWS + 2])
def test_move_slots_copies_each_rows_sources_into_place(batch_size):
    cache, buffer, lengths, rng = random_cache(batch_size, seed=10 + batch_size)
    # Sources at or after their destinations, as a tree's accepted path has them.
    sources = np.stack([np.sort(rng.integers(lengths[b], lengths[b] + T, T)) for b in range(batch_size)])
    sources = np.maximum(sources, lengths[:, None] + np.arange(T)).astype(np.int32)
    moved = jax.jit(KVCache.move_slots)(cache, jnp.asarray(sources))
    for got, original in ((moved.k[0], buffer), (moved.v[0], buffer + 1)):
        expected = original.copy()
        for b in range(batch_size):
            for k in range(K):
                expected[b * K + k, lengths[b] : lengths[b] + T] = original[b * K + k, sources[b]]
        np.testing.assert_array_equal(np.asarray(got), expected)
