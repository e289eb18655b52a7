"""The KV cache's buffers (models/cache.py): entry b*K + k of each buffer (values [B*K, S, E], keys
[B*K, E, S]) is row b's kv head k; writes land at each row's own length, and tree moves copy each
row's slots, both checked against numpy on random contents, for a batch written row by row and one
past UNROLLED_WRITE_ROWS (written by vmap). A pass that defers its writes (FreshEntries) computes what
a writing pass does, and the compiled loop updates the cache in place (no copies of it). A prefill
whose queries go in chunks (models/attention.py, `_fresh_attention`) computes what one block does."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax import TokenTree
from specjax.models import FreshEntries, LlamaConfig, attention, forward_hidden, init_cache
from specjax.models.cache import UNROLLED_WRITE_ROWS, KVCache
from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program
from specjax.speculate.sampling import SamplingParams, WarpSpec

K, S, E, T = 2, 12, 4, 3


def random_cache(batch_size, seed):
    """A one-layer cache of random contents: the values `buffer` [B*K, S, E], the keys `buffer + 1`
    with each entry transposed to [E, S]."""
    rng = np.random.default_rng(seed)
    buffer = rng.standard_normal((batch_size * K, S, E)).astype(np.float32)
    lengths = rng.integers(0, S - T, batch_size).astype(np.int32)
    keys = jnp.asarray(np.swapaxes(buffer + 1, 1, 2))
    cache = KVCache(k=(keys,), v=(jnp.asarray(buffer),), lengths=jnp.asarray(lengths))
    return cache, buffer, lengths, rng


def test_an_empty_cache_merges_rows_and_kv_heads():
    config = LlamaConfig(num_layers=3, num_heads=4, num_kv_heads=K, head_dim=E)
    cache = init_cache(config, batch_size=5, capacity=S, num_layers=2)
    assert cache.num_layers == 2 and cache.capacity == S and cache.batch_size == 5
    assert cache.k[0].shape == (5 * K, E, S) and cache.v[0].shape == (5 * K, S, E)
    assert not np.any(np.asarray(cache.k[1])) and not np.any(np.asarray(cache.v[1]))


@pytest.mark.parametrize("batch_size", [3, UNROLLED_WRITE_ROWS + 2])
def test_writes_store_each_row_at_its_length(batch_size):
    cache, buffer, lengths, rng = random_cache(batch_size, seed=batch_size)
    new = rng.standard_normal((batch_size, T, K, E)).astype(np.float32)  # [B, T, K, E]
    values = np.asarray(jax.jit(cache.write_values)(cache.v[0], jnp.asarray(new)))
    keys = np.asarray(jax.jit(cache.write_keys)(cache.k[0], jnp.asarray(new + 1)))
    expected = buffer.copy()
    for b in range(batch_size):
        for k in range(K):
            expected[b * K + k, lengths[b] : lengths[b] + T] = new[b, :, k]
    np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(np.swapaxes(keys, 1, 2), expected + 1)


@pytest.mark.parametrize("batch_size", [3, UNROLLED_WRITE_ROWS + 2])
def test_move_slots_copies_each_rows_sources_into_place(batch_size):
    cache, buffer, lengths, rng = random_cache(batch_size, seed=10 + batch_size)
    # Sources at or after their destinations, as a tree's accepted path has them.
    sources = np.stack([np.sort(rng.integers(lengths[b], lengths[b] + T, T)) for b in range(batch_size)])
    sources = np.maximum(sources, lengths[:, None] + np.arange(T)).astype(np.int32)
    moved = jax.jit(KVCache.move_slots)(cache, jnp.asarray(sources))
    for got, original in ((np.swapaxes(moved.k[0], 1, 2), buffer + 1), (moved.v[0], buffer)):
        expected = original.copy()
        for b in range(batch_size):
            for k in range(K):
                expected[b * K + k, lengths[b] : lengths[b] + T] = original[b * K + k, sources[b]]
        np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("mask", ["chain", "tree"])
def test_a_pass_that_defers_its_writes_matches_one_that_writes(mask):
    """forward_hidden(write=False) then KVCache.write: the hidden states and the cache of the
    write-first pass, on a ragged batch after a prefill (a chain's causal mask, or a tree's)."""
    model = tiny_model(seed=4)
    B, P, T = 3, 9, 4
    tokens = jax.random.randint(jax.random.key(1), (B, P + T), 0, model.config.vocab_size)
    lengths = jnp.array([9, 4, 6], jnp.int32)
    cache = init_cache(model.config, B, 32)
    positions = jnp.broadcast_to(jnp.arange(P), (B, P))
    _, cache = forward_hidden(model.params, model.config, tokens[:, :P], positions, cache, empty_cache=True)
    cache = cache.replace(lengths=lengths)
    tree = TokenTree.chain(T - 1) if mask == "chain" else TokenTree(((0,), (1,), (0, 0)))  # 4 nodes
    fresh_mask, fed = tree.attention_mask, tokens[:, P:]
    fed_positions = lengths[:, None] + jnp.asarray(tree.depths)[None]
    args = (model.params, model.config, fed, fed_positions, cache, fresh_mask)
    written_hidden, written = forward_hidden(*args)
    deferred_hidden, fresh = forward_hidden(*args, write=False)
    assert isinstance(fresh, FreshEntries) and fresh.k[0].shape == (B, T, model.config.num_kv_heads, 16)
    np.testing.assert_allclose(np.asarray(deferred_hidden), np.asarray(written_hidden), rtol=1e-5, atol=1e-5)
    stored = cache.write(fresh)
    for got, expected in zip(stored.k + stored.v, written.k + written.v, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)


def prefill(model, tokens, fresh_mask=None):
    """Hidden states and cache of a jitted prefill of tokens [B, T] into an empty cache."""
    B, T = tokens.shape

    def run(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        cache = init_cache(model.config, B, T)
        return forward_hidden(params, model.config, tokens, positions, cache, fresh_mask, empty_cache=True)

    products = str(jax.make_jaxpr(run)(model.params, tokens)).count("dot_general")
    return jax.jit(run)(model.params, tokens), products


@pytest.mark.parametrize("mask", ["causal", "tree", "looks ahead"])
def test_a_prefill_in_chunks_matches_one_block(mask, monkeypatch):
    """150 tokens go in chunks of 64, 64 and 22 queries, each scoring only the keys up to its
    end; the hidden states and cache equal those of one [T, T] block. A mask that lets a token
    see a later one is not chunked."""
    model = tiny_model(seed=4)
    B, T = 2, 150
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, model.config.vocab_size)
    rng = np.random.default_rng(0)
    fresh_mask = {
        "causal": None,
        "tree": np.tril(rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool),  # earlier tokens only
        "looks ahead": (rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool),
    }[mask]
    (hidden, cache), chunked_products = prefill(model, tokens, fresh_mask)
    monkeypatch.setattr(attention, "PREFILL_CHUNKS", 1)
    monkeypatch.setattr(attention, "MIN_PREFILL_CHUNK", T)
    (one_hidden, one_cache), block_products = prefill(model, tokens, fresh_mask)
    layers = model.config.num_layers
    assert chunked_products - block_products == (0 if mask == "looks ahead" else 2 * 2 * layers)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(one_hidden), rtol=1e-5, atol=1e-5)
    for got, expected in zip(cache.k + cache.v, one_cache.k + one_cache.v, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def cache_copies_in_the_loop(proposer) -> int:
    """Copies of a whole cache buffer ([B*K, S, E] or [B*K, E, S]) outside the program's entry
    computation (in the loop's body and the branches of conds inside it), counted in the optimized
    HLO."""
    model = tiny_model(seed=6)
    B, S = 1, 128
    warp = WarpSpec.of(specjax.Sampling())
    proposer_spec, proposer_params = specjax.speculate.proposers.resolve(proposer, model, warp)
    spec = LoopSpec(model.config, B, 16, S, warp, proposer_spec)
    inputs = GenerationInputs.simple(
        prompt_tokens=jnp.arange(1, 17, dtype=jnp.int32)[None],
        prompt_lengths=jnp.array([16], jnp.int32),
        max_new_tokens=jnp.array([64], jnp.int32),
        sampling=SamplingParams.of(specjax.Sampling(), B, model.config.vocab_size),
        key=jax.random.key(0),
    )
    args = (spec, model.params, proposer_params, inputs)
    hlo = jax.jit(generate_program, static_argnums=0).lower(*args).compile().as_text()
    c = model.config
    E = c.head_dim
    buffer = rf"f32\[{B * c.num_kv_heads},({S},{E}|{E},{S})\]\{{2,1,0\}} copy\("
    computations = hlo.split("\n\n")
    return sum(
        len(re.findall(buffer, text)) for text in computations if not text.lstrip().startswith("ENTRY")
    )


@pytest.mark.parametrize(
    "proposer",
    [None, specjax.NGram(k=3, n_max=2), specjax.SelfDraft(layers=1, k=2)],
    ids=["plain", "ngram", "self"],
)
def test_the_loop_never_copies_the_cache(proposer):
    """Each step updates the cache in place: no copy of a cache buffer in the loop, neither at
    batch 1 (see KVCache's layout) nor around NGram's batch-wide cond (see FreshEntries)."""
    assert cache_copies_in_the_loop(proposer) == 0
