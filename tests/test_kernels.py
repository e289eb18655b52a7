"""The CPU decoding kernels (specjax/kernels): panel products and cache attention against float64
numpy, the packed model against the plain one, and generate's use of them."""

from __future__ import annotations

import by_hand
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_config, tiny_model

import specjax
from specjax import kernels, planner, programs
from specjax.kernels.backend import Backend
from specjax.kernels.layouts import GateUpPanels, with_panel_weights
from specjax.models import forward, init_cache, init_params
from specjax.models.attention import attention
from specjax.models.llama import forward_hidden, lm_head
from specjax.models.passes import LayerCache, LayerMasks, PassKind, PassPlan, causal_mask, visible_slots

CPU = Backend(platforms=("cpu",), kernels="auto")  # the CPU kernels, as a CPU generate uses them


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded():
    # Not a skip: where this machine's compiler cannot build the kernel, these tests fail.
    assert kernels.available(), "the CPU kernel did not build (see the warning above)"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 17, 25, 48, 49, 100])
@pytest.mark.parametrize("d_in, d_out", [(64, 32), (48, 40), (7, 16), (96, 200), (200, 72)])
def test_panel_matmul_equals_the_float64_product(rows, d_in, d_out):
    """Every row count the kernel's chunking meets. With 8-float vectors (AVX2): up to 4 rows in
    chunks of up to 3 over a panel pair (4 as 2 + 2); more in chunks of 6 or 5 over one panel, the
    last 1-4 over the pair (7 as 6 + 1, 10 as 6 + 2 + 2, 11 as 6 + 5). With AVX-512: one row
    alone, 2-12 rows in one chunk over the pair, more in chunks of equal sizes (13 as 6 + 7, 17 as
    8 + 9, 25 as 8 + 8 + 9). Either way 48 rows to a group (49: a group and one row; 100: two and
    4 rows); inputs in one block, several, and a last partial one (200 = 3 x 64 + 8, 128 + 72,
    past the prefetch distance); output widths that are a whole number of panel pairs, an odd
    panel count (40, 72: a lone last panel), and widths padded to a panel (40, 200)."""
    rng = np.random.default_rng(rows * 1000 + d_in + d_out)
    x = rng.standard_normal((rows, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    got = np.asarray(jax.jit(kernels.panel_matmul)(jnp.asarray(x), kernels.pack(w)))
    assert got.shape == (rows, d_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def float64_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Llama's RMSNorm of x's rows in float64."""
    x = x.astype(np.float64)
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("rows", [1, 2, 7, 25, 49])
@pytest.mark.parametrize("d_in, d_out", [(48, 40), (200, 72), (7, 16)])
def test_panel_matmul_norms_its_rows_and_adds_a_residual(rows, d_in, d_out):
    """With `norm` the kernel RMS-norms the rows before the product, with `residual` it adds the
    residual after (one of them, or both): float64 numpy's norm, product and sum within 1e-5, for
    the one-row loop, chunks, a group and one more row (49), inputs that are no whole vector (7)
    and output widths padded to a panel (40, 72)."""
    rng = np.random.default_rng(rows * 1000 + d_in + d_out)
    x = rng.standard_normal((rows, d_in)).astype(np.float32) * 3
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, d_in).astype(np.float32)
    residual = rng.standard_normal((rows, d_out)).astype(np.float32)

    @jax.jit
    def product(x, w, weight, residual):  # (eps is the kernel's attribute: not traced)
        return kernels.panel_matmul(x, w, None if weight is None else (weight, 1e-5), residual)

    for norm, add in ((True, False), (False, True), (True, True)):
        got = product(
            jnp.asarray(x),
            kernels.pack(w),
            jnp.asarray(weight) if norm else None,
            jnp.asarray(residual) if add else None,
        )
        rows_in = float64_rms_norm(x, weight, 1e-5) if norm else x.astype(np.float64)
        want = rows_in @ w + (residual if add else 0)
        # within 1e-5 of the terms' sizes: a sum's float32 rounding grows with them, not with the
        # result (which may cancel to near 0)
        scale = np.abs(rows_in) @ np.abs(w) + (np.abs(residual) if add else 0)
        assert np.all(np.abs(np.asarray(got) - want) <= 1e-5 * scale), (norm, add)


def test_norm_and_residual_of_the_wrong_shape_are_clear_errors():
    w = kernels.pack(np.ones((8, 16), np.float32))
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match=r"norm: weight of shape \(7,\)"):
        kernels.panel_matmul(x, w, (jnp.ones(7), 1e-5))
    with pytest.raises(ValueError, match=r"residual of shape \(2, 15\)"):
        kernels.panel_matmul(x, w, residual=jnp.ones((2, 15)))


def test_panel_matmul_keeps_leading_axes_and_rows_apart():
    """x [B, T, D_in] keeps its leading axes; each row's result is what it gets alone, bit for bit
    (rows never mix, and every path adds a row's products in the same order: 14 rows go blocked,
    in chunks of 6 over one panel, one row alone over the pair): a request's greedy tokens cannot
    depend on how many rows run beside it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 7, 136)).astype(np.float32)
    w = kernels.pack(rng.standard_normal((136, 48)).astype(np.float32))
    got = np.asarray(jax.jit(kernels.panel_matmul)(jnp.asarray(x), w))
    assert got.shape == (2, 7, 48)
    for b in range(2):
        for t in range(7):
            alone = np.asarray(kernels.panel_matmul(jnp.asarray(x[b, t][None]), w))[0]
            np.testing.assert_array_equal(got[b, t], alone)


def test_pack_round_trips_and_lays_out_panels():
    w = np.arange(5 * 35, dtype=np.float32).reshape(5, 35)
    packed = kernels.pack(w)
    assert packed.panels.shape == (3, 5, 16) and packed.shape == (5, 35)
    np.testing.assert_array_equal(np.asarray(packed.panels[1, 2]), w[2, 16:32])  # panel 1, input row 2
    np.testing.assert_array_equal(np.asarray(packed.panels[2, 0, 3:]), 0)  # padding past column 35
    np.testing.assert_array_equal(np.asarray(kernels.unpack(packed)), w)


@pytest.mark.parametrize("tied", [True, False])
def test_panel_params_give_the_plain_models_logits(tied):
    """A forward pass over 1, 3 and 9 new tokens with every projection and the head as panels
    equals the same pass with XLA's products (float32 sums in another order: 1e-5)."""
    model = tiny_model(seed=11, tie_word_embeddings=tied)
    packed = with_panel_weights(model.params)
    config = model.config
    for num_tokens in (1, 3, 9):
        rng = np.random.default_rng(num_tokens)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, num_tokens)))
        positions = jnp.broadcast_to(jnp.arange(num_tokens), (2, num_tokens))
        cache = init_cache(config, batch_size=2, capacity=32)
        want, _, _ = jax.jit(forward, static_argnums=1)(model.params, config, tokens, positions, cache)
        got, _, _ = jax.jit(forward, static_argnums=1)(packed, config, tokens, positions, cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((4, config.hidden_size)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(lm_head(packed, hidden)), np.asarray(lm_head(model.params, hidden)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("intermediate_size", [96, 40])
def test_gate_and_up_multiply_as_one_panel_weight(intermediate_size):
    """with_panel_weights stores a dense MLP's gate and up as one panel weight (GateUpPanels:
    gate's panels, then up's; at F = 40 gate's last panel is padded, so up's columns start at 48),
    which the forward pass multiplies in one kernel call: the compiled pass holds 4 panel products
    per layer (qkv, o, gate and up, down) and the head's, and gives the plain model's logits. The
    layers' norms go with their products: the final norm is the pass's one rsqrt."""
    model = tiny_model(seed=12, intermediate_size=intermediate_size)
    packed = with_panel_weights(model.params)
    F = intermediate_size
    for plain, layer in zip(model.params.layers, packed.layers, strict=True):
        assert isinstance(layer.gate, GateUpPanels) and layer.up is None
        assert layer.gate.hidden == F and layer.gate.up_start == -(-F // 16) * 16
        both = np.asarray(kernels.unpack(layer.gate.both))
        np.testing.assert_array_equal(both[:, :F], np.asarray(plain.gate))
        np.testing.assert_array_equal(both[:, layer.gate.up_start :], np.asarray(plain.up))
    config = model.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 5)))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    cache = init_cache(config, batch_size=2, capacity=16)
    run = jax.jit(forward, static_argnums=1)
    with CPU.tracing():
        text = run.lower(packed, config, tokens, positions, cache).as_text()
        got, _, _ = run(packed, config, tokens, positions, cache)
    assert text.count("custom_call @specjax_panel_matmul(") == 4 * config.num_layers + 1
    assert text.count("stablehlo.rsqrt") == 1
    want, _, _ = run(model.params, config, tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _float64_attention(queries, keys, values, length):
    """One cache entry: queries [R, E] against keys [E, S], values [S, E], slots [0, length)."""
    scores = queries.astype(np.float64) @ keys[:, :length].astype(np.float64)  # [R, length]
    top = scores.max(axis=1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=1, keepdims=True)
    return (weights / total) @ values[:length].astype(np.float64), (top + np.log(total))[:, 0]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 27])
