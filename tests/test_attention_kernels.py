"""specjax.kernels.attention against float64 numpy references: every implementation ("xla", and
the Pallas kernels for "cuda" and "tpu" in Pallas' interpreter), plus lowering of the Pallas
kernels for both accelerators from this CPU host.

The Pallas decode tests fill every slot no query may see (at and past each entry's length, below
its window) with NaN: a kernel that read one into its products would return NaN, so an output
equal to the reference shows that only the visible slots' blocks reached the arithmetic.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from specjax import kernels as cpu_kernels
from specjax.kernels.attention import block_table, cache_attention, prefill_attention
from specjax.kernels.backend import Backend

# Float32: the kernels compute in float32 what the reference computes in float64.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# Bfloat16: the probabilities are rounded to bfloat16 (relative error <= 2**-9) before their
# product with the values, so an output can move by up to 2**-9 * max|v|; we allow twice that.
# Scores (and so the log-sum-exp) come from the same bfloat16 inputs with float32 sums.
BF16_LSE_ATOL = 1e-4


def interpret_for(implementation, tpu_model=False):
    """How each implementation runs here: "xla" as it is, the Pallas kernels in Pallas' generic
    interpreter, or with `tpu_model` the TPU kernel in Pallas' TPU interpreter, which models the
    TPU's memories and DMAs and raises on any read out of bounds (a wrong block index), at about
    twice the compile time. The windowed cases take it: they exercise the index maps most."""
    if implementation == "tpu" and tpu_model:
        return pltpu.InterpretParams()
    return implementation != "xla"


def rounded(x, dtype):
    """x as the kernel sees it (dtype) and as the reference reads it (float64 of that)."""
    x = jnp.asarray(x, dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


# ----------------------------------------------------------------------------------------------
# cache_attention


def decode_reference(q, k, v, lengths, starts):
    """out [N, R, E], lse [N, R] in float64: each query over slots max(start, 0) .. length - 1."""
    N, R, E = q.shape
    out, lse = np.zeros((N, R, E)), np.full((N, R), -np.inf)
    for n in range(N):
        for r in range(R):
            lo = 0 if starts is None else max(int(starts[n, r]), 0)
            if lo >= lengths[n]:
                continue
            scores = q[n, r] @ k[n][:, lo : lengths[n]]
            peak = scores.max()
            weights = np.exp(scores - peak)
            lse[n, r] = peak + np.log(weights.sum())
            out[n, r] = weights @ v[n][lo : lengths[n]] / weights.sum()
    return out, lse


def poisoned(k, v, lengths, starts):
    """Copies of keys [N, E, S] and values [N, S, E] with NaN in every slot no query of its
    entry sees: at and past the length, and below the lowest window start."""
    k, v = np.array(k), np.array(v)
    for n, length in enumerate(lengths):
        lo = 0 if starts is None else max(int(starts[n].min()), 0)
        k[n, :, length:] = k[n, :, :lo] = np.nan
        v[n, length:] = v[n, :lo] = np.nan
    return k, v


def decode_case(seed, *, N, G, T, E, S, dtype, windowed):
    """Random queries (scaled), keys and values, lengths from 0 to S (both ends included) and,
    when windowed, per-row starts below 0, inside the committed slots and past the length."""
    rng = np.random.default_rng(seed)
    R = G * T
    q, q64 = rounded(rng.standard_normal((N, R, E)) / np.sqrt(E), dtype)
    k, k64 = rounded(rng.standard_normal((N, E, S)), dtype)
    v, v64 = rounded(rng.standard_normal((N, S, E)), dtype)
    lengths = np.concatenate([[0, S], rng.integers(0, S + 1, N - 2)]).astype(np.int32)
    starts = rng.integers(-40, S + 40, (N, R)).astype(np.int32) if windowed else None
    return (q, k, v, lengths, starts), (q64, k64, v64)


# (head dim, dtype, windowed, slots): head dims 64/128/256, both dtypes, slot counts that are not
# a multiple of the blocks (128 slots on TPU, 32 on cuda below).
DECODE_CASES = [
    (64, jnp.float32, False, 300),
    (128, jnp.bfloat16, True, 270),
    (256, jnp.float32, True, 200),
]


def check_decode(out, lse, q64, k64, v64, lengths, starts, dtype):
    expect = decode_reference(q64, k64, v64, lengths, starts)
    assert_decode_close(out, lse, *expect, dtype=dtype, v_max=np.abs(v64).max())


def assert_decode_close(out, lse, expect_out, expect_lse, *, dtype, v_max):
    """out, lse close to the expected ones at the tolerances of operands of `dtype` (v_max:
    the largest |value|), with minus infinity where they have it."""
    assert out.dtype == lse.dtype == jnp.float32
    out, lse, expect_lse = np.asarray(out), np.asarray(lse), np.asarray(expect_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expect_lse))  # rows that see nothing
    seen = np.isfinite(expect_lse)
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, expect_out, **F32_TOL)
        np.testing.assert_allclose(lse[seen], expect_lse[seen], **F32_TOL)
    else:
        np.testing.assert_allclose(out, expect_out, rtol=0, atol=2 * 2**-9 * v_max)
        np.testing.assert_allclose(lse[seen], expect_lse[seen], rtol=0, atol=BF16_LSE_ATOL)


@pytest.mark.parametrize("implementation", ["tpu", "cuda"])
@pytest.mark.parametrize("head_dim, dtype, windowed, slots", DECODE_CASES)
def test_pallas_decode_reads_only_visible_slots(implementation, head_dim, dtype, windowed, slots):
    """GQA rows (G = 2 heads x T = 3 tokens), lengths 0..S, windows, several blocks split among
    3 partial softmaxes; every invisible slot is NaN."""
    (q, k, v, lengths, starts), (q64, k64, v64) = decode_case(
        head_dim, N=4, G=2, T=3, E=head_dim, S=slots, dtype=dtype, windowed=windowed
    )
    k_bad, v_bad = poisoned(k.astype(jnp.float32), v.astype(jnp.float32), lengths, starts)
    out, lse = cache_attention(
        q,
        jnp.asarray(k_bad, dtype),
        jnp.asarray(v_bad, dtype),
        lengths,
        starts,
        implementation=implementation,
        interpret=interpret_for(implementation, tpu_model=windowed),
        block_k=128 if implementation == "tpu" else 32,
        num_splits=3,
    )
    check_decode(out, lse, q64, k64, v64, lengths, starts, dtype)


@pytest.mark.parametrize("implementation", ["tpu", "cuda", "xla"])
@pytest.mark.parametrize("windowed", [False, True])
def test_paged_decode_reads_each_entrys_pages_in_place(implementation, windowed):
    """A pool of 12 pages (page 0 the null page) and the shuffled tables of 3 rows of 2 kv heads
    (3 pages a row, in no order): each entry attends to its row's pages as to a
    dense row of them, against the float64 reference over the gathered rows. Every slot no query
    sees and the pages no table names are NaN, so only the pages of the visible slots reach the
    arithmetic (for "xla", which gathers the rows and scores every slot, only the pages no table
    names)."""
    E, W, B, K = 64, 3, 3, 2
    P = 128 if implementation == "tpu" else 32
    rng = np.random.default_rng(7)
    (q, k, v, lengths, starts), (q64, k64, v64) = decode_case(
        5, N=B * K, G=2, T=2, E=E, S=W * P, dtype=jnp.float32, windowed=windowed
    )
    k_bad, v_bad = poisoned(np.asarray(k), np.asarray(v), lengths, starts)
    if implementation == "xla":  # (it scores every slot of the rows it gathers: no poison there)
        k_bad, v_bad = np.asarray(k), np.asarray(v)
    pages = (1 + rng.permutation(11)[: B * W]).reshape(B, W).astype(np.int32)
    pool_k = np.full((12 * K, E, P), np.nan, np.float32)
    pool_v = np.full((12 * K, P, E), np.nan, np.float32)
    for b in range(B):
        for w in range(W):
            for h in range(K):
                pool_k[pages[b, w] * K + h] = k_bad[b * K + h][:, w * P : (w + 1) * P]
                pool_v[pages[b, w] * K + h] = v_bad[b * K + h][w * P : (w + 1) * P]
    out, lse = cache_attention(
        q,
        jnp.asarray(pool_k),
        jnp.asarray(pool_v),
        lengths,
        starts,
        implementation=implementation,
        interpret=interpret_for(implementation, tpu_model=windowed),
        num_splits=2,
        pages=jnp.asarray(pages),
    )
    check_decode(out, lse, q64, k64, v64, lengths, starts, jnp.float32)


def test_paged_decode_refuses_a_page_the_tpu_kernel_cannot_block():
    q = jnp.zeros((2, 4, 64))
    pool = jnp.zeros((6, 64, 16)), jnp.zeros((6, 16, 64))
    with pytest.raises(ValueError, match="the page size"):
        cache_attention(
            q,
            *pool,
            jnp.zeros(2, jnp.int32),
            implementation="tpu",
            interpret=True,
            pages=jnp.ones((1, 2), jnp.int32),
        )


@pytest.mark.parametrize("head_dim, dtype, windowed, slots", [*DECODE_CASES, (16, jnp.float32, True, 50)])
def test_xla_decode(head_dim, dtype, windowed, slots):
    (q, k, v, lengths, starts), (q64, k64, v64) = decode_case(
        head_dim, N=4, G=2, T=3, E=head_dim, S=slots, dtype=dtype, windowed=windowed
    )
    out, lse = cache_attention(q, k, v, lengths, starts, implementation="xla")
    check_decode(out, lse, q64, k64, v64, lengths, starts, dtype)


def test_xla_decode_reads_every_slot():
    """The poison test can fail: "xla" scores every slot, so NaN past the lengths reaches it."""
    (q, k, v, lengths, _), _ = decode_case(0, N=3, G=1, T=1, E=16, S=40, dtype=jnp.float32, windowed=False)
    k_bad, v_bad = poisoned(k, v, lengths, None)
    out, _ = cache_attention(q, k_bad, v_bad, lengths, implementation="xla")
    assert np.isnan(np.asarray(out)).any()


@pytest.mark.parametrize("implementation", ["tpu", pytest.param("cuda", marks=pytest.mark.slow)])
def test_pallas_decode_tiny_head_dim_in_interpret_mode(implementation):
    """Head dim 32 (tiny test models), one split, one row per entry."""
    (q, k, v, lengths, starts), (q64, k64, v64) = decode_case(
        7, N=3, G=1, T=1, E=32, S=140, dtype=jnp.float32, windowed=True
    )
    out, lse = cache_attention(
        q,
        k,
        v,
        lengths,
        starts,
        implementation=implementation,
        interpret=interpret_for(implementation),
        num_splits=1,
    )
    check_decode(out, lse, q64, k64, v64, lengths, starts, jnp.float32)


# ----------------------------------------------------------------------------------------------
# cache_attention on a stacked cache: keys [L, N, E, S], values [L, N, S, E] and a layer


def stacked_case(seed, *, L, N, G, T, E, S, dtype, windowed):
    """L layers' own queries [L, N, R, E], keys [L, N, E, S] and values [L, N, S, E], with the
    lengths (0 and S among them) and window starts that every layer of a model shares; and the
    float64 copies."""
    layers = [
        decode_case(seed + l, N=N, G=G, T=T, E=E, S=S, dtype=dtype, windowed=windowed) for l in range(L)
    ]
    (_, _, _, lengths, starts), _ = layers[0]
    stacked = [jnp.stack([case[0][i] for case in layers]) for i in range(3)]
    stacked64 = [np.stack([case[1][i] for case in layers]) for i in range(3)]
    return (*stacked, lengths, starts), stacked64


def poisoned_stack(k, v, lengths, starts, *, only_layer, slots):
    """Copies of stacked keys and values with NaN in every layer but `only_layer` (None: in none)
    and, with `slots`, in each layer's slots that no query sees (as `poisoned`)."""
    dtype = k.dtype
    k, v = np.array(k.astype(jnp.float32)), np.array(v.astype(jnp.float32))
    if slots:
        for l in range(len(k)):
            k[l], v[l] = poisoned(k[l], v[l], lengths, starts)
    if only_layer is not None:
        others = np.arange(len(k)) != only_layer
        k[others] = v[others] = np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def stacked_options(implementation, windowed):
    """The kernel's keywords: several blocks of the slots, split among 2 partial softmaxes."""
    if implementation == "xla":
        return dict(implementation="xla")
    return dict(
        implementation=implementation,
        interpret=interpret_for(implementation, tpu_model=windowed),
        block_k=128 if implementation == "tpu" else 32,
        num_splits=2,
    )


