"""The target's KV cache in pages (KVCache.pages, models/cache.py): writes, tree moves and rows
through shuffled page tables against the dense layout slot for slot; the forward over a paged
cache against the dense one; and `generate(page_size=...)` giving the dense layout's tokens and
accepted counts for every kind of proposer state, unrolled and scanned layers, the XLA reads and
the CPU kernels', one pass and chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import (
    first_layer_eagle,
    first_layer_eagle3,
    first_layer_mtp,
    layered_target,
    noisy_copy,
    quiet_target,
)
from tiny import tiny_config, tiny_model

import specjax
from specjax import planner
from specjax.kernels import backend
from specjax.models.cache import NULL_PAGE, KVCache, init_cache, paged_cache
from specjax.models.llama import forward_hidden, stack_layers
from specjax.speculate.tree import TokenTree

RNG = np.random.default_rng(8)
CONFIG = tiny_config(num_layers=2)
PAGE = 4


def shuffled_tables(batch, width, extra=3):
    """Page tables [B, W] over a pool with `extra` pages nobody holds, in a random order."""
    pages = RNG.permutation(np.arange(1, 1 + batch * width + extra))[: batch * width]
    return jnp.asarray(pages.reshape(batch, width), jnp.int32), 1 + batch * width + extra


def both(batch=3, width=4, like=None):
    """An empty dense cache and an empty paged one of the same rows (capacity width * PAGE)."""
    tables, num_pages = shuffled_tables(batch, width)
    dense = init_cache(CONFIG, batch, width * PAGE, like=like)
    return dense, paged_cache(CONFIG, tables, PAGE, num_pages, like=like)


def entries(batch, tokens, layers=None):
    K, E = CONFIG.num_kv_heads, CONFIG.head_dim
    shape = (batch, tokens, K, E) if layers is None else (layers, batch, tokens, K, E)
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def committed_equal(dense: KVCache, paged: KVCache, tolerance: float = 0.0):
    """Every row's committed slots are the same in both (the paged rows gathered), to `tolerance`
    (a pass's later layers' entries, where the kernel's blocks followed the pages)."""
    gathered = paged.dense()
    np.testing.assert_array_equal(dense.lengths, gathered.lengths)
    for a, b in zip(dense.k + dense.v, gathered.k + gathered.v, strict=True):
        assert a.shape == b.shape
        for row, length in enumerate(np.asarray(dense.lengths)):
            K = CONFIG.num_kv_heads
            a_row, b_row = (
                np.asarray(a)[..., row * K : (row + 1) * K, :, :],
                np.asarray(b)[..., row * K : (row + 1) * K, :, :],
            )
            if a.shape[-1] == CONFIG.head_dim:  # values [.., S, E]
                np.testing.assert_allclose(
                    a_row[..., :length, :], b_row[..., :length, :], rtol=tolerance, atol=tolerance
                )
            else:  # keys [.., E, S]
                np.testing.assert_allclose(
                    a_row[..., :length], b_row[..., :length], rtol=tolerance, atol=tolerance
                )


@pytest.mark.parametrize("stacked", [False, True])
def test_writes_moves_and_rows_through_shuffled_tables(stacked):
    model = tiny_model(seed=1)
    like = stack_layers(model.params, model.config).layers if stacked else None
    dense, paged = both(like=like)
    assert paged.capacity == dense.capacity == 4 * PAGE and paged.num_pages == 16
    layers = 2 if stacked else None

    def write(cache, new, fresh=False):
        if stacked:
            return cache.replace(
                k=(cache.write_keys(cache.k[0], new, fresh),), v=(cache.write_values(cache.v[0], new, fresh),)
            )
        return cache.replace(
            k=tuple(cache.write_keys(b, new, fresh) for b in cache.k),
            v=tuple(cache.write_values(b, new, fresh) for b in cache.v),
        )

    prompt = entries(3, 6, layers)  # a prefill of 6 slots, then rows of 6, 4 and 5 committed
    dense, paged = (write(c, prompt, fresh=True).advance(jnp.asarray([6, 4, 5])) for c in (dense, paged))
    committed_equal(dense, paged)
    verify = entries(3, 5, layers)  # a verify pass, crossing page boundaries; 2, 0 and 5 kept
    dense, paged = (write(c, verify).advance(jnp.asarray([2, 0, 5])) for c in (dense, paged))
    committed_equal(dense, paged)
    sources = jnp.asarray([[8, 9], [5, 7], [11, 12]])  # a tree's path moved into place
    dense, paged = (c.replace(lengths=c.lengths - 1) for c in (dense, paged))
    dense, paged = (
        jax.jit(KVCache.move_slots)(c, sources).advance(jnp.asarray([2, 2, 2])) for c in (dense, paged)
    )
    committed_equal(dense, paged)
    one = entries(1, 3, layers)  # one row's pass alone, put back
    dense, paged = (
        c.with_row(jnp.int32(1), write(c.row(jnp.int32(1)), one).advance(jnp.asarray([3])))
        for c in (dense, paged)
    )
    committed_equal(dense, paged)


def test_writes_past_a_table_land_in_the_null_page():
    tables = jnp.asarray([[3, 1]], jnp.int32)
    paged = paged_cache(CONFIG, tables, PAGE, 4).replace(lengths=jnp.asarray([7]))
    new = entries(1, 4)  # slots 7 .. 10: 7 in page 1, 8 .. 10 past the table's 8 slots
    keys = paged.write_keys(paged.k[0], new)
    K = CONFIG.num_kv_heads
    by_page = np.asarray(keys).reshape(4, K, CONFIG.head_dim, PAGE)
    np.testing.assert_array_equal(by_page[1, :, :, 3], np.asarray(new[0, 0]))
    assert not by_page[2].any() and not by_page[3].any()  # untouched: nobody's page, and row 0's page 3
    assert by_page[NULL_PAGE].any()


@pytest.mark.parametrize("kernels", ["xla", "auto"])
def test_forward_over_pages_equals_dense(kernels):
    model = tiny_model(seed=2)
    dense, paged = both(batch=2, width=6)
    tokens = jnp.asarray(RNG.integers(0, 97, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    with backend.for_devices(jax.devices()[:1], kernels).tracing():
        outs = [
            forward_hidden(model.params, model.config, tokens, positions, c, empty_cache=True)
            for c in (dense, paged)
        ]
        dense, paged = (out[1].advance(jnp.asarray([7, 5])) for out in outs)
        np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
        drafts = jnp.asarray(RNG.integers(0, 97, (2, 4)), jnp.int32)  # a verify pass of 4 past each length
        positions = dense.lengths[:, None] + jnp.arange(4)
        outs = [forward_hidden(model.params, model.config, drafts, positions, c) for c in (dense, paged)]
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    committed_equal(outs[0][1].advance(jnp.asarray([4, 4])), outs[1][1].advance(jnp.asarray([4, 4])), 1e-5)


LAYERED = layered_target(seed=11)
QUIET = quiet_target(seed=11, num_layers=4)
MTP_TARGET = first_layer_mtp(layered_target(seed=12))
PROPOSERS = {
    "plain": (LAYERED, lambda: None),
    "ngram": (LAYERED, lambda: specjax.NGram(k=3)),
    "draft-model": (LAYERED, lambda: specjax.DraftModel(noisy_copy(LAYERED, 0.02), k=3)),
    "self-draft": (LAYERED, lambda: specjax.SelfDraft(layers=1, k=3)),
    "eagle-tree": (
        LAYERED,
        lambda: specjax.Eagle(first_layer_eagle(LAYERED), tree=TokenTree.top_k((2, 2, 1))),
    ),
    "eagle3": (QUIET, lambda: specjax.Eagle3(first_layer_eagle3(QUIET, (1, 2, 4)), k=3)),
    "mtp": (MTP_TARGET, lambda: specjax.MTP(k=1)),
}


# (A draft model's own cache, EAGLE-3's features and MTP's layers in `make test-all` only: the
# default set keeps a stateless drafter, a draft started from the target's cache and a tree.)
SLOW = {"draft-model", "eagle3", "mtp"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PROPOSERS]
)
def test_generate_on_pages_equals_dense(name):
    model, make = PROPOSERS[name]
    prompts = [list(map(int, RNG.integers(0, model.config.vocab_size, n))) for n in (5, 17, 40)]
    proposer = make()
    runs = [
        specjax.generate(model, prompts, proposer=proposer, max_new_tokens=12, prefill_chunk=16, page_size=p)
        for p in (None, 16)
    ]
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].metrics.accepted.tolist() == runs[0].metrics.accepted.tolist()
    if proposer is not None and name != "ngram":  # drafts were accepted and rejected
        assert 0 < sum(runs[1].metrics.accepted.tolist()) < sum(runs[1].metrics.drafted.tolist())


@pytest.mark.parametrize("options", [dict(scan_layers=True), dict(kernels="xla"), dict(prefill_chunk=None)])
def test_generate_on_pages_scanned_xla_and_one_pass(options):
    prompts = [list(map(int, RNG.integers(0, 97, n))) for n in (9, 33)]
    proposer = specjax.SelfDraft(layers=1, k=3)
    runs = [
        specjax.generate(LAYERED, prompts, proposer=proposer, max_new_tokens=10, page_size=p, **options)
        for p in (None, 32)
    ]
    assert runs[1].tokens == runs[0].tokens


@pytest.mark.parametrize("kernels, page", [("pallas:cuda", 32), ("pallas:tpu", 128)])
def test_generate_on_pages_with_the_pallas_kernels_reading_them(kernels, page):
    """The Pallas kernels (in Pallas' interpreter here) read each row's pages in place, a block a
    page, in the decoding and verify passes of an EAGLE tree and in the prefill's packed passes:
    the dense layout's tokens and accepted counts."""
    on = backend.Backend(("cpu",), kernels)
    assert on.cache_attention_reads_pages(LAYERED.config.head_dim, "float32", page)
    assert not on.cache_attention_reads_pages(LAYERED.config.head_dim, "float32", 16) or kernels.endswith(
        "cuda"
    )
    prompts = [list(map(int, RNG.integers(0, 97, n))) for n in (9, 33)]
    proposer = specjax.Eagle(first_layer_eagle(LAYERED), tree=TokenTree.top_k((2, 1)))
    runs = [
        specjax.generate(LAYERED, prompts, proposer=proposer, max_new_tokens=8, page_size=p, kernels=kernels)
        for p in (None, page)
    ]
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].metrics.accepted.tolist() == runs[0].metrics.accepted.tolist()