def test_cache_attention_equals_float64(head_dim, rows):
    """Lengths that meet every path of the kernel: nothing committed (output 0, log-sum-exp minus
    infinity), fewer slots than a vector (7), one vector (8), a vector and a ragged end (15), two
    (16), one block with a ragged end (300), the largest single block (512), one slot past it (513:
    two equal blocks, 272 and 241 slots, the second ending in one slot on its own), two blocks
    (1000: 512 and 488) and the whole cache (S = 1100, not a multiple of 16: three blocks). Row
    counts: one chunk, a full chunk of 6, chunks of 4 and 3, several chunks; the values go 16 head
    dims at a time (one pass at head_dim 16, sixteen at 256)."""
    lengths = [0, 1, 7, 8, 15, 16, 300, 512, 513, 1000, 1100]
    N, S = len(lengths), 1100
    rng = np.random.default_rng(head_dim * 100 + rows)
    q = rng.standard_normal((N, rows, head_dim)).astype(np.float32) / np.sqrt(head_dim)
    k = rng.standard_normal((N, head_dim, S)).astype(np.float32)
    v = rng.standard_normal((N, S, head_dim)).astype(np.float32)
    out, lse = jax.jit(kernels.cache_attention)(q, k, v, jnp.asarray(lengths, jnp.int32))
    out, lse = np.asarray(out), np.asarray(lse)
    assert out.shape == (N, rows, head_dim) and lse.shape == (N, rows)
    np.testing.assert_array_equal(out[0], 0)
    assert np.all(lse[0] == -np.inf)
    for n in range(1, N):
        want_out, want_lse = _float64_attention(q[n], k[n], v[n], lengths[n])
        np.testing.assert_allclose(out[n], want_out, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(lse[n], want_lse, rtol=1e-6, atol=1e-5)


def _float64_window_attention(queries, keys, values, length, starts):
    """One cache entry, query row r seeing slots [max(starts[r], 0), length): output [R, E] and
    log-sum-exp [R], with 0 and minus infinity for a row that sees no slot."""
    out, lse = np.zeros(queries.shape), np.full(len(queries), -np.inf)
    for r, start in enumerate(starts):
        first = max(int(start), 0)
        if first < length:
            seen = _float64_attention(queries[r : r + 1], keys[:, first:], values[first:], length - first)
            out[r], lse[r] = seen[0][0], seen[1][0]
    return out, lse


def _check_window_attention(q, k, v, lengths, starts):
    """The kernel with starts [N, R] against the float64 reference, entry by entry: exactly 0 and
    minus infinity for the rows that see nothing, 1e-5 elsewhere (as without starts)."""
    out, lse = jax.jit(kernels.cache_attention)(q, k, v, jnp.asarray(lengths, jnp.int32), jnp.asarray(starts))
    out, lse = np.asarray(out), np.asarray(lse)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    for n, length in enumerate(lengths):
        want_out, want_lse = _float64_window_attention(q[n], k[n], v[n], length, starts[n])
        blind = want_lse == -np.inf
        np.testing.assert_array_equal(lse[n] == -np.inf, blind)
        np.testing.assert_array_equal(out[n][blind], 0)
        np.testing.assert_allclose(out[n][~blind], want_out[~blind], rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(lse[n][~blind], want_lse[~blind], rtol=1e-6, atol=1e-5)


def _random_cache(rng, num_entries, rows, head_dim, num_slots):
    """Queries [N, R, E] (scaled), keys [N, E, S], values [N, S, E]: standard normal float32."""
    q = rng.standard_normal((num_entries, rows, head_dim)).astype(np.float32) / np.sqrt(head_dim)
    k = rng.standard_normal((num_entries, head_dim, num_slots)).astype(np.float32)
    v = rng.standard_normal((num_entries, num_slots, head_dim)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 7, 27])
def test_cache_attention_with_starts_equals_float64(head_dim, rows):
    """Each entry's rows draw their starts from one range (different starts for different rows):
    all 0, all negative, inside the first vector, through a two-block entry's blocks (513: 272 + 241
    slots), from inside the second block (1000), anywhere from below 0 to past the length, all at or
    past the length (no row sees a slot), all 1 (the blocks begin at slot 1 and mask nothing), and
    a mix of those. Rows of one chunk mask different slots,
    a block can begin past some rows' windows' starts, and a row can see nothing in one block but
    something in another."""
    entries = [  # (length, the range [low, high) its rows' starts come from)
        (0, (-5, 5)),
        (1, (0, 1)),
        (15, (-20, 0)),
        (300, (1, 16)),
        (513, (0, 513)),
        (1000, (520, 990)),
        (1100, (-100, 1200)),
        (1000, (1000, 1010)),
        (1100, (1, 2)),
    ]
    lengths = [length for length, _ in entries]
    rng = np.random.default_rng(head_dim * 100 + rows)
    q, k, v = _random_cache(rng, len(entries), rows, head_dim, num_slots=1100)
    starts = np.stack([rng.integers(low, high, rows) for _, (low, high) in entries]).astype(np.int32)
    starts[-1] = rng.permutation(np.resize([-1, 0, 7, 300, 600, 1099, 1100, 5000], rows))  # the mix
    _check_window_attention(q, k, v, lengths, starts)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("groups, tokens", [(1, 1), (3, 4), (2, 9)])
def test_cache_attention_with_a_sliding_window_equals_float64(head_dim, groups, tokens):
    """What a sliding-window model asks: `tokens` queries at positions L .. L + T - 1 after L
    committed slots, window W, so query t starts at L + t - W + 1, in the rows (g, t) of a kv head's
    `groups` query heads (row g*T + t). Windows 1 (a query sees only itself: no cache slot), 7 (a
    few of the last slots), 300 and 600 (through the blocks) and 4096 (all of them)."""
    lengths = [0, 1, 15, 300, 513, 1000, 1100]
    windows = [1, 7, 300, 600, 4096]
    cases = [(length, window) for length in lengths for window in windows]
    rng = np.random.default_rng(head_dim * 100 + groups * 10 + tokens)
    q, k, v = _random_cache(rng, len(cases), groups * tokens, head_dim, num_slots=1100)
    t = np.arange(tokens)
    starts = np.stack([np.tile(length + t - window + 1, groups) for length, window in cases]).astype(np.int32)
    _check_window_attention(q, k, v, [length for length, _ in cases], starts)


def test_cache_attention_without_starts_equals_starts_zero_bit_for_bit():
    """starts None, all 0 and all negative read the same blocks with no mask: the same bits."""
    lengths = jnp.asarray([0, 15, 300, 513, 1000, 1100], jnp.int32)
    rng = np.random.default_rng(7)
    q, k, v = _random_cache(rng, len(lengths), 9, 64, num_slots=1100)
    want_out, want_lse = jax.jit(kernels.cache_attention)(q, k, v, lengths)
    for starts in (np.zeros((6, 9), np.int32), np.full((6, 9), -3, np.int32)):
        out, lse = jax.jit(kernels.cache_attention)(q, k, v, lengths, jnp.asarray(starts))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_cache_attention_refuses_starts_of_another_shape():
    q, k, v = jnp.zeros((2, 3, 16)), jnp.zeros((2, 16, 32)), jnp.zeros((2, 32, 16))
    with pytest.raises(ValueError, match=r"starts has shape \(2,\)"):
        kernels.cache_attention(q, k, v, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32))