# (head dim, dtype, windowed, slots), as DECODE_CASES.
STACKED_CASES = [(32, jnp.float32, False, 200), (64, jnp.bfloat16, True, 270)]
LAYER_GIVEN_AS = ["int", "traced", "fori_loop"]
# The default suite's cases (implementation, windowed, layer given as); the rest are slow.
FAST_STACKED = {("tpu", True, "fori_loop"), ("cuda", False, "traced")}


STACKED_PARAMS = [
    pytest.param(
        implementation,
        *case,
        given,
        marks=() if (implementation, case[2], given) in FAST_STACKED else pytest.mark.slow,
    )
    for implementation in ("xla", "tpu", "cuda")
    for case in STACKED_CASES
    for given in LAYER_GIVEN_AS
]


@pytest.mark.parametrize("implementation, head_dim, dtype, windowed, slots, given", STACKED_PARAMS)
def test_stacked_decode_reads_its_layer_in_place(implementation, head_dim, dtype, windowed, slots, given):
    """Each layer of a 3-layer stacked cache against the float64 reference on that layer's own
    buffers, the layer given as a Python int, as a traced scalar (jit) or as a fori_loop's index.
    With one layer asked for, every other layer is NaN (only that layer reaches the arithmetic),
    and the result also matches the unstacked kernel on that layer's buffers. In the loop every
    layer is read, each holding its own keys and values, so a kernel that read another layer's
    would differ from the reference. The Pallas kernels also get NaN in each layer's slots that
    no query sees (xla scores every slot of its layer: test_xla_decode_reads_every_slot)."""
    L = 3
    (q, k, v, lengths, starts), (q64, k64, v64) = stacked_case(
        head_dim, L=L, N=3, G=2, T=2, E=head_dim, S=slots, dtype=dtype, windowed=windowed
    )
    attend = functools.partial(cache_attention, **stacked_options(implementation, windowed))
    pallas = implementation != "xla"
    if given == "fori_loop":
        k_bad, v_bad = poisoned_stack(k, v, lengths, starts, only_layer=None, slots=pallas)

        def every_layer(q, k, v, lengths, starts):
            def one(layer, results):
                out, lse = attend(q[layer], k, v, lengths, starts, layer=layer)
                return results[0].at[layer].set(out), results[1].at[layer].set(lse)

            N, R, E = q.shape[1:]
            return lax.fori_loop(0, L, one, (jnp.zeros((L, N, R, E)), jnp.zeros((L, N, R))))

        outs, lses = jax.jit(every_layer)(q, k_bad, v_bad, lengths, starts)
        layers = range(L)
    else:
        layer = 1  # the middle one: a layer off by one either way reads NaN
        k_bad, v_bad = poisoned_stack(k, v, lengths, starts, only_layer=layer, slots=pallas)
        if given == "int":
            out, lse = attend(q[layer], k_bad, v_bad, lengths, starts, layer=layer)
        else:
            out, lse = jax.jit(attend)(q[layer], k_bad, v_bad, lengths, starts, layer=jnp.int32(layer))
        unstacked = attend(q[layer], k_bad[layer], v_bad[layer], lengths, starts)
        assert_decode_close(out, lse, *unstacked, dtype=dtype, v_max=np.abs(v64[layer]).max())
        outs, lses, layers = {layer: out}, {layer: lse}, [layer]
    for l in layers:
        check_decode(outs[l], lses[l], q64[l], k64[l], v64[l], lengths, starts, dtype)