@pytest.mark.parametrize("bad", [8, 24, 0, "16", 16.0])
def test_page_size_must_be_a_power_of_two_of_16_or_more(bad):
    with pytest.raises(
        ValueError, match=r"page_size must be None or a power of two of at least 16 slots, got"
    ):
        specjax.generate(LAYERED, [[1, 2, 3]], max_new_tokens=2, page_size=bad)


def test_page_size_refuses_latent_attention():
    model = tiny_model(seed=3, num_kv_heads=1, head_dim=24, rotary_dim=8, v_head_dim=24, kv_lora_rank=32)
    with pytest.raises(ValueError, match="latent attention"):
        specjax.generate(model, [[1, 2, 3]], max_new_tokens=2, page_size=16)


@pytest.mark.parametrize("page, window", [(16, False), (32, True), (1024, False)])
def test_the_cpu_kernel_reads_pages_in_place(page, window):
    """The CPU kernel over pools and shuffled tables against itself over the same rows gathered
    dense: every row's committed slots, windows' starts, a page longer than one block (1024)."""
    from specjax import kernels as cpu_kernels

    B, K, R, E, W = 3, 2, 5, 64, 3
    pages, num_pages = shuffled_tables(B, W)
    shape_k, shape_v = (num_pages * K, E, page), (num_pages * K, page, E)
    keys = jnp.asarray(RNG.standard_normal(shape_k), jnp.float32)
    values = jnp.asarray(RNG.standard_normal(shape_v), jnp.float32)
    queries = jnp.asarray(RNG.standard_normal((B * K, R, E)), jnp.float32)
    lengths = jnp.repeat(jnp.asarray([W * page, page + 3, 1]), K)  # full, into a second page, one slot
    starts = None
    if window:
        starts = jnp.asarray(RNG.integers(-5, W * page, (B * K, R)), jnp.int32)
    from specjax.models.cache import rows_of_pool

    dense = cpu_kernels.cache_attention(
        queries, rows_of_pool(keys, pages, K, True), rows_of_pool(values, pages, K, False), lengths, starts
    )
    paged = cpu_kernels.cache_attention(queries, keys, values, lengths, starts, pages=pages)
    for a, b in zip(dense, paged, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_the_prefill_packs_rows_on_pages_where_the_kernel_reads_them():
    """On the CPU kernels a paged program packs the rows' prompts end to end (passes straddling
    rows: chunks of 16 over prompts of 5, 16, 17, 61 and 40 tokens); under XLA's attention it runs
    one row a chunk. Both give the dense one-pass prefill's tokens."""
    prompts = [list(map(int, RNG.integers(0, 97, n))) for n in (5, 16, 17, 61, 40)]
    assert planner.plan(LAYERED, prompts, max_new_tokens=4, prefill_chunk=16, page_size=16).spec.packs_prefill
    xla = planner.plan(LAYERED, prompts, max_new_tokens=4, prefill_chunk=16, page_size=16, kernels="xla")
    assert not xla.spec.packs_prefill
    short = [[1] * 6] * 20  # "auto": one pass over a dense cache (each row's chunk mostly padding),
    assert planner.plan(LAYERED, short, max_new_tokens=4).spec.prefill_chunk is None
    packed_short = planner.plan(LAYERED, short, max_new_tokens=4, page_size=16).spec  # packed on pages
    assert packed_short.prefill_chunk == planner.PREFILL_CHUNK and packed_short.packs_prefill
    one_pass = specjax.generate(LAYERED, prompts, max_new_tokens=8, prefill_chunk=None)
    packed = specjax.generate(LAYERED, prompts, max_new_tokens=8, prefill_chunk=16, page_size=16)
    assert packed.tokens == one_pass.tokens


def test_packed_rows_keep_their_windows_and_sinks():
    """A sliding window shorter than a pass and one longer, with attention sinks: each packed
    token attends inside its own row's window only."""
    for window in (8, 40):
        model = tiny_model(
            seed=3,
            sliding_window=window,
            layer_types=("sliding_attention", "full_attention"),
            attention_sinks=True,
        )
        prompts = [list(map(int, RNG.integers(0, 97, n))) for n in (70, 33, 9)]
        runs = [
            specjax.generate(model, prompts, max_new_tokens=10, prefill_chunk=c, page_size=p)
            for c, p in ((None, None), (16, 16))
        ]
        assert runs[1].tokens == runs[0].tokens