def test_cache_attention_refuses_an_unsupported_head_dim():
    q = jnp.zeros((1, 1, 8))
    with pytest.raises(ValueError, match="head_dim 8"):
        kernels.cache_attention(q, jnp.zeros((1, 8, 16)), jnp.zeros((1, 16, 8)), jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("tree, T", [(False, 1), (False, 5), (True, 5)])
@pytest.mark.parametrize("write", [True, False])
def test_kernel_attention_equals_xlas_forms(write, tree, T):
    """`attention` with `committed` (the kernel, plus the fresh tokens merged in) equals XLA's
    write-first form and its read-only form, for a chain's causal mask and a tree's ancestor
    mask, with rows of different lengths (one with nothing committed); one token written first
    is read from its slot by the kernel, with no merge."""
    B, K, G, E, S = 3, 2, 3, 16, 80
    lengths = np.array([0, 17, 70])
    rng = np.random.default_rng(int(write) * 2 + int(tree))
    q = jnp.asarray(rng.standard_normal((B, T, K * G, E)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((B, T, K, E)), jnp.float32) for _ in range(2))
    k_cache = rng.standard_normal((B * K, E, S)).astype(np.float32)
    v_cache = rng.standard_normal((B * K, S, E)).astype(np.float32)
    mask = causal_mask(T)
    if tree:  # node 0 the root, 1 and 2 its children, 3 a child of 1, 4 a child of 2
        mask = np.eye(T, dtype=bool)
        for node, parent in ((1, 0), (2, 0), (3, 1), (4, 2)):
            mask[node] |= mask[parent]
    if write:  # the write-first form: the fresh entries already sit at slots lengths .. + T - 1
        for b in range(B):
            for t in range(T):
                k_cache[b * K : (b + 1) * K, :, lengths[b] + t] = np.asarray(k_new[b, t])
                v_cache[b * K : (b + 1) * K, lengths[b] + t] = np.asarray(v_new[b, t])
        visible = visible_slots(jnp.asarray(lengths), jnp.asarray(mask), S)
    else:
        visible = jnp.arange(S)[None, :] < jnp.asarray(lengths)[:, None]
    kind = PassKind.WRITE_FIRST if write else PassKind.READ_ONLY
    masks = LayerMasks(visible, committed=jnp.asarray(lengths, jnp.int32))
    args = (q, k_new, v_new, LayerCache(jnp.asarray(k_cache), jnp.asarray(v_cache)), masks, mask)
    want = attention(*args, PassPlan(kind))
    with CPU.tracing():
        got = attention(*args, PassPlan(kind, CPU.cache_attention(E, jnp.float32)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("write", [True, False])
def test_panel_model_decodes_from_a_filled_cache(write):
    """After a 21-token prefill, passes of 1 and 6 tokens with panel weights under the CPU backend
    (kernel attention over the committed slots) give the plain model's hidden states under plain
    XLA, in the write-first and the read-only form; the compiled pass holds the attention kernel's
    custom call under the CPU backend only."""
    model = tiny_model(seed=5)
    packed = with_panel_weights(model.params)
    config = model.config
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (2, 21)))
    cache = init_cache(config, batch_size=2, capacity=48)
    _, _, cache = jax.jit(forward, static_argnums=1)(
        model.params, config, prompt, jnp.broadcast_to(jnp.arange(21), (2, 21)), cache
    )
    cache = cache.replace(lengths=jnp.asarray([21, 13], jnp.int32))  # row 1: its last 8 slots stale

    def hidden(params, tokens, positions):
        return forward_hidden(params, config, tokens, positions, cache, write=write)[0]

    for num_tokens in (1, 6):
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, num_tokens)))
        positions = cache.lengths[:, None] + jnp.arange(num_tokens)
        want = jax.jit(hidden)(model.params, tokens, positions)
        program = jax.jit(hidden).lower
        assert "specjax_cache_attention" not in program(model.params, tokens, positions).as_text()
        with CPU.tracing():
            got = jax.jit(hidden)(packed, tokens, positions)
            assert "specjax_cache_attention" in program(packed, tokens, positions).as_text()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_head_dim_the_kernel_lacks_keeps_xlas_attention():
    """head_dim 8 (not one the attention kernel is built for): panel weights still multiply through
    the panel kernel, attention stays XLA's, and the logits equal the plain model's."""
    model = tiny_model(seed=6, num_heads=8, num_kv_heads=2)  # head_dim 64 / 8 = 8
    packed = with_panel_weights(model.params)
    config = model.config
    tokens = jnp.asarray([[3, 1, 4, 1, 5]])
    positions = jnp.arange(5)[None]
    cache = init_cache(config, batch_size=1, capacity=16).replace(lengths=jnp.zeros((1,), jnp.int32))
    run = jax.jit(forward, static_argnums=1)
    with CPU.tracing():
        text = run.lower(packed, config, tokens, positions, cache).as_text()
        got, _, _ = run(packed, config, tokens, positions, cache)
    assert "specjax_panel_matmul" in text and "specjax_cache_attention" not in text
    want, _, _ = run(model.params, config, tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_generate_decodes_through_the_kernel(monkeypatch):
    """On the CPU, generate multiplies with panels (the packed params, made once per params
    object, reach the compiled program) and gives the tokens XLA's products give; with
    SPECJAX_CPU_KERNEL=0 it keeps the plain params."""
    model = tiny_model(seed=2)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    seen = []
    real = programs.compiled

    def compiled(spec, params, *rest):
        seen.append(params)
        return real(spec, params, *rest)

    monkeypatch.setattr(programs, "compiled", compiled)
    with_kernel = specjax.generate(model, prompts, max_new_tokens=12)
    again = specjax.generate(model, prompts, proposer=specjax.NGram(k=3), max_new_tokens=12)
    monkeypatch.setenv("SPECJAX_CPU_KERNEL", "0")
    without = specjax.generate(model, prompts, max_new_tokens=12)
    assert with_kernel.tokens == without.tokens == again.tokens
    assert isinstance(seen[0].layers[0].qkv, kernels.PanelWeight) and seen[0].head_panels is not None
    assert seen[1] is seen[0]  # packed once for these params
    assert seen[2] is model.params


def test_a_missing_compiler_is_an_error_that_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(FileNotFoundError, match="no-such-compiler"):
        kernels._build()


def test_training_shapes_are_untouched():
    """init_params still gives plain arrays: only with_panel_weights makes panels."""
    params = init_params(tiny_config(), jax.random.key(0))
    assert isinstance(params.layers[0].qkv, jax.Array) and params.head_panels is None


def _heads(model):
    from specjax.models import DFlashHead, Eagle3Head, EagleHead

    subset = np.arange(0, model.config.vocab_size, 3)  # a draft vocabulary of its own
    return {
        "eagle": specjax.Eagle(EagleHead.init(model, jax.random.key(0), vocab=subset, scale=1.0), k=3),
        "eagle3": specjax.Eagle3(
            Eagle3Head.init(model, jax.random.key(1), vocab=subset, aux_layer_ids=(0, 1, 2), scale=1.0), k=3
        ),
        "dflash": specjax.DFlash(
            DFlashHead.init(model, jax.random.key(2), block_size=4, aux_layer_ids=(0, 2))
        ),
    }


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_heads_with_panel_weights_draft_what_plain_heads_draft(kind):
    """A trained head's weights as panels (its layers, fc and LM head, for drafting on the CPU):
    the same head outputs from the prefill's catch-up and a drafting step within float32 rounding,
    the same drafts, and the compiled drafting step multiplies through the kernel."""
    model = tiny_model(seed=3)
    proposer = _heads(model)[kind]
    spec, params = proposer.spec(model), proposer.params(model)
    packed = spec.with_panel_weights(params)
    leaves = jax.tree.leaves(packed, is_leaf=lambda x: isinstance(x, kernels.PanelWeight))
    assert sum(isinstance(x, kernels.PanelWeight) for x in leaves) >= 6
    B, S = 2, 32
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (B, S)), jnp.int32)
    streams = {"eagle": 1, "eagle3": 3, "dflash": 2}[kind]  # target features the head reads
    features = jnp.asarray(rng.standard_normal((B, 10, streams * model.config.hidden_size)), jnp.float32)
    prompt_lengths = jnp.asarray([10, 6], jnp.int32)
    target = planner._with_panels(model.params)

    def draft(p):
        state = by_hand.init(spec, target, p, tokens[:, :10], prompt_lengths, S, features)
        return by_hand.propose(spec, target, p, state, tokens, prompt_lengths + 1, None, None, None)

    text = jax.jit(draft).lower(packed).as_text()
    assert "specjax_panel_matmul" in text
    (want, want_state), (got, got_state) = jax.jit(draft)(params), jax.jit(draft)(packed)
    assert np.asarray(got.draft_tokens).tolist() == np.asarray(want.draft_tokens).tolist()
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # make test-all: the default suite keeps within its 20 minutes
def test_generate_packs_a_heads_weights_once(monkeypatch):
    """On the CPU, generate drafts with a head's panel copy, made once for the proposer object and
    model (the same params object each call), and gives the tokens the plain head gives."""
    model = tiny_model(seed=3)
    prompts = [[1, 2, 3, 1, 2], [9, 8, 7]]
    seen = []
    real = programs.compiled

    def compiled(spec, params, proposer_params, *rest):
        seen.append(proposer_params)
        return real(spec, params, proposer_params, *rest)

    monkeypatch.setattr(programs, "compiled", compiled)
    heads = _heads(model)
    hybrid = specjax.Hybrid(specjax.NGram(k=4), specjax.Eagle3(heads["eagle3"].head, k=1))
    for proposer in (heads["eagle"], hybrid):
        first = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=10)
        again = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=10)
        assert seen[-1] is seen[-2]  # packed once
        leaves = jax.tree.leaves(seen[-1], is_leaf=lambda x: isinstance(x, kernels.PanelWeight))
        assert any(isinstance(x, kernels.PanelWeight) for x in leaves)
        monkeypatch.setenv("SPECJAX_CPU_KERNEL", "0")
        without = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=10)
        monkeypatch.delenv("SPECJAX_CPU_KERNEL")
        assert first.tokens == again.tokens == without.tokens
        assert not any(
            isinstance(x, kernels.PanelWeight)
            for x in jax.tree.leaves(seen[-1], is_leaf=lambda x: isinstance(x, kernels.PanelWeight))
        )