# ----------------------------------------------------------------------------------------------
# prefill_attention


def prefill_reference(q, k, v, keep):
    """out [N, T, G, E] in float64; keep [N, T, T] bool (query t, key u); 0 where t keeps nothing."""
    scores = np.einsum("ntge,nue->ngtu", q, k)
    scores = np.where(keep[:, None], scores, -np.inf)
    peak = scores.max(-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(peak), peak, 0))
    total = weights.sum(-1, keepdims=True)
    probs = np.where(total > 0, weights / np.where(total > 0, total, 1), 0)
    return np.einsum("ngtu,nue->ntge", probs, v)


def tree_mask(rng, T):
    """A random tree in node order (each node's parent comes before it): node t sees its
    ancestors and itself."""
    mask = np.eye(T, dtype=bool)
    for t in range(1, T):
        mask[t] |= mask[rng.integers(0, t)]
    return mask


def look_ahead_mask(T, block):
    """DFlash-style blocks: a token sees every token of its own block (later ones too) and of
    the blocks before it."""
    blocks = np.arange(T) // block
    return blocks[None, :] <= blocks[:, None]


def prefill_case(seed, *, B, K, G, T, E, dtype):
    rng = np.random.default_rng(seed)
    N = B * K
    q, q64 = rounded(rng.standard_normal((N, T, G, E)) / np.sqrt(E), dtype)
    k, k64 = rounded(rng.standard_normal((N, T, E)), dtype)
    v, v64 = rounded(rng.standard_normal((N, T, E)), dtype)
    return rng, (q, k, v), (q64, k64, v64)


def prefill_masks(name, rng, B, K, T):
    """(mask argument, positions [B, T] or None, window or None, keep [N, T, T] for the reference)."""
    positions, window = None, None
    if name == "causal":
        mask, keep = None, np.tril(np.ones((T, T), bool))
    elif name == "tree":
        mask = keep = tree_mask(rng, T)
    else:  # look-ahead blocks under a sliding window, one row seeing nothing
        mask = look_ahead_mask(T, 5)
        mask[7] = False
        keep = mask
        positions = np.stack([np.arange(T), np.arange(T) + 11]).astype(np.int32)[:B]
        window = 9
    keep = np.broadcast_to(keep, (B * K, T, T))
    if window is not None:
        per_entry = np.repeat(positions, K, axis=0)
        keep = keep & (per_entry[:, :, None] - per_entry[:, None, :] < window)
    return mask, positions, window, keep


# (mask, head dim, dtype, tokens): T never a multiple of the blocks; on TPU the 150- and
# 140-token cases take several 128-key blocks.
PREFILL_CASES = [
    ("causal", 64, jnp.float32, 150),
    ("tree", 128, jnp.bfloat16, 45),
    ("look-ahead+window", 256, jnp.float32, 140),
]


@pytest.mark.parametrize("implementation", ["xla", "tpu", "cuda"])
@pytest.mark.parametrize("mask_name, head_dim, dtype, tokens", PREFILL_CASES)
def test_prefill(implementation, mask_name, head_dim, dtype, tokens):
    B, K, G = 2, 1, 2
    rng, (q, k, v), (q64, k64, v64) = prefill_case(tokens, B=B, K=K, G=G, T=tokens, E=head_dim, dtype=dtype)
    mask, positions, window, keep = prefill_masks(mask_name, rng, B, K, tokens)
    blocks = dict(block_q=32, block_k=128) if implementation == "tpu" else dict(block_q=32, block_k=32)
    out = prefill_attention(
        q,
        k,
        v,
        mask=mask,
        positions=positions,
        window=window,
        implementation=implementation,
        interpret=interpret_for(implementation, tpu_model=window is not None),
        **blocks,
    )
    expect = prefill_reference(q64, k64, v64, keep)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out), expect, **F32_TOL)
    else:
        np.testing.assert_allclose(np.asarray(out), expect, rtol=0, atol=2 * 2**-9 * np.abs(v64).max())


def test_block_table_skips_and_shares_tiles():
    """Causal at equal blocks: key blocks above the diagonal are never visited, blocks below it
    need no mask, and the diagonal tiles are one shared partial tile."""
    T, block = 100, 32  # 4 blocks, the last one 4 tokens long
    table = block_table(np.tril(np.ones((T, T), bool)), block, block)
    np.testing.assert_array_equal(table.count, [1, 2, 3, 4])
    for qi in range(4):
        np.testing.assert_array_equal(table.kv_block[qi, : qi + 1], np.arange(qi + 1))
        assert (table.tile[qi, :qi] == 0).all() and table.tile[qi, qi] > 0
    # The first three diagonal tiles are equal; the last one is cut at T.
    assert len(set(table.tile[:3, :].max(axis=1))) == 1 and table.tiles.shape[0] == 3
    np.testing.assert_array_equal(table.tiles[0], np.ones((block, block), bool))


# ----------------------------------------------------------------------------------------------
# Lowering for the accelerators, from this CPU host


def custom_calls(exported) -> set[str]:
    """The custom call targets in an exported module (searched, never printed: it is megabytes)."""
    text = exported.mlir_module()
    return set(re.findall(r"custom_call @([\w$.]+)", text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', text)
    )


EXPECTED_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def export_for(platform, f, *args):
    # Triton's custom call has no compatibility guarantee, so export only with that check off.
    checks = [jax.export.DisabledSafetyCheck.custom_call(EXPECTED_CALL["cuda"])]
    return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)


def assert_kernel_only(exported, platform):
    calls = custom_calls(exported)
    assert EXPECTED_CALL[platform] in calls
    assert not any(call.startswith("specjax_") for call in calls), calls  # no CPU FFI kernel


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_lowers(platform, head_dim, dtype):
    N, R, S = 8, 36, 1000
    spec = jax.ShapeDtypeStruct
    args = [spec((N, R, head_dim), dtype), spec((N, head_dim, S), dtype), spec((N, S, head_dim), dtype)]
    args += [spec((N,), jnp.int32), spec((N, R), jnp.int32)]
    for windowed in (True, False):

        def f(q, k, v, lengths, starts, windowed=windowed):
            return cache_attention(q, k, v, lengths, starts if windowed else None, implementation=platform)

        assert_kernel_only(export_for(platform, f, *args), platform)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_paged_decode_lowers(platform):
    """The paged kernel (pools and page tables) lowers for each accelerator as the kernel alone:
    no gather of the rows in front of it (which would copy every row's pages)."""
    N, R, E, P, W, M = 8, 12, 128, 128, 5, 40
    spec = jax.ShapeDtypeStruct
    args = [spec((N, R, E), jnp.bfloat16), spec((M, E, P), jnp.bfloat16), spec((M, P, E), jnp.bfloat16)]
    args += [spec((N,), jnp.int32), spec((N // 2, W), jnp.int32)]

    def f(q, k, v, lengths, pages):
        return cache_attention(q, k, v, lengths, implementation=platform, pages=pages)

    exported = export_for(platform, f, *args)
    assert_kernel_only(exported, platform)
    assert "stablehlo.gather" not in exported.mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_lowers(platform, dtype):
    B, K, G, T = 2, 2, 4, 300
    rng = np.random.default_rng(0)
    spec = jax.ShapeDtypeStruct
    for head_dim, mask, window in (
        (64, None, None),
        (128, tree_mask(rng, T), None),
        (256, look_ahead_mask(T, 16), 64),
    ):
        args = [
            spec((B * K, T, G, head_dim), dtype),
            spec((B * K, T, head_dim), dtype),
            spec((B * K, T, head_dim), dtype),
        ]
        args.append(spec((B, T), jnp.int32))

        def f(q, k, v, positions, mask=mask, window=window):
            return prefill_attention(
                q,
                k,
                v,
                mask=mask,
                positions=positions if window else None,
                window=window,
                implementation=platform,
            )

        assert_kernel_only(export_for(platform, f, *args), platform)


@pytest.mark.parametrize("layers_as", ["fori_loop", "python ints"])
def test_stacked_decode_lowers_without_slicing_the_stack(layers_as):
    """A loop over the layers of a stacked cache, calling the backend's kernel as a model would,
    lowered for cuda and tpu at once: each platform's kernel takes the stacked buffers
    themselves, and nothing slices a layer out of them in front of it (that slice would copy the
    layer's whole cache at every layer of every step). The stacked shapes occur nowhere else, so
    an op that slices one names its type."""
    L, N, R, E, S = 3, 4, 8, 64, 1000
    spec = jax.ShapeDtypeStruct
    args = [spec((L, N, R, E), jnp.float32), spec((L, N, E, S), jnp.float32), spec((L, N, S, E), jnp.float32)]
    args += [spec((N,), jnp.int32), spec((N, R), jnp.int32)]
    backend = Backend(("cuda", "tpu"), "auto")

    def f(q, k, v, lengths, starts):
        with backend.tracing():
            kernel = backend.cache_attention(E, jnp.float32)

            def one(layer, total):
                return total + kernel(q[layer], k, v, lengths, starts, layer=layer)[0]

            total = jnp.zeros((N, R, E))
            if layers_as == "fori_loop":
                return lax.fori_loop(0, L, one, total)
            for layer in range(L):
                total = one(layer, total)
            return total

    checks = [jax.export.DisabledSafetyCheck.custom_call(EXPECTED_CALL["cuda"])]
    exported = jax.export.export(jax.jit(f), platforms=["cuda", "tpu"], disabled_checks=checks)(*args)
    assert set(EXPECTED_CALL.values()) <= custom_calls(exported)
    stacked = (f"tensor<{L}x{N}x{E}x{S}xf32>", f"tensor<{L}x{N}x{S}x{E}xf32>")
    lines = exported.mlir_module().splitlines()
    slicing = re.compile(r"stablehlo\.(dynamic_slice|slice|gather|dynamic_gather|real_dynamic_slice)\b")
    sliced = [
        line.strip()[:200] for line in lines if slicing.search(line) and any(t in line for t in stacked)
    ]
    assert not sliced, sliced
    for call in EXPECTED_CALL.values():  # each kernel's operands: the stacked buffers
        calls = [line for line in lines if f"custom_call @{call}(" in line]
        assert calls and all(t in line for line in calls for t in stacked), call


# ----------------------------------------------------------------------------------------------
# Errors at the door


def test_errors_name_the_argument():
    q, k, v = jnp.zeros((2, 3, 64)), jnp.zeros((2, 64, 10)), jnp.zeros((2, 10, 64))
    lengths = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="implementation is 'gpu'"):
        cache_attention(q, k, v, lengths, implementation="gpu")
    with pytest.raises(ValueError, match=r"keys has shape \(2, 10, 64\)"):
        cache_attention(q, v, v, lengths, implementation="xla")
    with pytest.raises(ValueError, match=r"starts has shape \(2, 4\)"):
        cache_attention(q, k, v, lengths, jnp.zeros((2, 4), jnp.int32), implementation="xla")
    with pytest.raises(ValueError, match="lengths has shape"):
        cache_attention(q, k, v, lengths[:1], implementation="xla")
    with pytest.raises(ValueError, match="head dim .* is 48"):
        cache_attention(q[..., :48], k[:, :48], v[..., :48], lengths, implementation="tpu")
    with pytest.raises(ValueError, match="head dim .* is 32"):  # tiny heads: interpret mode only
        cache_attention(q[..., :32], k[:, :32], v[..., :32], lengths, implementation="cuda")
    with pytest.raises(ValueError, match="block_k is 100"):
        cache_attention(q, k, v, lengths, implementation="tpu", block_k=100)
    with pytest.raises(ValueError, match="dtype int32"):
        cache_attention(q.astype(jnp.int32), k, v, lengths, implementation="xla")
    pq, pk = jnp.zeros((2, 5, 2, 64)), jnp.zeros((2, 5, 64))
    with pytest.raises(ValueError, match="mask is"):
        prefill_attention(pq, pk, pk, mask=jnp.ones((5, 5), bool), implementation="xla")
    with pytest.raises(ValueError, match="positions is None and window is 4"):
        prefill_attention(pq, pk, pk, window=4, implementation="xla")
    with pytest.raises(ValueError, match="positions has shape"):
        prefill_attention(pq, pk, pk, positions=jnp.zeros((3, 5), jnp.int32), window=4, implementation="xla")
    with pytest.raises(ValueError, match="block_q is 12"):
        prefill_attention(pq, pk, pk, implementation="cuda", block_q=12)


def test_stacked_cache_errors_name_the_argument():
    q, lengths = jnp.zeros((2, 3, 64)), jnp.zeros((2,), jnp.int32)
    k, v = jnp.zeros((4, 2, 64, 10)), jnp.zeros((4, 2, 10, 64))  # 4 layers
    with pytest.raises(ValueError, match=r"values has shape \(4, 2, 10, 64\); allowed: \[N, S, E\]"):
        cache_attention(q, k, v, lengths, implementation="xla")  # a stack, but no layer
    with pytest.raises(ValueError, match=r"values has shape \(2, 10, 64\); allowed: \[L, N, S, E\]"):
        cache_attention(q, k[0], v[0], lengths, implementation="xla", layer=0)  # one layer's cache
    with pytest.raises(ValueError, match=r"keys has shape \(4, 2, 10, 64\), expected \(4, 2, 64, 10\)"):
        cache_attention(q, v, v, lengths, implementation="tpu", layer=0)
    with pytest.raises(ValueError, match=r"keys has shape \(3, 2, 64, 10\), expected \(4, 2, 64, 10\)"):
        cache_attention(q, k[:3], v, lengths, implementation="cuda", layer=0)  # layer counts differ
    for layer in (4, -1):
        with pytest.raises(ValueError, match=rf"layer is {layer}; allowed: 0..3"):
            cache_attention(q, k, v, lengths, implementation="xla", layer=layer)
    for layer in (1.0, True, jnp.zeros((1,), jnp.int32), jnp.float32(1)):
        with pytest.raises(
            ValueError, match="layer is .*; allowed: None, an int in 0..3 or an integer scalar"
        ):
            cache_attention(q, k, v, lengths, implementation="xla", layer=layer)
    with pytest.raises(ValueError, match="layer is 0; allowed: None"):  # the CPU kernel: one layer only
        cpu_kernels.cache_attention(q, k, v, lengths, layer=0)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_prefill_with_sinks_lowers(platform):
    """gpt-oss's attention sinks ([N, G], one per entry and head) start the Pallas prefill
    kernels' online softmax, under a sliding window too (their values: tests/test_attention_sinks.py)."""
    B, K, G, T, E = 2, 2, 4, 300, 64
    spec = jax.ShapeDtypeStruct
    args = [spec((B * K, T, G, E), jnp.bfloat16), spec((B * K, T, E), jnp.bfloat16)]
    args += [spec((B * K, T, E), jnp.bfloat16), spec((B, T), jnp.int32), spec((B * K, G), jnp.float32)]

    def f(q, k, v, positions, sinks):
        return prefill_attention(
            q, k, v, positions=positions, window=128, sinks=sinks, implementation=platform
        )

    assert_kernel_only(export_for(platform, f, *args), platform)
